"""Hostile requests against a real gateway process over real HTTP: each is refused with a 4xx
within a second, while /health keeps answering (90% in under 100 ms, all under 300 ms) and the gateway's memory (its
peak resident set, from /proc) stays under 1 GiB; afterwards it still serves.

The inputs are those of issue 22: a chat template with nested loops, one dividing by zero, one
asking for range(1000000), a prompt of 10 M token ids (28 MiB of JSON), 20 MB of text to
/tokenize, and top_k of 2**31 and 10**30 (past the proto's int32); and an infinite temperature,
a repetition_penalty of 1e-300 and tool_choice "required". Each is sent alone, then all at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from nori.launch.local_cluster import LocalCluster
from tests.cluster.conftest import running_cluster
from tests.cluster.test_cluster_e2e import model_name

pytestmark = pytest.mark.slow

MAX_ANSWER_S = 1.0
# All of them at once, sent by one process's threads on a shared CI machine: some slack.
MAX_ANSWER_TOGETHER_S = 2.0
# /health's answers while the hostile requests run: 90% within 100 ms (issue 22's figure), and
# none past 300 ms. A gateway whose event loop one of them blocks (a 28 MiB body parsed on the
# loop, a template rendered there) stalls /health for seconds; a lone answer over 100 ms
# also came from a shared CI machine's scheduler (111.9 ms once, 41-73 ms run alone).
MAX_HEALTH_P90_S = 0.1
MAX_HEALTH_S = 0.3
MAX_RSS_BYTES = 1 << 30
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def colocated_cluster(
    redis_url: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    yield from running_cluster(
        redis_url, checkpoint, tmp_path_factory, colocated=True, num_decode=1
    )


def hostile_requests(model: str) -> dict[str, tuple[str, bytes]]:
    """Name -> (path, JSON body)."""

    def chat(template: str) -> tuple[str, bytes]:
        body = {"model": model, "messages": MESSAGES, "chat_template": template}
        return "/v1/chat/completions", json.dumps(body).encode()

    def completion(**fields: object) -> tuple[str, bytes]:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, **fields}
        return "/v1/completions", json.dumps(body).encode()

    return {
        "nested loops": chat(
            "{% for i in range(1500) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        ),
        "1/0": chat("{{ 1/0 }}"),
        "range(1000000)": chat("{% for i in range(1000000) %}{{ i }}{% endfor %}"),
        "10 M token ids": completion(prompt=[1000] * 10_000_000),
        "20 MB to /tokenize": (
            "/tokenize",
            json.dumps({"model": model, "prompt": "Once upon a time. " * 1_100_000}).encode(),
        ),
        "top_k 2**31": completion(top_k=2**31),
        "top_k 10**30": completion(top_k=10**30),
        # The minor ones of the issue: refused by name too.
        "temperature Infinity": completion(temperature=float("inf")),
        "repetition_penalty 1e-300": completion(repetition_penalty=1e-300),
        "tool_choice required": (
            "/v1/chat/completions",
            json.dumps({"model": model, "messages": MESSAGES, "tool_choice": "required"}).encode(),
        ),
    }


def memory_bytes(pid: int, field_name: str) -> int:
    """VmRSS (now) or VmHWM (the peak since the process started), from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field_name}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field_name} in /proc/{pid}/status")


# The poller runs in a process of its own: in the test's, the threads sending 28 MiB bodies
# would share its GIL and add their delays to what it measures.
POLLER = """
import sys, threading, time, json, httpx
url, stop, seconds, failures = sys.argv[1], threading.Event(), [], []
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("polling", flush=True)
with httpx.Client(timeout=5) as http:
    while not stop.is_set():
        started = time.monotonic()
        try:
            status = http.get(url + "/health").status_code
            if status != 200:
                failures.append(f"status {status}")
        except httpx.HTTPError as error:
            failures.append(repr(error))
        seconds.append(time.monotonic() - started)
        stop.wait(0.02)
seconds.sort()
print(json.dumps({
    "slowest_s": seconds[-1] if seconds else 0.0,
    "p90_s": seconds[int(0.9 * (len(seconds) - 1))] if seconds else 0.0,
    "num_polls": len(seconds),
    "failures": failures,
}), flush=True)
"""


class HealthPoller:
    """GET /health every 20 ms from another process, until stopped: the slowest answer."""

    def __init__(self, url: str) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", POLLER, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        assert self._process.stdout.readline().strip() == "polling"

    def stop(self) -> dict[str, Any]:
        out, _ = self._process.communicate(timeout=30)
        return dict(json.loads(out.strip().splitlines()[-1]))


def send(url: str, path: str, body: bytes) -> tuple[int, float, str]:
    started = time.monotonic()
    with httpx.Client(timeout=30) as http:
        response = http.post(
            f"{url}{path}", content=body, headers={"content-type": "application/json"}
        )
    return response.status_code, time.monotonic() - started, response.text[:300]


def test_hostile_requests_get_a_4xx_fast_while_the_gateway_stays_responsive_and_small(
    colocated_cluster: LocalCluster,
) -> None:
    cluster = colocated_cluster
    model = model_name(cluster)
    gateway_pid = cluster.worker("gateway").process.pid
    requests = hostile_requests(model)
    poller = HealthPoller(cluster.url)
    answers: dict[str, tuple[int, float, str]] = {}
    try:
        for name, (path, body) in requests.items():
            answers[name] = send(cluster.url, path, body)
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            together = {
                name: pool.submit(send, cluster.url, path, body)
                for name, (path, body) in requests.items()
            }
            for name, future in together.items():
                answers[f"{name} (all at once)"] = future.result()
        time.sleep(0.2)
    finally:
        polled = poller.stop()

    print({name: (status, round(seconds, 3)) for name, (status, seconds, _) in answers.items()})
    print(
        f"/health: {polled['num_polls']} polls, p90 {polled['p90_s'] * 1000:.1f} ms, "
        f"slowest {polled['slowest_s'] * 1000:.1f} ms"
    )
    for name, (status, seconds, text) in answers.items():
        assert 400 <= status < 500, (name, status, text)
        bound = MAX_ANSWER_TOGETHER_S if name.endswith("(all at once)") else MAX_ANSWER_S
        assert seconds < bound, (name, seconds)
        assert '"error"' in text, (name, text)
    assert not polled["failures"], polled
    assert polled["num_polls"] >= 5, polled
    assert polled["p90_s"] < MAX_HEALTH_P90_S, polled
    assert polled["slowest_s"] < MAX_HEALTH_S, polled
    peak = memory_bytes(gateway_pid, "VmHWM")
    print(f"gateway peak RSS {peak / 2**20:.0f} MiB")
    assert peak < MAX_RSS_BYTES, peak

    cluster.check_alive()
    served = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": 4},
        timeout=60,
    )
    assert served.status_code == 200, served.text
