"""Nobody joins a cluster with a secret by writing to its Redis, and its Redis wants passwords.

One real cluster for the module, as `nori up` makes it: a private redis-server from
`resolve_redis_url(..., namespace=...)` (a generated password, one ACL user per role, each role
logging in as its own), a cluster secret, a gateway, a prefill and a decode worker.

- Forged membership: "colocated" worker entries written straight into Redis (one unsigned, one
  signed with another secret), pointing at a gRPC server of the test's that records every call.
  100 requests: none reaches it; the gateway logs each refusal once and counts it in /metrics.
- Redis refuses a client without the password, or with a wrong one.
- The ACL: the gateway's user cannot write a worker entry or the block directory (NOPERM, from
  Redis itself); a worker's user can write worker entries; no role's password is in any log.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import grpc
import httpx
import pytest
import redis

from nori.cluster_auth import ClusterAuth, generate_secret
from nori.launch.local_cluster import LocalCluster
from nori.launch.redis_acl import READ_ONLY_PATTERNS_SINCE
from nori.launch.redis_server import RedisServer, resolve_redis_url
from nori.state.keys import Keys
from nori.state.registry import WorkerInfo, sign_entry
from tests.cluster.conftest import start_cluster
from tests.cluster.test_cluster_e2e import model_name

pytestmark = pytest.mark.slow

NUM_REQUESTS = 100
CONCURRENCY = 8


@dataclass
class CallRecorder(grpc.GenericRpcHandler):
    """A gRPC server's handler that records every method called on it and serves none."""

    calls: list[str] = field(default_factory=list)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> None:
        self.calls.append(handler_call_details.method)
        return None  # UNIMPLEMENTED


@dataclass(frozen=True)
class SecuredCluster:
    cluster: LocalCluster
    redis: RedisServer


@pytest.fixture(scope="module")
def secured(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredCluster]:
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    # As `nori up` gets its Redis when REDIS_URL is unset.
    url, server = resolve_redis_url(None, namespace=namespace)
    assert server is not None
    try:
        cluster = start_cluster(
            url,
            checkpoint,
            tmp_path_factory.mktemp("logs"),
            namespace=namespace,
            num_decode=1,
            cluster_secret=generate_secret(),
            role_redis_urls=tuple(sorted(server.role_urls().items())),
        )
        try:
            yield SecuredCluster(cluster, server)
        finally:
            cluster.stop()
    finally:
        server.stop()


@pytest.fixture
def recorder() -> Iterator[tuple[CallRecorder, str]]:
    handler = CallRecorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield handler, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def _fake_entry(worker_id: str, address: str, model: str) -> dict[str, str]:
    """An entry as attractive as can be: colocated, idle, huge KV pool, the cluster's layout."""
    now = time.time()
    return WorkerInfo(
        worker_id=worker_id,
        role="colocated",
        grpc_address=address,
        model=model,
        num_free_blocks=10**6,
        num_total_blocks=10**6,
        block_size=16,
        kv_cache_dtype="float32",
        started_at=now - 3600,
        updated_at=now,
        expires_at=now + 3600,
    ).to_mapping()


def _complete(client: httpx.Client, model: str, index: int) -> int:
    response = client.post(
        "/v1/completions",
        json={"model": model, "prompt": f"Request {index}", "max_tokens": 2, "ignore_eos": True},
    )
    return response.status_code


def test_forged_worker_entries_are_never_routed_to_and_are_logged_once_and_counted(
    secured: SecuredCluster, recorder: tuple[CallRecorder, str]
) -> None:
    cluster, (handler, address) = secured.cluster, recorder
    keys = Keys(cluster.spec.namespace)
    model = model_name(cluster)
    admin = redis.Redis.from_url(secured.redis.url, decode_responses=True)
    try:
        # Whoever can write to Redis but lacks the secret: no signature, or one under another.
        admin.hset(keys.worker("intruder"), mapping=_fake_entry("intruder", address, model))
        other = ClusterAuth.from_text(generate_secret())
        forged = sign_entry(other, _fake_entry("forger", address, model))
        admin.hset(keys.worker("forger"), mapping=forged)
        time.sleep(1.5)  # a few registry reads by the gateway
        with (
            httpx.Client(base_url=cluster.url, timeout=60) as client,
            futures.ThreadPoolExecutor(CONCURRENCY) as pool,
        ):
            statuses = list(pool.map(lambda i: _complete(client, model, i), range(NUM_REQUESTS)))
            health = client.get("/health").json()
            metrics = client.get("/metrics").text
    finally:
        admin.delete(keys.worker("intruder"), keys.worker("forger"))
        admin.close()
    assert statuses == [200] * NUM_REQUESTS
    assert handler.calls == []
    assert health["workers"] == {"prefill": 1, "decode": 1}
    log = cluster.worker("gateway").log_tail(200_000)
    assert log.count("refusing worker entry intruder: it carries no signature") == 1, log
    assert log.count("refusing worker entry forger: its signature does not verify") == 1, log
    assert 'nori_gateway_refused_worker_entries_total{reason="unsigned"} 1' in metrics
    assert 'nori_gateway_refused_worker_entries_total{reason="forged"} 1' in metrics


def test_redis_refuses_a_client_without_the_password(secured: SecuredCluster) -> None:
    port = secured.redis.port
    for password in (None, "wrong-password"):
        client = redis.Redis(port=port, password=password, socket_timeout=2, retry=None)
        try:
            with pytest.raises(redis.AuthenticationError):
                client.set(f"{secured.cluster.spec.namespace}:probe", "1")
        finally:
            client.close()
    # A role's user with another role's password is refused too.
    urls = secured.redis.role_urls()
    gateway, decode = urlsplit(urls["gateway"]), urlsplit(urls["decode"])
    client = redis.Redis(port=port, username=gateway.username, password=decode.password, retry=None)
    try:
        with pytest.raises(redis.AuthenticationError):
            client.ping()
    finally:
        client.close()


def test_each_role_may_write_only_its_own_keys(secured: SecuredCluster) -> None:
    keys = Keys(secured.cluster.spec.namespace)
    urls = secured.redis.role_urls()
    probe = keys.worker("acl-probe")
    clients = {role: redis.Redis.from_url(url) for role, url in urls.items()}
    try:
        assert clients["gateway"].ping()
        if secured.redis.version >= READ_ONLY_PATTERNS_SINCE:
            with pytest.raises(redis.exceptions.NoPermissionError):
                clients["gateway"].hset(probe, "worker_id", "acl-probe")
            with pytest.raises(redis.exceptions.NoPermissionError):
                clients["gateway"].sadd(f"{keys.namespace}:block:00", "acl-probe")
        # What it does write, and what it reads.
        clients["gateway"].hset(keys.request("acl-probe"), "state", "queued")
        assert clients["gateway"].hgetall(keys.worker("decode-0"))
        # Workers write their entries; a prefill worker writes no request states.
        assert clients["decode"].hset(probe, "worker_id", "acl-probe") == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            clients["prefill"].hset(keys.request("acl-probe"), "state", "queued")
        # Nobody but the default user reaches another namespace, or the server's settings.
        for client in clients.values():
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.set("other-namespace:worker:x", "1")
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.flushall()
    finally:
        clients["decode"].delete(probe)
        clients["gateway"].delete(keys.request("acl-probe"))
        for client in clients.values():
            client.close()
    # No password, of Redis or of a role, in any process's log.
    passwords = {secured.redis.password or ""}
    passwords |= {unquote(urlsplit(url).password or "") for url in urls.values()}
    for role in secured.cluster.processes:
        text = role.log_tail(10_000_000)
        assert not any(password and password in text for password in passwords), role.name
