"""Issue 22: a cluster with a secret takes internal calls only with its credential, and a cluster
started as `nori up` starts one listens on loopback only.

One real cluster (Redis, a gateway, a prefill and a decode worker, all `nori serve` processes)
with a generated cluster secret, started as `nori up` does: the gateway and every worker on
127.0.0.1. A raw client using the project's own stubs gets UNAUTHENTICATED from both workers
without the token, and answers with it; the health service answers anyone; the gateway's own
calls (Generate, Prefill, GetStats) and the prefill worker's lease renewals carry the token, so
requests are served. A KV sender without a reservation's token is refused by the decode worker,
which keeps that reservation's blocks. Then the kernel's socket table: every listening socket of
every process of the cluster is on loopback (the decode workers' UCX receivers open none: senders
reach them by their UCX worker addresses).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nori.cluster_auth import RPC_TOKEN_METADATA, ClusterAuth, generate_secret, random_token
from nori.launch.local_cluster import LocalCluster
from nori.rpc.convert import params_to_proto
from nori.sampling.params import SamplingParams
from nori.state.keys import Keys
from nori.transfer.base import TransferRejected
from nori.transfer.factory import make_sender
from nori.transfer.handoff import TransferHeader, parse_address
from nori.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from nori.v1.handoff_pb2 import KVDestination
from tests.cluster.conftest import running_cluster

GREEDY = SamplingParams(max_tokens=3, temperature=0.0)
SECRET = generate_secret()
TOKEN = ClusterAuth.from_text(SECRET).rpc_metadata()
WRONG = ((RPC_TOKEN_METADATA, ClusterAuth.from_text(generate_secret()).rpc_token()),)


@pytest.fixture(scope="module")
def cluster(
    redis_url: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    # As `nori up` starts one: a secret of its own, the gateway on 127.0.0.1 (its --host), the
    # workers on 127.0.0.1 (LocalCluster.add_worker).
    yield from running_cluster(
        redis_url,
        checkpoint,
        tmp_path_factory,
        num_decode=1,
        host="127.0.0.1",
        cluster_secret=SECRET,
    )


def generate_request(compute_prompt: bool = True) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id=f"raw-{time.monotonic_ns()}",
        prompt_token_ids=[1, 2, 3, 4],
        params=params_to_proto(GREEDY),
        compute_prompt=compute_prompt,
    )


RENEWAL = decode_pb2.RenewLeasesRequest(
    prefill_worker_id="x", renewals=[decode_pb2.LeaseRenewal(request_id="r")]
)


def denied_calls(
    decode: decode_pb2_grpc.DecodeServiceStub,
    prefill: prefill_pb2_grpc.PrefillServiceStub,
    metadata: tuple[tuple[str, str], ...],
) -> dict[str, Callable[[], object]]:
    """Every method of both workers, called with `metadata` (streams read to their end)."""
    stats = common_pb2.StatsRequest()
    prefill_request = prefill_pb2.PrefillRequest(
        request_id="raw-prefill", prompt_token_ids=[1, 2, 3], params=params_to_proto(GREEDY)
    )
    return {
        # The bypass: tokens straight from a decode worker, past the gateway.
        "Generate(compute_prompt)": lambda: list(
            decode.Generate(generate_request(), metadata=metadata, timeout=10)
        ),
        "Generate(reserve)": lambda: list(
            decode.Generate(generate_request(False), metadata=metadata, timeout=10)
        ),
        "RenewLeases": lambda: decode.RenewLeases(RENEWAL, metadata=metadata, timeout=10),
        "decode GetStats": lambda: decode.GetStats(stats, metadata=metadata, timeout=10),
        "Prefill": lambda: prefill.Prefill(prefill_request, metadata=metadata, timeout=10),
        "prefill GetStats": lambda: prefill.GetStats(stats, metadata=metadata, timeout=10),
    }


def status_of(call: Callable[[], object]) -> grpc.StatusCode:
    """The status a call (read to its end) failed with."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    error = caught.value
    assert isinstance(error, grpc.Call)
    code: grpc.StatusCode = error.code()
    return code


def test_worker_calls_without_the_cluster_token_are_refused(cluster: LocalCluster) -> None:
    decode = cluster.worker("decode-0").grpc_address
    prefill = cluster.worker("prefill-0").grpc_address
    with grpc.insecure_channel(decode) as d_channel, grpc.insecure_channel(prefill) as p_channel:
        d_stub = decode_pb2_grpc.DecodeServiceStub(d_channel)
        p_stub = prefill_pb2_grpc.PrefillServiceStub(p_channel)
        for metadata in ((), WRONG):
            calls = denied_calls(d_stub, p_stub, metadata)
            for name, call in calls.items():
                # A denied stream ends at once: a hang would end in DEADLINE_EXCEEDED.
                started = time.monotonic()
                assert status_of(call) == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
                assert time.monotonic() - started < 5, name
            with pytest.raises(grpc.RpcError, match="cluster's credential"):
                calls["Prefill"]()

        # With the token: served.
        deltas = list(d_stub.Generate(generate_request(), metadata=TOKEN, timeout=60))
        assert sum(len(m.delta.token_ids) for m in deltas) == 3 and deltas[-1].delta.finished
        assert d_stub.GetStats(common_pb2.StatsRequest(), metadata=TOKEN, timeout=10).role == (
            "decode"
        )
        assert p_stub.GetStats(common_pb2.StatsRequest(), metadata=TOKEN, timeout=10).role == (
            "prefill"
        )
        answer = d_stub.RenewLeases(RENEWAL, metadata=TOKEN, timeout=10)
        assert list(answer.unknown_request_ids) == ["r"]
        # A prompt whose first token ends it: answered by the prefill worker alone (no KV).
        one_token = prefill_pb2.PrefillRequest(
            request_id=f"raw-{time.monotonic_ns()}",
            prompt_token_ids=[1, 2, 3],
            params=params_to_proto(SamplingParams(max_tokens=1, temperature=0.0)),
        )
        first = p_stub.Prefill(one_token, metadata=TOKEN, timeout=60).first
        assert len(first.token_ids) == 1 and first.finished

        # The health service answers anyone (the containers' healthchecks hold no secret).
        for channel in (d_channel, p_channel):
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_the_gateway_and_the_prefill_worker_carry_the_token(cluster: LocalCluster) -> None:
    """Disaggregated requests go through: the gateway's Generate and Prefill calls, and the
    prefill worker's lease renewals, all authenticated; /metrics has every worker's GetStats."""
    model = Path(cluster.spec.model).name
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        for _ in range(3):
            response = client.post(
                "/v1/completions",
                json={"model": model, "prompt": "Once upon a time", "max_tokens": 8},
            )
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 8
        metrics = client.get("/metrics").text
    for worker in ("prefill-0", "decode-0"):
        assert f'nori_worker_total_kv_blocks{{worker_id="{worker}"' in metrics, metrics[-2000:]
    for process in cluster.processes:
        log = process.log_path.read_text(errors="replace")
        assert "UNAUTHENTICATED" not in log, (process.name, log[-3000:])
        assert "could not renew" not in log, (process.name, log[-3000:])


def free_blocks(stub: decode_pb2_grpc.DecodeServiceStub) -> int:
    stats = stub.GetStats(common_pb2.StatsRequest(), metadata=TOKEN, timeout=10)
    return int(stats.num_free_blocks)


def renew(stub: decode_pb2_grpc.DecodeServiceStub, request_id: str) -> list[str]:
    renewal = decode_pb2.RenewLeasesRequest(
        prefill_worker_id="test", renewals=[decode_pb2.LeaseRenewal(request_id=request_id)]
    )
    return list(stub.RenewLeases(renewal, metadata=TOKEN, timeout=10).unknown_request_ids)


async def send_forged(address: str, headers: list[TransferHeader]) -> list[str]:
    """What the receiver answers each header (a refusal's words), one small buffer each."""
    sender = make_sender(None)
    answers = []
    try:
        for header in headers:
            try:
                await sender.send(address, header, [torch.zeros(16, dtype=torch.uint8)])
                answers.append("accepted")
            except TransferRejected as error:
                answers.append(str(error))
    finally:
        await sender.close()
    return answers


def test_a_kv_transfer_without_its_reservations_token_is_refused_and_frees_nothing(
    cluster: LocalCluster,
) -> None:
    """A sender that learned a live reservation's worker, address, blocks and epoch, but not
    its token, is refused by the decode worker's receiver; the reservation keeps exactly its
    blocks and stays live, and cancelling it then frees exactly them."""
    with grpc.insecure_channel(cluster.worker("decode-0").grpc_address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        before = free_blocks(stub)
        request = generate_request(compute_prompt=False)
        del request.prompt_token_ids[:]
        request.prompt_token_ids.extend(range(1, 41))
        stream = stub.Generate(request, metadata=TOKEN, timeout=60)
        try:
            reservation = next(stream).reservation
            reserved = list(reservation.block_ids)
            assert reserved and free_blocks(stub) == before - len(reserved)
            forged = []
            for token in ("", random_token(), reservation.transfer_token[:-1] + "x"):
                destination = KVDestination()
                destination.CopyFrom(reservation)
                destination.transfer_token = token
                forged.append(
                    TransferHeader.of(request.request_id, reserved, [16], destination=destination)
                )
            answers = asyncio.run(send_forged(reservation.transfer_address, forged))
            assert all("transfer token" in answer for answer in answers), answers
            assert renew(stub, request.request_id) == [], "the reservation is still live"
            assert free_blocks(stub) == before - len(reserved), "nothing was freed"
        finally:
            stream.cancel()
        deadline = time.monotonic() + 10
        while free_blocks(stub) != before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert free_blocks(stub) == before
        assert renew(stub, request.request_id) == [request.request_id]


# ---------------------------------------------------------------------- the socket table


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str
    port: int


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (host byte order words) in plain text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listeners(pid: int) -> list[Listener]:
    """The listening TCP sockets (IPv4 and IPv6) that process `pid` holds."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # TCP_LISTEN
                    host, port = local.split(":")
                    found.append(Listener(pid, _address(host), int(port, 16)))
    return found


def test_parse_the_socket_table() -> None:
    assert _address("0100007F") == "127.0.0.1"
    assert _address("00000000000000000000000001000000") == "::1"
    assert is_loopback(_address("0000000000000000FFFF00000100007F"))  # ::ffff:127.0.0.1
    assert not is_loopback(_address("00000000")) and not is_loopback("::")


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def with_descendants(pid: int) -> list[int]:
    """`pid` and every process below it (a tensor-parallel worker's follower ranks, say)."""
    found, index = [pid], 0
    while index < len(found):
        for task in os.listdir(f"/proc/{found[index]}/task"):
            path = f"/proc/{found[index]}/task/{task}/children"
            with contextlib.suppress(OSError), open(path) as children:
                found.extend(int(child) for child in children.read().split())
        index += 1
    return found


def cluster_listeners(cluster: LocalCluster) -> dict[str, list[Listener]]:
    """Every listening socket of each of the cluster's processes and their children."""
    found = {}
    for process in cluster.processes:
        assert process.process.poll() is None, process.log_tail()
        pids = with_descendants(process.process.pid)
        found[process.name] = [entry for pid in pids for entry in listeners(pid)]
    assert all(found.values()), found  # every process listens somewhere (the table is read)
    return found


def transfer_addresses(cluster: LocalCluster) -> list[str]:
    """The decode workers' registered KV transfer addresses."""
    client = redis.Redis.from_url(cluster.spec.redis_url)
    try:
        return [
            client.hget(
                Keys(cluster.spec.namespace).worker(process.name), "transfer_address"
            ).decode()
            for process in cluster.processes
            if process.role == "decode"
        ]
    finally:
        client.close()


def test_every_listener_of_a_nori_up_cluster_is_on_loopback(cluster: LocalCluster) -> None:
    """The gateway's HTTP, each worker's gRPC and /metrics, the KV receivers, and UCX's own
    sockets (its TCP transport's, one per network device it uses: `lo` only here)."""
    wide = {
        name: [f"{entry.address}:{entry.port}" for entry in entries]
        for name, entries in cluster_listeners(cluster).items()
        if any(not is_loopback(e.address) for e in entries)
    }
    assert not wide, f"listening beyond loopback: {wide}"


def test_the_ucx_receivers_are_reached_by_worker_address_not_a_port(cluster: LocalCluster) -> None:
    addresses = [parse_address(address) for address in transfer_addresses(cluster)]
    if not all(address.scheme == "ucx" for address in addresses):
        pytest.skip("the cluster moves KV over TCP")
    assert addresses and all(a.peer and a.port == 0 for a in addresses), addresses
