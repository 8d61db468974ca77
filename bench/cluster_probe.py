"""What a benchmark needs of a local cluster: one started on a private Redis for the run, and
what it reads from it while it runs (each role's RSS from /proc, each worker's /metrics, the
free KV blocks once it is idle)."""

from __future__ import annotations

import time
import urllib.request
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from nori.cluster_auth import generate_secret
from nori.launch.local_cluster import ClusterSpec, LocalCluster, free_port
from nori.launch.redis_server import redis_for_cluster
from nori.models.demo import resolve_model


@dataclass(frozen=True)
class BenchCluster:
    """The cluster a benchmark runs against: a model folder or a built-in name, and its roles."""

    model: str = "demo"
    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    worker_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    startup_timeout_s: float = 300.0
    # The benchmark's name: the prefix of the cluster's Redis namespace.
    name: str = "bench"


def start_bench_cluster(stack: ExitStack, options: BenchCluster) -> LocalCluster:
    """A started cluster (and its private Redis, when REDIS_URL has none) that `stack` stops."""
    model_dir = resolve_model(options.model)
    redis_url, redis_server = redis_for_cluster()
    if redis_server is not None:
        stack.callback(redis_server.stop)
    spec = ClusterSpec(
        redis_url=redis_url,
        model=str(model_dir),
        num_prefill=options.num_prefill,
        num_decode=options.num_decode,
        port=free_port(),
        namespace=f"{options.name}-{uuid.uuid4().hex[:8]}",
        served_model_name=model_dir.name,
        colocated=options.colocated,
        worker_args=options.worker_args,
        log_dir=options.log_dir,
        # Authenticated as `nori up` runs it: the benchmark pays what users pay.
        cluster_secret=generate_secret(),
    )
    cluster = stack.enter_context(LocalCluster(spec))
    cluster.start(timeout_s=options.startup_timeout_s)
    return cluster


def rss_bytes(pid: int) -> int:
    """A process's resident set, from /proc (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def scrape(address: str) -> dict[str, float]:
    """A worker's unlabelled samples from its /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def worker_metrics_addresses(cluster: LocalCluster) -> dict[str, str]:
    import redis

    from nori.state.keys import Keys

    client = redis.Redis.from_url(cluster.spec.redis_url)
    try:
        addresses = {}
        for process in cluster.processes:
            if process.role == "gateway":
                continue
            key = Keys(cluster.spec.namespace).worker(process.name)
            value = client.hget(key, "metrics_address")
            if isinstance(value, bytes) and value:
                addresses[process.name] = value.decode()
        return addresses
    finally:
        client.close()


def sample_cluster(cluster: LocalCluster, addresses: dict[str, str]) -> dict[str, Any]:
    """Every role's RSS (MiB) and every worker's free and total KV blocks, now."""
    blocks = {}
    for name, address in addresses.items():
        figures = scrape(address)
        blocks[name] = {
            "free": int(figures.get("nori_kv_blocks_free", 0)),
            "total": int(figures.get("nori_kv_blocks_total", 0)),
        }
    return {
        "rss_mib": {p.name: rss_bytes(p.process.pid) / 2**20 for p in cluster.processes},
        "kv_blocks": blocks,
    }


def idle_free_blocks(addresses: dict[str, str], timeout_s: float = 60.0) -> dict[str, int]:
    """Each worker's free blocks once nothing runs or waits (the end of a window's stragglers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        figures = {name: scrape(address) for name, address in addresses.items()}
        busy = any(
            f.get("nori_num_requests_running", 0) + f.get("nori_num_requests_waiting", 0)
            for f in figures.values()
        )
        if not busy or time.monotonic() > deadline:
            return {name: int(f.get("nori_kv_blocks_free", 0)) for name, f in figures.items()}
        time.sleep(0.2)
