"""Choosing a transport: "ucx", "tcp", or "auto" (whichever a probe measures faster here).

"auto" is measured, not assumed: the first receiver of a process runs `probe_transports` once
(cached for the process) and takes the faster working transport. The receiver's choice is the
only one: it shows in its address scheme (ucx:// or tcp://), and an "auto" sender sends over
whatever the address names, so prefill and decode workers always agree.

The probe moves 8 MiB in messages of a transfer's largest run (`buffers.MAX_RUN_BYTES`, 1 MiB:
adjacent blocks move as one message), 3 rounds, the best counts (~0.3 s in all), each way to a
forked child that receives every message in place, as the other worker would, on other CPUs than
its parent's where it may (the other worker's, in `nori up`'s plan): over UCX, the child a UCX
context of its own reached at its worker address (shared memory where UCX may use it, else
TCP), and over loopback TCP. Both across two processes: a socket's cost is largely its reader's
sleeping and waking, and UCX's copies run on both ends at once, which one thread driving both
ends never shows (the first probe ran UCX in one thread and TCP across a fork, and chose TCP on
an Intel Xeon where the UCX transport then moved KV 1.8-2.1x faster than the TCP transport in
`nori bench transfer`). The TCP figure is a plain socket's, an upper bound of the TCP transport,
so a close call goes to TCP. Each process keeps its choice. Host memory only: a CUDA cache's path
is not probed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np
import torch

from nori.transfer.address import parse_address
from nori.transfer.base import (
    KVReceiver,
    KVSender,
    KVSink,
    TransferConfig,
    TransferError,
    TransferHeader,
)
from nori.transfer.buffers import MAX_RUN_BYTES
from nori.transfer.tcp import TcpReceiver, TcpSender

logger = logging.getLogger(__name__)

KINDS = ("auto", "ucx", "tcp")


def _load_ucx() -> ModuleType | str:
    """The UCX transport module, or why it cannot be imported (no ucxx, broken native libs)."""
    try:
        return importlib.import_module("nori.transfer.ucx")
    except (ImportError, OSError) as error:
        return str(error) or type(error).__name__


def ucx_available() -> bool:
    return isinstance(_load_ucx(), ModuleType)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"transport kind must be one of {', '.join(KINDS)}, got {kind!r}")


def _require_ucx() -> ModuleType:
    module = _load_ucx()
    if isinstance(module, str):
        raise ValueError(
            f"the UCX transport needs ucxx, which is not importable ({module}); "
            "install ucxx-cu12 or choose the tcp transport"
        )
    return module


def _auto_ucx() -> ModuleType | None:
    module = _load_ucx()
    if isinstance(module, str):
        _warn_no_ucxx(module)
        return None
    return module


@functools.cache
def _warn_no_ucxx(reason: str) -> None:
    """Once per process: the UCX path cannot work here."""
    logger.warning("ucxx is not importable (%s); using the TCP transport", reason)


_PROBE_BLOCK_BYTES = MAX_RUN_BYTES
_PROBE_BLOCKS = (8 * 1024 * 1024) // _PROBE_BLOCK_BYTES  # 8 MiB
_PROBE_ROUNDS = 3
# The most a probe waits for its child, per round.
_PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ProbeResult:
    """What `probe_transports` measured (GB/s; None where the transport failed) and chose."""

    chosen: Literal["ucx", "tcp"]
    ucx_gbps: float | None
    tcp_gbps: float | None
    # Why UCX was not measured or failed, if it was not.
    ucx_problem: str | None = None


def _best_rate(run_once: object) -> float:
    """The best of a few rounds of `run_once()` (moves _PROBE_BLOCKS blocks), in GB/s."""
    best = float("inf")
    for _ in range(_PROBE_ROUNDS):
        start = time.perf_counter()
        run_once()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return _PROBE_BLOCK_BYTES * _PROBE_BLOCKS / best / 1e9


def _probe_ucx(source: np.ndarray, destination: np.ndarray, child_cpus: frozenset[int]) -> float:
    """UCX to a forked child with a context of its own, one message per block; the child's
    copy of the last round comes back in `destination` (so the caller checks the bytes)."""
    # Importing the transport applies its UCX settings before either context reads them.
    importlib.import_module("nori.transfer.ucx")
    from ucxx._lib import libucxx as ucx_api
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    size, tag = _PROBE_BLOCK_BYTES, Tag(1)
    parent_end, child_end = socket.socketpair()
    with parent_end, child_end:
        pid = os.fork()
        if pid == 0:  # the child: a UCX worker receiving in place, then out without cleanup
            code = 1
            try:
                parent_end.close()
                _move_to(child_cpus)
                worker = ucx_api.UCXWorker(ucx_api.UCXContext({}))
                address = bytes(ucx_api.UCXAddress.create_from_worker(worker))
                child_end.sendall(len(address).to_bytes(4, "little") + address)
                into = np.empty_like(destination)
                for _ in range(_PROBE_ROUNDS):
                    requests = [
                        worker.tag_recv(Array(into[i * size : (i + 1) * size]), tag, TagMaskFull)
                        for i in range(_PROBE_BLOCKS)
                    ]
                    _progress_until(requests, worker.progress)
                    child_end.sendall(b"k")  # this round arrived
                child_end.sendall(into.data)
                code = 0
            finally:
                os._exit(code)
        child_end.close()
        parent_end.settimeout(_PROBE_TIMEOUT_S)
        try:
            length = bytearray(4)
            _recv_exactly(parent_end, memoryview(length))
            child_address = bytearray(int.from_bytes(length, "little"))
            _recv_exactly(parent_end, memoryview(child_address))
            worker = ucx_api.UCXWorker(ucx_api.UCXContext({}))
            endpoint = ucx_api.UCXEndpoint.create_from_worker_address(
                worker, ucx_api.UCXAddress.create_from_buffer(bytes(child_address)), True
            )

            def run_once() -> None:
                requests = [
                    endpoint.tag_send(Array(source[i * size : (i + 1) * size]), tag)
                    for i in range(_PROBE_BLOCKS)
                ]
                _progress_until(requests, worker.progress)
                if parent_end.recv(1) != b"k":  # the round is over once the child has it all
                    raise ConnectionError("the UCX probe's receiver failed")

            try:
                rate = _best_rate(run_once)
                _recv_exactly(parent_end, destination.data)
                return rate
            finally:
                endpoint.close()
        finally:
            parent_end.close()  # a child still sending sees the end, and leaves
            os.waitpid(pid, 0)


@contextlib.contextmanager
def _probe_cpus() -> Iterator[frozenset[int]]:
    """Keeps a probe's two ends on different CPUs: two busy-polling UCX workers on one CPU
    measured 0.35-0.53 GB/s where the pair on two CPUs moved 8-9. Yields the CPUs for the
    probe's child. A thread pinned to one CPU (a worker of `nori up`'s plan, whose peer runs on
    other CPUs) leaves its child the others; a thread allowed several keeps only its first
    while it probes (restored after) and leaves the child the rest: left to the scheduler, the
    two ends shared a CPU in 2 of 24 probes on a 2-core EPYC (UCX 0.42-0.52 GB/s, TCP chosen)."""
    allowed = frozenset(os.sched_getaffinity(0))
    if len(allowed) < 2:
        yield frozenset(range(os.cpu_count() or 1)) - allowed
        return
    first = min(allowed)
    try:
        os.sched_setaffinity(0, {first})
    except OSError:
        yield allowed
        return
    try:
        yield allowed - {first}
    finally:
        os.sched_setaffinity(0, allowed)


def _move_to(cpus: frozenset[int]) -> None:
    """A probe's child onto `cpus`, where it may run there."""
    if cpus:
        with contextlib.suppress(OSError):  # none of them in this process's cpuset
            os.sched_setaffinity(0, cpus)


def _recv_exactly(peer: socket.socket, into: memoryview) -> None:
    view = into.cast("B")
    while len(view):
        received = peer.recv_into(view)
        if not received:
            raise ConnectionError("the probe's child left")
        view = view[received:]


def _progress_until(requests: list[Any], progress: Callable[[], None]) -> None:
    deadline = time.monotonic() + _PROBE_TIMEOUT_S
    while not all(request.completed for request in requests):
        if time.monotonic() > deadline:
            raise TimeoutError("the UCX probe made no progress")
        progress()
    for request in requests:
        request.check_error()


def _probe_tcp(source: np.ndarray, child_cpus: frozenset[int]) -> float:
    """Loopback TCP to a forked child that receives each block in place, as a TCP receiver
    does. Across two processes, not in one thread: a socket's cost is largely the sleeping and
    waking of its reader, which one thread doing both ends never pays (it measured 4.4 GB/s
    in-process against 1.5-1.8 GB/s between two processes on the 2-core Xeon)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        pid = os.fork()
        if pid == 0:  # the child: nothing but sockets, then out without cleanup
            code = 1
            try:
                _move_to(child_cpus)
                with socket.create_connection(("127.0.0.1", port)) as peer:
                    into = np.empty(_PROBE_BLOCK_BYTES, dtype=np.uint8).data
                    for _ in range(_PROBE_ROUNDS):
                        for _ in range(_PROBE_BLOCKS):
                            view = into
                            while len(view):
                                received = peer.recv_into(view)
                                if not received:
                                    raise ConnectionError("the prober left")
                                view = view[received:]
                        peer.sendall(b"k")  # this round arrived
                code = 0
            finally:
                os._exit(code)
        listener.settimeout(5.0)
        try:
            peer, _ = listener.accept()
        except OSError:
            os.waitpid(pid, 0)
            raise
    size = _PROBE_BLOCK_BYTES
    blocks = [source[i * size : (i + 1) * size].data for i in range(_PROBE_BLOCKS)]

    def run_once() -> None:
        for block in blocks:
            peer.sendall(block)
        if peer.recv(1) != b"k":  # the round is over once the child has every byte
            raise ConnectionError("the TCP probe's receiver failed")

    try:
        with peer:
            peer.settimeout(5.0)
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return _best_rate(run_once)
    finally:
        os.waitpid(pid, 0)


@functools.cache
def probe_transports() -> ProbeResult:
    """Measures both transports once per process (see the module doc) and logs the choice."""
    nbytes = _PROBE_BLOCK_BYTES * _PROBE_BLOCKS
    source = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    tcp_gbps: float | None = None
    ucx_gbps: float | None = None
    ucx_problem: str | None = None
    module = _load_ucx()
    with _probe_cpus() as child_cpus:
        try:
            tcp_gbps = _probe_tcp(source, child_cpus)
        except OSError as error:
            logger.warning("the TCP transport failed its probe: %s", error)
        if isinstance(module, str):
            ucx_problem = f"ucxx is not importable ({module})"
        else:
            destination = np.zeros_like(source)
            try:
                ucx_gbps = _probe_ucx(source, destination, child_cpus)
                if not np.array_equal(source, destination):
                    ucx_gbps, ucx_problem = None, "UCX delivered different bytes in its probe"
            except Exception as error:  # ucxx raises its own types; any failure rules UCX out
                ucx_problem = f"UCX failed its probe: {error or type(error).__name__}"
    if ucx_problem is not None:
        logger.warning("%s; --transport auto uses TCP", ucx_problem)
    chosen: Literal["ucx", "tcp"] = (
        "ucx" if ucx_gbps is not None and (tcp_gbps is None or ucx_gbps >= tcp_gbps) else "tcp"
    )
    logger.info(
        "--transport auto: %s (probe: UCX %s GB/s, TCP %s GB/s)",
        chosen,
        "-" if ucx_gbps is None else f"{ucx_gbps:.2f}",
        "-" if tcp_gbps is None else f"{tcp_gbps:.2f}",
    )
    return ProbeResult(chosen, ucx_gbps, tcp_gbps, ucx_problem)


def make_receiver(kind: str, sink: KVSink, config: TransferConfig | None = None) -> KVReceiver:
    """A receiver of `kind`; "auto" takes what `probe_transports` measured faster here."""
    _check_kind(kind)
    if kind == "auto":
        kind = probe_transports().chosen
    if kind == "tcp":
        return TcpReceiver(sink, config)
    receiver: KVReceiver = _require_ucx().UcxReceiver(sink, config)
    return receiver


def make_sender(kind: str, config: TransferConfig | None = None) -> KVSender:
    """A sender for either address scheme: what a receiver advertises decides the transport.

    "ucx" fails here without ucxx; "tcp" never loads ucxx (sending to a ucx:// address then
    raises ValueError); "auto" uses UCX for ucx:// addresses when ucxx imports.
    """
    _check_kind(kind)
    if kind == "tcp":
        return MultiSender(None, config)
    module = _require_ucx() if kind == "ucx" else _auto_ucx()
    return MultiSender(module, config)


class MultiSender:
    """Dispatches each transfer by the address scheme, creating each transport's sender lazily."""

    def __init__(self, ucx_module: ModuleType | None, config: TransferConfig | None = None) -> None:
        self._ucx_module = ucx_module
        self._config = config
        self._senders: dict[str, KVSender] = {}
        self._closed = False

    def _sender(self, scheme: str) -> KVSender:
        if self._closed:
            raise TransferError("the sender is closed")
        sender = self._senders.get(scheme)
        if sender is None:
            if scheme == "tcp":
                sender = TcpSender(self._config)
            elif self._ucx_module is not None:
                sender = self._ucx_module.UcxSender(self._config)
            else:
                raise ValueError(
                    "cannot send to a ucx:// address: this sender has no UCX transport"
                )
            self._senders[scheme] = sender
        return sender

    @property
    def bytes_sent(self) -> int:
        return sum(sender.bytes_sent for sender in self._senders.values())

    async def send(self, address: str, header: TransferHeader, buffers: list[torch.Tensor]) -> None:
        await self._sender(parse_address(address).scheme).send(address, header, buffers)

    async def close(self) -> None:
        # The senders stay (closed) so bytes_sent still counts what they sent.
        self._closed = True
        for sender in list(self._senders.values()):
            await sender.close()
