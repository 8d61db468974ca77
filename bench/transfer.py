"""`nori bench transfer`: how fast KV blocks move between two processes.

The same bytes, cut into the same blocks, are moved four ways:

- ucx: our UCX transport (`UcxSender` -> `UcxReceiver` in another process);
- tcp_transport: our TCP fallback (`TcpSender` -> `TcpReceiver` in another process);
- socket: a plain blocking TCP socket between two processes (`sendall` / `recv_into` per block),
  the yardstick the UCX transport is held to;
- memcpy: one local `copy_` of all the bytes, the ceiling of what memory does.

The receiving side always writes in place into one preallocated "cache" tensor. Each transport
moves the blocks once untimed (connection setup, UCX wire-up, page faults), then `repeats` timed
times; the figures are the median of the timed repeats, in GB/s (1e9 bytes per second), timed
on the sender from the first byte until the receiver's acknowledgement.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from nori.transfer.base import TransferConfig
from nori.transfer.handoff import TransferHeader
from nori.transfer.integrity import buffer_checksums

# One message = one block of one layer's K (or V) in Nori's cache layout
# [layers, 2, blocks, block_size, kv_heads, head_dim]: that is the largest piece a receiver can
# write in place when the destination blocks are not adjacent. 16 tokens x 8 KV heads x 128 dims
# x 2 bytes (a Llama-3-8B-class model in bfloat16, block_size 16) = 32 KiB.
DEFAULT_BLOCK_KIB = 32
TRANSPORTS = ("ucx", "tcp_transport", "socket", "memcpy")

# A child that never reports its address (failed import, crashed UCX) must not hang the run.
_CHILD_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TransferBenchConfig:
    total_mib: int = 64
    block_kib: int = DEFAULT_BLOCK_KIB
    repeats: int = 5
    transports: tuple[str, ...] = TRANSPORTS

    def __post_init__(self) -> None:
        if self.total_mib < 1 or self.block_kib < 1 or self.repeats < 1:
            raise ValueError("--total-mib, --block-kib and --repeats must be >= 1")
        if self.block_kib * 1024 > self.total_bytes:
            raise ValueError("--block-kib must not exceed --total-mib")
        unknown = set(self.transports) - set(TRANSPORTS)
        if unknown or not self.transports:
            raise ValueError(f"transports must be among {', '.join(TRANSPORTS)}")

    @property
    def block_bytes(self) -> int:
        return self.block_kib * 1024

    @property
    def num_blocks(self) -> int:
        return self.total_bytes // self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.total_mib * 1024 * 1024


def _blocks(data: torch.Tensor, block_bytes: int) -> list[torch.Tensor]:
    return list(data.view(-1, block_bytes).unbind(0))


class _CacheSink:
    """Hands out one block of a preallocated tensor per header buffer (block id = index)."""

    def __init__(self, cache: torch.Tensor, block_bytes: int) -> None:
        self._blocks = _blocks(cache, block_bytes)

    def destinations(self, header: TransferHeader) -> list[torch.Tensor]:
        return [self._blocks[block_id] for block_id in header.block_ids]

    def completed(self, header: TransferHeader, nbytes: int) -> None:
        pass

    def failed(self, header: TransferHeader, error: str) -> None:
        pass


async def _serve_transport(kind: str, settings: TransferBenchConfig, conn: Connection) -> None:
    from nori.transfer.factory import make_receiver

    cache = torch.zeros(settings.num_blocks * settings.block_bytes, dtype=torch.uint8)
    receiver = make_receiver(kind, _CacheSink(cache, settings.block_bytes))
    conn.send((await receiver.start(host="127.0.0.1"), _ucx_environment()))
    # Serve until the parent says stop (or goes away): its pipe becomes readable.
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not stop.done():
            stop.set_result(None)

    loop.add_reader(conn.fileno(), on_readable)
    await stop
    loop.remove_reader(conn.fileno())
    await receiver.close()


def _serve_socket(settings: TransferBenchConfig, conn: Connection) -> None:
    cache = torch.zeros(settings.num_blocks * settings.block_bytes, dtype=torch.uint8)
    views = [block.numpy().data for block in _blocks(cache, settings.block_bytes)]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send((f"tcp://127.0.0.1:{listener.getsockname()[1]}", {}))
        peer, _ = listener.accept()
        with peer:
            while True:
                for view in views:
                    while len(view):
                        received = peer.recv_into(view)
                        if received == 0:
                            return  # the sender is done
                        view = view[received:]
                peer.sendall(b"k")


def _child_main(kind: str, settings: TransferBenchConfig, conn: Connection) -> None:
    """Entry point of the receiving process (spawned: nothing inherited but the arguments)."""
    if kind == "socket":
        _serve_socket(settings, conn)
    else:
        asyncio.run(_serve_transport(kind, settings, conn))


def _ucx_environment() -> dict[str, str]:
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith(("UCX_", "UCXPY_"))
    }


class _Child:
    """A receiving process; `address` is where it listens."""

    def __init__(self, kind: str, settings: TransferBenchConfig) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(kind, settings, child_conn), daemon=True
        )
        self._process.start()
        child_conn.close()
        if not self._conn.poll(_CHILD_START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"the {kind} receiver process did not start")
        self.address, self.environment = self._conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._process.join(10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join()
        self._conn.close()


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def _time_transport(
    kind: str, address: str, settings: TransferBenchConfig, source: torch.Tensor
) -> list[float]:
    from nori.transfer.factory import make_sender

    blocks = _blocks(source, settings.block_bytes)
    header = TransferHeader.of(
        request_id="bench",
        block_ids=list(range(settings.num_blocks)),
        buffer_nbytes=[settings.block_bytes] * settings.num_blocks,
    )
    sender = make_sender(kind, TransferConfig(timeout_s=300.0))
    rates = []
    try:
        for repeat in range(settings.repeats + 1):
            start = time.perf_counter()
            await sender.send(address, header, blocks)
            if repeat:  # the first round is the untimed warm-up
                rates.append(_rate(settings.total_bytes, time.perf_counter() - start))
    finally:
        await sender.close()
    return rates


def _time_socket(address: str, settings: TransferBenchConfig, source: torch.Tensor) -> list[float]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    views = [block.numpy().data for block in _blocks(source, settings.block_bytes)]
    rates = []
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for repeat in range(settings.repeats + 1):
            start = time.perf_counter()
            for view in views:
                sock.sendall(view)
            if sock.recv(1) != b"k":
                raise RuntimeError("the socket receiver went away")
            if repeat:
                rates.append(_rate(settings.total_bytes, time.perf_counter() - start))
    return rates


def _time_memcpy(settings: TransferBenchConfig, source: torch.Tensor) -> list[float]:
    destination = torch.empty_like(source)
    rates = []
    for repeat in range(settings.repeats + 1):
        start = time.perf_counter()
        destination.copy_(source)
        if repeat:
            rates.append(_rate(settings.total_bytes, time.perf_counter() - start))
    return rates


def _time_checksums(settings: TransferBenchConfig, source: torch.Tensor) -> list[float]:
    """What the integrity check costs: xxh3 over every block, as a sender (and then the
    receiver, once more) computes it per transfer buffer."""
    blocks = _blocks(source, settings.block_bytes)
    rates = []
    for repeat in range(settings.repeats + 1):
        start = time.perf_counter()
        buffer_checksums(blocks)
        if repeat:
            rates.append(_rate(settings.total_bytes, time.perf_counter() - start))
    return rates


def _measure(
    transport: str, settings: TransferBenchConfig, source: torch.Tensor
) -> tuple[list[float], dict[str, str]]:
    """The rates of the timed repeats, and the receiving process's UCX environment."""
    if transport == "memcpy":
        return _time_memcpy(settings, source), {}
    kind = {"ucx": "ucx", "tcp_transport": "tcp", "socket": "socket"}[transport]
    child = _Child(kind, settings)
    try:
        if kind == "socket":
            return _time_socket(child.address, settings, source), child.environment
        rates = asyncio.run(_time_transport(kind, child.address, settings, source))
        return rates, child.environment
    finally:
        child.stop()


def run_transfer_benchmark(settings: TransferBenchConfig) -> dict[str, Any]:
    """Runs the selected transports; returns one flat JSON-able report."""
    from nori.transfer.factory import ucx_available

    source = torch.randint(0, 256, (settings.num_blocks * settings.block_bytes,), dtype=torch.uint8)
    report: dict[str, Any] = {
        **{key: value for key, value in asdict(settings).items() if key != "transports"},
        "num_blocks": settings.num_blocks,
        "statistic": f"median of {settings.repeats} timed repeats after 1 warm-up",
        "cpu_count": os.cpu_count(),
    }
    samples: dict[str, list[float]] = {}
    for transport in settings.transports:
        if transport == "ucx" and not ucx_available():
            report["ucx_gbps"] = None
            report["ucx_note"] = "ucxx is not importable"
            continue
        samples[transport], environment = _measure(transport, settings, source)
        report[f"{transport}_gbps"] = round(statistics.median(samples[transport]), 3)
        if transport == "ucx":
            # What UCX ran with in the receiver: our defaults, ucxx's, and the caller's.
            report["ucx_env"] = environment
    # Integrity: the sender hashes each buffer before sending, the receiver after: two passes
    # over the bytes per transfer, on top of the transfer itself.
    samples["checksum"] = _time_checksums(settings, source)
    checksum_gbps = statistics.median(samples["checksum"])
    report["checksum_gbps"] = round(checksum_gbps, 3)
    for transport in ("ucx", "tcp_transport"):
        if report.get(f"{transport}_gbps"):
            report[f"checksum_cost_vs_{transport}"] = round(
                2 * report[f"{transport}_gbps"] / checksum_gbps, 3
            )
    if report.get("ucx_gbps") and report.get("socket_gbps"):
        report["ucx_vs_socket"] = round(report["ucx_gbps"] / report["socket_gbps"], 3)
    report["samples_gbps"] = {name: [round(r, 3) for r in rates] for name, rates in samples.items()}
    return report
