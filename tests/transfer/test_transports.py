"""Both transports end to end: the sender here, the receiver in another OS process."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from nori.transfer.base import TransferConfig, TransferError, TransferRejected
from nori.transfer.factory import make_sender
from nori.transfer.handoff import TransferHeader
from tests.transfer.helpers import KINDS, free_port, kv_blocks
from tests.transfer.receiver_process import UNTOUCHED, ReceiverProcess


def _events(receiver: ReceiverProcess, request_id: str) -> list[tuple[str, str, object]]:
    return [tuple(e) for e in receiver.status()["events"] if e[1] == request_id]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("dtype", "block_ids"), [(torch.float32, [3, 9, 14]), (torch.bfloat16, [0, 7, 15, 2])]
)
async def test_blocks_land_in_the_destination_blocks_and_nowhere_else(
    receiver: ReceiverProcess, dtype: torch.dtype, block_ids: list[int]
) -> None:
    cache = receiver.caches[str(dtype).removeprefix("torch.")]
    before = cache.clone()
    request_id = f"land-{dtype}"
    header, buffers, source = kv_blocks(
        request_id, block_ids, dtype, seed=1, output_token_ids=(42,)
    )
    mapped_before = receiver.status()["bytes_mapped"]
    sender = make_sender(receiver.kind)
    try:
        await sender.send(receiver.address, header, buffers)
    finally:
        await sender.close()

    # The child's sink handed out views of this very (shared) tensor: the bytes are in place.
    assert torch.equal(cache[:, :, block_ids].view(torch.uint8), source.view(torch.uint8))
    others = [b for b in range(cache.shape[2]) if b not in block_ids]
    assert torch.equal(cache[:, :, others], before[:, :, others])
    assert (cache[:, :, others] == UNTOUCHED).any()
    assert _events(receiver, request_id) == [("completed", request_id, header.total_nbytes)]
    assert sender.bytes_sent == header.total_nbytes
    status = receiver.status()
    assert status["bytes_received"] >= header.total_nbytes
    assert status["transfers_completed"] >= 1
    # What carried the bytes: copied out of this process's shared memory, or sent as messages.
    mapped = status["bytes_mapped"] - mapped_before
    assert mapped == (header.total_nbytes if receiver.bulk == "pull" else 0)


@pytest.mark.asyncio
async def test_a_rejection_reaches_the_sender_and_the_receiver_serves_on(
    receiver: ReceiverProcess,
) -> None:
    # One connection: the rejected transfer and the next one share it.
    sender = make_sender(receiver.kind, TransferConfig(max_connections_per_peer=1))
    try:
        header, buffers, _ = kv_blocks("reject-17", [1], torch.float32, seed=2)
        with pytest.raises(TransferRejected, match="unknown request reject-17"):
            await sender.send(receiver.address, header, buffers)
        header, buffers, _ = kv_blocks("crash-1", [1], torch.float32, seed=2)
        with pytest.raises(TransferRejected, match="receiver error"):
            await sender.send(receiver.address, header, buffers)

        header, buffers, source = kv_blocks("after-reject", [4], torch.float32, seed=3)
        await sender.send(receiver.address, header, buffers)
    finally:
        await sender.close()
    assert torch.equal(receiver.caches["float32"][:, :, [4]], source)
    assert _events(receiver, "reject-17") == []  # the sink refused: nothing to take back


@pytest.mark.asyncio
async def test_size_mismatches_are_rejected_and_leave_the_cache_alone(
    receiver: ReceiverProcess,
) -> None:
    cache = receiver.caches["float32"]
    before = cache.clone()
    sender = make_sender(receiver.kind)
    try:
        # Half-size blocks: the header is consistent with the sender's buffers, not the cache.
        header, buffers, _ = kv_blocks("half-size", [5], torch.bfloat16, seed=4)
        # ... sent to the float32 cache (a destination that names no cache).
        header = TransferHeader.of(header.request_id, header.block_ids, header.buffer_nbytes)
        with pytest.raises(TransferRejected, match="size mismatch"):
            await sender.send(receiver.address, header, buffers)
        # The sink hands out one destination too few.
        header, buffers, _ = kv_blocks("short-sink", [6], torch.float32, seed=5)
        with pytest.raises(TransferRejected, match="size mismatch"):
            await sender.send(receiver.address, header, buffers)
    finally:
        await sender.close()
    assert torch.equal(cache, before)
    # The sink learns that the destinations it handed out were not used.
    assert [e[0] for e in _events(receiver, "half-size")] == ["failed"]
    assert [e[0] for e in _events(receiver, "short-sink")] == ["failed"]


@pytest.mark.asyncio
async def test_concurrent_transfers_to_one_receiver(receiver: ReceiverProcess) -> None:
    cache = receiver.caches["bfloat16"]
    sender = make_sender(receiver.kind, TransferConfig(max_connections_per_peer=3))
    transfers = [
        kv_blocks(f"concurrent-{i}", [8 + i], torch.bfloat16, seed=10 + i) for i in range(7)
    ]
    try:
        await asyncio.gather(
            *(sender.send(receiver.address, header, buffers) for header, buffers, _ in transfers)
        )
    finally:
        await sender.close()
    for header, _, source in transfers:
        assert torch.equal(cache[:, :, header.block_ids], source)
    assert sender.bytes_sent == sum(header.total_nbytes for header, _, _ in transfers)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_dead_address_fails_fast(kind: str) -> None:
    sender = make_sender(kind, TransferConfig(connect_timeout_s=1.0))
    header, buffers, _ = kv_blocks("nobody-home", [0], torch.float32, seed=6)
    start = time.monotonic()
    try:
        with pytest.raises(TransferError, match="cannot connect"):
            await sender.send(f"{kind}://127.0.0.1:{free_port()}", header, buffers)
    finally:
        await sender.close()
    assert time.monotonic() - start < 10


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_receiver_that_went_away_is_a_transfer_error(kind: str) -> None:
    receiver = ReceiverProcess.start(kind)
    sender = make_sender(kind, TransferConfig(connect_timeout_s=1.0, timeout_s=5.0))
    try:
        header, buffers, _ = kv_blocks("before-death", [0], torch.float32, seed=7)
        await sender.send(receiver.address, header, buffers)  # leaves a pooled connection
        receiver.process.kill()
        receiver.process.join()
        start = time.monotonic()
        with pytest.raises(TransferError):
            await sender.send(receiver.address, header, buffers)
        assert time.monotonic() - start < 15
    finally:
        await sender.close()
        receiver.stop()
