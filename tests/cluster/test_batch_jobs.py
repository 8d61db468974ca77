"""Batch jobs on a real cluster: the official `openai` client through the Batch API, a batch
runner process, and every line's result exactly once while runners, workers and Redis are
killed with -9 mid-batch.

One cluster for the module (1 prefill, 2 decode workers, one batch runner with a short lease)
on a private redis-server, which one test kills and restarts empty on the same port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from nori.launch.local_cluster import LocalCluster, RoleProcess, free_port
from nori.launch.redis_server import RedisServer
from tests.cluster.conftest import start_cluster
from tests.cluster.test_redis_outage import kill_redis

pytestmark = pytest.mark.slow

LEASE_S = 2.0
RUNNER_METRICS_PORT = free_port()
FINAL = ("completed", "failed", "expired", "cancelled")
# Long enough that every disturbance lands mid-batch (the runner keeps 64 lines in flight).
BATCH_LINES = 240


@pytest.fixture(scope="module")
def cluster(
    redis_server: RedisServer, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    running = start_cluster(
        redis_server.url,
        checkpoint,
        tmp_path_factory.mktemp("logs"),
        batch_dir=tmp_path_factory.mktemp("batches"),
        batch_runner_args=(
            "--lease-s",
            str(LEASE_S),
            "--max-in-flight",
            "64",
            "--metrics-port",
            str(RUNNER_METRICS_PORT),
        ),
    )
    try:
        yield running
    finally:
        running.stop()


def api(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)


def model(cluster: LocalCluster) -> str:
    return str(api(cluster).models.list().data[0].id)


def completion_lines(cluster: LocalCluster, num: int, max_tokens: int = 12) -> list[dict[str, Any]]:
    name = model(cluster)
    return [
        {
            "custom_id": f"c-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": name,
                "prompt": f"Story {i}: once upon a time",
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(num)
    ]


def chat_lines(cluster: LocalCluster, num: int) -> list[dict[str, Any]]:
    name = model(cluster)
    return [
        {
            "custom_id": f"chat-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": name,
                "max_tokens": 10,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Tell me about {i} cats"}],
            },
        }
        for i in range(num)
    ]


def submit(cluster: LocalCluster, lines: list[dict[str, Any]], endpoint: str = "") -> str:
    client = api(cluster)
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint or lines[0]["url"],  # type: ignore[arg-type]
        completion_window="24h",
    )
    return batch.id


def wait_for(
    cluster: LocalCluster,
    batch_id: str,
    until: Callable[[Any], bool] = lambda b: b.status in FINAL,
    timeout_s: float = 240.0,
    supervise: bool = True,
) -> Any:
    """Polls as a client does; meanwhile restarts roles that were killed, as `nori up` does."""
    deadline = time.monotonic() + timeout_s
    client = api(cluster)
    while time.monotonic() < deadline:
        if supervise:
            cluster.supervise()
        try:
            batch = client.batches.retrieve(batch_id)
        except (openai.APIConnectionError, openai.InternalServerError):
            batch = None
        if batch is not None and until(batch):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} did not get there in {timeout_s:.0f} s: {batch}")


def results(cluster: LocalCluster, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = api(cluster).files.content(file_id).text
    return [json.loads(line) for line in text.splitlines()]


def answers(records: list[dict[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
    """custom_id -> (text, usage), checking each custom_id comes once."""
    by_id: dict[str, tuple[str, dict[str, Any]]] = {}
    for record in records:
        assert record["custom_id"] not in by_id, f"{record['custom_id']} twice"
        body = record["response"]["body"]
        choice = body["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        usage = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
        by_id[record["custom_id"]] = (text, usage)
    return by_id


def kill(process: RoleProcess) -> None:
    os.kill(process.process.pid, signal.SIGKILL)
    process.process.wait()


def runner(cluster: LocalCluster, name: str = "batch-0") -> RoleProcess:
    return next(p for p in cluster.processes if p.name == name)


def free_blocks_return(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    """Every decode worker's KV pool is whole again (no leaked block)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
        figures: dict[str, dict[str, float]] = {}
        for line in text.splitlines():
            for name in ("nori_worker_free_kv_blocks", "nori_worker_total_kv_blocks"):
                if line.startswith(name + "{") and 'role="decode"' in line:
                    worker = line.split('worker_id="')[1].split('"')[0]
                    figures.setdefault(worker, {})[name] = float(line.rsplit(" ", 1)[1])
        leaked = {
            w: f
            for w, f in figures.items()
            if f.get("nori_worker_free_kv_blocks") != f.get("nori_worker_total_kv_blocks")
        }
        if figures and not leaked:
            return
        assert time.monotonic() < deadline, f"KV blocks still held: {leaked}"
        time.sleep(0.5)


# ---------------------------------------------------------------------- the official client


def test_the_openai_clients_batch_equals_the_same_requests_one_by_one(
    cluster: LocalCluster,
) -> None:
    lines = completion_lines(cluster, 40) + chat_lines(cluster, 40)
    batch_ids = [submit(cluster, lines[:40]), submit(cluster, lines[40:])]

    def one_by_one(line: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        response = httpx.post(f"{cluster.url}{line['url']}", json=line["body"], timeout=120)
        assert response.status_code == 200, response.text
        record = {"custom_id": line["custom_id"], "response": {"body": response.json()}}
        return answers([record])[line["custom_id"]]

    with ThreadPoolExecutor(8) as pool:
        expected = dict(
            zip((line["custom_id"] for line in lines), pool.map(one_by_one, lines), strict=True)
        )
    got: dict[str, tuple[str, dict[str, Any]]] = {}
    for batch_id in batch_ids:
        batch = wait_for(cluster, batch_id)
        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {"total": 40, "completed": 40, "failed": 0}
        assert batch.error_file_id is None and batch.errors is None
        assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
        records = results(cluster, batch.output_file_id)
        assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in records)
        got.update(answers(records))
    assert got == expected
    # Job observability: batches by status on the gateway, lines and tokens on the runner.
    gateway = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    completed = next(
        line
        for line in gateway.splitlines()
        if line.startswith('nori_gateway_batches{status="completed"}')
    )
    assert float(completed.split()[-1]) >= 2
    runner_text = httpx.get(f"http://127.0.0.1:{RUNNER_METRICS_PORT}/metrics", timeout=10).text
    figures = {
        line.split()[0]: float(line.split()[1])
        for line in runner_text.splitlines()
        if line.startswith("nori_batch_")
    }
    assert figures['nori_batch_lines_total{outcome="completed"}'] >= 80
    assert figures["nori_batch_output_tokens_total"] > 0
    assert figures["nori_batch_lines_in_flight"] == 0


# ---------------------------------------------------------------------- exactly once


@pytest.fixture(scope="module")
def reference(cluster: LocalCluster) -> dict[str, tuple[str, dict[str, Any]]]:
    """The BATCH_LINES-line batch undisturbed, while 16 interactive streams run beside it."""
    lines = completion_lines(cluster, BATCH_LINES)
    batch_id = submit(cluster, lines)
    wait_for(cluster, batch_id, lambda b: b.request_counts.completed >= 50)

    def interactive(i: int) -> int:
        with httpx.stream(
            "POST",
            f"{cluster.url}/v1/completions",
            json={"model": model(cluster), "prompt": f"Hello {i}", "max_tokens": 8, "stream": True},
            timeout=120,
        ) as response:
            response.read()
            return response.status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(interactive, range(16)))
    assert statuses == [200] * 16  # none refused while the batch fills the pools
    batch = wait_for(cluster, batch_id)
    assert batch.status == "completed"
    assert batch.request_counts.completed == BATCH_LINES
    return answers(results(cluster, batch.output_file_id))


def _run_disturbed(
    cluster: LocalCluster, disturb: Callable[[], None], at: tuple[float, ...]
) -> dict[str, tuple[str, dict[str, Any]]]:
    batch_id = submit(cluster, completion_lines(cluster, BATCH_LINES))
    for fraction in at:
        wait_for(
            cluster, batch_id, lambda b, f=fraction: b.request_counts.completed >= BATCH_LINES * f
        )
        disturb()
    batch = wait_for(cluster, batch_id)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {
        "total": BATCH_LINES,
        "completed": BATCH_LINES,
        "failed": 0,
    }
    return answers(results(cluster, batch.output_file_id))


def test_a_runner_killed_twice_mid_batch_loses_and_repeats_nothing(
    cluster: LocalCluster, reference: dict[str, tuple[str, dict[str, Any]]]
) -> None:
    restarts = runner(cluster).restarts
    got = _run_disturbed(cluster, lambda: kill(runner(cluster)), at=(0.3, 0.7))
    assert got == reference
    assert runner(cluster).restarts == restarts + 2


@pytest.mark.parametrize("role", ["decode-0", "prefill-0"])
def test_a_worker_killed_mid_batch_loses_and_repeats_nothing(
    cluster: LocalCluster, reference: dict[str, tuple[str, dict[str, Any]]], role: str
) -> None:
    got = _run_disturbed(cluster, lambda: kill(cluster.worker(role)), at=(0.4,))
    assert got == reference
    cluster.wait_healthy({"prefill": 1, "decode": 2}, timeout_s=120)


def test_redis_killed_and_restarted_empty_mid_batch_loses_nothing(
    cluster: LocalCluster,
    redis_server: RedisServer,
    reference: dict[str, tuple[str, dict[str, Any]]],
) -> None:
    def restart_redis() -> None:
        kill_redis(redis_server)
        time.sleep(0.5)
        redis_server.start()

    assert _run_disturbed(cluster, restart_redis, at=(0.5,)) == reference
    cluster.wait_healthy({"prefill": 1, "decode": 2}, timeout_s=60)


def test_two_runners_share_a_batch_without_doing_a_line_twice(cluster: LocalCluster) -> None:
    second = cluster.add_batch_runner("batch-1", ["--metrics-port", "0"])
    try:
        batch_id = submit(cluster, completion_lines(cluster, 300))
        batch = wait_for(cluster, batch_id)
        assert batch.status == "completed" and batch.request_counts.completed == 300
        folder = cluster.spec.batch_dir / "batches" / batch_id / "results"  # type: ignore[operator]
        done_by = {
            log.stem: [json.loads(line)["line"] for line in log.read_text().splitlines()]
            for log in folder.glob("*.jsonl")
        }
        assert len(done_by) == 2 and all(done_by.values()), done_by  # both did work
        every = [line for lines in done_by.values() for line in lines]
        assert sorted(every) == list(range(1, 301))  # no line done twice
    finally:
        second.process.send_signal(signal.SIGTERM)
        second.process.wait(30)
        second.left = True


# ---------------------------------------------------------------------- bad input, cancel, bursts


def test_malformed_lines_go_to_the_error_file_and_the_rest_runs(cluster: LocalCluster) -> None:
    lines = completion_lines(cluster, 4, max_tokens=4)
    bad_model = {**lines[3], "custom_id": "bad-model", "body": {**lines[3]["body"], "model": "x"}}
    raw = [
        json.dumps(lines[0]),
        "{oops",
        json.dumps(lines[1]),
        json.dumps({**lines[2], "url": "/v1/embeddings"}),
        json.dumps(bad_model),
    ]
    client = api(cluster)
    uploaded = client.files.create(file=("in.jsonl", "\n".join(raw).encode()), purpose="batch")
    batch_id = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    ).id
    batch = wait_for(cluster, batch_id)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 5, "completed": 2, "failed": 3}
    assert [e.line for e in batch.errors.data] == [2, 4]
    assert {r["custom_id"] for r in results(cluster, batch.output_file_id)} == {"c-0", "c-1"}
    errors = results(cluster, batch.error_file_id)
    assert [e["error"]["message"].split(":")[0] for e in errors if e["error"]] == [
        "line 2",
        "line 4",
    ]
    answered = [e for e in errors if e["response"]]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in answered] == [
        ("bad-model", 404)
    ]


def test_a_duplicate_custom_id_fails_the_batch_at_validation(cluster: LocalCluster) -> None:
    lines = completion_lines(cluster, 3)
    batch = wait_for(cluster, submit(cluster, [*lines, lines[1]]))
    assert batch.status == "failed" and batch.failed_at
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 4)]
    assert batch.output_file_id is None


def test_a_cancelled_batch_stops_and_leaks_no_kv_block(cluster: LocalCluster) -> None:
    batch_id = submit(cluster, completion_lines(cluster, 200, max_tokens=200))
    wait_for(cluster, batch_id, lambda b: b.request_counts.completed >= 5)
    assert api(cluster).batches.cancel(batch_id).status == "cancelling"
    batch = wait_for(cluster, batch_id)
    assert batch.status == "cancelled" and batch.cancelled_at
    done = batch.request_counts.completed
    assert 5 <= done < 200
    assert len(results(cluster, batch.output_file_id)) == done
    free_blocks_return(cluster)


def test_the_burst_that_got_429s_completes_whole_as_a_batch(cluster: LocalCluster) -> None:
    """64 long prompts at once: as separate requests most got 429; as a batch all complete."""
    name = model(cluster)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "and",
        "runs",
        "far",
        "away",
    ]
    lines = [
        {
            "custom_id": f"long-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": name,
                "max_tokens": 4,
                "temperature": 0,
                "prompt": " ".join(words[(i + j) % len(words)] for j in range(300 + 10 * i)),
            },
        }
        for i in range(64)
    ]
    batch = wait_for(cluster, submit(cluster, lines), timeout_s=600)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 64, "completed": 64, "failed": 0}


def run_batch(
    source: Path, output: Path, url: str, *flags: str
) -> subprocess.CompletedProcess[str]:
    """`nori run-batch -i SOURCE -o OUTPUT --url URL FLAGS...`, as a user runs it."""
    command = ["run-batch", "-i", str(source), "-o", str(output), "--url", url, *flags]
    return subprocess.run(
        [sys.executable, "-m", "nori.cli.main", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_run_batch_resumes_a_partial_output(cluster: LocalCluster, tmp_path: Path) -> None:
    lines = completion_lines(cluster, 40, max_tokens=6)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out.jsonl"
    # A partial output from an earlier run: 10 results, then a torn line.
    first = run_batch(source, output, cluster.url, "--summary-json", str(tmp_path / "s.json"))
    assert first.returncode == 0, first.stderr
    full = output.read_text().splitlines()
    assert len(full) == 40
    output.write_text("\n".join(full[:10]) + "\n" + full[10][:20])
    again = run_batch(source, output, cluster.url, "--resume")
    assert again.returncode == 0, again.stderr
    assert "10 kept from the output" in again.stderr
    assert "effective throughput" in again.stderr
    resumed = [json.loads(line) for line in output.read_text().splitlines()[:10]]
    resumed += [json.loads(line) for line in output.read_text().splitlines()[11:]]
    assert answers(resumed) == answers([json.loads(line) for line in full])
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["done"] == 40 and summary["output_tokens"] > 0
    # Without --resume an existing output is refused, with a one-line error.
    refused = run_batch(source, output, cluster.url)
    assert refused.returncode == 2 and "--resume" in refused.stderr
