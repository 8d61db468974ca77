"""Connections to a UCX worker address: the hello that opens one, and how each end sees the
other leave.

A receiver bound to loopback opens no listening socket: senders reach it by its UCX worker
address with a hello on its tag (`connect_to_worker`, `accept_hello`), answered by a welcome.
Such a connection is two one-way endpoints on which UCX reports neither close nor death: a
`close` sends a bye on a tag of its own, and a killed peer is seen gone from /proc (`PeerWatch`).
"""

from __future__ import annotations

import os
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Any

from nori.transfer.ucx_env import apply_ucx_env_defaults
from nori.transfer.ucx_progress import UcxProgress, abort

apply_ucx_env_defaults()

import numpy as np  # noqa: E402
import ucxx  # noqa: E402 - UCX reads the environment set just above when ucxx initialises
from ucxx._lib import libucxx as ucx_api  # noqa: E402
from ucxx._lib_async.endpoint import Endpoint  # noqa: E402

# A hello: this magic, the sender's connection tag base (8 bytes), its process (`PeerProcess`),
# then its worker address. The welcome: _WELCOME and the receiver's process.
_HELLO_MAGIC = b"NORIUCX1"
_WELCOME = b"nori-ucx-welcome"
_PEER_CHECK_S = 0.2
# Larger hellos are read and dropped: a worker address is a few hundred bytes.
MAX_HELLO_BYTES = 8192
_SENDER_TO_RECEIVER, _RECEIVER_TO_SENDER, _SENDER_BYE, _RECEIVER_BYE = 0, 1, 2, 3


@dataclass(frozen=True)
class ConnectionTags:
    send: int
    recv: int
    send_bye: int
    recv_bye: int

    @classmethod
    def of(cls, base: int, sender: bool) -> ConnectionTags:
        if sender:
            ends = (_SENDER_TO_RECEIVER, _RECEIVER_TO_SENDER, _SENDER_BYE, _RECEIVER_BYE)
        else:
            ends = (_RECEIVER_TO_SENDER, _SENDER_TO_RECEIVER, _RECEIVER_BYE, _SENDER_BYE)
        return cls(*(base | end for end in ends))


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot); None if not seen, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        return None if fields[0] in (b"Z", b"X") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class PeerProcess:
    """The process at the other end of a worker-address connection: pid and start time (a reused
    pid has another). UCX does not tell this end when a loopback peer dies; this does.
    """

    pid: int
    start_ticks: int

    _FORMAT = "<IQ"
    SIZE = struct.calcsize(_FORMAT)

    @classmethod
    def this(cls) -> PeerProcess:
        return cls(os.getpid(), _start_ticks(os.getpid()) or 0)

    def pack(self) -> bytes:
        return struct.pack(self._FORMAT, self.pid, self.start_ticks)

    @classmethod
    def unpack(cls, data: bytes) -> PeerProcess:
        return cls(*struct.unpack(cls._FORMAT, data[: cls.SIZE]))

    def visible(self) -> bool:
        """Whether this host shows the process (not in another pid namespace, say)."""
        return self.start_ticks != 0 and _start_ticks(self.pid) == self.start_ticks

    def gone(self) -> bool:
        return _start_ticks(self.pid) != self.start_ticks


class PeerWatch:
    """Says whether a connection's peer left: its bye, or its process gone (checked at most
    every `_PEER_CHECK_S`)."""

    def __init__(self, progress: UcxProgress, bye_tag: int, peer: PeerProcess) -> None:
        self._progress = progress
        self._bye_tag = bye_tag
        self._peer = peer if peer.visible() else None
        self._next_check = 0.0
        self.left = False

    def __call__(self) -> bool:
        if not self.left:
            self.left = self._progress.take_bye(self._bye_tag)
        if not self.left and self._peer is not None:
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + _PEER_CHECK_S
                self.left = self._peer.gone()
        return self.left


def worker_address() -> bytes:
    """This process's UCX worker address: what a sender needs to reach it (no socket)."""
    return bytes(ucx_api.UCXAddress.create_from_worker(ucxx.core._get_ctx().worker))


def _endpoint_to(address: bytes, tags: ConnectionTags) -> Any:
    context = ucxx.core._get_ctx()
    buffer = np.frombuffer(address, dtype=np.uint8)
    raw = ucx_api.UCXEndpoint.create_from_worker_address(
        context.worker, ucx_api.UCXAddress.create_from_buffer(buffer), True
    )
    return Endpoint(raw, context, tags={"msg_send": tags.send, "msg_recv": tags.recv})


async def connect_to_worker(
    progress: UcxProgress, address: bytes, receiver_tag: int
) -> tuple[Any, ConnectionTags, PeerWatch]:
    """A connection to the receiver listening for hellos on `receiver_tag` at `address`: the
    hello, then its welcome. The caller bounds the wait."""
    tags = ConnectionTags.of(secrets.randbits(64) & ~3, sender=True)
    endpoint = _endpoint_to(address, tags)
    try:
        hello = (
            _HELLO_MAGIC
            + struct.pack("<Q", tags.send)
            + PeerProcess.this().pack()
            + worker_address()
        )
        await progress.post_send(endpoint, hello, receiver_tag)
        length = await progress.wait_message(endpoint, lambda: progress.take_bye(tags.recv_bye))
        if length is None or length != len(_WELCOME) + PeerProcess.SIZE:
            raise ConnectionError("the receiver did not welcome the connection")
        buffer = np.empty(length, dtype=np.uint8)
        await progress.run(endpoint.recv(buffer))
        answer = buffer.tobytes()
        if not answer.startswith(_WELCOME):
            raise ConnectionError("the receiver answered the hello with something else")
    except BaseException:
        abort(endpoint)
        raise
    receiver = PeerProcess.unpack(answer[len(_WELCOME) :])
    return endpoint, tags, PeerWatch(progress, tags.recv_bye, receiver)


def accept_hello(progress: UcxProgress, hello: bytes) -> tuple[Any, ConnectionTags, PeerWatch]:
    """The endpoint back to a hello's sender (the caller sends `welcome()`); ValueError for
    anything that is not a hello."""
    head = len(_HELLO_MAGIC) + 8 + PeerProcess.SIZE
    if len(hello) <= head or not hello.startswith(_HELLO_MAGIC):
        raise ValueError("not a hello")
    (base,) = struct.unpack("<Q", hello[8:16])
    tags = ConnectionTags.of(base & ~3, sender=False)
    sender = PeerProcess.unpack(hello[16:head])
    try:
        endpoint = _endpoint_to(hello[head:], tags)
    except Exception as error:  # ucxx's own error types for an unusable worker address
        raise ValueError(f"a hello with an unusable worker address: {error}") from error
    return endpoint, tags, PeerWatch(progress, tags.recv_bye, sender)


def welcome() -> bytes:
    return _WELCOME + PeerProcess.this().pack()
