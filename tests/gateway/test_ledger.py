"""The ledger's decisions as pure functions, and one ticket's life through it (exact counts)."""

from __future__ import annotations

import pytest

from nori.gateway.errors import QueueFullError
from nori.gateway.ledger import Ledger
from nori.gateway.worker_pool import (
    ASSUMED_FIGURES,
    PoolCapacity,
    SlotCounts,
    may_hold,
    owner_limit,
    pool_capacity,
    tokens_ahead,
)
from tests.gateway.ledger_helpers import request, take, try_take


def test_owner_limit_is_every_row_alone_and_its_share_beside_others() -> None:
    assert owner_limit(rows=512, max_share=0.5, others_active=False) == 512
    assert owner_limit(rows=512, max_share=0.5, others_active=True) == 256
    assert owner_limit(rows=3, max_share=0.25, others_active=True) == 1  # never 0


def test_beside_others_an_owner_shares_out_the_pools_shared_rows() -> None:
    # The prompt pool of one prefill worker: 256 rows, 32 of them shared out beside others.
    assert owner_limit(rows=256, max_share=0.5, others_active=False, shared_rows=32) == 256
    assert owner_limit(rows=256, max_share=0.5, others_active=True, shared_rows=32) == 16
    assert owner_limit(rows=8, max_share=0.5, others_active=True, shared_rows=32) == 4
    held = SlotCounts(held=16, calls=320, group_held=16, client_held=16, group_alone=False,
                      client_alone=False)  # fmt: skip
    assert may_hold(held, rows=256, max_share=0.5)
    assert not may_hold(held, rows=256, max_share=0.5, shared_rows=32)


def test_may_hold_needs_a_free_call_and_both_owners_under_their_limits() -> None:
    counts = SlotCounts(held=7, calls=8, group_held=3, client_held=3, group_alone=False,
                        client_alone=True)  # fmt: skip
    assert may_hold(counts, rows=8, max_share=0.5)  # group 3 < 4, client 3 < 8, 7 < 8 calls
    assert not may_hold(SlotCounts(8, 8, 3, 3, False, True), rows=8, max_share=0.5)  # no call
    assert not may_hold(SlotCounts(7, 8, 4, 4, False, True), rows=8, max_share=0.5)  # group at 4
    assert not may_hold(SlotCounts(7, 8, 0, 4, True, False), rows=8, max_share=0.5)  # client at 4


def test_other_clients_tokens_count_up_to_their_share_of_the_bound() -> None:
    # A wide request of 3,840 members x 6 tokens holds 23,040 tokens; another client's prompt
    # waits behind its own client's tokens and at most 4,096 (half the bound) of the wide one's.
    assert tokens_ahead(own=0, others=[23_040], share=4096) == 4096
    assert tokens_ahead(own=5000, others=[23_040, 100], share=4096) == 5000 + 4096 + 100
    assert tokens_ahead(own=0, others=[23_040], share=None) == 23_040


def test_a_pool_whose_workers_have_not_said_counts_the_assumed_figures() -> None:
    assert ASSUMED_FIGURES == (256, 320)
    assert pool_capacity({}, ["d0", "d1"]) is None
    assert pool_capacity({}, ["d0", "d1"], ASSUMED_FIGURES) == PoolCapacity(512, 640)
    assert pool_capacity({"d0": (32, 40)}, ["d0", "d1"], ASSUMED_FIGURES) == PoolCapacity(64, 80)
    assert pool_capacity({}, [], ASSUMED_FIGURES) is None


def wide_ledger() -> Ledger:
    """1 prefill worker (rows 32, calls 40) and a decode pool of rows 64, calls 80; a bound of
    1024 prompt tokens."""
    ledger = Ledger(max_tokens_per_worker=1024, max_share=0.5)
    ledger.set_capacity(PoolCapacity(rows=64, calls=80), PoolCapacity(rows=32, calls=40))
    return ledger


async def test_a_wide_requests_members_count_against_their_clients_share() -> None:
    """128 members of 40 tokens from one client, then other clients' single requests: the
    members hold at most the prompt pool's rows (32), the rest wait in the gateway; the others
    are admitted (the wide one's tokens count up to half the bound) and take a slot at once."""
    ledger = wide_ledger()
    wide = [ledger.admit(request(40, group="wide", client="a"), 1, 0.0) for _ in range(128)]
    started = [ticket for ticket in wide if ledger.may_start(ticket) and not ticket.take_slot()]
    assert len(started) == 32  # the prompt pool's rows: a lone client fills them
    assert (ledger.num_prompting, ledger.num_held, ledger.queued_tokens) == (32, 32, 1280)
    singles = [ledger.admit(request(4, client=f"user-{i}"), 1, 0.0) for i in range(8)]
    for ticket in singles:
        await ticket.take(wait_s=0)  # no 429: the calls beyond the rows are the newcomers'
    assert ledger.num_prompting == 40 and ledger.queued_tokens == 1280 + 8 * 4
    # The prompt pool's calls are all out now: the wide request's next member waits, while
    # a ninth single request is held to the decode pool only (the prefill worker answers it).
    assert not ledger.may_start(wide[32])
    ninth = ledger.admit(request(4, client="user-9"), 1, 0.0)
    await ninth.take(wait_s=0)
    singles.append(ninth)
    # Beside 9 other clients the wide request keeps to half the prompt pool's rows (16): 16 of
    # its members ending free no slot for it; the 17th does.
    for ticket in started[:16]:
        ticket.close()
    assert not ledger.may_start(wide[32])
    started[16].close()
    assert ledger.may_start(wide[32])
    for ticket in [*wide, *singles]:
        ticket.close()
    counts = (ledger.num_open, ledger.num_held, ledger.num_prompting, ledger.queued_tokens)
    assert counts == (0, 0, 0, 0)


def test_without_the_share_cap_the_wide_request_would_refuse_everyone() -> None:
    """The same wide request holding all 64 decode rows with its prompts queued (no prompt pool
    known): 2,560 tokens against a bound of 1,024. Its own client's next request is refused;
    another client's is not, as the wide one's tokens count up to 512 for it."""
    ledger = Ledger(max_tokens_per_worker=1024, max_share=0.5)
    wide = [ledger.admit(request(40, group="wide", client="a"), 1, 0.0) for _ in range(64)]
    for ticket in wide:
        ticket.take_slot()
    assert ledger.queued_tokens == 2560
    with pytest.raises(QueueFullError, match="2560 prompt tokens are waiting"):
        ledger.admit(request(4, client="a"), 1, 0.0)
    other = ledger.admit(request(4, client="b"), 1, 0.0)
    assert ledger.refusal(other, 1) == 0


async def test_a_ticket_goes_queued_prompt_decoding_closed_and_closes_once() -> None:
    ledger = wide_ledger()
    ticket = ledger.admit(request(40, client="a"), 1, 0.0)
    assert ticket.state == "queued" and ledger.num_open == 1
    await ticket.take(wait_s=0)
    ticket.decoding_on("decode-0")
    ticket.prompt_on("prefill-0")
    assert ticket.state == "prompt"
    assert ledger.in_flight == {"decode-0": 1, "prefill-0": 1}
    assert +ledger.pending_prompt_tokens == {"prefill-0": 40}
    ticket.first_token(2.0)
    assert ticket.state == "decoding" and ledger.in_flight == {"decode-0": 1}
    assert (ledger.queued_tokens, ledger.num_prompting, ledger.num_held) == (0, 0, 1)
    ticket.close()
    ticket.close()
    assert ticket.state == "closed"
    assert (ledger.num_open, ledger.num_held) == (0, 0)
    assert not ledger.in_flight and not ledger.held and not ledger.active
    assert ledger.drain_rate(2.0) == 40.0  # its prompt counts for Retry-After's drain rate


async def test_closing_a_ticket_mid_prompt_releases_every_hold() -> None:
    ledger = wide_ledger()
    ticket = ledger.admit(request(40, group="g", client="a"), 1, 0.0)
    ticket.take_slot()
    ticket.decoding_on("decode-1")
    ticket.prompt_on("decode-1", whole_request=False)  # computed on its decode worker
    assert ledger.in_flight == {"decode-1": 1}
    assert ledger.pending_prompt_tokens == {"decode-1": 40}
    ticket.close()
    assert not ledger.in_flight and not ledger.pending_prompt_tokens
    assert (ledger.queued_tokens, ledger.num_prompting, ledger.num_held, ledger.num_open) == (
        0, 0, 0, 0)  # fmt: skip
    assert not ledger.groups and not ledger.held and not ledger.prompting and not ledger.active
    assert ledger.drain_rate(3.0) is None  # it never prefilled
    assert await take(ledger, "next", "b", 0) is not None
    assert try_take(ledger, "other", "c") is not None
