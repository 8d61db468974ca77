"""The receiver reading a transfer's bytes out of the sender's memory (cross-memory attach):
how reads are cut, reads from another process, and the ways it must fall back or fail."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import subprocess
import sys
from multiprocessing.connection import Connection

import pytest
import torch
import xxhash

from nori.transfer.base import TransferError
from nori.transfer.buffers import ScatteredRun, check_sources
from nori.transfer.cross_memory import PullReader, PullSource, pull_batches, regions_of
from nori.transfer.factory import make_receiver, make_sender
from nori.transfer.handoff import CrossMemoryOffer, TransferHeader, decode_reply
from tests.transfer.helpers import KINDS, kv_blocks
from tests.transfer.receiver_process import CACHE_SHAPE, UNTOUCHED, CacheSink
from tests.transfer.test_robustness import _raw_channel, failed_and_serves_on


def test_pull_batches_cut_both_layouts_at_the_byte_and_segment_limits() -> None:
    # One source region of 100 bytes at 1000; destinations of 30, 50 (adjacent to it: one
    # segment when in one call) and 20 bytes.
    sources = [(1000, 100)]
    destinations = [(0, 30), (30, 50), (500, 20)]
    assert pull_batches(sources, destinations, max_bytes=40) == [
        ([(0, 40)], [(1000, 40)]),
        ([(40, 40)], [(1040, 40)]),
        ([(500, 20)], [(1080, 20)]),
    ]
    # Two source regions; at most 2 segments a side per call.
    sources = [(1000, 10), (2000, 10)]
    destinations = [(0, 5), (100, 5), (200, 10)]
    assert pull_batches(sources, destinations, max_bytes=64, max_segments=2) == [
        ([(0, 5), (100, 5)], [(1000, 10)]),
        ([(200, 10)], [(2000, 10)]),
    ]
    with pytest.raises(ValueError, match="different byte counts"):
        pull_batches([(0, 10)], [(0, 9)])


def test_regions_merge_adjacent_views_in_order() -> None:
    data = torch.zeros(64, dtype=torch.uint8)
    base = data.data_ptr()
    views = [data[0:8], data[8:16], data[32:40], data[16:16], data[40:48], data[0:4]]
    assert regions_of(views) == [(base, 16), (base + 32, 16), (base, 4)]


def _hold_bytes(conn: Connection) -> None:
    """A sender stand-in: offers 3 MiB of random bytes, then waits to be told to go."""
    source = torch.randint(0, 256, (3 * 1024 * 1024,), dtype=torch.uint8)
    views = list(source.view(96, 32 * 1024).unbind(0))
    pull_source = PullSource()
    offer = pull_source.offer(views)
    assert offer is not None
    conn.send((offer.SerializeToString(), source.numpy().tobytes()))
    conn.recv()


@pytest.mark.asyncio
async def test_a_receiver_reads_another_process_into_scattered_blocks_and_hashes_them() -> None:
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=_hold_bytes, args=(child_conn,), daemon=True)
    child.start()
    try:
        assert conn.poll(60)
        payload, expected = conn.recv()
        offer = CrossMemoryOffer.FromString(payload)
        cache = torch.zeros(2 * 96, 32 * 1024, dtype=torch.uint8)
        # Every other block, grouped as a receiver's staged runs would be: 3 reads of 1 MiB.
        blocks = [cache[2 * i] for i in range(96)]
        pieces = [ScatteredRun(tuple(blocks[:40])), *blocks[40:]]
        reader = PullReader()
        assert reader.can_pull(offer, pieces)
        hasher = xxhash.xxh3_64()
        await reader.pull(offer, pieces, hasher)
        assert torch.cat(blocks).numpy().tobytes() == expected
        assert not cache[1::2].any()
        assert hasher.intdigest() == xxhash.xxh3_64_intdigest(expected)
        assert reader.bytes_pulled == len(expected)

        conn.send("go")
        child.join(30)
        with pytest.raises(TransferError, match="reading KV from the sender failed"):
            await reader.pull(offer, pieces, None)
        assert not reader.can_pull(offer, pieces)
    finally:
        child.kill()
        child.join()


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("broken", ["pid of no process", "other probe bytes"])
async def test_an_offer_whose_probe_fails_moves_the_bytes_as_messages(
    kind: str, broken: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A pid the receiver cannot read (another host or namespace, no process, no permission)
    or that names another process: the receiver says so once in its log and takes the bytes as
    messages; they land all the same."""
    real_offer = PullSource.offer

    def broken_offer(self: PullSource, views: list[torch.Tensor]) -> CrossMemoryOffer | None:
        offer = real_offer(self, views)
        assert offer is not None
        if broken == "pid of no process":
            offer.pid = _dead_pid()
        else:
            offer.probe = bytes(16)
        return offer

    monkeypatch.setattr(PullSource, "offer", broken_offer)
    caches = {"float32": torch.full(CACHE_SHAPE, UNTOUCHED)}
    receiver = make_receiver(kind, CacheSink(caches))
    await receiver.start(host="127.0.0.1")
    sender = make_sender(kind)
    caplog.set_level(logging.INFO, logger="nori.transfer.cross_memory")
    try:
        for block in (4, 5):
            header, buffers, source = kv_blocks(f"r{block}", [block], torch.float32, seed=block)
            await sender.send(receiver.address, header, buffers)
            assert torch.equal(caches["float32"][:, :, [block]], source)
        assert receiver.bytes_pulled == 0
        refusals = [r for r in caplog.records if "not read from its memory" in r.getMessage()]
        assert len(refusals) == 1
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_sender_gone_before_its_trailer_fails_the_transfer(kind: str) -> None:
    """Bytes read from a sender that never confirmed it still owned them (it left after the
    receiver's `pulled`, before its trailer) are never handed to the decode side."""
    caches = {"float32": torch.full(CACHE_SHAPE, UNTOUCHED)}
    sink = CacheSink(caches)
    receiver = make_receiver(kind, sink)
    address = await receiver.start(host="127.0.0.1")
    raw, channel = await _raw_channel(kind, address)
    try:
        header, buffers, _ = kv_blocks("no-trailer", [2, 3], torch.float32, seed=8)
        views = check_sources(header, buffers)
        source = PullSource()  # holds the probe the receiver reads
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
