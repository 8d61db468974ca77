"""Iteration-level scheduling: which requests run in the next step, and with how many tokens.

Pure Python. Each step has a token budget shared by every scheduled request: running requests
come first (a decode costs one token, an unfinished chunked prefill up to the rest of the budget),
then waiting requests in arrival order. When the KV pool runs dry, the newest running request is
preempted: it gives back its blocks and returns to the front of the waiting queue, to be recomputed
(cheaply, when its prefix is still cached).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from nori.engine.block_manager import BlockManager
from nori.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # "static" admits a new batch only when the previous one has fully finished, reserving each
    # request's whole length up front: the baseline that continuous batching is measured against.
    policy: str = "continuous"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {self.policy!r}")


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    # Tokens computed in this step, starting at request.num_computed_tokens.
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step completes the request's known tokens, so a new one is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    # Single-token steps (decodes) first, then multi-token ones: the model runner relies on it.
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class Scheduler:
    config: SchedulerConfig
    block_manager: BlockManager
    # A static-policy request reserves blocks for prompt + this many tokens up front.
    static_reserve_tokens: dict[str, int] = field(default_factory=dict)

    waiting: deque[Request] = field(default_factory=deque, init=False)
    running: list[Request] = field(default_factory=list, init=False)
    # Requests whose blocks are reserved or held outside the running batch (RESERVED, PREFILLED).
    held: dict[str, Request] = field(default_factory=dict, init=False)

    # ------------------------------------------------------------------------- requests

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def hold(self, request: Request, status: RequestStatus) -> None:
        """Keeps a request's blocks while it is outside the running batch."""
        if request in self.running:
            self.running.remove(request)
        request.status = status
        self.held[request.request_id] = request

    def activate(self, request_id: str) -> Request:
        """Moves a held request (e.g. whose K/V has arrived) into the running batch."""
        request = self.held.pop(request_id)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request wherever it is and frees its blocks at once."""
        if request in self.running:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.held.pop(request.request_id, None)
        self.block_manager.free(request)
        self.static_reserve_tokens.pop(request.request_id, None)
        request.status = status

    def requests(self) -> Iterator[Request]:
        """Every request the scheduler knows, in no particular order."""
        yield from self.running
        yield from self.waiting
        yield from self.held.values()

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    # ------------------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1

        # Admitting new work while others were just preempted would only thrash the pool.
        if not preempted and self._may_admit():
            budget = self._admit_waiting(budget, scheduled)

        scheduled.sort(key=lambda s: s.num_new_tokens > 1)
        return SchedulerOutput(scheduled=scheduled, preempted=preempted)

    def _may_admit(self) -> bool:
        return self.config.policy == "continuous" or not self.running

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        static = self.config.policy == "static"
        # A static batch is formed all at once; its members start computing as budget allows.
        while (
            self.waiting and (budget > 0 or static) and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            prefix = self.block_manager.find_cached_prefix(request)
            num_computed = request.num_computed_tokens + len(prefix) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if static:
                if not self._reserve_whole_request(request, prefix, num_new):
                    break
            elif not self.block_manager.allocate(request, num_new, prefix):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if num_new > 0:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
        return budget

    def _reserve_whole_request(self, request: Request, prefix: list[int], num_new: int) -> bool:
        # Static batching cannot grow a request's memory later, so it claims all of it now.
        reserve = self.static_reserve_tokens.get(request.request_id, request.num_tokens)
        extra = reserve - request.num_computed_tokens - len(prefix) * self.block_manager.block_size
        return self.block_manager.allocate(request, max(extra, num_new), prefix)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    # ---------------------------------------------------------------------- after a step

    def update(self, output: SchedulerOutput) -> None:
        """Advances the counters of what was computed and publishes full blocks to the cache."""
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.request)
