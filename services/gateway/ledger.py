"""The gateway's one count of its requests: a `RequestTicket` (`ticket.py`) per request, in one
`Ledger`. What a ticket holds is counted here only: its place among the requests in flight
(`--max-in-flight`), its prompt tokens until its first token (admission: 429 past
`max_queued_prompt_tokens` per prompt worker; an admitted group's members are never refused),
its decode slot until it closes and prompt slot until its first token, and its calls and prompt
tokens on each worker (`worker_pool.Router`). The decisions are pure functions of these counts.
Fair shares: an owner (the ticket's group, its client) holds at most a pool's rows alone, or
`max_share` of them beside another active owner (in the prompt pool, of its `shared_rows`);
a freed slot goes to the most urgent priority,
then the client, then the group, holding least (first come on ties). docs/architecture.md, "The
path of one request through the cluster", has the whole of it.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from nori.gateway.backend import GenerationRequest
from nori.gateway.errors import QueueFullError, ShareRefusedError
from nori.gateway.ticket import RequestTicket
from nori.gateway.worker_pool import Router

# Prefills completed this recently set the drain rate behind Retry-After.
DRAIN_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60.0
# Entries of `Ledger._room_waiters` past which ended waits are dropped.
ROOM_WAITERS_PRUNE_AT = 1024
# (rows, calls) of a worker that has not stated its own: the workers' defaults.
ASSUMED_FIGURES = (256, 320)


@dataclass(frozen=True)
class PoolCapacity:
    """A pool's summed running rows (`--max-num-seqs`) and calls served at once (rows + queue);
    `shared_rows`, when set, the rows owners share out beside others instead of `rows`."""

    rows: int
    calls: int
    shared_rows: int | None = None


def pool_capacity(
    figures: Mapping[str, tuple[int, int]],
    worker_ids: Sequence[str],
    assumed: tuple[int, int] | None = None,
) -> PoolCapacity | None:
    """The pool's capacity; a silent worker counts as the others' mean, else as `assumed`."""
    known = [figures[worker_id] for worker_id in worker_ids if worker_id in figures]
    if not known:
        if assumed is None or not worker_ids:
            return None
        known = [assumed]
    scale = len(worker_ids) / len(known)
    return PoolCapacity(
        rows=round(sum(rows for rows, _ in known) * scale),
        calls=round(sum(calls for _, calls in known) * scale),
    )


# ---------------------------------------------------------------------- the decisions


def prompt_bound(max_tokens_per_worker: int, num_workers: int) -> int | None:
    """The admission bound in prompt tokens; None: none (0, or no worker: routing says 503)."""
    if max_tokens_per_worker == 0 or num_workers <= 0:
        return None
    return max_tokens_per_worker * num_workers


def tokens_ahead(own: int, others: Iterable[int], share: int | None) -> int:
    """What a client's new prompt waits behind: its own client's tokens, others' up to `share`."""
    return own + sum(n if share is None else min(n, share) for n in others)


def retry_after_s(excess_tokens: int, drain_rate: float | None) -> float:
    """How long the pool needs to drain the excess at the recent rate, in [1, 60] s."""
    if drain_rate is None:
        return 1.0
    return min(MAX_RETRY_AFTER_S, max(1.0, math.ceil(excess_tokens / drain_rate)))


def owner_limit(
    rows: int, max_share: float, others_active: bool, shared_rows: int | None = None
) -> int:
    """The most slots one owner may hold: every row alone, its share of `shared_rows` (else of
    the rows) beside others."""
    if not others_active:
        return max(1, rows)
    return max(1, math.floor(max_share * min(rows, shared_rows or rows)))


@dataclass(frozen=True)
class SlotCounts:
    """One pool's counts as one ticket sees them (its priority's calls, its owners' holds)."""

    held: int  # slots counted against `calls` (interactive: interactive ones only)
    calls: int
    group_held: int
    client_held: int
    group_alone: bool  # no other group holds or waits
    client_alone: bool


def may_hold(
    counts: SlotCounts, rows: int, max_share: float, shared_rows: int | None = None
) -> bool:
    return (
        counts.held < counts.calls
        and counts.group_held < owner_limit(rows, max_share, not counts.group_alone, shared_rows)
        and counts.client_held < owner_limit(rows, max_share, not counts.client_alone, shared_rows)
    )


# ---------------------------------------------------------------------- the ledger


class Ledger:
    """Every open ticket's holds, counted; see the module's docstring."""

    def __init__(
        self, max_in_flight: int = 4096, max_tokens_per_worker: int = 8192, max_share: float = 0.5
    ) -> None:
        if max_tokens_per_worker < 0:
            raise ValueError(f"max_queued_prompt_tokens must be >= 0, got {max_tokens_per_worker}")
        if not 0 < max_share <= 1:
            raise ValueError(f"--max-decode-share must be in (0, 1], got {max_share}")
        self.max_in_flight = max_in_flight
        self.max_tokens_per_worker = max_tokens_per_worker
        self.max_share = max_share
        self.router = Router()
        self.capacity: PoolCapacity | None = None  # the decode pool's
        self.prompt_capacity: PoolCapacity | None = None  # the pool computing prompts
        self.num_open = 0
        self.queued_tokens = 0  # prompt tokens of tickets in `prompt`
        self.background_tokens = 0  # of those, background (batch) ones
        self.client_tokens: Counter[str] = Counter()  # interactive ones, per client
        self.groups: Counter[str] = Counter()  # group -> tickets before their first token
        # Slots per owner key: decode (until close), prompt (until the first token); "active":
        # owners holding or waiting.
        self.held: Counter[str] = Counter()
        self.prompting: Counter[str] = Counter()
        self.active: Counter[str] = Counter()
        self.num_held = self.num_background_held = 0
        self.num_prompting = self.num_background_prompting = 0
        # One line of waiters per (group, client): a freed slot looks at each line's head only.
        self._waiters: dict[tuple[str, str], deque[RequestTicket]] = {}
        self._arrivals = 0
        self._drained: deque[tuple[float, int]] = deque()  # (time, tokens) of recent prefills
        self._room_waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._room_waiters_prune_at = ROOM_WAITERS_PRUNE_AT

    # -------------------------------------------------------------- admission

    def admit(
        self, request: GenerationRequest, num_prompt_workers: int, now: float
    ) -> RequestTicket:
        """The request's ticket, or QueueFullError: `max_in_flight` open, or see `refusal`."""
        if self.num_open >= self.max_in_flight:
            raise QueueFullError(f"the gateway has {self.num_open} requests in flight (the limit)")
        ticket = RequestTicket(self, request)
        excess = self.refusal(ticket, num_prompt_workers)
        if excess:
            bound = prompt_bound(self.max_tokens_per_worker, num_prompt_workers)
            raise QueueFullError(
                f"the prefill queue is full: {excess + (bound or 0) - ticket.num_tokens} prompt "
                f"tokens are waiting (limit {bound} for {num_prompt_workers} worker(s)) and this "
                f"prompt has {ticket.num_tokens}; retry after the time in Retry-After",
                retry_after_s=retry_after_s(excess, self.drain_rate(now)),
            )
        self.num_open += 1
        if ticket.group is not None:
            self.groups[ticket.group] += 1
        ticket.admitted = ticket.in_group = True
        return ticket

    def refusal(self, ticket: RequestTicket, num_workers: int) -> int:
        """The prompt tokens past the bound if `ticket` were admitted now (0: admit). Interactive
        prompts count only interactive ones ahead (the workers compute them first)."""
        bound = prompt_bound(self.max_tokens_per_worker, num_workers)
        if bound is None or (ticket.group is not None and self.groups[ticket.group] > 0):
            return 0
        share = math.floor(self.max_share * bound)
        others = (n for client, n in self.client_tokens.items() if client != ticket.client)
        ahead = tokens_ahead(self.client_tokens[ticket.client], others, share)
        if ticket.background:
            ahead += self.background_tokens
        if ahead > 0 and ahead + ticket.num_tokens > bound:
            return ahead + ticket.num_tokens - bound
        return 0

    def drain_rate(self, now: float) -> float | None:
        """Prompt tokens prefilled per second lately; None when none were."""
        while self._drained and now - self._drained[0][0] > DRAIN_WINDOW_S:
            self._drained.popleft()
        if not self._drained:
            return None
        tokens = sum(count for _, count in self._drained)
        return tokens / max(now - self._drained[0][0], 1.0)

    def room_freed(self, num_tokens: int) -> asyncio.Future[None]:
        """Done when freed queued tokens reach this refused prompt (oldest first)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if len(self._room_waiters) >= self._room_waiters_prune_at:
            # Amortized: prune ended waits when the live ones double.
            self._room_waiters = deque((n, f) for n, f in self._room_waiters if not f.done())
            self._room_waiters_prune_at = max(ROOM_WAITERS_PRUNE_AT, 2 * len(self._room_waiters))
        self._room_waiters.append((num_tokens, future))
        return future

    def _leave_group(self, group: str) -> None:
        self.groups[group] -= 1
        if self.groups[group] <= 0:
            del self.groups[group]

    def _count_tokens(self, ticket: RequestTicket, sign: int) -> None:
        self.queued_tokens += sign * ticket.num_tokens
        if ticket.background:
            self.background_tokens += sign * ticket.num_tokens
        else:
            self.client_tokens[ticket.client] += sign * ticket.num_tokens
            if self.client_tokens[ticket.client] <= 0:
                del self.client_tokens[ticket.client]
        freed = ticket.num_tokens if sign < 0 else 0
        while freed > 0 and self._room_waiters:
            waiting_tokens, future = self._room_waiters.popleft()
            if not future.done():
                future.set_result(None)
                freed -= waiting_tokens

    # -------------------------------------------------------------- slots

    def slot_counts(self, ticket: RequestTicket, prompt: bool) -> SlotCounts:
        """`ticket`'s view of the prompt pool (`prompt`) or the decode pool."""
        pool = self.prompt_capacity if prompt else self.capacity
        assert pool is not None
        counter = self.prompting if prompt else self.held
        total, background = (
            (self.num_prompting, self.num_background_prompting)
            if prompt
            else (self.num_held, self.num_background_held)
        )
        g, c = ticket.group_key, ticket.client_key
        held, calls = total - background, pool.calls
        if ticket.background:  # batch lines fill the rows, never the queues beyond them
            held, calls = total, min(pool.calls, pool.rows)
        num_groups = sum(1 for key in self.active if key.startswith("g:"))
        num_clients = len(self.active) - num_groups
        return SlotCounts(
            held,
            calls,
            counter[g],
            counter[c],
            num_groups - bool(self.active[g]) == 0,
            num_clients - bool(self.active[c]) == 0,
        )

    def may_start(self, ticket: RequestTicket) -> bool:
        """Whether `ticket` may take a slot now. Only a group's members are held to the prompt
        pool too, so that they wait here, not in the workers' queues."""
        pools = ((False, self.capacity), (True, self.prompt_capacity if ticket.waits else None))
        return all(
            pool is None
            or may_hold(
                self.slot_counts(ticket, prompt), pool.rows, self.max_share, pool.shared_rows
            )
            for prompt, pool in pools
        )

    def set_capacity(self, decode: PoolCapacity | None, prompt: PoolCapacity | None) -> None:
        self.capacity, self.prompt_capacity = decode, prompt
        self._grant_waiters()

    def _activity(self, ticket: RequestTicket, sign: int) -> None:
        for key in (ticket.group_key, ticket.client_key):
            self.active[key] += sign
            if self.active[key] <= 0:
                del self.active[key]

    def _hold(self, ticket: RequestTicket, sign: int, prompt: bool) -> None:
        counter = self.prompting if prompt else self.held
        for key in (ticket.group_key, ticket.client_key):
            counter[key] += sign
            if counter[key] <= 0:
                del counter[key]
        if prompt:
            self.num_prompting += sign
            self.num_background_prompting += sign * ticket.background
        else:
            self.num_held += sign
            self.num_background_held += sign * ticket.background

    def _grant_waiters(self) -> None:
        while self._waiters:
            for line in list(self._waiters.values()):
                while line and line[0].waiter is not None and line[0].waiter.done():
                    self._drop_waiter(line[0])  # cancelled: leaves its line now
            heads = [line[0] for line in self._waiters.values() if self.may_start(line[0])]
            if not heads:
                return
            chosen = min(
                heads,
                key=lambda t: (
                    t.priority,
                    self.held[t.client_key],
                    self.held[t.group_key],
                    t.arrival,
                ),
            )
            self._drop_waiter(chosen)
            chosen.take_slot()
            assert chosen.waiter is not None
            chosen.waiter.set_result(None)

    def _enqueue(self, ticket: RequestTicket) -> asyncio.Future[None]:
        """Lines `ticket` up; the future is set when `_grant_waiters` gives it a slot."""
        self._arrivals += 1
        ticket.arrival = self._arrivals
        ticket.waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(ticket.line, deque()).append(ticket)
        return ticket.waiter

    def _drop_waiter(self, ticket: RequestTicket) -> None:
        line = self._waiters.get(ticket.line)
        if line is not None and ticket in line:
            line.remove(ticket)
            if not line:
                del self._waiters[ticket.line]

    @property
    def num_waiting(self) -> int:
        return sum(len(line) for line in self._waiters.values())

    def slot_refusal(self, ticket: RequestTicket) -> ShareRefusedError:
        """The 429 for a ticket that may not take a slot now, naming the pool that is full."""
        name, prompt, pool = "decode pool", False, self.capacity
        if pool is None or may_hold(self.slot_counts(ticket, False), pool.rows, self.max_share):
            name, prompt, pool = "prompt pool", True, self.prompt_capacity
        assert pool is not None
        counts = self.slot_counts(ticket, prompt)
        kind = "interactive requests" if not ticket.background else "requests"
        if counts.held >= counts.calls:
            what = "calls" if not ticket.background else "running slots"
            message = f"the {name} is full: {counts.held} {kind} hold its {counts.calls} {what}"
        elif max(counts.group_held, counts.client_held) >= max(1, pool.rows):
            message = (
                f"the {name} is full: this client's requests hold all of its {pool.rows} "
                "running slots"
            )
        else:
            message = (
                f"this client or request holds its share of the {name} ({self.max_share:g} "
                f"of its {min(pool.rows, pool.shared_rows or pool.rows)} running slots) while "
                "others wait"
            )
        return ShareRefusedError(
            message + "; retry after the time in Retry-After", retry_after_s=1.0
        )
