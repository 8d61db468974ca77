"""`nori bench transfer`: how fast KV blocks move between two processes.

The same bytes, cut into the same blocks, are moved four ways:

- ucx: our UCX transport (`UcxSender` -> `UcxReceiver` in another process);
- tcp_transport: our TCP fallback (`TcpSender` -> `TcpReceiver` in another process);
- socket: a plain blocking TCP socket between two processes (`sendall` / `recv_into` per block),
  the yardstick the UCX transport is held to;
- memcpy: one local `copy_` of all the bytes, the ceiling of what memory does.

The receiving side always writes into one preallocated "cache" tensor (in place, or through
the UCX receiver's staging buffer for small scattered blocks). Each transport
moves the blocks once untimed (connection setup, UCX wire-up, page faults), then `repeats` timed
times; the figures are the median of the timed repeats, in GB/s (1e9 bytes per second), timed
on the sender from the first byte until the receiver's acknowledgement.

Over UCX the report also says what carried the bytes (`ucx_transports`: the endpoint's lanes,
and the protocols UCX picked for tagged sends by message size, from UCX's own info log in the
receiver) and what the integrity check costs end to end (`integrity_cost_vs_ucx`): each timed
UCX repeat is a pair, one transfer without checksums and one with them (the sender sends the
checksum its export copy took, as a prefill worker does; the receiver hashes the bytes as they
land and compares), and the figure is the median over the pairs of
(t_checked - t_unchecked) / t_unchecked.

Our transports move the bytes as the workers do: on one host the receiver reads them out of the
sender's memory (`nori.transfer.cross_memory`) where it can (`--bulk auto`), or always as
messages (`--bulk messages`); `ucx_transports["bulk"]` says which carried them, and
`<transport>_cpu_s_per_gib` what each side's process spent on CPU per GiB moved.

Across hosts: `nori bench transfer --listen HOST:PORT` on the receiving host serves the
receivers (one process per transport, as on one host, listening on HOST), and `nori bench
transfer --receiver HOST:PORT ...` on the sending host runs the benchmark against them (memcpy
and the checksums stay on the sender). The two talk over a control connection authenticated by
a key derived from NORI_CLUSTER_SECRET, which both sides must have; the receiving side exits
once the sender is done. `bench/cross_host_transfer.py` runs both in two network namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import re
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import torch

from nori.cluster_auth import CLUSTER_SECRET_ENV, ClusterAuth
from nori.transfer.base import TransferConfig, TransferRejected
from nori.transfer.handoff import TransferHeader
from nori.transfer.integrity import TransferHasher, buffer_checksums, landed_mismatch

# One message = one block of one layer's K (or V) in Nori's cache layout
# [layers, 2, blocks, block_size, kv_heads, head_dim]: that is the largest piece a receiver can
# write in place when the destination blocks are not adjacent. 16 tokens x 8 KV heads x 128 dims
# x 2 bytes (a Llama-3-8B-class model in bfloat16, block_size 16) = 32 KiB.
DEFAULT_BLOCK_KIB = 32
TRANSPORTS = ("ucx", "tcp_transport", "socket", "memcpy")
DestinationLayout = Literal["scattered", "adjacent"]

# A child that never reports its address (failed import, crashed UCX) must not hang the run.
_CHILD_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TransferBenchConfig:
    total_mib: int = 64
    block_kib: int = DEFAULT_BLOCK_KIB
    repeats: int = 5
    transports: tuple[str, ...] = TRANSPORTS
    # Where the blocks land in the receiver's cache: "scattered" (no two consecutive blocks
    # adjacent, as in a fragmented cache: blocks of 256 KiB and more move one message each,
    # smaller ones in messages of up to 1 MiB that the receiver stages and copies to their
    # places, `nori.transfer.buffers.receive_runs`) or "adjacent" (consecutive, as for a fresh
    # reservation: both ends move runs of up to 1 MiB as one message, in place,
    # `nori.transfer.buffers.joint_runs`).
    destinations: DestinationLayout = "scattered"
    # Our transports' TransferConfig.cross_memory_attach (`--bulk auto`; False: `messages`).
    cross_memory_attach: bool = True
    # HOST:PORT of `nori bench transfer --listen` (the receivers on another host); None: the
    # receivers are child processes of this one.
    receiver: str | None = None

    def __post_init__(self) -> None:
        if self.total_mib < 1 or self.block_kib < 1 or self.repeats < 1:
            raise ValueError("--total-mib, --block-kib and --repeats must be >= 1")
        if self.block_kib * 1024 > self.total_bytes:
            raise ValueError("--block-kib must not exceed --total-mib")
        unknown = set(self.transports) - set(TRANSPORTS)
        if unknown or not self.transports:
            raise ValueError(f"transports must be among {', '.join(TRANSPORTS)}")
        if self.receiver is not None:
            host_port(self.receiver, "--receiver")

    @property
    def block_bytes(self) -> int:
        return self.block_kib * 1024

    @property
    def num_blocks(self) -> int:
        return self.total_bytes // self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.total_mib * 1024 * 1024


def destination_block_ids(num_blocks: int, layout: DestinationLayout) -> list[int]:
    """The receiver's cache block of each block sent, in order: the identity, or for
    "scattered" the even slots then the odd ones (consecutive blocks two slots apart)."""
    if layout == "adjacent":
        return list(range(num_blocks))
    return [*range(0, num_blocks, 2), *range(1, num_blocks, 2)]


def _blocks(data: torch.Tensor, block_bytes: int) -> list[torch.Tensor]:
    return list(data.view(-1, block_bytes).unbind(0))


class _CacheSink:
    """Hands out one block of a preallocated tensor per header buffer (block id = index), and
    checks a checked transfer's bytes as the decode worker's sink does (fail-closed)."""

    def __init__(self, cache: torch.Tensor, block_bytes: int) -> None:
        self._blocks = _blocks(cache, block_bytes)

    def destinations(self, header: TransferHeader) -> list[torch.Tensor]:
        return [self._blocks[block_id] for block_id in header.block_ids]

    def completed(self, header: TransferHeader, nbytes: int) -> None:
        if not (header.buffer_checksums or header.checksums_follow):
            return
        problem = landed_mismatch(
            header.received_checksums, header.buffer_checksums, self.destinations(header)
        )
        if problem is not None:
            raise TransferRejected(f"corrupted KV transfer: {problem}")

    def failed(self, header: TransferHeader, error: str) -> None:
        pass


async def _serve_transport(
    kind: str, settings: TransferBenchConfig, conn: Connection, ucx_log: Path | None, host: str
) -> None:
    from nori.transfer.factory import make_receiver

    cache = torch.zeros(settings.num_blocks * settings.block_bytes, dtype=torch.uint8)
    receiver = make_receiver(
        kind,
        _CacheSink(cache, settings.block_bytes),
        TransferConfig(cross_memory_attach=settings.cross_memory_attach),
    )
    conn.send((await receiver.start(host=host, advertise_host=host), _ucx_environment()))
    # Serve until the parent says stop (or goes away): its pipe becomes readable. It may first
    # ask what carried the bytes (UCX logs an endpoint's lanes once a sender connected).
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        try:
            asked = conn.recv()
        except (EOFError, OSError):
            asked = "stop"
        if asked == "transports":
            log = ucx_log.read_text(errors="replace") if ucx_log and ucx_log.exists() else ""
            conn.send(
                {
                    **ucx_transports(log),
                    "bulk": bulk_path(
                        receiver.bytes_pulled, receiver.bytes_mapped, receiver.bytes_received
                    ),
                }
            )
        elif not stop.done():
            stop.set_result(None)

    loop.add_reader(conn.fileno(), on_readable)
    await stop
    loop.remove_reader(conn.fileno())
    await receiver.close()


def _serve_socket(settings: TransferBenchConfig, conn: Connection, host: str) -> None:
    cache = torch.zeros(settings.num_blocks * settings.block_bytes, dtype=torch.uint8)
    blocks = _blocks(cache, settings.block_bytes)
    views = [
        blocks[block_id].numpy().data
        for block_id in destination_block_ids(settings.num_blocks, settings.destinations)
    ]
    with socket.create_server((host, 0)) as listener:
        conn.send((f"tcp://{host}:{listener.getsockname()[1]}", {}))
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


def _child_main(kind: str, settings: TransferBenchConfig, conn: Connection, host: str) -> None:
    """Entry point of the receiving process (spawned: nothing inherited but the arguments),
    listening on `host`."""
    if kind == "socket":
        _serve_socket(settings, conn, host)
        return
    if kind != "ucx":
        asyncio.run(_serve_transport(kind, settings, conn, None, host))
        return
    with tempfile.TemporaryDirectory(prefix="nori-ucx-log-") as folder:
        # Before ucxx starts: UCX's info log (lanes, and the protocol table of each endpoint
        # configuration) into a file; an operator's own UCX_LOG_LEVEL and UCX_LOG_FILE win.
        ucx_log = Path(folder) / "ucx.log"
        os.environ.setdefault("UCX_LOG_LEVEL", "info")
        os.environ.setdefault("UCX_PROTO_INFO", "y")
        os.environ.setdefault("UCX_LOG_FILE", str(ucx_log))
        asyncio.run(_serve_transport(kind, settings, conn, ucx_log, host))


# "... intra-node cfg#0 tag(sysv/memory)  rma(sysv/memory posix/memory)  am(sysv/memory) ..."
_UCX_LANES = re.compile(r"(?:intra|inter)-node cfg#\d+\s+((?:\w+\([^)]*\)\s*)+)$", re.MULTILINE)
# The protocol table of tagged sends from host memory (not its fast-completion or multi rows).
_UCX_TAG_TABLE = re.compile(
    r"\| [^|]*cfg#\d+ \| tagged message by ucp_tag_send\* from host memory\s+\|"
)
# "|  8K..inf | (?) rendezvous fragmented copy-in copy-out | sysv/memory |"
_UCX_TABLE_ROW = re.compile(r"\|\s*(\S+\.\.\S+)\s*\|\s*(.*?)\s*\|\s*(.*?)\s*\|")


def bulk_path(bytes_pulled: int, bytes_mapped: int, bytes_received: int) -> str:
    """What carried a receiver's bytes: copied out of its mapping of the sender's shared
    memory, read from the sender's memory, or its messages."""
    if not bytes_pulled:
        return "messages"
    ways = []
    if bytes_mapped:
        ways.append(f"shared memory mapped by the receiver for {bytes_mapped}")
    if bytes_pulled > bytes_mapped:
        ways.append(f"process_vm_readv by the receiver for {bytes_pulled - bytes_mapped}")
    if bytes_received > bytes_pulled:
        ways.append(f"messages for {bytes_received - bytes_pulled}")
    return f"{'; '.join(ways)} of {bytes_received} bytes"


def ucx_transports(log: str) -> dict[str, Any]:
    """What UCX says it used, from its info log: `lanes` (each endpoint configuration's lanes
    per operation, e.g. "tag(sysv/memory) rma(sysv/memory posix/memory) ...") and `tag_send`
    (message size range -> protocol and transport of a tagged send from host memory)."""
    lanes = sorted({" ".join(match.group(1).split()) for match in _UCX_LANES.finditer(log)})
    tag_send: dict[str, str] = {}
    lines = log.splitlines()
    for number, line in enumerate(lines):
        if not _UCX_TAG_TABLE.search(line):
            continue
        for row in lines[number + 2 :]:
            match = _UCX_TABLE_ROW.search(row)
            if match is None:
                break
            tag_send[match.group(1)] = f"{match.group(2)} ({match.group(3)})"
        break
    return {"lanes": lanes, "tag_send": tag_send}


def _ucx_environment() -> dict[str, str]:
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith(("UCX_", "UCXPY_"))
    }


class _Child:
    """A receiving process, listening on `host`; `address` is where it listens."""

    def __init__(self, kind: str, settings: TransferBenchConfig, host: str = "127.0.0.1") -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(kind, settings, child_conn, host), daemon=True
        )
        self._process.start()
        child_conn.close()
        if not self._conn.poll(_CHILD_START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"the {kind} receiver process did not start")
        self.address, self.environment = self._conn.recv()

    def transports(self) -> dict[str, Any]:
        """A UCX receiver's `ucx_transports`, once a sender has connected."""
        self._conn.send("transports")
        if not self._conn.poll(_CHILD_START_TIMEOUT_S):
            return {}
        transports: dict[str, Any] = self._conn.recv()
        return transports

    def cpu_s(self) -> float:
        assert self._process.pid is not None
        return _process_cpu_s(self._process.pid)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._process.join(10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join()
        self._conn.close()


def host_port(text: str, flag: str) -> tuple[str, int]:
    """HOST:PORT (an IPv4 address or a name; port 0 only where listening picks one)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{flag} takes HOST:PORT, got {text!r}")
    return host, int(port)


def _control_key() -> bytes:
    """The control connection's key (both sides derive it from the cluster secret): what comes
    over it is unpickled, so only a peer that holds the secret may talk."""
    auth = ClusterAuth.from_text(os.environ.get(CLUSTER_SECRET_ENV))
    if not auth.enabled:
        raise ValueError(
            f"--listen and --receiver need {CLUSTER_SECRET_ENV}, the same on both sides "
            "(`nori cluster-secret` prints one)"
        )
    return auth.key("bench-transfer")


def serve_receivers(listen: str) -> None:
    """`--listen HOST:PORT`: for each control connection, one receiving process (as `_Child`,
    listening on HOST) for the transport the sender names, until a sender says "quit"."""
    host, port = host_port(listen, "--listen")
    key = _control_key()
    with multiprocessing.connection.Listener((host, port), authkey=key) as listener:
        print(f"nori: transfer receivers listening on {host}:{listener.address[1]}", flush=True)
        while True:
            try:
                conn = listener.accept()
            except (multiprocessing.AuthenticationError, OSError, EOFError) as error:
                print(f"nori: refused a control connection: {error!r}", flush=True)
                continue
            with conn:
                if not _serve_control(conn, host):
                    return


def _serve_control(conn: Connection, host: str) -> bool:
    """Serves one sender's requests for one receiver; False once it said "quit"."""
    child: _Child | None = None
    try:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                return True
            if request == "quit":
                return False
            try:
                if isinstance(request, tuple) and request[0] == "start" and child is None:
                    child = _Child(request[1], request[2], host)
                    answer: Any = (child.address, child.environment)
                elif request == "transports" and child is not None:
                    answer = child.transports()
                elif request == "cpu_s" and child is not None:
                    answer = child.cpu_s()
                elif request == "stop":
                    if child is not None:
                        child.stop()
                        child = None
                    answer = None
                else:
                    raise ValueError(f"unexpected request {request!r}")
            except Exception as error:
                conn.send(("error", f"{type(error).__name__}: {error}"))
                continue
            conn.send(("ok", answer))
    finally:
        if child is not None:
            child.stop()


def _connect(receiver: str) -> Connection:
    """The control connection to `--listen`, waiting for it to listen."""
    address = host_port(receiver, "--receiver")
    deadline = time.monotonic() + _CHILD_START_TIMEOUT_S
    while True:
        try:
            return multiprocessing.connection.Client(address, authkey=_control_key())
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class _RemoteChild:
    """A receiving process that `nori bench transfer --listen` started, on another host."""

    def __init__(self, kind: str, settings: TransferBenchConfig, receiver: str) -> None:
        self._conn = _connect(receiver)
        try:
            self.address, self.environment = self._ask(("start", kind, settings))
        except BaseException:
            self._conn.close()
            raise

    def _ask(self, request: Any) -> Any:
        self._conn.send(request)
        if not self._conn.poll(_CHILD_START_TIMEOUT_S):
            raise RuntimeError(f"the remote receiver did not answer {request!r}")
        status, answer = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"the remote receiver: {answer}")
        return answer

    def transports(self) -> dict[str, Any]:
        transports: dict[str, Any] = self._ask("transports")
        return transports

    def cpu_s(self) -> float:
        return float(self._ask("cpu_s"))

    def stop(self) -> None:
        with contextlib.suppress(OSError, EOFError, RuntimeError):
            self._ask("stop")
        self._conn.close()


def _quit_receivers(receiver: str) -> None:
    """Tells `--listen` that this sender is done: it exits."""
    with _connect(receiver) as conn:
        conn.send("quit")


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def _time_transport(
    kind: str, address: str, settings: TransferBenchConfig, source: torch.Tensor, checked: bool
) -> tuple[list[float], list[float]]:
    """The rates of the timed repeats, and with `checked` the integrity check's relative cost
    per repeat: each repeat also sends the same blocks with checksums, right after."""
    from nori.transfer.factory import make_sender

    blocks = _blocks(source, settings.block_bytes)

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
        kind, TransferConfig(timeout_s=300.0, cross_memory_attach=settings.cross_memory_attach)
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
    """xxh3 alone over every block, out of cache, as a sender computes it per transfer buffer."""
    blocks = _blocks(source, settings.block_bytes)
    rates = []
    for repeat in range(settings.repeats + 1):
        start = time.perf_counter()
        buffer_checksums(blocks)
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


def _process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(transport: str, settings: TransferBenchConfig, source: torch.Tensor) -> _Measured:
    if transport == "memcpy":
        return _Measured(_time_memcpy(settings, source))
    kind = {"ucx": "ucx", "tcp_transport": "tcp", "socket": "socket"}[transport]
    child: _Child | _RemoteChild = (
        _RemoteChild(kind, settings, settings.receiver)
        if settings.receiver
        else _Child(kind, settings)
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
    from nori.transfer.factory import probe_transports, ucx_available

    source = torch.randint(0, 256, (settings.num_blocks * settings.block_bytes,), dtype=torch.uint8)
    # In shared memory, as the workers' KV caches are (`nori.worker.engine_process`).
    source.share_memory_()
    report: dict[str, Any] = {
        **{key: value for key, value in asdict(settings).items() if key != "transports"},
        "num_blocks": settings.num_blocks,
        "statistic": f"median of {settings.repeats} timed repeats after 1 warm-up",
        "cpu_count": os.cpu_count(),
    }
    # What `--transport auto` would choose here, and the probe's figures behind it.
    report["auto_transport"] = asdict(probe_transports())
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
                _quit_receivers(settings.receiver)
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
