"""A real cluster for the end-to-end tests: Redis, a gateway, 1 prefill and 2 decode processes.

Everything is real: the processes are `nori serve ROLE` as containers run them, KV blocks move
over UCX (ucxx) between processes, the workers talk gRPC, the clients speak HTTP.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nori.launch.local_cluster import ClusterSpec, LocalCluster, free_port
from nori.launch.redis_server import RedisServer
from nori.models.init_checkpoint import init_checkpoint
from nori.transfer.factory import ucx_available

# Small pools so that blocks are easy to account for, float32 so the offline reference matches.
WORKER_ARGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "32")
LEASE_S = 3.0


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The demo shape (4 layers, 4096 positions): slow enough on a CPU that a long request is
    # reliably still running when a test disconnects or stops its worker.
    folder = tmp_path_factory.mktemp("cluster") / "demo-llama"
    init_checkpoint(folder, "demo", seed=11)
    return folder


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server for a module whose tests kill it and start it again on the
    same port (empty)."""
    server = RedisServer(port=free_port()).start()
    try:
        yield server
    finally:
        server.stop()


def start_cluster(
    redis_url: str, checkpoint: Path, log_dir: Path, **overrides: object
) -> LocalCluster:
    options: dict[str, object] = {
        "redis_url": redis_url,
        "model": str(checkpoint),
        "num_prefill": 1,
        "num_decode": 2,
        "port": free_port(),
        "namespace": f"test-{uuid.uuid4().hex[:12]}",
        "transport": os.environ.get("NORI_TEST_TRANSPORT") or ("ucx" if ucx_available() else "tcp"),
        "kv_lease_s": LEASE_S,
        # Every prompt through a prefill worker: these tests follow the KV between workers
        # (the conditional disaggregation test asks for `auto`, the default, itself).
        "disaggregation": "always",
        "worker_args": WORKER_ARGS,
        "log_dir": log_dir,
    }
    options.update(overrides)
    cluster = LocalCluster(ClusterSpec(**options))  # type: ignore[arg-type]
    try:
        cluster.start(timeout_s=180)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def running_cluster(
    redis_url: str, checkpoint: Path, factory: pytest.TempPathFactory, **overrides: object
) -> Iterator[LocalCluster]:
    """A module fixture's body: a started cluster (`start_cluster` overrides), stopped after."""
    running = start_cluster(redis_url, checkpoint, factory.mktemp("logs"), **overrides)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def cluster(
    redis_url: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    yield from running_cluster(redis_url, checkpoint, tmp_path_factory)
