"""The receiver copying a transfer's bytes out of its mapping of the sender's shared memory:
how copies are cut, copies from another process, and the ways it must fall back or fail."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from nori.transfer.base import TransferError
from nori.transfer.cross_memory_receiver import (
    COPY_THREAD_MIN_BYTES,
    PullReader,
    copy_plan,
    regions_of,
)
from nori.transfer.cross_memory_sender import PullSource
from nori.transfer.factory import make_receiver, make_sender
from nori.transfer.handoff import CrossMemoryOffer, TransferHeader, decode_reply
from nori.transfer.integrity import TransferHasher, check_sources
from tests.transfer.helpers import KINDS, kv_blocks, reference_checksum
from tests.transfer.receiver_process import CACHE_SHAPE, UNTOUCHED, CacheSink
from tests.transfer.test_robustness import _raw_channel, failed_and_serves_on


def test_copy_plan_cuts_both_layouts_into_chunks_of_the_stream() -> None:
    # Sources of 60 and 40 bytes; destinations of 30, 50 and 20; chunks of 40 bytes.
    sources = [(1000, 60), (2000, 40)]
    destinations = [(0, 30), (100, 50), (500, 20)]
    assert [chunk.tolist() for chunk in copy_plan(sources, destinations, chunk_bytes=40)] == [
        [[0, 1000, 30], [100, 1030, 10]],
        [[110, 1040, 20], [130, 2000, 20]],
        [[500, 2020, 20]],
    ]
    assert copy_plan([], []) == []
    with pytest.raises(ValueError, match="different byte counts"):
        copy_plan([(0, 10)], [(0, 9)])


@pytest.mark.parametrize("seed", range(5))
def test_copy_plan_moves_the_same_bytes_as_a_plain_copy(seed: int) -> None:
    """Random layouts on both sides (empty regions too): following the plan byte for byte
    gives the concatenated sources in the concatenated destinations, chunk sizes respected."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=generator)

    def cut(total: int) -> list[tuple[int, int]]:
        sizes = torch.randint(0, 300, (100,), generator=generator).tolist()
        regions, start, taken = [], 0, 0
        for size in sizes:
            size = min(size, total - taken)
            regions.append((start, size))
            taken += size
            start += size + int(torch.randint(0, 7, (1,), generator=generator))
        return [*regions, (start, total - taken)]

    sources = cut(2000)
    destinations = cut(2000)
    destination = torch.zeros(12000, dtype=torch.uint8)
    plan = copy_plan(sources, destinations, chunk_bytes=256)
    for chunk in plan:
        assert chunk[:, 2].sum() <= 256
        for to, start, nbytes in chunk.tolist():
            destination[to : to + nbytes] = source[start : start + nbytes]
    assert sum(int(chunk[:, 2].sum()) for chunk in plan) == 2000
    expected = torch.cat([source[a : a + n] for a, n in sources])
    landed = torch.cat([destination[a : a + n] for a, n in destinations])
    assert torch.equal(landed, expected)


def test_regions_merge_adjacent_views_in_order() -> None:
    data = torch.zeros(64, dtype=torch.uint8)
    base = data.data_ptr()
    views = [data[0:8], data[8:16], data[32:40], data[16:16], data[40:48], data[0:4]]
    assert regions_of(views) == [(base, 16), (base + 32, 16), (base, 4)]


def test_private_memory_is_not_offered() -> None:
    """Bytes outside shared memory (a private copy) get no offer: they go as messages."""
    source = torch.randint(0, 256, (64 * 1024,), dtype=torch.uint8)
    assert PullSource().offer(list(source.view(2, -1).unbind(0))) is None
    assert PullSource().offer([]) is None


def _hold_shared_bytes(conn: Connection, nbytes: int) -> None:
    """A sender stand-in with its bytes in shared memory, as a worker's KV cache is: offers
    them, then waits to be told to go."""
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    source.share_memory_()
    views = list(source.view(-1, 32 * 1024).unbind(0))
    pull_source = PullSource()
    offer = pull_source.offer(views)
    assert offer is not None and offer.segment_socket
    conn.send((offer.SerializeToString(), source.numpy().tobytes()))
    conn.recv()
    pull_source.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "nbytes", [3 * 1024 * 1024, COPY_THREAD_MIN_BYTES], ids=["in the loop", "on the copy thread"]
)
async def test_a_receiver_copies_another_process_shared_memory_without_reading_the_process(
    nbytes: int,
) -> None:
    """Copied out of the receiver's mapping of the sender's segments, which needs no permission
    to read the sender (Yama's ptrace_scope >= 1 lets sibling workers read nothing of each
    other), hashed as they land. Once the sender is gone its segments are unmapped."""
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=_hold_shared_bytes, args=(child_conn, nbytes), daemon=True)
    child.start()
    try:
        assert conn.poll(60)
        payload, expected = conn.recv()
        offer = CrossMemoryOffer.FromString(payload)
        blocks_count = nbytes // (32 * 1024)
        cache = torch.zeros(2 * blocks_count, 32 * 1024, dtype=torch.uint8)
        blocks = [cache[2 * i] for i in range(blocks_count)]
        pieces = blocks
        reader = PullReader()
        assert reader.can_pull(offer, pieces) and reader.mapped_senders == 1
        hasher = TransferHasher()
        await reader.pull(offer, pieces, hasher)
        assert torch.cat(blocks).numpy().tobytes() == expected
        assert not cache[1::2].any()
        assert hasher.intdigest() == reference_checksum(expected)
        assert reader.bytes_mapped == nbytes

        # A region outside the offered segments is refused, not read.
        cache.zero_()
        outside = CrossMemoryOffer()
        outside.CopyFrom(offer)
        outside.region_addresses[0] += 2**40
        with pytest.raises(TransferError, match="outside the offered segments"):
            await reader.pull(outside, pieces, None)
        assert not cache.any()

        conn.send("go")
        child.join(30)
        assert not reader.can_pull(offer, pieces)  # nothing to map
        assert reader.mapped_senders == 0
        reader.close()
    finally:
        child.kill()
        child.join()


@pytest.mark.asyncio
async def test_a_segment_the_sender_no_longer_holds_is_not_copied() -> None:
    """A key the sender's socket does not know (it closed that segment): the receiver maps
    nothing and refuses the offer (the bytes then go as messages); a copy asked for anyway
    fails without touching the destination."""
    source = torch.randint(0, 256, (64 * 1024,), dtype=torch.uint8)
    source.share_memory_()
    pull_source = PullSource()
    offer = pull_source.offer(list(source.view(2, -1).unbind(0)))
    assert offer is not None
    offer.segment_keys[0] += 1
    destination = torch.zeros_like(source)
    reader = PullReader()
    try:
        assert not reader.can_pull(offer, [destination])
        assert reader.mapped_senders == 0
        with pytest.raises(TransferError, match="no longer mapped"):
            await reader.pull(offer, [destination], None)
        assert not destination.any() and reader.bytes_mapped == 0
    finally:
        reader.close()
        pull_source.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("broken", ["socket of nobody", "other probe bytes"])
async def test_an_offer_that_cannot_be_mapped_moves_the_bytes_as_messages(
    kind: str, broken: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A segment socket the receiver cannot reach (another host or network namespace), or one
    that answers for another sender: the receiver says so once in its log and takes the bytes
    as messages; they land all the same."""
    real_offer = PullSource.offer

    def broken_offer(
        self: PullSource, views: list[torch.Tensor], *how: Any
    ) -> CrossMemoryOffer | None:
        offer = real_offer(self, views, *how)
        assert offer is not None and offer.segment_socket  # kv_blocks is shared memory
        if broken == "socket of nobody":
            offer.segment_socket = "nori-kv-nobody-listens-here"
        else:
            offer.probe = bytes(16)
        return offer

    monkeypatch.setattr(PullSource, "offer", broken_offer)
    caches = {"float32": torch.full(CACHE_SHAPE, UNTOUCHED)}
    receiver = make_receiver(kind, CacheSink(caches))
    await receiver.start(host="127.0.0.1")
    sender = make_sender(kind)
    caplog.set_level(logging.INFO, logger="nori.transfer.cross_memory_receiver")
    try:
        for block in (4, 5):
            header, buffers, source = kv_blocks(f"r{block}", [block], torch.float32, seed=block)
            await sender.send(receiver.address, header, buffers)
            assert torch.equal(caches["float32"][:, :, [block]], source)
        assert receiver.bytes_mapped == 0
        refusals = [r for r in caplog.records if "not copied out of its shared" in r.getMessage()]
        assert len(refusals) == 1
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_sender_gone_before_its_trailer_fails_the_transfer(kind: str) -> None:
    """Bytes copied from a sender that never confirmed it still owned them (it left after the
    receiver's `pulled`, before its trailer) are never handed to the decode side."""
    caches = {"float32": torch.full(CACHE_SHAPE, UNTOUCHED)}
    sink = CacheSink(caches)
    receiver = make_receiver(kind, sink)
    address = await receiver.start(host="127.0.0.1")
    raw, channel = await _raw_channel(kind, address)
    source = PullSource()  # serves the segments the receiver maps
    try:
        header, buffers, _ = kv_blocks("no-trailer", [2, 3], torch.float32, seed=8)
        views = check_sources(header, buffers)
        offered = TransferHeader(
            header.hand_off, header.buffer_nbytes, pull_offer=source.offer(views)
        )
        await channel.send_message(offered.to_bytes())
        accept = decode_reply(await channel.recv_message(65536))
        assert accept.WhichOneof("kind") == "accepted" and accept.pull
        pulled = decode_reply(await asyncio.wait_for(channel.recv_message(65536), 10))
        assert pulled.WhichOneof("kind") == "pulled"
        await channel.close()

        await failed_and_serves_on(kind, receiver, sink, "no-trailer")
    finally:
        await channel.close()
        await raw.close()
        await receiver.close()
        source.close()


def _ask_for_segments_as_nobody(name: str, key: int, conn: Connection) -> None:
    """Another user's process (uid 65534): connects to the segment socket and asks."""
    import os
    import socket

    os.setuid(65534)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
        client.settimeout(10)
        try:
            client.connect("\0" + name)
            client.sendall(key.to_bytes(8, "little"))
            answer, fds, _, _ = socket.recv_fds(client, 1024, 4)
            conn.send((answer, len(fds)))
        except OSError as error:
            conn.send((repr(error).encode(), 0))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_the_segment_socket_answers_no_other_user() -> None:
    """Another local user gets no descriptor of the sender's shared memory (nor its probe):
    the socket closes on it."""
    source = torch.randint(0, 256, (64 * 1024,), dtype=torch.uint8)
    source.share_memory_()
    pull_source = PullSource()
    try:
        offer = pull_source.offer([source])
        assert offer is not None and offer.segment_socket
        context = multiprocessing.get_context("fork")
        conn, child_conn = context.Pipe()
        child = context.Process(
            target=_ask_for_segments_as_nobody,
            args=(offer.segment_socket, offer.segment_keys[0], child_conn),
        )
        child.start()
        assert conn.poll(30)
        answer, fds = conn.recv()
        child.join(10)
        assert fds == 0 and offer.probe not in answer
        # This process's own user is answered.
        reader = PullReader()
        assert reader.can_pull(offer, [torch.zeros_like(source)]) and reader.mapped_senders == 1
        reader.close()
    finally:
        pull_source.close()
