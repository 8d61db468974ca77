"""The gateway's one count of its requests: a `RequestTicket` per request in one `Ledger`, from
admission to `close()`: its place among the requests in flight, its prompt tokens until token one
(admission: 429 past `max_queued_prompt_tokens` per prompt worker), its decode slot until close and
prompt slot until token one (fair shares), and its calls and prompt tokens on each worker (what
`worker_pool.pick_decode` and `pick_prefill` read: their decisions are pure functions of them)."""

from __future__ import annotations

import asyncio
import math
from collections import Counter, deque

from nori.gateway.backend import GenerationRequest
from nori.gateway.errors import QueueFullError, ShareRefusedError
from nori.gateway.worker_pool import (
    PoolCapacity,
    SlotCounts,
    may_hold,
    prompt_bound,
    retry_after_s,
    tokens_ahead,
)

# Prefills completed this recently set the drain rate behind Retry-After.
DRAIN_WINDOW_S = 10.0
# Entries of `Ledger._room_waiters` past which ended waits are dropped.
ROOM_WAITERS_PRUNE_AT = 1024


class RequestTicket:
    """One request's holds: `queued` -> `prompt` (on a worker) -> `decoding` (token one came)
    -> `closed`. Retries and migration move it between workers, never out of the ledger."""

    def __init__(self, ledger: Ledger, request: GenerationRequest) -> None:
        self.ledger = ledger
        self.request_id = request.request_id
        self.group = request.admission_group
        self.priority = request.priority
        self.background = request.priority > 0
        self.waits = request.admission_group is not None or self.background
        # Batch lines are an owner apart from the same key's interactive work.
        self.client = f"{request.client}#background" if self.background else request.client
        self.group_key = f"g:{self.group or request.request_id}"
        self.client_key = f"c:{self.client}"
        self.line = (self.group_key, self.client_key)
        self.num_tokens = len(request.prompt_token_ids)
        self.admitted = False  # counted among the requests in flight
        self.in_group = False  # counted in its group, until token one
        self.active = False  # holds or waits for a slot
        self.slot = False  # holds a decode-pool slot
        self.prompting = False  # holds a prompt-pool slot; its tokens are queued
        self.first_token_at: float | None = None
        self.prompt_worker: tuple[str, bool] | None = None  # (worker, counted in flight there)
        self.decode_worker: str | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.arrival = 0
        self.closed = False

    @property
    def state(self) -> str:
        if self.closed:
            return "closed"
        if self.first_token_at is not None:
            return "decoding"
        return "prompt" if self.prompt_worker is not None else "queued"

    async def take(self, wait_s: float) -> None:
        """Takes a slot, waiting up to `wait_s` for one (`ShareRefusedError`, 429, past it)."""
        ledger = self.ledger
        if ledger.may_start(self):
            self.take_slot()
            return
        if wait_s <= 0:
            raise ledger.slot_refusal(self)
        self._activate()
        try:
            async with asyncio.timeout(wait_s):
                await ledger.enqueue(self)
        except TimeoutError:
            if not self.slot:  # else granted just as the wait ended: it keeps the slot
                ledger.drop_waiter(self)
                raise ledger.slot_refusal(self) from None

    def take_slot(self) -> None:
        self._activate()
        self.slot = self.prompting = True
        self.ledger.hold(self, +1, prompt=False)
        self.ledger.hold(self, +1, prompt=True)

    def _activate(self) -> None:
        if not self.active:
            self.active = True
            self.ledger.activity(self, +1)

    def prompt_on(self, worker_id: str, whole_request: bool = True) -> None:
        """Its prompt goes to `worker_id`, counted there until token one (as tokens only when
        the decode worker, where the request is counted already, computes it)."""
        self.prompt_off()
        self.prompt_worker = (worker_id, whole_request)
        self.ledger.worker_started(worker_id, self.num_tokens, calls=int(whole_request))

    def prompt_off(self) -> None:
        if self.prompt_worker is not None:
            worker_id, whole_request = self.prompt_worker
            self.prompt_worker = None
            self.ledger.worker_ended(worker_id, self.num_tokens, calls=int(whole_request))

    def decoding_on(self, worker_id: str) -> None:
        """An attempt on decode worker `worker_id`, counted in flight there until `decoding_off`."""
        self.decoding_off()
        self.decode_worker = worker_id
        self.ledger.worker_started(worker_id)

    def decoding_off(self) -> None:
        if self.decode_worker is not None:
            self.ledger.worker_ended(self.decode_worker)
            self.decode_worker = None

    def first_token(self, now: float) -> None:
        """Token one came back: its prompt no longer waits."""
        if self.first_token_at is None and not self.closed:
            self.first_token_at = now
            self.prompt_off()
            self._leave_prompt(drained_at=now)
            self.ledger.grant_waiters()

    def _leave_prompt(self, drained_at: float | None) -> None:
        if self.prompting:
            self.prompting = False
            self.ledger.hold(self, -1, prompt=True, drained_at=drained_at)
        if self.in_group and self.group is not None:
            self.in_group = False
            _add(self.ledger.groups, self.group, -1)

    def close(self) -> None:
        """Releases everything the ticket holds; a no-op after the first time."""
        if self.closed:
            return
        ledger = self.ledger
        self.prompt_off()
        self.decoding_off()
        if self.waiter is not None and not self.slot:
            ledger.drop_waiter(self)
        self._leave_prompt(drained_at=None)
        self.closed = True
        if self.slot:
            self.slot = False
            ledger.hold(self, -1, prompt=False)
        if self.active:
            self.active = False
            ledger.activity(self, -1)
        if self.admitted:
            self.admitted = False
            ledger.num_open -= 1
        ledger.grant_waiters()


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
        # Calls, and prompt tokens not yet computed, this gateway has on each worker.
        self.in_flight: Counter[str] = Counter()
        self.pending_prompt_tokens: Counter[str] = Counter()
        self.picks: Counter[str] = Counter()  # picks per role: equal workers take turns
        self.capacity: PoolCapacity | None = None  # the decode pool's
        self.prompt_capacity: PoolCapacity | None = None  # the pool computing prompts
        self.num_open = 0
        self.queued_tokens = 0  # prompt tokens of tickets in `prompt`
        self.background_tokens = 0  # of those, background (batch) ones
        self.client_tokens: Counter[str] = Counter()  # interactive ones, per client
        self.groups: Counter[str] = Counter()  # group -> tickets before their first token
        # Slots per owner: decode (until close), prompt (to token one); "active": holders, waiters.
        self.held: Counter[str] = Counter()
        self.prompting: Counter[str] = Counter()
        self.active: Counter[str] = Counter()
        self.num_held = self.num_background_held = 0
        self.num_prompting = self.num_background_prompting = 0
        # One line of waiters per (group, client): a freed slot looks at each line's head only.
        self._waiters: dict[tuple[str, str], deque[RequestTicket]] = {}
        self._arrivals = 0
        self.drained: deque[tuple[float, int]] = deque()  # (time, tokens) of recent prefills
        self._room_waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._room_waiters_prune_at = ROOM_WAITERS_PRUNE_AT

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
        while self.drained and now - self.drained[0][0] > DRAIN_WINDOW_S:
            self.drained.popleft()
        if not self.drained:
            return None
        tokens = sum(count for _, count in self.drained)
        return tokens / max(now - self.drained[0][0], 1.0)

    def room_freed(self, num_tokens: int) -> asyncio.Future[None]:
        """Done when freed queued tokens reach this refused prompt (oldest first)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if len(self._room_waiters) >= self._room_waiters_prune_at:
            # Amortized: prune ended waits when the live ones double.
            self._room_waiters = deque((n, f) for n, f in self._room_waiters if not f.done())
            self._room_waiters_prune_at = max(ROOM_WAITERS_PRUNE_AT, 2 * len(self._room_waiters))
        self._room_waiters.append((num_tokens, future))
        return future

    def slot_counts(self, ticket: RequestTicket, prompt: bool) -> SlotCounts:
        """`ticket`'s view of the prompt pool (`prompt`) or the decode pool."""
        pool = self.prompt_capacity if prompt else self.capacity
        assert pool is not None
        counter = self.prompting if prompt else self.held
        total = self.num_prompting if prompt else self.num_held
        background = self.num_background_prompting if prompt else self.num_background_held
        held, calls = total - background, pool.calls
        if ticket.background:  # batch lines fill the rows, never the queues beyond them
            held, calls = total, min(pool.calls, pool.rows)
        g, c = ticket.group_key, ticket.client_key
        num_groups = sum(1 for key in self.active if key.startswith("g:"))
        num_clients = len(self.active) - num_groups
        group_alone = num_groups - bool(self.active[g]) == 0
        client_alone = num_clients - bool(self.active[c]) == 0
        return SlotCounts(held, calls, counter[g], counter[c], group_alone, client_alone)

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
        self.grant_waiters()

    def activity(self, ticket: RequestTicket, sign: int) -> None:
        _add(self.active, ticket.group_key, sign)
        _add(self.active, ticket.client_key, sign)

    def hold(
        self, ticket: RequestTicket, sign: int, prompt: bool, drained_at: float | None = None
    ) -> None:
        """A decode slot, or a prompt slot with its queued tokens, taken (+1) or given back (-1);
        a prompt computed at `drained_at` counts toward the drain rate."""
        counter = self.prompting if prompt else self.held
        _add(counter, ticket.group_key, sign)
        _add(counter, ticket.client_key, sign)
        if not prompt:
            self.num_held += sign
            self.num_background_held += sign * ticket.background
            return
        self.num_prompting += sign
        self.num_background_prompting += sign * ticket.background
        tokens = sign * ticket.num_tokens
        self.queued_tokens += tokens
        if ticket.background:
            self.background_tokens += tokens
        else:
            _add(self.client_tokens, ticket.client, tokens)
        if drained_at is not None:
            self.drained.append((drained_at, ticket.num_tokens))
        freed = -tokens
        while freed > 0 and self._room_waiters:
            waiting_tokens, future = self._room_waiters.popleft()
            if not future.done():
                future.set_result(None)
                freed -= waiting_tokens

    def grant_waiters(self) -> None:
        while self._waiters:
            for line in list(self._waiters.values()):
                while line and line[0].waiter is not None and line[0].waiter.done():
                    self.drop_waiter(line[0])  # cancelled: leaves its line now
            heads = [line[0] for line in self._waiters.values() if self.may_start(line[0])]
            if not heads:
                return
            held = self.held
            chosen = min(
                heads, key=lambda t: (t.priority, held[t.client_key], held[t.group_key], t.arrival)
            )
            self.drop_waiter(chosen)
            chosen.take_slot()
            assert chosen.waiter is not None
            chosen.waiter.set_result(None)

    def enqueue(self, ticket: RequestTicket) -> asyncio.Future[None]:
        """Lines `ticket` up; the future is set when `grant_waiters` gives it a slot."""
        self._arrivals += 1
        ticket.arrival = self._arrivals
        ticket.waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(ticket.line, deque()).append(ticket)
        return ticket.waiter

    def drop_waiter(self, ticket: RequestTicket) -> None:
        line = self._waiters.get(ticket.line)
        if line is not None and ticket in line:
            line.remove(ticket)
            if not line:
                del self._waiters[ticket.line]

    def turn(self, role: str) -> int:
        """The next pick's turn among equal workers of `role`."""
        self.picks[role] += 1
        return self.picks[role] - 1

    def worker_started(self, worker_id: str, prompt_tokens: int = 0, calls: int = 1) -> None:
        """`calls` on `worker_id`, with the prompt tokens it is to compute."""
        _add(self.in_flight, worker_id, calls)
        _add(self.pending_prompt_tokens, worker_id, prompt_tokens)

    def worker_ended(self, worker_id: str, prompt_tokens: int = 0, calls: int = 1) -> None:
        _add(self.in_flight, worker_id, -calls)
        _add(self.pending_prompt_tokens, worker_id, -prompt_tokens)

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
            message = f"the {name} is full: this client's requests hold all of its {pool.rows} "
            message += "running slots"
        else:
            message = (
                f"this client or request holds its share of the {name} ({self.max_share:g} "
                f"of its {min(pool.rows, pool.shared_rows or pool.rows)} running slots) while "
                "others wait"
            )
        return ShareRefusedError(
            message + "; retry after the time in Retry-After", retry_after_s=1.0
        )


def _add(counter: Counter[str], key: str, n: int) -> None:
    """`counter[key] += n`, dropping keys at 0 (worker ids and owners come and go)."""
    counter[key] += n
    if counter[key] <= 0:
        del counter[key]
