"""The ledger's fair shares: who may hold the decode pool's calls (exact counts)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from nori.gateway.backend import GenerationRequest
from nori.gateway.cluster import ClusterBackend, ClusterOptions
from nori.gateway.errors import (
    InvalidRequestError,
    ShareRefusedError,
    WorkerLostError,
    error_from_rpc,
)
from nori.gateway.ledger import Ledger
from nori.gateway.prompts import client_identity
from nori.gateway.worker_pool import PoolCapacity, pool_capacity
from nori.sampling.params import SamplingParams
from tests.gateway.ledger_helpers import request, shares, take, try_take


def test_no_capacity_known_limits_nothing() -> None:
    pool = Ledger(max_share=0.5)
    held = [try_take(pool, "big", "a") for _ in range(1000)]
    assert all(share is not None for share in held)


def test_a_lone_request_fills_the_rows_and_leaves_the_queues_free() -> None:
    pool = shares(rows=8, calls=10)
    held = [try_take(pool, "big", "a") for _ in range(8)]
    assert all(held)
    assert try_take(pool, "big", "a") is None  # the rows are full: the rest waits
    # Another client's single request gets one of the calls beyond the rows at once.
    assert try_take(pool, "single-1", "b") is not None
    assert try_take(pool, "single-2", "c") is not None
    assert try_take(pool, "single-3", "d") is None  # every call is out
    assert pool.num_held == 10


def test_while_others_are_active_a_request_keeps_to_its_share() -> None:
    pool = shares(rows=8, calls=10, max_share=0.5)
    held = [try_take(pool, "big", "a") for _ in range(8)]
    single = try_take(pool, "single", "b")
    assert single is not None
    # The big request holds 8 > 4 (half the rows) while another is active: none of its
    # members starts until it is back under 4, even with calls free.
    for share in held[:4]:
        assert share is not None
        share.close()
    assert pool.num_held == 5
    assert try_take(pool, "big", "a") is None
    held[4].close()  # type: ignore[union-attr]
    assert try_take(pool, "big", "a") is not None  # 3 + 1 = 4
    assert try_take(pool, "big", "a") is None
    single.close()  # alone again: the rows are its to fill
    assert try_take(pool, "big", "a") is not None


def test_one_clients_requests_share_one_limit() -> None:
    pool = shares(rows=8, calls=20, max_share=0.5)
    for i in range(8):
        assert try_take(pool, f"r{i}", "a") is not None
    assert try_take(pool, "r8", "a") is None  # the client fills the rows with its singles
    assert try_take(pool, "other", "b") is not None
    assert try_take(pool, "r9", "a") is None


async def test_a_freed_call_goes_to_the_waiter_holding_least() -> None:
    pool = shares(rows=4, calls=4, max_share=0.5)
    held = [try_take(pool, "big", "a") for _ in range(4)]
    big_next = asyncio.ensure_future(take(pool, "big", "a", wait_s=10))
    newcomer = asyncio.ensure_future(take(pool, "batch-of-b", "b", wait_s=10))
    await asyncio.sleep(0)
    assert pool.num_waiting == 2
    held[0].close()  # type: ignore[union-attr]
    await asyncio.sleep(0)
    assert newcomer.done() and not big_next.done()  # b holds nothing, a holds 3
    # a holds 3 > 2 (its share while b is active): freed calls do not go to it.
    held[1].close()  # type: ignore[union-attr]
    await asyncio.sleep(0)
    assert not big_next.done()
    held[2].close()  # type: ignore[union-attr]
    await asyncio.sleep(0)
    assert big_next.done()  # a holds 1 < 2
    assert pool.num_held == 3
    newcomer.result().close()
    big_next.result().close()
    held[3].close()  # type: ignore[union-attr]
    assert pool.num_held == 0
    assert pool.held == {} and pool.active == {}  # nothing left behind


async def test_a_wait_that_runs_out_is_a_429_and_leaves_nothing() -> None:
    pool = shares(rows=1, calls=1)
    held = try_take(pool, "first", "a")
    with pytest.raises(ShareRefusedError) as refused:
        await take(pool, "second", "b", wait_s=0.01)
    assert refused.value.status_code == 429
    assert "decode pool is full" in str(refused.value)
    with pytest.raises(ShareRefusedError):
        await take(pool, "single", "c", wait_s=0)  # no wait at all
    assert pool.num_waiting == 0
    assert held is not None
    held.close()
    assert pool.held == {} and pool.active == {}


async def test_a_cancelled_waiter_leaves_nothing() -> None:
    pool = shares(rows=1, calls=1)
    held = try_take(pool, "first", "a")
    waiter = asyncio.ensure_future(take(pool, "second", "b", wait_s=10))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert held is not None
    held.close()
    assert pool.num_held == 0 and pool.num_waiting == 0
    assert pool.held == {} and pool.active == {}


async def test_a_call_freed_as_a_waiter_is_cancelled_goes_to_no_one() -> None:
    """A batch whose client left: its waiters' tasks are cancelled while its running members
    release their shares, before the cancelled tasks have run again."""
    pool = shares(rows=1, calls=1)
    held = try_take(pool, "batch", "a")
    waiter = asyncio.ensure_future(take(pool, "batch", "a", wait_s=10))
    await asyncio.sleep(0)
    waiter.cancel()  # its future is cancelled now, its task runs later
    assert held is not None
    held.close()  # must not grant the cancelled waiter (the share would never come back)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool.num_held == 0 and pool.num_waiting == 0
    assert pool.held == {} and pool.active == {}
    assert try_take(pool, "next", "b") is not None


def test_a_share_is_released_once() -> None:
    pool = shares(rows=2, calls=2)
    share = try_take(pool, "r", "a")
    assert share is not None
    share.close()
    share.close()
    assert pool.num_held == 0


def test_share_bounds() -> None:
    with pytest.raises(ValueError, match="max-decode-share"):
        Ledger(max_share=0)
    with pytest.raises(ValueError, match="max-decode-share"):
        Ledger(max_share=1.5)


def test_a_waiting_prompt_is_out_of_the_token_count_but_keeps_its_group_admitted() -> None:
    queue = Ledger(max_tokens_per_worker=10)
    first = queue.admit(request(8, group="batch"), 1, now=0.0)
    first.take_slot()
    second = queue.admit(request(8, group="batch"), 1, now=0.0)  # joins its group past the bound
    assert queue.queued_tokens == 8  # waits for a slot: not queued on any worker
    second.take_slot()
    assert queue.queued_tokens == 16
    second.close()  # failed before its first token
    second.close()  # its tokens are not taken off twice
    first.first_token(1.0)
    assert queue.queued_tokens == 0


def test_a_call_the_worker_cancelled_is_dropped_not_failed() -> None:
    """gRPC core cancels calls left in a server's backlog (CANCELLED, no handler ran): the
    flow retries them, where it used to answer 500 "decode-1 failed (CANCELLED)"."""
    error = grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "CANCELLED"
    )
    dropped = error_from_rpc(error, "decode-1")
    assert isinstance(dropped, WorkerLostError) and dropped.cancelled_by_server
    # mid-stream: lost, the request migrates
    assert "decode-1 dropped the call" in str(dropped)


def test_requests_wider_than_the_caps_are_400s() -> None:
    backend = ClusterBackend(ClusterOptions(max_n=8, max_request_members=100, max_in_flight=50))
    params = SamplingParams()

    def member(group_size: int, n: int) -> GenerationRequest:
        return GenerationRequest("r-0", [1, 2], params, "r", "c", group_size, n)

    backend._check_fan_out(member(50, 8))  # at the caps: fine
    with pytest.raises(InvalidRequestError, match=r"n is 9, more than this server allows \(8"):
        backend._check_fan_out(member(9, 9))
    # Past --max-in-flight too: such a batch could never be in flight whole.
    with pytest.raises(InvalidRequestError, match=r"51 choices .* \(50, --max-request-members"):
        backend._check_fan_out(member(51, 1))
    with pytest.raises(ValueError, match="--max-n"):
        ClusterOptions(max_n=65)
    with pytest.raises(ValueError, match="--max-decode-share"):
        ClusterOptions(max_decode_share=0)


def test_clients_are_told_apart_by_key_else_by_address() -> None:
    def scope(authorization: bytes | None, host: str = "10.0.0.1") -> dict[str, object]:
        headers = [(b"authorization", authorization)] if authorization is not None else []
        return {"type": "http", "headers": headers, "client": (host, 5555)}

    alice = client_identity(scope(b"Bearer alice-key"))
    assert alice == client_identity(scope(b"bearer alice-key", host="10.0.0.2"))
    assert alice != client_identity(scope(b"Bearer bob-key"))
    assert "alice-key" not in alice  # a digest: the key itself is never kept
    assert client_identity(scope(None)) == "addr:10.0.0.1"
    assert client_identity(scope(b"Basic xyz")) == "addr:10.0.0.1"
    assert client_identity({"type": "http", "headers": []}) == "addr:unknown"


def test_the_pool_capacity_counts_a_worker_that_has_not_said_yet_as_the_mean_of_the_others() -> (
    None
):
    # Found by test_queue_bounds: right after start the gateway had one decode worker's
    # figures of two, and held a lone client to 2 running slots of 4.
    assert pool_capacity({}, ["decode-0"]) is None
    assert pool_capacity({"decode-0": (2, 3)}, ["decode-0", "decode-1"]) == PoolCapacity(4, 6)
    both = {"decode-0": (2, 3), "decode-1": (32, 40)}
    assert pool_capacity(both, ["decode-0", "decode-1"]) == PoolCapacity(34, 43)
    # A worker that left (drained, or gone from the registry) is not counted.
    assert pool_capacity(both, ["decode-1"]) == PoolCapacity(32, 40)


async def test_a_freed_call_goes_to_an_interactive_waiter_before_batch_ones() -> None:
    pool = shares(rows=2, calls=2, max_share=1.0)
    held = [try_take(pool, "line-0", "runner#background"), try_take(pool, "line-1", "c")]
    batch_waiters = [
        asyncio.ensure_future(take(pool, f"line-{i}", "runner#background", 10, priority=1000))
        for i in (2, 3)
    ]
    await asyncio.sleep(0)
    interactive = asyncio.ensure_future(take(pool, "chat", "d", 10, priority=0))
    await asyncio.sleep(0)
    held[0].close()  # type: ignore[union-attr]
    await asyncio.sleep(0)
    # The interactive request came last and holds nothing more than the others: it goes first.
    assert interactive.done() and not any(w.done() for w in batch_waiters)
    interactive.result().close()
    await asyncio.sleep(0)
    assert batch_waiters[0].done() and not batch_waiters[1].done()
    for waiter in batch_waiters[1:]:
        waiter.cancel()
    batch_waiters[0].result().close()
    held[1].close()  # type: ignore[union-attr]
    await asyncio.sleep(0)
    assert pool.num_held == 0


async def test_batch_lines_fill_the_rows_but_leave_the_workers_queues_to_interactive_work() -> None:
    pool = shares(rows=4, calls=6, max_share=1.0)
    batch = [try_take(pool, f"line-{i}", "r#background", priority=1000) for i in range(5)]
    assert [share is not None for share in batch] == [True] * 4 + [False]
    waiter = asyncio.ensure_future(take(pool, "line-9", "r#background", 10, priority=1000))
    await asyncio.sleep(0)
    # Interactive members count against each other only, as the workers count their calls:
    # every call of the pool is theirs at once, whatever the batch holds.
    chats = [try_take(pool, f"chat-{i}", f"c{i}") for i in range(7)]
    assert [share is not None for share in chats] == [True] * 6 + [False]
    with pytest.raises(ShareRefusedError, match="6 interactive requests hold its 6 calls"):
        await take(pool, "chat-7", "c7", 0)
    assert pool.num_held == 10 and pool.num_background_held == 4 and not waiter.done()
    batch[0].close()  # type: ignore[union-attr]
    await asyncio.sleep(0)
    assert not waiter.done()  # 9 calls held, 4 rows: no room for a batch line
    for share in chats[:5]:
        share.close()  # type: ignore[union-attr]
    await asyncio.sleep(0)
    assert not waiter.done()  # batch lines start while fewer calls than rows are held
    chats[5].close()  # type: ignore[union-attr]
    await asyncio.sleep(0)
    assert waiter.done()
    for share in [*batch[1:4], waiter.result()]:
        share.close()  # type: ignore[union-attr]
    assert pool.num_held == 0 and pool.num_background_held == 0
