"""The decode side's lease: what it accepts, what it refuses, and when it lets blocks go."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator

import pytest
import torch

from nori.cluster_auth import random_token
from nori.decode.kv_sink import DecodeKVSink, Lease, LeaseExpired, LeaseState
from nori.decode.servicer import kv_listen_host
from nori.transfer.base import TransferRejected
from nori.transfer.handoff import TransferHeader
from nori.transfer.integrity import TransferHasher, byte_view
from nori.transfer.tcp import TcpReceiver, TcpSender
from nori.v1.handoff_pb2 import KVDestination
from nori.worker.servicer_base import BlockLayout, destination_buffers, source_buffers


def make_sink(receiving: list[str] | None = None) -> tuple[DecodeKVSink, torch.Tensor]:
    cache = torch.zeros(2, 2, 8, 4, 1, 2)
    on_receiving = receiving.append if receiving is not None else None
    return DecodeKVSink((cache,), transfer_timeout_s=1.0, on_receiving=on_receiving), cache


def reservation_of(lease: Lease | None) -> KVDestination:
    """The destination a reservation hands out: its epoch and transfer token."""
    if lease is None:
        return KVDestination()
    return KVDestination(lease_epoch=lease.epoch, transfer_token=lease.transfer_token)


def header(
    request_id: str,
    block_ids: list[int],
    cache: torch.Tensor,
    sink: DecodeKVSink | None = None,
    fill: float = 0.0,
    checksums: bool = True,
) -> TransferHeader:
    """A sender's header for `block_ids`: sizes, the reservation's epoch and transfer token
    (from `sink`; none without it), and (`sender_checksum`) the checksum of buffers holding
    `fill`, which follows the data."""
    buffers = destination_buffers((cache,), block_ids)
    lease = sink.lease(request_id) if sink is not None else None
    destination = reservation_of(lease)
    sent = TransferHeader.of(
        request_id,
        block_ids,
        [b.nbytes for b in buffers],
        output_token_ids=[7],
        destination=destination,
        checksums_follow=checksums,
    )
    return dataclasses.replace(
        sent, sender_checksum=checksum([torch.full_like(b, fill) for b in buffers])
    )


def checksum(buffers: list[torch.Tensor]) -> int:
    """The transfer checksum of the buffers' bytes, in order."""
    hasher = TransferHasher()
    for buffer in buffers:
        hasher.update(byte_view(buffer.contiguous()).numpy())
    return hasher.intdigest()


def landed(sent: TransferHeader, buffers: list[torch.Tensor]) -> TransferHeader:
    """`sent` as the receiving conversation hands it to `completed`: the sender's checksum and
    the one taken over what landed in `buffers`."""
    assert sent.sender_checksum is not None
    return dataclasses.replace(
        sent, buffer_checksums=(sent.sender_checksum,), received_checksums=(checksum(buffers),)
    )


async def test_accepts_only_the_reserved_blocks_with_the_expected_sizes() -> None:
    receiving: list[str] = []
    sink, cache = make_sink(receiving)
    sink.expect("r1", [3, 4], lease_s=5)
    with pytest.raises(TransferRejected, match="no reserved blocks"):
        sink.destinations(header("other", [3, 4], cache))
    with pytest.raises(TransferRejected, match="differ from the reservation"):
        sink.destinations(header("r1", [3, 5], cache, sink))
    reserved = reservation_of(sink.lease("r1"))
    bad_sizes = TransferHeader.of("r1", [3, 4], [1, 2, 3], destination=reserved)
    with pytest.raises(TransferRejected, match="buffer sizes"):
        sink.destinations(bad_sizes)
    with pytest.raises(TransferRejected, match="transfer token"):
        sink.destinations(header("r1", [3, 4], cache))  # an earlier reservation's sender
    other_epoch = KVDestination(lease_epoch=reserved.lease_epoch ^ 1)
    other_epoch.transfer_token = reserved.transfer_token
    with pytest.raises(TransferRejected, match="names reservation"):
        sink.destinations(TransferHeader.of("r1", [3, 4], [], destination=other_epoch))
    with pytest.raises(TransferRejected, match="checksum follows"):
        sink.destinations(header("r1", [3, 4], cache, sink, checksums=False))

    good = header("r1", [3, 4], cache, sink, fill=1.0)
    assert receiving == []  # refused transfers are not "transferring"
    buffers = sink.destinations(good)
    assert receiving == ["r1"]
    with pytest.raises(TransferRejected, match="already receiving"):
        sink.destinations(good)
    for buffer in buffers:
        buffer.fill_(1.0)
    sink.completed(landed(good, buffers), sum(good.buffer_nbytes))
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
    buffers = sink.destinations(started)
    sink.completed(landed(started, buffers), sum(started.buffer_nbytes))
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
        sink.destinations(header("r1", [0], cache, sink))
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
        sink.completed(landed(sent, buffers), nbytes)  # refused instead of acknowledged
    with pytest.raises(TransferRejected, match="corrupted KV transfer"):
        await sink.wait("r1")
    assert sink.state("r1") is LeaseState.FAILED
    assert sink.checksum_failures == 1 and sink.transfers_completed == 0


@pytest.mark.parametrize("match", [True, False])
async def test_a_checksum_that_follows_the_data_is_checked(match: bool) -> None:
    """A `checksums_follow` header carries no checksums when the sink accepts it; the
    conversation hands `completed` the sender's transfer checksum and the receiver's own
    (computed as the bytes landed): equal, the request may decode; different, it fails."""
    sink, cache = make_sink()
    sink.expect("r1", [3, 4], lease_s=5)
    buffers = destination_buffers((cache,), [3, 4])
    follows = TransferHeader.of(
        "r1",
        [3, 4],
        [b.nbytes for b in buffers],
        destination=reservation_of(sink.lease("r1")),
        checksums_follow=True,
    )
    sink.destinations(follows)  # accepted: its checksum comes after the data
    landed = dataclasses.replace(
        follows, buffer_checksums=(1234,), received_checksums=(1234 if match else 4321,)
    )
    if match:
        sink.completed(landed, sum(follows.buffer_nbytes))
        await sink.wait("r1")
        assert sink.transfers_completed == 1 and sink.checksum_failures == 0
    else:
        with pytest.raises(TransferRejected, match="corrupted KV transfer"):
            sink.completed(landed, sum(follows.buffer_nbytes))
        assert sink.state("r1") is LeaseState.FAILED and sink.checksum_failures == 1


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
        destination=reservation_of(sink.lease("r1")),
        checksums_follow=True,
    )
    buffers = sink.destinations(good)
    assert all(
        b.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr() for b in buffers
    )
    for buffer, data in zip(buffers, sent, strict=True):
        buffer.copy_(data)
    assert sink.staged_blocks("r1") is None  # not arrived yet
    arrived = dataclasses.replace(
        good, buffer_checksums=(checksum(sent),), received_checksums=(checksum(buffers),)
    )
    sink.completed(arrived, sum(good.buffer_nbytes))
    await sink.wait("r1")
    (staged,) = sink.staged_blocks("r1")  # type: ignore[misc]
    assert staged.shape == (2, 2, 3, 4, 2, 2)
    assert torch.equal(
        torch.cat([view.flatten() for view in source_buffers((staged,), [6, 2, 3])]),
        torch.cat([d.flatten() for d in sent]),
    )
    assert sink.staged_blocks("r1") is None  # handed over once
    assert not cache.any()


def forgeries(
    request_id: str, block_ids: list[int], cache: torch.Tensor, sink: DecodeKVSink
) -> Iterator[TransferHeader]:
    """Headers for `request_id`'s blocks from senders that were never handed its reservation:
    no token, another reservation's, a random one, the right one off by a character, and the
    right epoch without the token."""
    lease = sink.lease(request_id)
    assert lease is not None
    other = sink.lease("r1" if request_id != "r1" else "r2")
    assert other is not None
    right = lease.transfer_token
    near = right[:-1] + ("0" if right[-1] != "0" else "1")
    for destination in (
        KVDestination(),
        reservation_of(other),
        KVDestination(lease_epoch=lease.epoch, transfer_token=random_token()),
        KVDestination(lease_epoch=lease.epoch, transfer_token=near),
        KVDestination(lease_epoch=lease.epoch),
        KVDestination(lease_epoch=lease.epoch, transfer_token="é" * 32),
    ):
        buffers = destination_buffers((cache,), block_ids)
        yield TransferHeader.of(
            request_id,
            block_ids,
            [b.nbytes for b in buffers],
            output_token_ids=[9],
            destination=destination,
            checksums_follow=True,
        )


async def test_a_transfer_without_its_reservations_token_is_refused_and_frees_nothing() -> None:
    """A forger that knows a request id and its block ids (not its token) writes into no block,
    and fails, frees or delays neither that request nor any other: both still take their own
    KV afterwards, into exactly their blocks."""
    receiving: list[str] = []
    sink, cache = make_sink(receiving)
    sink.expect("r1", [1, 2], lease_s=5)
    sink.expect("r2", [5, 6], lease_s=5)
    waiters = {rid: asyncio.ensure_future(sink.wait(rid)) for rid in ("r1", "r2")}
    for victim, blocks in (("r2", [5, 6]), ("r1", [1, 2])):
        for forged in forgeries(victim, blocks, cache, sink):
            with pytest.raises(TransferRejected, match="transfer token"):
                sink.destinations(forged)
            # The transport tells the sink of a failure only after destinations() handed some
            # out; a forger may still try it: the lease does not move.
            sink.failed(forged, "forged")
    await asyncio.sleep(0.05)
    assert receiving == [] and not cache.any()
    assert not any(waiter.done() for waiter in waiters.values())
    for rid, blocks in (("r1", [1, 2]), ("r2", [5, 6])):
        lease = sink.lease(rid)
        assert lease is not None and lease.state is LeaseState.QUEUED and lease.block_ids == blocks
    # The real senders, after the forgers: accepted, into their blocks only.
    for rid, blocks, fill in (("r2", [5, 6], 2.0), ("r1", [1, 2], 1.0)):
        good = header(rid, blocks, cache, sink, fill=fill)
        buffers = sink.destinations(good)
        for buffer in buffers:
            buffer.fill_(fill)
        sink.completed(landed(good, buffers), sum(good.buffer_nbytes))
    assert [list((await waiters[rid]).output_token_ids) for rid in ("r1", "r2")] == [[7], [7]]
    assert cache[:, :, 1:3].eq(1).all() and cache[:, :, 5:7].eq(2).all()
    untouched = [b for b in range(cache.shape[2]) if b not in (1, 2, 5, 6)]
    assert not cache[:, :, untouched].any()
    assert sink.transfers_completed == 2 and sink.checksum_failures == 0


async def test_a_forged_transfer_over_tcp_is_refused_and_the_real_one_lands() -> None:
    """The same through a real receiver and sender (TCP sockets, the transfer conversation)."""
    sink, cache = make_sink()
    sink.expect("r1", [1, 2], lease_s=5)
    sink.expect("r2", [5, 6], lease_s=5)
    receiver = TcpReceiver(sink)
    sender = TcpSender()
    address = await receiver.start(host="127.0.0.1", port=0)
    try:
        for forged in forgeries("r2", [5, 6], cache, sink):
            data = [torch.full_like(b, 5.0) for b in destination_buffers((cache,), [5, 6])]
            with pytest.raises(TransferRejected, match="transfer token"):
                await sender.send(address, forged, data)
        assert sink.state("r1") is LeaseState.QUEUED and sink.state("r2") is LeaseState.QUEUED
        assert not cache.any()
        good = header("r2", [5, 6], cache, sink, fill=2.0)
        data = [torch.full_like(b, 2.0) for b in destination_buffers((cache,), [5, 6])]
        await sender.send(address, good, data)
        assert list((await sink.wait("r2")).output_token_ids) == [7]
        assert cache[:, :, 5:7].eq(2).all() and not cache[:, :, :5].any()
        assert sink.state("r1") is LeaseState.QUEUED
    finally:
        await sender.close()
        await receiver.close()


def test_reservations_get_random_epochs_and_tokens() -> None:
    """Neither can be guessed from an earlier reservation: no counter behind the epochs, a fresh
    128-bit token each time."""
    sink, _ = make_sink()
    leases = [sink.expect(f"r{i}", [i % 8], lease_s=5) for i in range(64)]
    epochs = [lease.epoch for lease in leases]
    tokens = [lease.transfer_token for lease in leases]
    assert len(set(epochs)) == len(epochs) and len(set(tokens)) == len(tokens)
    steps = {b - a for a, b in itertools.pairwise(epochs)}
    assert 1 not in steps and len(steps) == len(epochs) - 1, "epochs follow a pattern"
    assert all(0 <= epoch < 1 << 62 for epoch in epochs)
    assert all(len(token) == 32 and int(token, 16) >= 0 for token in tokens)
    assert sink.lease("r0") is leases[0] and leases[0].admits(tokens[0])
    assert not leases[0].admits(tokens[1]) and not leases[0].admits("")
    assert not Lease.reserve("x", [0], leases[0].policy, 0.0).admits("")  # no token: nothing


def test_the_kv_receiver_listens_where_it_is_advertised() -> None:
    """--host names the address; a wildcard --host narrows to the advertised address when it
    is this machine's own, and stays a wildcard for one it cannot bind (behind a NAT)."""
    assert kv_listen_host("127.0.0.1", "10.0.0.9") == "127.0.0.1"
    assert kv_listen_host("0.0.0.0", "127.0.0.1") == "127.0.0.1"
    assert kv_listen_host("0.0.0.0", "localhost") in ("127.0.0.1", "::1")
    assert kv_listen_host("0.0.0.0", "198.51.100.7") == "0.0.0.0"  # TEST-NET-2: not ours
    assert kv_listen_host("", "no-such-host.invalid") == ""
