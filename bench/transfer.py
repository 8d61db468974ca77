"""`nori bench transfer`: how fast KV blocks move between two processes.

The same bytes, cut into the same blocks, move four ways: `ucx` and `tcp_transport` (our
transports, sender to a receiver in another process, as the workers move KV), `socket` (a plain
blocking TCP socket, the yardstick) and `memcpy` (one local copy, the ceiling). Each moves the
blocks once untimed, then `repeats` timed times; figures are medians in GB/s (1e9 B/s), timed on
the sender from the first byte to the receiver's acknowledgement. The report also says what
carried the bytes (`ucx_transports`), what the integrity check costs (`integrity_cost_vs_ucx`,
paired checked/unchecked repeats) and CPU seconds per GiB on each side. With `--receiver
HOST:PORT` the receivers run on another host (`nori bench transfer --listen`,
bench/transfer_receivers.py). How it measures: docs/benchmarks.md#how-nori-bench-transfer-measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from nori.bench.transfer_config import TransferBenchConfig, destination_block_ids, split_blocks
from nori.bench.transfer_receivers import Child, RemoteChild, quit_receivers
from nori.transfer.base import TransferConfig
from nori.transfer.handoff import TransferHeader
from nori.transfer.integrity import TransferHasher


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def _time_transport(
    kind: str, address: str, settings: TransferBenchConfig, source: torch.Tensor, checked: bool
) -> tuple[list[float], list[float]]:
    """The rates of the timed repeats, and with `checked` the integrity check's relative cost
    per repeat: each repeat also sends the same blocks with checksums, right after."""
    from nori.transfer.factory import make_sender

    blocks = split_blocks(source, settings.block_bytes)

    def header(checksums_follow: bool) -> TransferHeader:
        return TransferHeader.of(
            request_id="bench",
            block_ids=destination_block_ids(settings.num_blocks, settings.destinations),
            buffer_nbytes=[settings.block_bytes] * settings.num_blocks,
            checksums_follow=checksums_follow,
        )

    unchecked = header(checksums_follow=False)
    # As a prefill worker sends: its export copy took the checksum as it copied the blocks
    # (`nori.prefill.export_arena`), so the sender sends it without hashing them again; the
    # receiver hashes what lands. (What taking it costs the export copy: docs/benchmarks.md.)
    stream = TransferHasher()
    stream.update(source.numpy())
    checked_header = dataclasses.replace(
        header(checksums_follow=True), sender_checksum=stream.intdigest()
    )
    sender = make_sender(
        kind, TransferConfig(timeout_s=300.0, map_shared_memory=settings.map_shared_memory)
    )
    rates, costs = [], []
    try:
        for repeat in range(settings.repeats + 1):
            start = time.perf_counter()
            await sender.send(address, unchecked, blocks)
            plain_s = time.perf_counter() - start
            if checked:
                start = time.perf_counter()
                await sender.send(address, checked_header, blocks)
                checked_s = time.perf_counter() - start
            if repeat:  # the first round is the untimed warm-up
                rates.append(_rate(settings.total_bytes, plain_s))
                if checked:
                    costs.append((checked_s - plain_s) / plain_s)
    finally:
        await sender.close()
    return rates, costs


def _time_socket(address: str, settings: TransferBenchConfig, source: torch.Tensor) -> list[float]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    views = [block.numpy().data for block in split_blocks(source, settings.block_bytes)]
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
    """The transfer checksum alone over every block, out of cache, as a sender takes it."""
    blocks = split_blocks(source, settings.block_bytes)
    rates = []
    for repeat in range(settings.repeats + 1):
        start = time.perf_counter()
        hasher = TransferHasher()
        for block in blocks:
            hasher.update(block.numpy())
        hasher.intdigest()
        if repeat:
            rates.append(_rate(settings.total_bytes, time.perf_counter() - start))
    return rates


@dataclass(frozen=True)
class _Measured:
    rates: list[float]
    # The receiving process's UCX environment, what UCX says carried the bytes, and the
    # integrity check's relative cost per repeat (UCX only).
    environment: dict[str, str] = field(default_factory=dict)
    transports: dict[str, Any] = field(default_factory=dict)
    integrity_costs: list[float] = field(default_factory=list)
    # CPU seconds per GiB moved (all of the transport's transfers, checked ones too), in the
    # sending and the receiving process: what a transfer takes from the workers' cores.
    cpu_s_per_gib: dict[str, float] = field(default_factory=dict)


def _measure(transport: str, settings: TransferBenchConfig, source: torch.Tensor) -> _Measured:
    if transport == "memcpy":
        return _Measured(_time_memcpy(settings, source))
    kind = {"ucx": "ucx", "tcp_transport": "tcp", "socket": "socket"}[transport]
    child: Child | RemoteChild = (
        RemoteChild(kind, settings, settings.receiver)
        if settings.receiver
        else Child(kind, settings)
    )
    try:
        if kind == "socket":
            return _Measured(_time_socket(child.address, settings, source), child.environment)
        receiver_cpu_s, sender_cpu_s = child.cpu_s(), time.process_time()
        rates, costs = asyncio.run(
            _time_transport(kind, child.address, settings, source, checked=kind == "ucx")
        )
        transfers = (settings.repeats + 1) * (2 if kind == "ucx" else 1)
        gib = transfers * settings.total_bytes / 2**30
        cpu = {
            "sender": round((time.process_time() - sender_cpu_s) / gib, 3),
            "receiver": round((child.cpu_s() - receiver_cpu_s) / gib, 3),
        }
        transports = child.transports() if kind == "ucx" else {}
        return _Measured(rates, child.environment, transports, costs, cpu)
    finally:
        child.stop()


def run_transfer_benchmark(settings: TransferBenchConfig) -> dict[str, Any]:
    """Runs the selected transports; returns one flat JSON-able report."""
    from nori.transfer.factory import ucx_available

    source = torch.randint(0, 256, (settings.num_blocks * settings.block_bytes,), dtype=torch.uint8)
    # In shared memory, as the workers' KV caches are (`nori.worker.engine_process`).
    source.share_memory_()
    report: dict[str, Any] = {
        **{key: value for key, value in asdict(settings).items() if key != "transports"},
        "num_blocks": settings.num_blocks,
        "statistic": f"median of {settings.repeats} timed repeats after 1 warm-up",
        "cpu_count": os.cpu_count(),
    }
    samples: dict[str, list[float]] = {}
    try:
        measured_by = {
            transport: _measure(transport, settings, source)
            for transport in settings.transports
            if transport != "ucx" or ucx_available()
        }
    finally:
        if settings.receiver:
            with contextlib.suppress(OSError, EOFError):
                quit_receivers(settings.receiver)
    for transport in settings.transports:
        if transport not in measured_by:
            report["ucx_gbps"] = None
            report["ucx_note"] = "ucxx is not importable"
            continue
        measured = measured_by[transport]
        samples[transport] = measured.rates
        report[f"{transport}_gbps"] = round(statistics.median(measured.rates), 3)
        if measured.cpu_s_per_gib:
            report[f"{transport}_cpu_s_per_gib"] = measured.cpu_s_per_gib
        if transport == "ucx":
            # What UCX ran with in the receiver (our defaults, ucxx's, the caller's), what
            # carried the bytes, and what checking them cost.
            report["ucx_env"] = measured.environment
            report["ucx_transports"] = measured.transports
            report["integrity_cost_vs_ucx"] = round(statistics.median(measured.integrity_costs), 3)
            samples["integrity_cost_vs_ucx"] = measured.integrity_costs
    samples["checksum"] = _time_checksums(settings, source)
    report["checksum_gbps"] = round(statistics.median(samples["checksum"]), 3)
    if report.get("ucx_gbps") and report.get("socket_gbps"):
        report["ucx_vs_socket"] = round(report["ucx_gbps"] / report["socket_gbps"], 3)
    if report.get("ucx_gbps") and report.get("memcpy_gbps"):
        report["ucx_vs_memcpy"] = round(report["ucx_gbps"] / report["memcpy_gbps"], 3)
    report["samples"] = {name: [round(r, 3) for r in rates] for name, rates in samples.items()}
    return report
