"""Admission: refuse a request up front (429) rather than let it queue longer than it is worth.

Time to first token is mostly the wait behind the prompt tokens queued ahead, so the gateway
counts prompt tokens it has admitted and not yet seen prefilled (their first token has not come
back), over the whole pool of workers that compute prompts: prefill workers, and colocated ones,
which compute their prompts themselves. A request is refused when the queue is not empty and the
request would take it past

    max_queued_prompt_tokens x (live workers that compute prompts)

so the bound grows with the pool. A request arriving at an empty queue is always admitted however
long it is, else a prompt longer than the bound could never be served. The prompts of one HTTP
request (a batch, or n choices) are one request here: once its first is admitted, the rest are
too, else a batch larger than the bound would be refused forever, even by an idle cluster.

The default of 8192 tokens per worker is four engine steps at the default step budget
(`--max-num-batched-tokens` 2048): every admitted prompt has started within about four steps, so
time to first token stays near five step times whatever the hardware, while the prefill batch is
still always full. That is under a second for an 8B model on one GPU; for the demo model on two
shared CPU cores (1.5-4k prefill tokens/s measured) a burst's slowest admitted answer came in
4.6 s. To aim at a TTFT target instead, set it to target x prefill tokens per second.

Retry-After is how long the pool needs to drain the excess at the rate it drained prompts in the
last few seconds (1 s when it has not drained anything yet), clamped to [1, 60] s.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, deque
from dataclasses import dataclass, field

from nori.gateway.backend import QueueFullError

# Prefills completed this recently set the drain rate behind Retry-After.
DRAIN_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60.0
# Entries of `PromptQueue._room_waiters` past which ended waits are dropped.
ROOM_WAITERS_PRUNE_AT = 1024


@dataclass
class PromptQueue:
    # 0: no bound (every request is admitted).
    max_tokens_per_worker: int = 8192
    queued_tokens: int = 0
    # Of those, the tokens of background (batch) prompts.
    background_tokens: int = 0
    # (time, prompt tokens) of recent prefills: the drain rate.
    _drained: deque[tuple[float, int]] = field(default_factory=deque)
    # Admission groups with members admitted and still waiting: how many.
    _groups: dict[str, int] = field(default_factory=dict)
    # Prompts waiting for room (batch lines, see `room_freed`), oldest first: (tokens, future).
    _room_waiters: deque[tuple[int, asyncio.Future[None]]] = field(default_factory=deque)
    _room_waiters_prune_at: int = ROOM_WAITERS_PRUNE_AT

    def __post_init__(self) -> None:
        if self.max_tokens_per_worker < 0:
            raise ValueError(
                f"max_queued_prompt_tokens must be >= 0, got {self.max_tokens_per_worker}"
            )

    def bound(self, num_workers: int) -> int | None:
        if self.max_tokens_per_worker == 0 or num_workers <= 0:
            return None  # no bound, or no worker: routing answers 503 then
        return self.max_tokens_per_worker * num_workers

    def admit(
        self,
        num_tokens: int,
        num_workers: int,
        now: float,
        group: str | None = None,
        background: bool = False,
    ) -> QueuedPrompt:
        """Counts the prompt in, or raises QueueFullError (429 with Retry-After). A prompt of a
        `group` that already has members waiting is admitted with them.

        Priorities: an interactive prompt is measured against the interactive prompts ahead of
        it only (the workers compute it before any batch prompt, see the engine's scheduler),
        so a queue full of batch work never refuses it; a `background` one (a batch line)
        against everything queued, so batch work fills the room interactive work leaves."""
        bound = self.bound(num_workers)
        joins_group = group is not None and self._groups.get(group, 0) > 0
        ahead = self.queued_tokens if background else self.queued_tokens - self.background_tokens
        if not joins_group and bound is not None and ahead > 0 and ahead + num_tokens > bound:
            excess = ahead + num_tokens - bound
            raise QueueFullError(
                f"the prefill queue is full: {ahead} prompt tokens are waiting "
                f"(limit {bound} for {num_workers} worker(s)) and this prompt has {num_tokens}; "
                "retry after the time in Retry-After",
                retry_after_s=self.retry_after_s(excess, now),
            )
        self.queued_tokens += num_tokens
        if background:
            self.background_tokens += num_tokens
        if group is not None:
            self._groups[group] = self._groups.get(group, 0) + 1
        return QueuedPrompt(self, num_tokens, group, background)

    def drain_rate(self, now: float) -> float | None:
        """Prompt tokens prefilled per second lately; None when none were."""
        while self._drained and now - self._drained[0][0] > DRAIN_WINDOW_S:
            self._drained.popleft()
        if not self._drained:
            return None
        tokens = sum(count for _, count in self._drained)
        return tokens / max(now - self._drained[0][0], 1.0)

    def retry_after_s(self, excess_tokens: int, now: float) -> float:
        rate = self.drain_rate(now)
        if rate is None:
            return 1.0
        return min(MAX_RETRY_AFTER_S, max(1.0, math.ceil(excess_tokens / rate)))

    def room_freed(self, num_tokens: int) -> asyncio.Future[None]:
        """A future done when room frees for a prompt of `num_tokens` that was just refused:
        a waiting batch line tries again the moment the queue drains, not at its next poll
        (a poll every second left the prefill workers idle between waves). Waiters are woken
        oldest first, as many as the freed tokens cover; the caller cancels the future when it
        stops waiting."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if len(self._room_waiters) >= self._room_waiters_prune_at:
            # Waits that ended (timed out, cancelled) leave their entries: drop them, so the
            # deque holds about the waiting prompts, however long they wait (amortized: the
            # next pruning waits for twice the entries that stayed).
            self._room_waiters = deque((n, f) for n, f in self._room_waiters if not f.done())
            self._room_waiters_prune_at = max(ROOM_WAITERS_PRUNE_AT, 2 * len(self._room_waiters))
        self._room_waiters.append((num_tokens, future))
        return future

    def _count(self, num_tokens: int, background: bool) -> None:
        self.queued_tokens += num_tokens
        if background:
            self.background_tokens += num_tokens
        freed = -num_tokens
        while freed > 0 and self._room_waiters:
            waiting_tokens, future = self._room_waiters.popleft()
            if not future.done():
                future.set_result(None)
                freed -= waiting_tokens

    def _leave(
        self,
        num_tokens: int,
        now: float | None,
        group: str | None,
        counted: bool = True,
        background: bool = False,
    ) -> None:
        if counted:
            self._count(-num_tokens, background)
        if group is not None:
            self._groups[group] -= 1
            if not self._groups[group]:
                del self._groups[group]
        if now is not None:
            self._drained.append((now, num_tokens))


class QueuedPrompt:
    """One admitted prompt's place in the count; leaves it exactly once."""

    def __init__(
        self,
        queue: PromptQueue,
        num_tokens: int,
        group: str | None = None,
        background: bool = False,
    ) -> None:
        self._queue = queue
        self.num_tokens = num_tokens
        self._group = group
        self._background = background
        self._left = False
        self._paused = False

    def pause(self) -> None:
        """Out of the token count while it waits for a decode share (it is not queued on any
        worker then), still a member of its group."""
        if not self._left and not self._paused:
            self._paused = True
            self._queue._count(-self.num_tokens, self._background)

    def resume(self) -> None:
        if not self._left and self._paused:
            self._paused = False
            self._queue._count(self.num_tokens, self._background)

    def prefilled(self, now: float) -> None:
        """Its first token came back: the prompt no longer waits (and counts for the drain rate)."""
        if not self._left:
            self._left = True
            self._queue._leave(
                self.num_tokens, now, self._group, not self._paused, self._background
            )

    def abandon(self) -> None:
        """Failed or cancelled before its first token."""
        if not self._left:
            self._left = True
            self._queue._leave(
                self.num_tokens, None, self._group, not self._paused, self._background
            )


# ---------------------------------------------------------------------- fair shares of the decode pool


@dataclass(frozen=True)
class PoolCapacity:
    """What the decode (or colocated) workers hold at once, summed over the pool, as each
    reports it in GetStats: running batch rows (`--max-num-seqs`) and calls served at once
    (the batch plus its bounded queue, past which a worker answers RESOURCE_EXHAUSTED)."""

    rows: int
    calls: int


class ShareRefusedError(QueueFullError):
    """No decode share for the request now: the pool is full, or its owner holds its share."""


class DecodeShares:
    """Who holds the decode pool's calls, so that one request or one client cannot take it all.

    Every member (one prompt's one choice) holds a share from its routing to its end. Owners
    are its request (`group`: the HTTP request) and its `client` (the API key, else the client
    address). A member may start when

    - the pool has a call free (`calls`: more never go out, so a batch of thousands never
      floods a worker's gRPC server, see `cluster.py`), and
    - each of its owners holds fewer than its limit: the pool's running batch (`rows`) when it
      is the only owner active (work-conserving: a lone request fills every row, and the calls
      beyond the rows, the workers' queues, stay free for a newcomer, whose first token then
      comes at once), or `max_share` of the rows while another owner holds or waits.

    Members that may not start wait here, not on a worker, and a freed call goes to the waiter
    whose client, then request, holds the least (first come on ties): a single request of
    another user goes before the next member of a big batch. With no capacity known (no
    worker has said), nothing is limited.
    """

    def __init__(self, max_share: float = 0.5) -> None:
        if not 0 < max_share <= 1:
            raise ValueError(f"--max-decode-share must be in (0, 1], got {max_share}")
        self.max_share = max_share
        self.capacity: PoolCapacity | None = None
        self.num_held = 0
        # Of those, members of background (batch) work.
        self.num_background_held = 0
        # Members held per owner key, and members held or waiting per owner key ("active").
        self._held: Counter[str] = Counter()
        self._active: Counter[str] = Counter()
        self._num_active_groups = 0
        self._num_active_clients = 0
        # Waiters in arrival order, one line per (request, client): a freed call looks at the
        # first of each line only, so a batch of thousands waiting costs one look, not one each.
        self._waiters: dict[tuple[str, str], deque[_ShareWaiter]] = {}
        self._arrivals = 0

    def set_capacity(self, capacity: PoolCapacity | None) -> None:
        self.capacity = capacity
        self._grant_waiters()

    def limit(self, key: str, num_active_owners: int) -> int:
        """The most members owner `key` may hold now."""
        assert self.capacity is not None
        others_active = num_active_owners > 1 or (num_active_owners == 1 and not self._active[key])
        if not others_active:
            return max(1, self.capacity.rows)
        return max(1, math.floor(self.max_share * self.capacity.rows))

    def may_start(self, group: str, client: str, priority: int = 0) -> bool:
        """Background members (a priority above 0: batch lines) may fill the running rows but
        never the calls beyond them, the workers' queues. An interactive member is measured
        against the interactive members held only, as the workers measure its call (see
        `EngineServicer._open`) and the engine schedules it, ahead of every batch line: a
        batch cannot make an interactive request's share a 429."""
        if self.capacity is None:
            return True
        g, c = _group_key(group), _client_key(client)
        num_held, calls = self._calls_for(priority)
        return (
            num_held < calls
            and self._held[g] < self.limit(g, self._num_active_groups)
            and self._held[c] < self.limit(c, self._num_active_clients)
        )

    def try_take(self, group: str, client: str, priority: int = 0) -> DecodeShare | None:
        """A share at once, or None (the caller waits or refuses)."""
        if not self.may_start(group, client, priority):
            return None
        self._enter(group, client)
        return self._grant(group, client, priority)

    async def take(self, group: str, client: str, wait_s: float, priority: int = 0) -> DecodeShare:
        """A share, waiting at most `wait_s` for it; ShareRefusedError (429) past that. Freed
        shares go to waiters of the lowest `priority` value first (interactive before batch)."""
        share = self.try_take(group, client, priority)
        if share is not None:
            return share
        if wait_s <= 0:
            raise self._refusal(group, client, priority)
        self._enter(group, client)
        self._arrivals += 1
        waiter = _ShareWaiter(
            group, client, self._arrivals, asyncio.get_running_loop().create_future(), priority
        )
        self._waiters.setdefault((group, client), deque()).append(waiter)
        try:
            async with asyncio.timeout(wait_s):
                return await waiter.future
        except BaseException as error:
            if waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().release()  # granted just as the wait ended
            else:
                self._drop_waiter(waiter)
                self._leave_active(group, client)
            if isinstance(error, TimeoutError):
                raise self._refusal(group, client, priority) from None
            raise

    def _calls_for(self, priority: int) -> tuple[int, int]:
        """(members counted, their limit) for a member of `priority`: an interactive one counts
        the interactive members against every call; a background one counts all members
        against the calls up to the running rows."""
        assert self.capacity is not None
        if priority <= 0:
            return self.num_held - self.num_background_held, self.capacity.calls
        return self.num_held, min(self.capacity.calls, self.capacity.rows)

    def _refusal(self, group: str, client: str, priority: int) -> ShareRefusedError:
        assert self.capacity is not None
        g, c = _group_key(group), _client_key(client)
        at_rows = max(1, self.capacity.rows)
        num_held, calls = self._calls_for(priority)
        if num_held >= calls and priority <= 0:
            message = (
                f"the decode pool is full: {num_held} interactive requests hold its {calls} calls"
            )
        elif num_held >= calls:
            message = (
                f"the decode pool is full for background work: {num_held} requests hold "
                f"its {calls} running slots"
            )
        elif self._held[g] >= at_rows or self._held[c] >= at_rows:
            # Alone, an owner may fill every running slot, and it has: the pool is full for it.
            message = (
                f"the decode pool is full: this client's requests hold all of its "
                f"{self.capacity.rows} running slots"
            )
        else:
            message = (
                "this client or request holds its share of the decode pool "
                f"({self.max_share:g} of its {self.capacity.rows} running slots) while others wait"
            )
        return ShareRefusedError(
            message + "; retry after the time in Retry-After", retry_after_s=1.0
        )

    def _enter(self, group: str, client: str) -> None:
        g, c = _group_key(group), _client_key(client)
        if not self._active[g]:
            self._num_active_groups += 1
        if not self._active[c]:
            self._num_active_clients += 1
        self._active[g] += 1
        self._active[c] += 1

    def _leave_active(self, group: str, client: str) -> None:
        for key in (_group_key(group), _client_key(client)):
            self._active[key] -= 1
            if self._active[key] <= 0:
                del self._active[key]
                if key.startswith("g:"):
                    self._num_active_groups -= 1
                else:
                    self._num_active_clients -= 1

    def _grant(self, group: str, client: str, priority: int) -> DecodeShare:
        self.num_held += 1
        if priority > 0:
            self.num_background_held += 1
        self._held[_group_key(group)] += 1
        self._held[_client_key(client)] += 1
        return DecodeShare(self, group, client, priority)

    def _release(self, group: str, client: str, priority: int) -> None:
        self.num_held -= 1
        if priority > 0:
            self.num_background_held -= 1
        for key in (_group_key(group), _client_key(client)):
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]
        self._leave_active(group, client)
        self._grant_waiters()

    def _drop_waiter(self, waiter: _ShareWaiter) -> None:
        line = self._waiters.get((waiter.group, waiter.client))
        if line is not None and waiter in line:
            line.remove(waiter)
            if not line:
                del self._waiters[(waiter.group, waiter.client)]

    def _grant_waiters(self) -> None:
        """Freed calls to the waiters of the most urgent priority, then whose client, then
        request, holds the least (first come on ties), while any may start."""
        while self._waiters:
            # A waiter whose task was cancelled leaves its line when that task next runs; until
            # then its future is done (cancelled) and it must not be granted anything.
            for line in list(self._waiters.values()):
                while line and line[0].future.done():
                    self._drop_waiter(line[0])
            heads = [
                line[0]
                for line in self._waiters.values()
                if self.may_start(line[0].group, line[0].client, line[0].priority)
            ]
            if not heads:
                return
            chosen = min(
                heads,
                key=lambda w: (
                    w.priority,
                    self._held[_client_key(w.client)],
                    self._held[_group_key(w.group)],
                    w.arrival,
                ),
            )
            self._drop_waiter(chosen)
            chosen.future.set_result(self._grant(chosen.group, chosen.client, chosen.priority))

    @property
    def num_waiting(self) -> int:
        return sum(len(line) for line in self._waiters.values())


def _group_key(group: str) -> str:
    return f"g:{group}"


def _client_key(client: str) -> str:
    return f"c:{client}"


@dataclass
class _ShareWaiter:
    group: str
    client: str
    arrival: int
    future: asyncio.Future[DecodeShare]
    priority: int = 0


class DecodeShare:
    """One member's hold on the decode pool; released exactly once (which may start a waiter)."""

    def __init__(self, shares: DecodeShares, group: str, client: str, priority: int = 0) -> None:
        self._shares = shares
        self.group = group
        self.client = client
        self.priority = priority
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._shares._release(self.group, self.client, self.priority)
