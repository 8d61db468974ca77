"""The decode side's lease: what it accepts, what it refuses, and when it lets blocks go."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nori.decode.kv_sink import DecodeKVSink, LeaseExpired
from nori.decode.lease import LeaseState
from nori.transfer.base import TransferRejected
from nori.transfer.handoff import KVDestination, TransferHeader
from nori.transfer.integrity import buffer_checksums
from nori.worker.kv_layout import BlockLayout, destination_buffers, source_buffers


def make_sink(receiving: list[str] | None = None) -> tuple[DecodeKVSink, torch.Tensor]:
    cache = torch.zeros(2, 2, 8, 4, 1, 2)
    on_receiving = receiving.append if receiving is not None else None
    return DecodeKVSink((cache,), transfer_timeout_s=1.0, on_receiving=on_receiving), cache


def header(
    request_id: str,
    block_ids: list[int],
    cache: torch.Tensor,
    sink: DecodeKVSink | None = None,
    fill: float = 0.0,
    checksums: bool = True,
) -> TransferHeader:
    """A sender's header for `block_ids`: sizes, the reservation's epoch (from `sink`), and the
    checksums of buffers holding `fill`."""
    buffers = destination_buffers((cache,), block_ids)
    lease = sink.lease(request_id) if sink is not None else None
    destination = KVDestination(lease_epoch=lease.epoch if lease is not None else 0)
    return TransferHeader.of(
        request_id,
        block_ids,
        [b.nbytes for b in buffers],
        output_token_ids=[7],
        destination=destination,
        buffer_checksums=buffer_checksums([torch.full_like(b, fill) for b in buffers])
        if checksums
        else (),
    )


async def test_accepts_only_the_reserved_blocks_with_the_expected_sizes() -> None:
    receiving: list[str] = []
    sink, cache = make_sink(receiving)
    sink.expect("r1", [3, 4], lease_s=5)
    with pytest.raises(TransferRejected, match="no reserved blocks"):
        sink.destinations(header("other", [3, 4], cache))
    with pytest.raises(TransferRejected, match="differ from the reservation"):
        sink.destinations(header("r1", [3, 5], cache, sink))
    epoch = KVDestination(lease_epoch=sink.lease("r1").epoch)  # type: ignore[union-attr]
    bad_sizes = TransferHeader.of("r1", [3, 4], [1, 2, 3], destination=epoch)
    with pytest.raises(TransferRejected, match="buffer sizes"):
        sink.destinations(bad_sizes)
    with pytest.raises(TransferRejected, match="names reservation 0"):
        sink.destinations(header("r1", [3, 4], cache))  # an earlier reservation's sender
    with pytest.raises(TransferRejected, match="0 checksums for 4 buffers"):
        sink.destinations(header("r1", [3, 4], cache, sink, checksums=False))

    good = header("r1", [3, 4], cache, sink, fill=1.0)
    assert receiving == []  # refused transfers are not "transferring"
    buffers = sink.destinations(good)
    assert receiving == ["r1"]
    with pytest.raises(TransferRejected, match="already receiving"):
        sink.destinations(good)
    for buffer in buffers:
        buffer.fill_(1.0)
    sink.completed(good, sum(good.buffer_nbytes))
    assert list((await sink.wait("r1")).output_token_ids) == [7]
    assert cache[:, :, 3:5].eq(1).all() and not cache[:, :, :3].any()
    assert sink.bytes_received == sum(good.buffer_nbytes) and sink.transfers_completed == 1


async def test_an_expired_lease_refuses_late_transfers() -> None:
    sink, cache = make_sink()
    sink.expect("r1", [0], lease_s=0.05)
    with pytest.raises(LeaseExpired, match="did not arrive within the lease"):
        await sink.wait("r1")
    with pytest.raises(TransferRejected, match="no reserved blocks"):
        sink.destinations(header("r1", [0], cache))


async def test_a_transfer_under_way_holds_the_lease_until_it_ends() -> None:
    sink, cache = make_sink()
    sink.expect("r1", [1], lease_s=0.05)
    started = header("r1", [1], cache, sink)
    sink.destinations(started)
    waiter = asyncio.ensure_future(sink.wait("r1"))
    await asyncio.sleep(0.2)  # past the lease, but bytes are landing: the blocks stay reserved
    assert not waiter.done()
    sink.failed(started, "connection reset")
    with pytest.raises(TransferRejected, match="connection reset"):
        await waiter


async def test_renewals_keep_the_blocks_past_the_lease_and_silence_frees_them() -> None:
    sink, cache = make_sink()
    sink.expect("r1", [2], lease_s=0.4)
    waiter = asyncio.ensure_future(sink.wait("r1"))
    # The prompt waits in the prefill queue, then is computed, for 2 leases: renewed all along.
    for step in range(8):
        await asyncio.sleep(0.1)
        assert sink.renew("r1", started=step >= 4)
        assert not waiter.done()
    assert sink.state("r1") is LeaseState.COMPUTING
    started = header("r1", [2], cache, sink)
    sink.destinations(started)
    sink.completed(started, sum(started.buffer_nbytes))
    assert list((await waiter).output_token_ids) == [7]

    # Another one whose prefill worker hangs after two renewals: freed one lease later.
    sink.expect("r2", [3], lease_s=0.4)
    waiter = asyncio.ensure_future(sink.wait("r2"))
    for _ in range(2):
        await asyncio.sleep(0.1)
        assert sink.renew("r2", started=True)
    with pytest.raises(LeaseExpired, match="stopped renewing"):
        await waiter
    assert not sink.renew("r2", started=True), "the holder learns to stop"
    with pytest.raises(TransferRejected, match="no reserved blocks"):
        sink.destinations(header("r2", [3], cache))


async def test_a_queue_that_never_moves_frees_the_blocks_at_the_queue_timeout() -> None:
    cache = torch.zeros(2, 2, 8, 4, 1, 2)
    sink = DecodeKVSink((cache,), queue_timeout_s=0.6)
    sink.expect("r1", [0], lease_s=0.4)
    waiter = asyncio.ensure_future(sink.wait("r1"))
    for _ in range(10):
        await asyncio.sleep(0.1)
        if waiter.done():
            break
        sink.renew("r1", started=False)
    with pytest.raises(LeaseExpired, match=r"waited more than 0\.6 s in the prefill queue"):
        await waiter
    assert sink.state("r1") is None


async def test_a_transfer_is_refused_once_the_deadline_passed_even_before_the_waiter_wakes() -> (
    None
):
    sink, cache = make_sink()
    sink.expect("r1", [0], lease_s=0.05)
    await asyncio.sleep(0.1)  # nobody waits: the lease is past its deadline but still listed
    with pytest.raises(TransferRejected, match="has expired"):
        sink.destinations(header("r1", [0], cache))
    assert sink.renew("unknown", started=True) is False


@pytest.mark.parametrize("damage", ["flipped byte", "short"])
async def test_a_corrupted_or_truncated_transfer_is_refused_and_never_decoded(damage: str) -> None:
    sink, cache = make_sink()
    sink.expect("r1", [3, 4], lease_s=5)
    sent = header("r1", [3, 4], cache, sink, fill=1.0)
    buffers = sink.destinations(sent)
    for buffer in buffers:
        buffer.fill_(1.0)
    nbytes = sum(sent.buffer_nbytes)
    if damage == "flipped byte":
        buffers[1].reshape(-1).view(torch.uint8)[5] ^= 0x10  # a view: the byte lands in the cache
    else:
        nbytes -= 4
    with pytest.raises(TransferRejected, match="corrupted KV transfer"):
        sink.completed(sent, nbytes)  # the receiver refuses instead of acknowledging
    with pytest.raises(TransferRejected, match="corrupted KV transfer"):
        await sink.wait("r1")
    assert sink.state("r1") is LeaseState.FAILED
    assert sink.checksum_failures == 1 and sink.transfers_completed == 0


async def test_a_staging_sink_receives_into_fresh_tensors_and_hands_them_over_once() -> None:
    """A tensor-parallel decode worker's sink: its cache is split over processes, so the bytes
    land in tensors of the whole-model layout (every kv head, 2 here against the cache's 1),
    in the request's block order, and the cache is left for the engine to write."""
    cache = torch.zeros(2, 2, 8, 4, 1, 2)
    whole = BlockLayout(torch.float32, (2, 2, 4, 2, 2))
    sink = DecodeKVSink((cache,), transfer_timeout_s=1.0, staging=[whole])
    sink.expect("r1", [6, 2, 3], lease_s=5)
    staged_shape = torch.zeros(2, 2, 3, 4, 2, 2)
    sent = [torch.randn_like(b) for b in source_buffers((staged_shape,), [6, 2, 3])]
    good = TransferHeader.of(
        "r1",
        [6, 2, 3],
        [b.nbytes for b in sent],
        output_token_ids=[7],
        destination=KVDestination(lease_epoch=sink.lease("r1").epoch),  # type: ignore[union-attr]
        buffer_checksums=buffer_checksums(sent),
    )
    buffers = sink.destinations(good)
    assert all(
        b.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr() for b in buffers
    )
    for buffer, data in zip(buffers, sent, strict=True):
        buffer.copy_(data)
    assert sink.staged_blocks("r1") is None  # not arrived yet
    sink.completed(good, sum(good.buffer_nbytes))
    await sink.wait("r1")
    (staged,) = sink.staged_blocks("r1")  # type: ignore[misc]
    assert staged.shape == (2, 2, 3, 4, 2, 2)
    assert torch.equal(
        torch.cat([view.flatten() for view in source_buffers((staged,), [6, 2, 3])]),
        torch.cat([d.flatten() for d in sent]),
    )
    assert sink.staged_blocks("r1") is None  # handed over once
    assert not cache.any()
