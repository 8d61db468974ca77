"""Hostile and broken peers: the receiver rejects or drops them and keeps serving.

These talk to a receiver in the test process through the transports' own channels, which
lets a test send exactly the bytes a broken or malicious sender would.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import socket
import struct
from typing import Any, cast

import pytest
import torch

from nori.transfer.base import Channel, KVReceiver, TransferConfig, TransferError, TransferRejected
from nori.transfer.factory import make_receiver, make_sender, ucx_available
from nori.transfer.handoff import HEADER_VERSION, TransferHeader, decode_reply
from nori.transfer.integrity import check_sources
from nori.v1.handoff_pb2 import HandOff, KVDestination, KVTransferHeader
from tests.transfer.helpers import KINDS, kv_blocks
from tests.transfer.receiver_process import CACHE_SHAPE, UNTOUCHED, CacheSink


def _local_caches() -> dict[str, torch.Tensor]:
    return {
        "float32": torch.full(CACHE_SHAPE, UNTOUCHED),
        "bfloat16": torch.full(CACHE_SHAPE, UNTOUCHED, dtype=torch.bfloat16),
    }


async def _raw_channel(kind: str, address: str) -> tuple[Any, Channel]:
    """A bare connection to a receiver, to speak the protocol by hand."""
    sender: Any
    if kind == "tcp":
        from nori.transfer.tcp import TcpSender

        sender = TcpSender()
    else:
        from nori.transfer.ucx import UcxSender

        sender = UcxSender()
    return sender, await sender._connect(address)


async def _reply(channel: Channel) -> dict[str, Any]:
    """The receiver's reply as {"status": "accept" | "reject" | "done", "error": ...}."""
    reply = decode_reply(await channel.recv_message(65536))
    kind = reply.WhichOneof("kind")
    if kind == "rejected":
        return {"status": "reject", "error": reply.rejected}
    if kind == "done_nbytes":
        return {"status": "done", "nbytes": reply.done_nbytes}
    return {"status": "accept"}


async def _still_serves(kind: str, receiver: KVReceiver, caches: dict[str, torch.Tensor]) -> None:
    header, buffers, source = kv_blocks("healthy", [11], torch.float32, seed=99)
    sender = make_sender(kind)
    try:
        await sender.send(receiver.address, header, buffers)
    finally:
        await sender.close()
    assert torch.equal(caches["float32"][:, :, [11]], source)


async def failed_and_serves_on(
    kind: str, receiver: KVReceiver, sink: CacheSink, request_id: str
) -> None:
    """The transfer of `request_id` failed on the sink, completed nothing, and the receiver
    still takes the next one."""
    await _eventually(lambda: sink.events)
    assert [event[:2] for event in sink.events] == [("failed", request_id)]
    assert receiver.transfers_completed == 0
    await _still_serves(kind, receiver, sink.caches)


async def _eventually(condition: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "timed out waiting for the receiver"
        await asyncio.sleep(0.01)


def _header(
    request_id: str = "r",
    block_ids: tuple[int, ...] = (1,),
    buffer_nbytes: tuple[int, ...] = (1,),
    version: int = HEADER_VERSION,
) -> bytes:
    """Header bytes as a sender would frame them, unchecked (so they can be wrong)."""
    hand_off = HandOff(request_id=request_id, destination=KVDestination(block_ids=block_ids))
    message = KVTransferHeader(hand_off=hand_off, buffer_nbytes=buffer_nbytes)
    return b"NKV" + bytes([version]) + message.SerializeToString()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_malformed_headers_are_rejected_and_the_receiver_serves_on(kind: str) -> None:
    caches = _local_caches()
    sink = CacheSink(caches)
    receiver = make_receiver(kind, sink, TransferConfig(max_header_bytes=4096))
    address = await receiver.start(host="127.0.0.1")
    raw, channel = await _raw_channel(kind, address)
    try:
        bad_headers = [
            (b"\xff\x00 not a header", "not a Nori KV transfer header"),
            (b"[1, 2]", "not a Nori KV transfer header"),
            # What a Nori of header version 1 (JSON) would send.
            (json.dumps({"version": 1, "request_id": "r"}).encode(), "not a Nori"),
            (_header(version=99), "version"),
            (_header(request_id=""), "request_id"),
            (_header(block_ids=(-1,)), "block_ids"),
            (_header(buffer_nbytes=(-5,)), "negative"),
            (b"NKV" + bytes([HEADER_VERSION]) + b"\xff\xff\xff", "malformed"),
            # Nested groups of an unknown field, deeper than protobuf will parse.
            (b"NKV" + bytes([HEADER_VERSION]) + b"\x7b" * 3000, "malformed"),
        ]
        for payload, complaint in bad_headers:
            await channel.send_message(payload)
            reply = await _reply(channel)
            assert reply["status"] == "reject"
            assert complaint in reply["error"]

        # An oversized message: refused, then the connection is dropped (it cannot be trusted).
        oversized: asyncio.Future[None] | None = None
        if kind == "tcp":
            # A length prefix claiming a terabyte, and nothing after it.
            sock: socket.socket = cast(Any, channel)._sock
            await asyncio.get_running_loop().sock_sendall(sock, struct.pack("<Q", 1 << 40))
        else:
            # Never received, so this send itself fails once the receiver hangs up.
            oversized = asyncio.ensure_future(channel.send_message(b"x" * 10_000))
        reply = await _reply(channel)
        assert reply["status"] == "reject" and "exceeds" in reply["error"]
        with pytest.raises(TransferError):
            await asyncio.wait_for(channel.recv_message(65536), 5)
        if oversized is not None:
            with contextlib.suppress(TransferError):
                await oversized
        await channel.close()

        assert sink.events == []
        await _still_serves(kind, receiver, caches)
    finally:
        await channel.close()
        await raw.close()
        await receiver.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_large_foreign_header_is_rejected(kind: str) -> None:
    receiver = make_receiver(kind, CacheSink(_local_caches()))
    address = await receiver.start(host="127.0.0.1")
    raw, channel = await _raw_channel(kind, address)
    try:
        await channel.send_message(b"[" * 200_000)
        reply = await _reply(channel)
        assert reply["status"] == "reject" and "not a Nori KV transfer header" in reply["error"]
    finally:
        await channel.close()
        await raw.close()
        await receiver.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_sender_that_vanishes_mid_transfer_fails_the_transfer_on_the_sink(
    kind: str,
) -> None:
    caches = _local_caches()
    sink = CacheSink(caches)
    receiver = make_receiver(kind, sink)
    address = await receiver.start(host="127.0.0.1")
    raw, channel = await _raw_channel(kind, address)
    try:
        header, buffers, _ = kv_blocks("cut-short", [2, 3], torch.float32, seed=8)
        await channel.send_message(header.to_bytes())
        assert (await _reply(channel))["status"] == "accept"
        await channel.send_buffers(check_sources(header, buffers)[:3])  # 3 of 8 buffers
        await channel.close()

        await failed_and_serves_on(kind, receiver, sink, "cut-short")
    finally:
        await channel.close()
        await raw.close()
        await receiver.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_bytes_the_sink_finds_bad_are_refused_not_acknowledged(kind: str) -> None:
    """A sender must never hear "done" for KV the receiver threw away: the prefill worker
    would answer token one for a request whose decode side has already failed it."""
    caches = _local_caches()
    sink = CacheSink(caches)
    receiver = make_receiver(kind, sink)
    await receiver.start(host="127.0.0.1")
    sender = make_sender(kind)
    try:
        header, buffers, _ = kv_blocks("bad-bytes", [4], torch.float32, seed=5)
        with pytest.raises(TransferRejected, match="corrupted KV transfer of bad-bytes"):
            await sender.send(receiver.address, header, buffers)
        assert [event[:2] for event in sink.events] == [("failed", "bad-bytes")]
        assert receiver.transfers_completed == 0
        await _still_serves(kind, receiver, caches)  # the connection is reused, and serves
    finally:
        await sender.close()
        await receiver.close()


class _DropAfterAccept:
    """A receiver that accepts a header, then hangs up: the sender must not wait forever."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._stop: list[Any] = []

    async def _serve(self, channel: Channel) -> None:
        await channel.recv_message(1 << 20)
        await channel.send_message(b'{"status":"accept"}')
        await channel.close()

    async def start(self) -> str:
        if self.kind == "tcp":
            from nori.transfer.tcp import _HostStaging, _TcpChannel

            loop = asyncio.get_running_loop()
            listener = socket.create_server(("127.0.0.1", 0))
            listener.setblocking(False)

            async def accept() -> None:
                sock, _ = await loop.sock_accept(listener)
                sock.setblocking(False)
                await self._serve(_TcpChannel(sock, _HostStaging("test")))

            task = loop.create_task(accept())
            self._stop = [task.cancel, listener.close]
            return f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        from nori.transfer.ucx import UcxChannel
        from nori.transfer.ucx_worker import UcxProgress, listen

        progress = UcxProgress()

        async def handle(endpoint: Any) -> None:  # ucxx awaits only coroutine functions
            await self._serve(UcxChannel(endpoint, progress))

        ucx_listener = listen(handle, 0, 5.0)
        self._stop = [ucx_listener.close, progress.close]
        return f"ucx://127.0.0.1:{ucx_listener.port}"

    def stop(self) -> None:
        for stop in self._stop:
            stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_receiver_that_hangs_up_mid_transfer_is_a_transfer_error(kind: str) -> None:
    peer = _DropAfterAccept(kind)
    address = await peer.start()
    sender = make_sender(kind, TransferConfig(timeout_s=10.0))
    header, buffers, _ = kv_blocks("hung-up", [0, 1, 2, 3], torch.float32, seed=9)
    try:
        with pytest.raises(TransferError):
            await asyncio.wait_for(sender.send(address, header, buffers), 20)
    finally:
        await sender.close()
        await asyncio.sleep(0.05)
        peer.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_closing_releases_everything_cleanly(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    # ucxx's logger does not propagate: listen to it directly.
    ucx_logger = logging.getLogger("ucx")
    ucx_logger.addHandler(caplog.handler)
    caches = _local_caches()
    receiver = make_receiver(kind, CacheSink(caches))
    address = await receiver.start(host="127.0.0.1")
    sender = make_sender(kind, TransferConfig(connect_timeout_s=1.0))
    header, buffers, _ = kv_blocks("before-close", [1], torch.float32, seed=10)
    try:
        await asyncio.gather(*(sender.send(address, header, buffers) for _ in range(3)))
        # Connections are pooled and idle now; the receiver goes away under them.
        await receiver.close()
        gc.collect()
        with pytest.raises(TransferError):
            await sender.send(address, header, buffers)
    finally:
        await sender.close()
        gc.collect()
        ucx_logger.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if "still alive" in r.getMessage()]
    assert receiver.transfers_completed == 3


def test_header_round_trip() -> None:
    header = TransferHeader.of(
        "req-1",
        [4, 2],
        [128, 64],
        output_token_ids=[7],
        generator_state=b"\x00\x01\x02",
        destination=KVDestination(worker_id="decode-0", transfer_address="tcp://h:1"),
    )
    parsed = TransferHeader.from_bytes(header.to_bytes())
    assert parsed == header
    assert parsed.request_id == "req-1" and parsed.block_ids == [4, 2]
    assert parsed.hand_off.output_token_ids == [7]
    assert parsed.hand_off.generator_state == b"\x00\x01\x02"
    assert parsed.hand_off.destination.transfer_address == "tcp://h:1"
    assert header.total_nbytes == 192
    # An unseeded request carries no RNG state, which is not the same as an empty one.
    unseeded = TransferHeader.from_bytes(TransferHeader.of("r", [1], [8]).to_bytes())
    assert not unseeded.hand_off.HasField("generator_state")


# ------------------------------------------------------------ UCX receivers on loopback

_SENDER_THEN_SLEEP = """
import asyncio, sys, torch
from nori.transfer.integrity import check_sources
from nori.transfer.ucx import UcxSender
from tests.transfer.helpers import kv_blocks

async def main():
    sender = UcxSender()
    channel = await sender._connect(sys.argv[1])
    header, buffers, _ = kv_blocks("killed", [2, 3], torch.float32, seed=8)
    await channel.send_message(header.to_bytes())
    await channel.recv_message(65536)  # accepted
    await channel.send_buffers(check_sources(header, buffers)[:3])  # 3 of 8 buffers
    print("sent", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.asyncio
@pytest.mark.skipif(not ucx_available(), reason="ucxx is not importable")
async def test_a_loopback_ucx_receiver_is_reached_by_its_worker_address() -> None:
    """No listening socket of its own: the address names the receiver's UCX worker."""
    from nori.transfer.handoff import parse_address
    from nori.transfer.ucx import UcxReceiver

    caches = _local_caches()
    receiver = make_receiver("ucx", CacheSink(caches))
    assert isinstance(receiver, UcxReceiver)
    address = await receiver.start(host="127.0.0.1", advertise_host="127.0.0.1")
    try:
        parsed = parse_address(address)
        assert parsed.peer and parsed.port == 0 and parsed.host == "127.0.0.1"
        assert receiver._listener is None
        await _still_serves("ucx", receiver, caches)
    finally:
        await receiver.close()


@pytest.mark.asyncio
@pytest.mark.skipif(not ucx_available(), reason="ucxx is not importable")
async def test_junk_hellos_are_dropped_and_the_receiver_serves_on() -> None:
    from nori.transfer.handoff import parse_address
    from nori.transfer.ucx_worker import ConnectionTags, UcxProgress, _endpoint_to, abort

    caches = _local_caches()
    receiver = make_receiver("ucx", CacheSink(caches))
    target = parse_address(await receiver.start(host="127.0.0.1"))
    progress = UcxProgress()
    endpoint = _endpoint_to(target.worker_address, ConnectionTags.of(4, sender=True))
    try:
        for junk in (
            b"junk",
            b"NORIUCX1" + struct.pack("<Q", 8) + b"\x00" * 40,  # no usable worker address
            b"x" * 20000,  # longer than any hello
        ):
            await progress.post_send(endpoint, junk, target.hello_tag)
        await asyncio.sleep(0.2)
        await _still_serves("ucx", receiver, caches)
    finally:
        abort(endpoint)
        progress.close()
        await receiver.close()


@pytest.mark.asyncio
@pytest.mark.skipif(not ucx_available(), reason="ucxx is not importable")
async def test_a_sender_process_killed_mid_transfer_ends_its_connection_on_the_receiver() -> None:
    """Two one-way endpoints carry no disconnect: UCX's keepalive finds the dead process, the
    transfer fails on the sink and the connection ends, within seconds."""
    import os
    import signal
    import subprocess
    import sys

    caches = _local_caches()
    sink = CacheSink(caches)
    receiver = make_receiver("ucx", sink)
    address = await receiver.start(host="127.0.0.1")
    child = subprocess.Popen(
        [sys.executable, "-c", _SENDER_THEN_SLEEP, address],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
        assert line.strip() == b"sent"
        await _eventually(lambda: receiver._channels)
        child.send_signal(signal.SIGKILL)
        await _eventually(lambda: sink.events and not receiver._channels, timeout_s=10.0)
        assert [event[:2] for event in sink.events] == [("failed", "killed")]
        await _still_serves("ucx", receiver, caches)
    finally:
        child.kill()
        child.wait()
        await receiver.close()
