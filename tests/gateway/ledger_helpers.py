"""Tickets of a `Ledger` as the old admission and share tests took them (exact counts)."""

from __future__ import annotations

import itertools

from nori.gateway.backend import GenerationRequest
from nori.gateway.ledger import Ledger, RequestTicket
from nori.gateway.worker_pool import PoolCapacity
from nori.sampling.params import SamplingParams

_ids = itertools.count()


def request(
    num_tokens: int = 1, group: str | None = None, client: str = "", priority: int = 0
) -> GenerationRequest:
    return GenerationRequest(
        f"r-{next(_ids)}",
        [1] * num_tokens,
        SamplingParams(),
        admission_group=group,
        client=client,
        priority=priority,
    )


def admit(
    ledger: Ledger,
    num_tokens: int,
    num_workers: int,
    now: float,
    group: str | None = None,
    background: bool = False,
    client: str = "",
) -> RequestTicket:
    """Admitted and holding its slot (its tokens queued), as a request with no wait does."""
    ticket = ledger.admit(
        request(num_tokens, group, client, 1000 if background else 0), num_workers, now
    )
    ticket.take_slot()
    return ticket


def shares(rows: int = 8, calls: int = 10, max_share: float = 0.5) -> Ledger:
    ledger = Ledger(max_share=max_share)
    ledger.set_capacity(PoolCapacity(rows=rows, calls=calls), None)
    return ledger


def try_take(ledger: Ledger, group: str, client: str, priority: int = 0) -> RequestTicket | None:
    """A member of `group` (its request) from `client`, holding a slot at once, or None."""
    ticket = ledger.admit(request(1, group, client, priority), 1, 0.0)
    if not ledger.may_start(ticket):
        ticket.close()
        return None
    ticket.take_slot()
    return ticket


async def take(
    ledger: Ledger, group: str, client: str, wait_s: float, priority: int = 0
) -> RequestTicket:
    """A member waiting up to `wait_s` for its slot; closed (as `generate` closes it) if not."""
    ticket = ledger.admit(request(1, group, client, priority), 1, 0.0)
    try:
        await ticket.take(wait_s)
    except BaseException:
        ticket.close()
        raise
    return ticket
