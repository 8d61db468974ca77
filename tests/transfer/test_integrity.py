"""KV transfer checksums: over the bytes, whatever the dtype, and sensitive to one flipped bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import xxhash

from nori.transfer import conversation
from nori.transfer.base import TransferConfig, TransferRejected
from nori.transfer.factory import make_receiver, make_sender
from nori.transfer.handoff import TransferHeader
from nori.transfer.integrity import (
    HASH_CHUNK_BYTES,
    TransferHasher,
    byte_view,
    hash_chunks,
    landed_mismatch,
)
from nori.v1.handoff_pb2 import KVTransferHeader
from tests.transfer.helpers import KINDS, reference_checksum


def _checksum(buffers: list[torch.Tensor]) -> int:
    hasher = TransferHasher()
    for buffer in buffers:
        hasher.update(byte_view(buffer).numpy())
    return hasher.intdigest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
def test_the_checksum_is_of_the_bytes_whatever_the_dtype(dtype: torch.dtype) -> None:
    buffer = torch.arange(64, dtype=torch.float32).to(dtype)
    raw = bytes(buffer.view(torch.uint8).tolist())
    assert _checksum([buffer]) == reference_checksum(raw)


def test_one_flipped_bit_is_a_mismatch() -> None:
    buffers = [torch.ones(4, 8), torch.ones(4, 8)]
    expected = (_checksum(buffers),)
    assert landed_mismatch((_checksum(buffers),), expected) is None
    buffers[1].view(-1).view(torch.uint8)[13] ^= 0x01
    assert landed_mismatch((_checksum(buffers),), expected).startswith(  # type: ignore[union-attr]
        "the transfer checksum is"
    )
    assert landed_mismatch((), expected) == "1 checksums from the sender, 0 taken on receipt"


class _CheckingSink:
    """Checks a transfer's bytes as the decode worker's sink does: against the checksums the
    receiving transport computed as they landed, refusing (fail-closed) on any difference."""

    def __init__(self, size: int) -> None:
        self.cache = torch.zeros(size, dtype=torch.uint8)
        self.failures: list[str] = []
        self.completed_headers: list[TransferHeader] = []

    def destinations(self, header: TransferHeader) -> list[torch.Tensor]:
        size = header.buffer_nbytes[0]
        # Every other slot: destinations that are not adjacent, as in a fragmented cache.
        return [self.cache[2 * i * size : (2 * i + 1) * size] for i in range(len(header.block_ids))]

    def completed(self, header: TransferHeader, nbytes: int) -> None:
        problem = landed_mismatch(header.received_checksums, header.buffer_checksums)
        if problem is not None:
            raise TransferRejected(f"corrupted KV transfer: {problem}")
        self.completed_headers.append(header)

    def failed(self, header: TransferHeader, error: str) -> None:
        self.failures.append(error)


@pytest.mark.parametrize("pull", [False, True], ids=["messages", "pull"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.asyncio
async def test_checksums_that_follow_the_data_are_checked(
    kind: str, pull: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real transfer whose checksum follows the data (or, copied by the receiver out of the
    sender's shared memory, comes in its trailer): accepted when the bytes match, with the receiver's
    own hash (computed as they landed) equal to an independent xxh3 of the bytes; refused when
    the sender's checksum is not the bytes' (a corrupted transfer)."""
    size, count = 4096, 24
    sink = _CheckingSink(2 * size * count)
    config = TransferConfig(map_shared_memory=pull)
    receiver = make_receiver(kind, sink, config)
    address = await receiver.start(host="127.0.0.1")
    sender = make_sender(kind, config)
    source = torch.randint(0, 256, (size * count,), dtype=torch.uint8).share_memory_()
    blocks = list(source.view(count, size).unbind(0))
    header = TransferHeader.of("r", list(range(count)), [size] * count, checksums_follow=True)
    try:
        await sender.send(address, header, blocks)
        (landed,) = sink.completed_headers
        expected = reference_checksum(source.numpy().tobytes())
        assert landed.buffer_checksums == landed.received_checksums == (expected,)
        for i, block in enumerate(blocks):
            assert torch.equal(sink.destinations(header)[i], block)

        real_pack = conversation.pack_checksum
        monkeypatch.setattr(conversation, "pack_checksum", lambda c: real_pack(c ^ 1))
        with pytest.raises(TransferRejected, match="corrupted KV transfer"):
            await sender.send(address, header, blocks)
        assert len(sink.completed_headers) == 1
        assert receiver.bytes_mapped == (2 * size * count if pull else 0)
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared memory"])
@pytest.mark.parametrize("pull", [False, True], ids=["messages", "pull"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.asyncio
async def test_a_checksum_taken_where_the_bytes_were_written_is_sent_and_checked(
    kind: str, pull: bool, shared: bool
) -> None:
    """A sender whose checksum was taken beforehand (the prefill worker's export copy) sends it
    without hashing: right, the transfer lands; wrong (the bytes changed after it was taken),
    the receiver, which hashed what landed, refuses it. Sent as messages, or copied out of the
    sender's shared memory (private memory goes as messages all the same)."""
    size, count = 64 * 1024, 40  # 2.5 MiB: several chunks of the checksum
    sink = _CheckingSink(2 * size * count)
    config = TransferConfig(map_shared_memory=pull)
    receiver = make_receiver(kind, sink, config)
    address = await receiver.start(host="127.0.0.1")
    sender = make_sender(kind, config)
    source = torch.randint(0, 256, (size * count,), dtype=torch.uint8)
    if shared:
        source.share_memory_()
    blocks = list(source.view(count, size).unbind(0))
    right = reference_checksum(source.numpy().tobytes())
    header = TransferHeader.of("r", list(range(count)), [size] * count, checksums_follow=True)
    try:
        await sender.send(address, dataclasses.replace(header, sender_checksum=right), blocks)
        (landed,) = sink.completed_headers
        assert landed.buffer_checksums == landed.received_checksums == (right,)
        assert receiver.bytes_mapped == (size * count if pull and shared else 0)
        with pytest.raises(TransferRejected, match="corrupted KV transfer"):
            await sender.send(
                address, dataclasses.replace(header, sender_checksum=right ^ 1), blocks
            )
        assert len(sink.completed_headers) == 1
    finally:
        await sender.close()
        await receiver.close()


def test_a_header_with_per_buffer_checksums_is_refused() -> None:
    raw = TransferHeader.of("r", [1], [8]).to_bytes()
    message = KVTransferHeader.FromString(raw[4:])
    message.buffer_checksums.append(1)
    with pytest.raises(ValueError, match="per-buffer checksums"):
        TransferHeader.from_bytes(raw[:4] + message.SerializeToString())
    header = TransferHeader.of("r", [1], [8], checksums_follow=True)
    assert TransferHeader.from_bytes(header.to_bytes()) == header


def test_the_transfer_checksum_does_not_depend_on_how_the_bytes_are_cut() -> None:
    """Fed in any cuts (empty ones too), or partly as whole chunks' digests hashed elsewhere
    (as the receiver's copy threads do), the checksum is its definition's."""
    generator = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (3 * 1024 * 1024 + 4321,), dtype=torch.uint8, generator=generator)
    raw = data.numpy().tobytes()
    assert TransferHasher().intdigest() == reference_checksum(b"")
    cuts = sorted(torch.randint(0, len(raw), (40,), generator=generator).tolist())
    hasher = TransferHasher()
    for start, end in zip([0, *cuts], [*cuts, len(raw)], strict=True):
        hasher.update(data.numpy()[start:end])
    assert hasher.intdigest() == reference_checksum(raw)

    mib = 1024 * 1024
    hasher = TransferHasher()
    hasher.update(memoryview(raw)[:mib])
    hasher.add_chunk_digests(
        [xxhash.xxh3_64_intdigest(raw[start : start + mib]) for start in (mib, 2 * mib, 3 * mib)],
        last_nbytes=4321,
    )
    assert hasher.intdigest() == reference_checksum(raw)
    with pytest.raises(ValueError, match="after the transfer's last chunk"):
        hasher.update(b"x")
    partial = TransferHasher()
    partial.update(b"abc")
    with pytest.raises(ValueError, match="chunk boundary"):
        partial.add_chunk_digests([0], last_nbytes=mib)


def test_hash_chunks_cover_every_byte_in_order() -> None:
    """Runs of adjacent views hash as one chunk (capped), others alone: the same digest as
    hashing the views one by one."""
    data = torch.randint(0, 256, (3 * HASH_CHUNK_BYTES,), dtype=torch.uint8)
    views = list(data.view(-1, 32 * 1024).unbind(0))
    views = [*views[:20], torch.empty(0, dtype=torch.uint8), *views[30:], *views[20:30]]
    one_by_one, chunked = xxhash.xxh3_64(), xxhash.xxh3_64()
    for view in views:
        one_by_one.update(view.numpy().tobytes())
    chunks = hash_chunks(views)
    for _, chunk in chunks:
        chunked.update(chunk)
    assert chunked.intdigest() == one_by_one.intdigest()
    assert all(len(chunk) <= HASH_CHUNK_BYTES for _, chunk in chunks)
    assert len(chunks) < len(views) / 4
    # Each chunk is named by its last non-empty view: the one whose send or receive it follows.
    assert all(views[index].numel() for index, _ in chunks)
    assert [index for index, _ in chunks] == sorted(index for index, _ in chunks)


class _LayoutSink(_CheckingSink):
    """A cache of `slots` blocks, handing out the slot of each block id (the header's ids name
    slots): scattered ids land through the receiver's staging buffers, runs in place."""

    def __init__(self, slots: int, block_bytes: int) -> None:
        super().__init__(slots * block_bytes)
        self.blocks = list(self.cache.view(slots, block_bytes).unbind(0))

    def destinations(self, header: TransferHeader) -> list[torch.Tensor]:
        return [self.blocks[block_id] for block_id in header.block_ids]


@pytest.mark.parametrize("pull", [False, True], ids=["messages", "pull"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.asyncio
async def test_scattered_blocks_staged_in_many_messages_land_in_place(
    kind: str, pull: bool
) -> None:
    """Scattered 8 KiB blocks, more than the receiver's few staging buffers hold at once (so
    each is reused, within a transfer and on the next one), around a run large enough to land
    in place: every block's bytes reach its slot, no other slot changes, and the checksum the
    receiver took as the pieces landed is the xxh3 of the sent bytes. The same when the
    receiver copies them out of the sender's shared memory (more than one 1 MiB chunk, each
    cut at block boundaries that are not the chunk's)."""
    block_bytes = 8 * 1024
    scattered = [2 * i for i in range(700)]  # 5.5 MiB, in groups of 1 MiB
    run = list(range(1500, 1564))  # 512 KiB, adjacent
    block_ids = scattered[:300] + run + scattered[300:] + [1401, 1403]
    sink = _LayoutSink(1600, block_bytes)
    config = TransferConfig(map_shared_memory=pull)
    receiver = make_receiver(kind, sink, config)
    address = await receiver.start(host="127.0.0.1")
    sender = make_sender(kind, config)
    try:
        for seed in (1, 2):
            generator = torch.Generator().manual_seed(seed)
            source = torch.randint(
                0, 256, (len(block_ids) * block_bytes,), dtype=torch.uint8, generator=generator
            ).share_memory_()
            blocks = list(source.view(len(block_ids), block_bytes).unbind(0))
            header = TransferHeader.of(
                f"r{seed}", block_ids, [block_bytes] * len(block_ids), checksums_follow=True
            )
            await sender.send(address, header, blocks)
            landed = sink.completed_headers[-1]
            expected = reference_checksum(source.numpy().tobytes())
            assert landed.received_checksums == (expected,)
            cache = sink.cache.view(1600, block_bytes)
            assert torch.equal(cache[block_ids], source.view(len(block_ids), block_bytes))
            others = sorted(set(range(1600)) - set(block_ids))
            assert not cache[others].any()
        assert receiver.bytes_mapped == (2 * len(block_ids) * block_bytes if pull else 0)
    finally:
        await sender.close()
        await receiver.close()
