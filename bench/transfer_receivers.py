"""The receiving side of `nori bench transfer`: one process per transport, spawned here
(`Child`) or on another host by `nori bench transfer --listen` (`RemoteChild`, over a control
connection authenticated with a key derived from NORI_CLUSTER_SECRET).

Contract: a receiver writes every block into one preallocated cache tensor at the block id the
header names, checks a checked transfer's bytes fail-closed, and answers "transports" (what
carried the bytes, from UCX's info log) and "cpu_s" until told to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import re
import socket
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from nori.bench.transfer_config import (
    TransferBenchConfig,
    destination_block_ids,
    host_port,
    split_blocks,
)
from nori.cluster_auth import CLUSTER_SECRET_ENV, ClusterAuth
from nori.transfer.base import TransferConfig, TransferRejected
from nori.transfer.handoff import TransferHeader
from nori.transfer.integrity import landed_mismatch

# A child that never reports its address (failed import, crashed UCX) must not hang the run.
CHILD_START_TIMEOUT_S = 60.0


class _CacheSink:
    """Hands out one block of a preallocated tensor per header buffer (block id = index), and
    checks a checked transfer's bytes as the decode worker's sink does (fail-closed)."""

    def __init__(self, cache: torch.Tensor, block_bytes: int) -> None:
        self._blocks = split_blocks(cache, block_bytes)

    def destinations(self, header: TransferHeader) -> list[torch.Tensor]:
        return [self._blocks[block_id] for block_id in header.block_ids]

    def completed(self, header: TransferHeader, nbytes: int) -> None:
        if not header.checksums_follow:
            return
        problem = landed_mismatch(header.received_checksums, header.buffer_checksums)
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
        TransferConfig(map_shared_memory=settings.map_shared_memory),
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
                    "bulk": bulk_path(receiver.bytes_mapped, receiver.bytes_received),
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
    blocks = split_blocks(cache, settings.block_bytes)
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


def child_main(kind: str, settings: TransferBenchConfig, conn: Connection, host: str) -> None:
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


def bulk_path(bytes_mapped: int, bytes_received: int) -> str:
    """What carried a receiver's bytes: copied out of its mapping of the sender's shared
    memory, or its messages."""
    if not bytes_mapped:
        return "messages"
    ways = [f"shared memory mapped by the receiver for {bytes_mapped}"]
    if bytes_received > bytes_mapped:
        ways.append(f"messages for {bytes_received - bytes_mapped}")
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


class Child:
    """A receiving process, listening on `host`; `address` is where it listens."""

    def __init__(self, kind: str, settings: TransferBenchConfig, host: str = "127.0.0.1") -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=child_main, args=(kind, settings, child_conn, host), daemon=True
        )
        self._process.start()
        child_conn.close()
        if not self._conn.poll(CHILD_START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"the {kind} receiver process did not start")
        self.address, self.environment = self._conn.recv()

    def transports(self) -> dict[str, Any]:
        """A UCX receiver's `ucx_transports`, once a sender has connected."""
        self._conn.send("transports")
        if not self._conn.poll(CHILD_START_TIMEOUT_S):
            return {}
        transports: dict[str, Any] = self._conn.recv()
        return transports

    def cpu_s(self) -> float:
        assert self._process.pid is not None
        return process_cpu_s(self._process.pid)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._process.join(10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join()
        self._conn.close()


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def control_key() -> bytes:
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
    """`--listen HOST:PORT`: for each control connection, one receiving process (as `Child`,
    listening on HOST) for the transport the sender names, until a sender says "quit"."""
    host, port = host_port(listen, "--listen")
    key = control_key()
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
    child: Child | None = None
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
                    child = Child(request[1], request[2], host)
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


def connect(receiver: str) -> Connection:
    """The control connection to `--listen`, waiting for it to listen."""
    address = host_port(receiver, "--receiver")
    deadline = time.monotonic() + CHILD_START_TIMEOUT_S
    while True:
        try:
            return multiprocessing.connection.Client(address, authkey=control_key())
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class RemoteChild:
    """A receiving process that `nori bench transfer --listen` started, on another host."""

    def __init__(self, kind: str, settings: TransferBenchConfig, receiver: str) -> None:
        self._conn = connect(receiver)
        try:
            self.address, self.environment = self._ask(("start", kind, settings))
        except BaseException:
            self._conn.close()
            raise

    def _ask(self, request: Any) -> Any:
        self._conn.send(request)
        if not self._conn.poll(CHILD_START_TIMEOUT_S):
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


def quit_receivers(receiver: str) -> None:
    """Tells `--listen` that this sender is done: it exits."""
    with connect(receiver) as conn:
        conn.send("quit")
