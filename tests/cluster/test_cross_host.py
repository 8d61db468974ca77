"""A cluster over several hosts: Redis and the gateway on one, a prefill worker on another, two
decode workers on a host each. Each host is a network namespace with one address on a private
bridge, and each process also has mount (a private /dev/shm and /proc), IPC, UTS (its hostname)
and PID namespaces of its own (bench/netns_hosts.py): no shared-memory shortcut joins two
hosts, so the KV blocks must cross the network.

- Greedy completions equal the offline engine's text (which the one-host cluster is held to,
  token for token, in test_cluster_e2e), with the KV over UCX between the hosts' addresses: the
  `kv_send` span names the decode host's UCX address, its child `kv_receive` says the bytes came
  as messages (not mapped out of the sender's shared memory, not read out of its memory), the
  decode workers count the bytes as messages, and UCX's own protocol tables (UCX_PROTO_INFO)
  show that every lane it chose is TCP on the hosts' eth0.
- A prefill host whose link is cut for 5 s: every request completes or gets 503 with
  Retry-After, no KV block, queued prompt or request stays held afterwards, and the cluster
  serves again.
- A decode host torn down mid-stream (its link gone first, so no reset ever reaches anyone):
  its streams continue on the other decode host, token for token.

The processes are `nori serve ROLE` as compose.yaml starts them: `--host 0.0.0.0`, fixed ports
(every host has its own), NORI_ADVERTISE_HOST the host's address, a cluster secret.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nori.bench.netns_hosts import Host, HostProcess, Hosts, require_namespaces
from nori.engine.llm import LLM
from nori.launch.redis_server import find_redis_server
from nori.sampling.params import SamplingParams
from nori.transfer.factory import ucx_available
from tests.cluster.conftest import WORKER_ARGS
from tests.telemetry.otlp_receiver import OTLPReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

# Every host has its own network namespace: the ports compose.yaml uses, on each.
REDIS_PORT = 6379
GATEWAY_PORT = 8000
PREFILL_PORT = 50061
DECODE_PORT = 50071
TRANSFER_PORT = 50100
METRICS_PORT = 9400
DECODES = ("decode-0", "decode-1")
WORKERS = ("prefill", *DECODES)
HOST_NAMES = ("gateway", *WORKERS)

Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]
# What a leak would show in.
LEAK_GAUGES = frozenset(
    {
        "nori_kv_blocks_used",
        "nori_kv_blocks_free",
        "nori_kv_transfers_in_flight",
        "nori_num_requests_running",
        "nori_num_requests_waiting",
        "nori_kv_export_arena_bytes_in_use",
        "nori_gateway_requests_in_flight",
        "nori_gateway_queued_prompt_tokens",
    }
)


class BridgeReceiver(OTLPReceiver):
    """The test's OTLP receiver, also listening on the root namespace's bridge address, where
    the hosts' processes reach it."""

    def __init__(self, host: str) -> None:
        super().__init__()
        self.host = host
        self.port = self._server.add_insecure_port(f"{host}:0")

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BridgeReceiver:
        super().__enter__()
        return self


@dataclass
class CrossHostCluster:
    hosts: Hosts
    receiver: BridgeReceiver
    http: httpx.Client
    checkpoint: Path
    log_dir: Path
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    processes: dict[str, HostProcess] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.checkpoint.name

    @property
    def url(self) -> str:
        return f"http://{self.hosts['gateway'].address}:{GATEWAY_PORT}"

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def _env(self, host: Host) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "REDIS_URL": f"redis://{self.address('gateway')}:{REDIS_PORT}/0",
            "NORI_ADVERTISE_HOST": host.address,
            "NORI_CLUSTER_SECRET": self.secret,
            # Export each batch of spans at once rather than every 5 s.
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            # UCX prints the protocols and lanes (transport/device) it picks per endpoint.
            "UCX_PROTO_INFO": "y",
        }

    def _serve(self, name: str, args: list[str]) -> HostProcess:
        host = self.hosts["gateway" if name == "gateway" else name]
        argv = [sys.executable, "-m", "nori.cli.main", *args]
        process = host.spawn(name, argv, self.log_dir / f"{name}.log", self._env(host))
        self.processes[name] = process
        return process

    def start(self, redis_binary: str, timeout_s: float = 180.0) -> None:
        gateway_host = self.hosts["gateway"]
        self.processes["redis"] = gateway_host.spawn(
            "redis",
            [redis_binary, "--port", str(REDIS_PORT), "--bind", gateway_host.address,
             "--protected-mode", "no", "--save", "", "--appendonly", "no"],
            self.log_dir / "redis.log",
        )  # fmt: skip
        common = ["--model", str(self.checkpoint), "--otlp-traces-endpoint", self.receiver.endpoint]
        worker = [*common, "--transport", "ucx", "--metrics-port", str(METRICS_PORT), *WORKER_ARGS]
        self._serve("prefill", ["-v", "serve", "prefill", "--port", str(PREFILL_PORT),
                                "--worker-id", "prefill", *worker])  # fmt: skip
        for name in DECODES:
            self._serve(name, ["-v", "serve", "decode", "--port", str(DECODE_PORT),
                               "--transfer-port", str(TRANSFER_PORT), "--worker-id", name,
                               *worker])  # fmt: skip
        # Every prompt through the prefill host: these tests follow the KV across the link.
        self._serve("gateway", ["serve", "gateway", "--port", str(GATEWAY_PORT),
                                "--disaggregation", "always", *common])  # fmt: skip
        self.wait_for_workers({"prefill": 1, "decode": 2}, timeout_s)

    # ------------------------------------------------------------------ looking at it

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None and not self.hosts[_host_of(name)].torn_down:
                raise AssertionError(f"{name} exited ({process.poll()}):\n{process.log()}")

    def workers_seen(self) -> dict[str, int] | None:
        try:
            workers = self.http.get(f"{self.url}/health", timeout=2).json().get("workers")
        except (httpx.HTTPError, ValueError):
            return None
        return dict(workers) if isinstance(workers, dict) else None

    def wait_for_workers(self, expected: dict[str, int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (seen := self.workers_seen()) != expected:
            self.check_alive()
            assert time.monotonic() < deadline, f"the gateway sees {seen}, not {expected}"
            time.sleep(0.2)

    def metrics(self, name: str) -> Scrape:
        host = "gateway" if name == "gateway" else name
        port = GATEWAY_PORT if name == "gateway" else METRICS_PORT
        text = self.http.get(f"http://{self.address(host)}:{port}/metrics", timeout=10).text
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    @contextlib.contextmanager
    def logs_on_failure(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            for name, process in self.processes.items():
                print(f"--- {name} (exit {process.poll()})\n{process.log(6000)}")
            raise


def _host_of(process_name: str) -> str:
    return "gateway" if process_name in ("gateway", "redis") else process_name


def value(scrape: Scrape, name: str, **labels: str) -> float:
    """A sample's value; 0 for one not there (a labelled counter never incremented)."""
    return scrape.get((name, frozenset(labels.items())), 0.0)


def gauge(scrape: Scrape, name: str, **labels: str) -> float:
    """A sample that must be there."""
    key = (name, frozenset(labels.items()))
    assert key in scrape, f"no {name}{labels or ''} in the scrape"
    return scrape[key]


@pytest.fixture(scope="module")
def cross_host(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CrossHostCluster]:
    require_namespaces()
    if not ucx_available():
        pytest.skip("needs ucxx (the KV must cross the hosts over UCX)")
    redis_binary = find_redis_server()
    if redis_binary is None:
        pytest.skip("no redis-server")
    log_dir = tmp_path_factory.mktemp("cross-host")
    hosts = Hosts(HOST_NAMES)
    try:
        with (
            BridgeReceiver(hosts.root_address) as receiver,
            httpx.Client(trust_env=False, timeout=120) as http,
        ):
            cluster = CrossHostCluster(hosts, receiver, http, checkpoint, log_dir)
            with cluster.logs_on_failure():
                cluster.start(redis_binary)
            yield cluster
    finally:
        hosts.close()
        assert not hosts.leftovers(), hosts.leftovers()


@pytest.fixture(scope="module")
def offline(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), dtype="float32", num_kv_blocks=512)


def greedy_texts(offline: LLM, prompts: list[str], max_tokens: int) -> list[str]:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in offline.generate(prompts, greedy, use_tqdm=False)]


def complete(cluster: CrossHostCluster, prompt: str, max_tokens: int) -> httpx.Response:
    return cluster.http.post(
        f"{cluster.url}/v1/completions",
        json={
            "model": cluster.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )


def settle(done: Callable[[], bool], timeout_s: float, what: str | Callable[[], str]) -> None:
    """Polls `done` until it holds; fails after `timeout_s`, saying `what` did not happen."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what() if callable(what) else what}")
        time.sleep(0.2)


# UCX_PROTO_INFO's table rows end with the lane: "| 0..8191 | eager short | tcp/eth0 |".
_UCX_LANE = re.compile(r"\|\s*([a-z0-9_]+/[A-Za-z0-9_.:-]+)\s*\|\s*$")


def ucx_lanes(log: str) -> set[str]:
    """Every transport/device UCX chose for a protocol of this process (UCX_PROTO_INFO)."""
    return {found.group(1) for line in log.splitlines() if (found := _UCX_LANE.search(line))}


def test_completions_cross_the_hosts_over_ucx_and_equal_the_offline_text(
    cross_host: CrossHostCluster, offline: LLM
) -> None:
    cluster = cross_host
    prompts = [
        "Once upon a time",
        "The little dog ran to the",
        "In a small village there lived an old man who",
        "1 2 3 4 5 6 7 8 9 10",
        "She looked at the sky and said",
        "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3,
    ]
    max_tokens = 16
    expected = greedy_texts(offline, prompts, max_tokens)
    before = {name: cluster.metrics(name) for name in WORKERS}
    with cluster.logs_on_failure():
        with ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(lambda p: complete(cluster, p, max_tokens), prompts))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        # The same text as one host's cluster gives (the offline engine's, token for token).
        assert [r.json()["choices"][0]["text"] for r in responses] == expected

        # Every KV byte came as messages, on both decode hosts: none copied out of a mapping of
        # the sender's shared memory.
        def received(name: str, bulk: str) -> float:
            return value(after[name], "nori_kv_received_bytes_total", bulk=bulk) - value(
                before[name], "nori_kv_received_bytes_total", bulk=bulk
            )

        after = {name: cluster.metrics(name) for name in WORKERS}
        for name in DECODES:
            assert received(name, "messages") > 0, name
            assert received(name, "mapped") == 0, name
        sent = value(after["prefill"], "nori_kv_transfer_bytes_total") - value(
            before["prefill"], "nori_kv_transfer_bytes_total"
        )
        assert sent == sum(received(name, "messages") for name in DECODES)

        # Each request's trace: the prefill host's kv_send names the decode host's UCX address,
        # and the decode worker's kv_receive (its child, by the context in the hand-off) says the
        # bytes came as messages.
        decode_of_address = {
            f"ucx://{cluster.address(name)}:{TRANSFER_PORT}": name for name in DECODES
        }
        receivers = set()
        for response in responses:
            spans = cluster.receiver.wait_for(
                response.headers["x-trace-id"],
                lambda found: {"kv_send", "kv_receive"} <= {s.name for s in found},
            )
            kv_send = _one(spans, "nori-prefill", "kv_send")
            kv_receive = _one(spans, "nori-decode", "kv_receive")
            assert kv_receive.parent_span_id == kv_send.span_id
            destination = kv_send.attributes["nori.kv.destination"]
            assert destination in decode_of_address, destination
            # The decode worker that received is the one on the host the sender addressed,
            # another host than the prefill worker's.
            assert kv_receive.attributes["nori.worker_id"] == decode_of_address[destination]
            assert cluster.address("prefill") not in destination
            assert kv_receive.attributes["nori.kv.bulk"] == "messages"
            assert kv_receive.attributes["nori.kv.bytes"] == kv_send.attributes["nori.kv.bytes"]
            assert kv_receive.attributes["nori.kv.bytes"] > 0
            # The receiver's own word: UCX carried the bytes, sent by the prefill worker at its
            # host's address.
            assert kv_receive.attributes["nori.kv.transport"] == "ucx"
            assert (
                kv_receive.attributes["nori.kv.sender"] == f"prefill@{cluster.address('prefill')}"
            )
            receivers.add(kv_receive.attributes["nori.worker_id"])
        assert receivers == set(DECODES), receivers

        # UCX's own word: every lane it chose, on the sender and both receivers, is TCP on the
        # hosts' eth0 (no sysv/posix shared memory, no cma, no loopback device).
        for name in WORKERS:
            assert ucx_lanes(cluster.log(name)) == {"tcp/eth0"}, (
                name,
                ucx_lanes(cluster.log(name)),
            )
        # Nori's one-host path was tried and refused on each decode host: the sender's segment
        # socket is an abstract Unix socket of another network namespace.
        for name in DECODES:
            log = cluster.log(name)
            assert "is received as messages, not copied out of its shared memory" in log, name


def _one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


def idle_free_blocks(cluster: CrossHostCluster, names: tuple[str, ...]) -> dict[str, float]:
    """Each worker's free KV blocks once none is held by a request."""

    def idle() -> bool:
        return all(gauge(cluster.metrics(n), "nori_kv_blocks_used") == 0 for n in names)

    settle(idle, 30, f"every block of {names} came back")
    return {name: gauge(cluster.metrics(name), "nori_kv_blocks_free") for name in names}


def test_a_prefill_hosts_link_cut_for_5_s_ends_in_answers_or_503_and_leaks_nothing(
    cross_host: CrossHostCluster, offline: LLM
) -> None:
    cluster = cross_host
    prefill = cluster.hosts["prefill"]
    max_tokens = 8
    long_prompt = "Once upon a time there was a little cat who liked to play. " * 6
    with cluster.logs_on_failure():
        baseline = idle_free_blocks(cluster, DECODES)
        with ThreadPoolExecutor(max_workers=24) as pool:
            futures = [
                pool.submit(complete, cluster, f"{index} {long_prompt}", max_tokens)
                for index in range(8)
            ]
            time.sleep(0.3)  # prompts queued, computing and in transfer
            with prefill.link_cut():
                cut_at = time.monotonic()
                for index in range(8, 18):  # and more while the link is down
                    futures.append(
                        pool.submit(complete, cluster, f"{index} {long_prompt}", max_tokens)
                    )
                    time.sleep(0.5)
                time.sleep(max(0.0, 5.0 - (time.monotonic() - cut_at)))
            responses = [future.result() for future in futures]
        answers = [(r.status_code, r.headers.get("retry-after"), r.text[:160]) for r in responses]
        print("answers:", [(status, retry) for status, retry, _ in answers])
        # The cut was felt: the prefill worker's registry entry expired (its heartbeat could not
        # reach Redis) or the gateway marked it failed, and requests got 503 meanwhile.
        assert any(r.status_code == 503 for r in responses), answers
        for response in responses:
            if response.status_code == 200:
                assert response.json()["usage"]["completion_tokens"] == max_tokens
            else:
                assert response.status_code == 503, answers
                assert int(response.headers["retry-after"]) >= 1, answers

        # The prefill worker is back in the registry, and the cluster serves again (to a client
        # that honours Retry-After: the gateway's channel to the prefill host may still wait
        # out gRPC's reconnect backoff a moment).
        cluster.wait_for_workers({"prefill": 1, "decode": 2}, timeout_s=30)
        deadline = time.monotonic() + 30
        while (again := complete(cluster, "Once upon a time", max_tokens)).status_code == 503:
            assert time.monotonic() < deadline, again.text
            time.sleep(int(again.headers["retry-after"]))
        assert again.status_code == 200, again.text
        assert (
            again.json()["choices"][0]["text"]
            == greedy_texts(offline, ["Once upon a time"], max_tokens)[0]
        )

        # Nothing leaks: every decode block came back, no prompt or export is held on the
        # prefill host, no request is in flight at the gateway.
        last: dict[str, Scrape] = {}

        def drained() -> bool:
            last.update({name: cluster.metrics(name) for name in (*WORKERS, "gateway")})
            decodes, prefill_now, gateway = last, last["prefill"], last["gateway"]
            return (
                all(
                    gauge(decodes[n], "nori_kv_blocks_used") == 0
                    and gauge(decodes[n], "nori_kv_blocks_free")
                    == gauge(decodes[n], "nori_kv_blocks_total")
                    == baseline[n]
                    and gauge(decodes[n], "nori_kv_transfers_in_flight") == 0
                    and gauge(decodes[n], "nori_num_requests_running") == 0
                    and gauge(decodes[n], "nori_num_requests_waiting") == 0
                    for n in DECODES
                )
                and gauge(prefill_now, "nori_kv_blocks_used") == 0
                and gauge(prefill_now, "nori_num_requests_running") == 0
                and gauge(prefill_now, "nori_num_requests_waiting") == 0
                and gauge(prefill_now, "nori_kv_export_arena_bytes_in_use") == 0
                and gauge(gateway, "nori_gateway_requests_in_flight", endpoint="/v1/completions")
                == 0
                and gauge(gateway, "nori_gateway_queued_prompt_tokens") == 0
            )

        def held() -> str:
            return str(
                {
                    name: {key[0]: v for key, v in scrape.items() if key[0] in LEAK_GAUGES}
                    for name, scrape in last.items()
                }
            )

        settle(drained, 45, lambda: f"every block, prompt and request released: {held()}")


# Tokens each stream has (one an event: the gateway's --stream-interval is 1) before the strike.
STRIKE_AFTER = 4


@dataclass
class Streamed:
    text: str = ""
    completion_tokens: int = 0
    longest_gap_s: float = 0.0


def stream(
    cluster: CrossHostCluster, prompt: str, max_tokens: int, started: threading.Barrier
) -> Streamed:
    """Streams one greedy completion (no error event allowed), waiting at `started` once its
    first STRIKE_AFTER tokens have come (token one from the prefill host, the rest decoded)."""
    body = {
        "model": cluster.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen, events = Streamed(), 0
    with cluster.http.stream("POST", f"{cluster.url}/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        last = time.monotonic()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            seen.longest_gap_s, last = max(seen.longest_gap_s, now - last), now
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            if event["choices"]:
                seen.text += event["choices"][0]["text"]
                events += 1
                if events == STRIKE_AFTER:
                    started.wait()
            if event.get("usage"):
                seen.completion_tokens = event["usage"]["completion_tokens"]
    return seen


def test_a_decode_host_torn_down_mid_stream_hands_its_streams_to_the_other(
    cross_host: CrossHostCluster, offline: LLM
) -> None:
    """The host goes as a machine that loses power: its link first, then its processes and
    its namespace, so no FIN or reset ever reaches the gateway; gRPC keepalive (a ping every
    10 s, 5 s to answer) ends its calls, and every stream continues on the other decode host."""
    cluster = cross_host
    prompts = [f"Story {index}: once upon a time, a little" for index in range(8)]
    max_tokens = 48
    expected = greedy_texts(offline, prompts, max_tokens)
    with cluster.logs_on_failure():
        baseline = idle_free_blocks(cluster, ("decode-1",))
        started = threading.Barrier(len(prompts) + 1, timeout=120)
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            futures = [pool.submit(stream, cluster, p, max_tokens, started) for p in prompts]
            started.wait()  # every stream is decoding: about half of them on each decode host
            cluster.hosts["decode-0"].tear_down(abrupt=True)
            results = [future.result() for future in futures]
        assert [r.text for r in results] == expected  # no token lost, repeated or changed
        assert all(r.completion_tokens == max_tokens for r in results)
        print("longest gaps:", [round(r.longest_gap_s, 1) for r in results])
        assert max(r.longest_gap_s for r in results) < 30.0
        assert "continuing on another decode worker" in cluster.log("gateway")
        assert cluster.processes["decode-0"].poll() is not None
        assert idle_free_blocks(cluster, ("decode-1",)) == baseline
