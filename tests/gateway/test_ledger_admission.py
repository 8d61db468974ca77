"""Admission by queued prompt tokens: exact decisions, the count kept exactly, Retry-After."""

from __future__ import annotations

import pytest

from nori.gateway.errors import QueueFullError
from nori.gateway.ledger import ROOM_WAITERS_PRUNE_AT, Ledger
from nori.gateway.worker_pool import prompt_bound, retry_after_s
from tests.gateway.ledger_helpers import admit, request


def test_refuses_beyond_the_bound_of_the_pool_and_admits_again_once_drained() -> None:
    queue = Ledger(max_tokens_per_worker=1000)
    first = admit(queue, 600, num_workers=1, now=0.0)
    second = admit(queue, 400, num_workers=1, now=0.0)  # exactly at the bound
    assert queue.queued_tokens == 1000
    with pytest.raises(QueueFullError, match="1000 prompt tokens are waiting") as refused:
        admit(queue, 1, num_workers=1, now=0.0)
    assert refused.value.status_code == 429 and refused.value.retry_after_s == 1.0
    # Two workers: the bound doubles.
    third = admit(queue, 900, num_workers=2, now=0.0)
    first.first_token(now=1.0)
    second.close()
    third.first_token(now=2.0)
    third.close()  # leaves once only
    assert queue.queued_tokens == 0


def test_an_empty_queue_admits_any_prompt_and_zero_means_no_bound() -> None:
    queue = Ledger(max_tokens_per_worker=1000)
    huge = admit(queue, 50_000, num_workers=1, now=0.0)
    with pytest.raises(QueueFullError):
        admit(queue, 10, num_workers=1, now=0.0)
    huge.close()
    unbounded = Ledger(max_tokens_per_worker=0)
    for _ in range(100):
        admit(unbounded, 10_000, num_workers=1, now=0.0)
    assert unbounded.queued_tokens == 1_000_000
    # No worker computes prompts: routing answers that (503), not admission.
    assert prompt_bound(1000, num_workers=0) is None
    with pytest.raises(ValueError, match=">= 0"):
        Ledger(max_tokens_per_worker=-1)


def test_retry_after_is_the_excess_at_the_recent_drain_rate() -> None:
    queue = Ledger(max_tokens_per_worker=1000)
    for now in (0.0, 1.0, 2.0, 3.0, 4.0):  # 500 tokens a second
        admit(queue, 500, num_workers=1, now=now).first_token(now=now + 1.0)
    assert queue.drain_rate(now=5.0) == pytest.approx(2500 / 4.0)
    admit(queue, 1000, num_workers=1, now=5.0)
    with pytest.raises(QueueFullError) as refused:
        admit(queue, 2000, num_workers=1, now=5.0)
    assert refused.value.retry_after_s == 4.0  # 2000 tokens too many at 625 tokens/s -> 3.2 s
    # Old prefills leave the window: no recent rate, the default second.
    assert queue.drain_rate(now=100.0) is None
    assert retry_after_s(10_000, queue.drain_rate(now=100.0)) == 1.0
    trickle = Ledger(max_tokens_per_worker=1000)
    admit(trickle, 1, num_workers=1, now=100.0).first_token(now=100.0)
    assert retry_after_s(10**9, trickle.drain_rate(now=100.5)) == 60.0  # never more than a minute


def test_the_prompts_of_one_request_are_admitted_together() -> None:
    """A batch of 3 x 600 tokens against a bound of 1000: once its first prompt is in, the rest
    follow (else the batch would be refused forever, even by an idle cluster); another request
    is still held to the bound, and the group is forgotten once its prompts have left."""
    queue = Ledger(max_tokens_per_worker=1000)
    batch = [admit(queue, 600, num_workers=1, now=0.0, group="cmpl-1") for _ in range(3)]
    assert queue.queued_tokens == 1800
    with pytest.raises(QueueFullError):
        admit(queue, 10, num_workers=1, now=0.0, group="cmpl-2")
    for prompt in batch:
        prompt.first_token(now=1.0)
    assert queue.queued_tokens == 0 and not queue.groups
    # A group refused at its first prompt is not let in by its later ones.
    admit(queue, 900, num_workers=1, now=2.0)
    for _ in range(2):
        with pytest.raises(QueueFullError):
            admit(queue, 600, num_workers=1, now=2.0, group="cmpl-3")


def test_batch_prompts_never_refuse_an_interactive_one_and_fill_what_it_leaves() -> None:
    queue = Ledger(max_tokens_per_worker=1000)
    batch = [
        admit(queue, 400, num_workers=1, now=0.0, group="batch", background=True) for _ in range(2)
    ]
    assert (queue.queued_tokens, queue.background_tokens) == (800, 800)
    # A batch prompt is measured against everything queued: refused (it waits, see cluster.py).
    with pytest.raises(QueueFullError):
        admit(queue, 300, num_workers=1, now=0.0, background=True)
    # An interactive one only against interactive work: admitted past the batch's tokens.
    chat = admit(queue, 900, num_workers=1, now=0.0)
    with pytest.raises(QueueFullError, match="900 prompt tokens are waiting"):
        admit(queue, 200, num_workers=1, now=0.0)
    assert (queue.queued_tokens, queue.background_tokens) == (1700, 800)
    # A member of the batch, admitted with it but waiting for its slot (on no worker yet): not
    # counted until it holds one.
    waiting = queue.admit(request(400, group="batch", priority=1000), 1, now=0.0)
    assert (queue.queued_tokens, queue.background_tokens) == (1700, 800)
    waiting.take_slot()
    assert (queue.queued_tokens, queue.background_tokens) == (2100, 1200)
    for prompt in (*batch, chat, waiting):
        prompt.first_token(now=1.0)
    assert (queue.queued_tokens, queue.background_tokens) == (0, 0)


async def test_freed_room_wakes_waiting_prompts_oldest_first_as_many_as_it_covers() -> None:
    queue = Ledger(max_tokens_per_worker=100)
    first = admit(queue, 60, 1, now=0.0, background=True)
    second = admit(queue, 40, 1, now=0.0, background=True)
    waiters = [queue.room_freed(30), queue.room_freed(30), queue.room_freed(30)]
    gone = queue.room_freed(10)
    gone.cancel()  # its wait ended: skipped, and covers nothing
    second.first_token(now=1.0)  # 40 tokens free: the first waiter (30), then the second (30)
    assert [w.done() for w in waiters] == [True, True, False]
    first.close()  # 60 more: the third
    assert all(w.done() and not w.cancelled() for w in waiters)
    assert queue.queued_tokens == 0


async def test_a_prompt_that_fails_before_its_first_token_frees_room_too() -> None:
    queue = Ledger(max_tokens_per_worker=10)
    queued = admit(queue, 10, 1, now=0.0, background=True)
    waiter = queue.room_freed(5)
    queued.close()
    assert waiter.done()


async def test_ended_waits_are_pruned() -> None:
    queue = Ledger(max_tokens_per_worker=10)
    admit(queue, 10, 1, now=0.0, background=True)
    for _ in range(5000):
        queue.room_freed(5).cancel()  # waits that timed out, one per retry
    live = queue.room_freed(5)
    assert len(queue._room_waiters) <= ROOM_WAITERS_PRUNE_AT
    assert not live.done()
