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

import math
from collections import deque
from dataclasses import dataclass, field

from nori.gateway.backend import QueueFullError

# Prefills completed this recently set the drain rate behind Retry-After.
DRAIN_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60.0


@dataclass
class PromptQueue:
    # 0: no bound (every request is admitted).
    max_tokens_per_worker: int = 8192
    queued_tokens: int = 0
    # (time, prompt tokens) of recent prefills: the drain rate.
    _drained: deque[tuple[float, int]] = field(default_factory=deque)
    # Admission groups with members admitted and still waiting: how many.
    _groups: dict[str, int] = field(default_factory=dict)

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
        self, num_tokens: int, num_workers: int, now: float, group: str | None = None
    ) -> QueuedPrompt:
        """Counts the prompt in, or raises QueueFullError (429 with Retry-After). A prompt of a
        `group` that already has members waiting is admitted with them."""
        bound = self.bound(num_workers)
        joins_group = group is not None and self._groups.get(group, 0) > 0
        if (
            not joins_group
            and bound is not None
            and self.queued_tokens > 0
            and self.queued_tokens + num_tokens > bound
        ):
            excess = self.queued_tokens + num_tokens - bound
            raise QueueFullError(
                f"the prefill queue is full: {self.queued_tokens} prompt tokens are waiting "
                f"(limit {bound} for {num_workers} worker(s)) and this prompt has {num_tokens}; "
                "retry after the time in Retry-After",
                retry_after_s=self.retry_after_s(excess, now),
            )
        self.queued_tokens += num_tokens
        if group is not None:
            self._groups[group] = self._groups.get(group, 0) + 1
        return QueuedPrompt(self, num_tokens, group)

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

    def _leave(self, num_tokens: int, now: float | None, group: str | None) -> None:
        self.queued_tokens -= num_tokens
        if group is not None:
            self._groups[group] -= 1
            if not self._groups[group]:
                del self._groups[group]
        if now is not None:
            self._drained.append((now, num_tokens))


class QueuedPrompt:
    """One admitted prompt's place in the count; leaves it exactly once."""

    def __init__(self, queue: PromptQueue, num_tokens: int, group: str | None = None) -> None:
        self._queue = queue
        self.num_tokens = num_tokens
        self._group = group
        self._left = False

    def prefilled(self, now: float) -> None:
        """Its first token came back: the prompt no longer waits (and counts for the drain rate)."""
        if not self._left:
            self._left = True
            self._queue._leave(self.num_tokens, now, self._group)

    def abandon(self) -> None:
        """Failed or cancelled before its first token."""
        if not self._left:
            self._left = True
            self._queue._leave(self.num_tokens, None, self._group)
