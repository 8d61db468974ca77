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

A request a full queue refuses is answered 429 at once, unless it is background work (a batch
line), which waits for room (`GroupWait`); so does a batch member that finds every decode worker
full (`request_flow.py`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from nori.gateway.errors import QueueFullError

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


# ---------------------------------------------------------------------- waiting for room

FIRST_DELAY_S = 0.05
MAX_DELAY_S = 1.0


class GroupWait:
    """The wait of a batch member or a batch line that found every worker full
    (`ClusterOptions.group_wait_s`): backoff, 50 ms doubling up to 1 s, until `limit_s` after
    the first turn.

    A single request that finds every worker full gets 429 at once (limit 0): its client is
    the one to retry. A batch was admitted as a whole, and its own running members free the
    room the rest need, so they wait for it instead of failing the batch.
    """

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._limit_s = limit_s
        self._clock = clock
        self._deadline: float | None = None
        self._delay_s = FIRST_DELAY_S

    async def turn(self, woken: asyncio.Future[None] | None = None) -> bool:
        """Waits before the next try, or until `woken` is done (room freed), whichever comes
        first; False (without waiting) once the time is up. `woken` is cancelled either way."""
        try:
            if self._limit_s <= 0:
                return False
            now = self._clock()
            if self._deadline is None:
                self._deadline = now + self._limit_s
            if now >= self._deadline:
                return False
            delay_s = min(self._delay_s, self._deadline - now)
            if woken is None:
                await asyncio.sleep(delay_s)
            else:
                await asyncio.wait([woken], timeout=delay_s)
            self._delay_s = min(self._delay_s * 2, MAX_DELAY_S)
            return True
        finally:
            if woken is not None:
                woken.cancel()
