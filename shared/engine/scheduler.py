"""Iteration-level scheduling: which requests run in the next step, and with how many tokens.

Pure Python. One token budget per step: running requests first (a decode costs one token, an
unfinished prompt a chunk), then waiting ones by priority (lower values first), in arrival order
within one. With decodes in the step, prompt tokens may be capped (`prefill_budget_with_decodes`).
When the KV pool runs dry the least important running request (largest priority, newest among
equals) is preempted: its blocks go back and it is recomputed later, ahead of its equals; a
waiting request may preempt running ones of a strictly larger value (`preempt_for`). Requests
whose K/V is in transit are `held` until `activate` or `finish`. Drafts (`schedule(spec_lengths)`)
are granted as the budget and free blocks allow, never by preempting; `update` keeps the
accepted ones and gives back the blocks only rejected drafts used.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any, NamedTuple

from nori.engine.block_manager import BlockManager
from nori.engine.config import SchedulerConfig
from nori.engine.request import Request, RequestStatus


class ScheduledRequest(NamedTuple):
    request: Request
    # Tokens computed in this step from request.num_computed_tokens, drafts included.
    num_new_tokens: int
    # Of those, draft tokens to verify (after the request's last token): a multi-query decode.
    num_spec_tokens: int = 0

    @property
    def samples(self) -> bool:
        """Whether this step completes the request's known tokens, so a new one is sampled."""
        num_known = self.num_new_tokens - self.num_spec_tokens
        return self.request.num_computed_tokens + num_known == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    # Decodes, then verifications (decodes with drafts), then prompt chunks: the runner needs it.
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def generators(self) -> dict[str, Any]:
        """The seeded requests' samplers (torch.Generator), by request id."""
        return {
            item.request.request_id: item.request.generator
            for item in self.scheduled
            if item.request.generator is not None
        }


def _queue_behind_equals(queue: MutableSequence[Request], request: Request) -> None:
    """Queues `request` behind every request of its priority or a more urgent one: ahead of
    less urgent ones (a larger value), never ahead of its equals (FIFO within a priority)."""
    if not queue or queue[-1].priority <= request.priority:
        queue.append(request)  # every priority equal: a plain append
        return
    index = next(i for i, queued in enumerate(queue) if queued.priority > request.priority)
    queue.insert(index, request)


def _queue_ahead_of_equals(queue: MutableSequence[Request], request: Request) -> None:
    """Queues `request` in front of every request of its priority (a preempted request resumes
    before its equals), behind more urgent ones."""
    index = next((i for i, q in enumerate(queue) if q.priority >= request.priority), len(queue))
    queue.insert(index, request)


@dataclass
class Scheduler:
    config: SchedulerConfig
    block_manager: BlockManager
    # Both sorted by priority, then arrival (see `_queue_behind_equals`): the waiting queue is
    # served from its front, and the running batch's last request is the preemption victim.
    waiting: deque[Request] = field(default_factory=deque, init=False)
    running: list[Request] = field(default_factory=list, init=False)
    # Requests holding blocks outside the running batch: waiting for their K/V to arrive
    # (WAITING_FOR_KV) or to be sent (PREFILLED). `schedule` never looks at them.
    held: dict[str, Request] = field(default_factory=dict, init=False)
    # Requests whose K/V is in place, by priority then arrival, waiting for a row of the batch.
    ready: deque[Request] = field(default_factory=deque, init=False)
    # The prompt-token cap of steps with decodes (the engine adjusts it step by step on "auto").
    prefill_budget_with_decodes: int | None = field(init=False)
    # Preemptions since the scheduler was made (a request preempted twice counts twice).
    num_preemptions: int = field(default=0, init=False)
    # Prompt positions scheduled since the scheduler was made (a recompute counts again).
    num_prompt_tokens_computed: int = field(default=0, init=False)
    # Steps since one with an interactive request (priority <= 0); starts past the linger.
    steps_since_interactive: int = field(init=False)

    def __post_init__(self) -> None:
        self.prefill_budget_with_decodes = self.config.prefill_budget_with_decodes
        self.steps_since_interactive = self.config.background_cap_linger_steps + 1

    # ------------------------------------------------------------------------- requests

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        _queue_behind_equals(self.waiting, request)

    def hold(self, request: Request, status: RequestStatus) -> None:
        """Keeps a request's blocks while it is outside the running batch."""
        if request in self.running:
            self.running.remove(request)
        request.status = status
        self.held[request.request_id] = request

    def activate(self, request_id: str) -> None:
        """A held request whose K/V has arrived: it runs from the next step when the batch has a
        row for it (never past max_num_seqs), else it queues (READY) for one."""
        request = self.held.pop(request_id)
        request.status = RequestStatus.READY
        _queue_behind_equals(self.ready, request)
        self._run_ready()

    def _run_ready(self) -> None:
        while self.ready and len(self.running) < self.config.max_num_seqs:
            request = self.ready.popleft()
            request.status = RequestStatus.RUNNING
            _queue_behind_equals(self.running, request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request wherever it is and frees its blocks at once."""
        self._release(request)
        request.status = status

    def _release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.READY:
            self.ready.remove(request)
        self.held.pop(request.request_id, None)
        self.block_manager.free(request)

    def requests(self) -> Iterator[Request]:
        """Every request the scheduler knows, in no particular order."""
        yield from self.running
        yield from self.waiting
        yield from self.ready
        yield from self.held.values()

    @property
    def num_unfinished(self) -> int:
        """Requests still to run (the running batch and those queued for a row in it)."""
        return len(self.running) + len(self.waiting) + len(self.ready)

    @property
    def num_queued(self) -> int:
        """Requests waiting for a row in the running batch (new prompts and arrived K/V)."""
        return len(self.waiting) + len(self.ready)

    # ------------------------------------------------------------------------- one step

    def schedule(self, spec_lengths: Mapping[str, int] | None = None) -> SchedulerOutput:
        """`spec_lengths`: the draft tokens a decoding request would like to verify in this
        step, by request id (speculative decoding); each gets as many as fit."""
        spec_lengths = spec_lengths or {}
        # Arrived K/V first: those requests hold their blocks already and cost one token a step.
        self._run_ready()
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget(budget)
        background_budget = self._background_budget(budget)
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.awaits_last_token:
                index += 1  # it ends when its last token is resolved
                continue
            num_new = min(request.num_uncomputed_tokens, budget)
            # Drafts take what is left once every running request has one token of the budget.
            num_spec = (
                min(spec_lengths.get(request.request_id, 0), budget - len(self.running) + index)
                if spec_lengths
                else 0
            )
            if num_new == 1 and num_spec > 0 and self.block_manager.allocate(request, 1 + num_spec):
                scheduled.append(ScheduledRequest(request, 1 + num_spec, num_spec))
                budget -= 1 + num_spec
                index += 1
                continue
            if num_new > 1:
                # An unfinished prompt: its next chunk shares the prompt-token budget (and a
                # background prompt the background one too).
                num_new = min(num_new, prefill_budget)
                if request.priority > 0:
                    num_new = min(num_new, background_budget)
                if num_new == 0:
                    index += 1
                    continue
            while not self.block_manager.allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                if num_new > 1:
                    prefill_budget -= num_new
                    if request.priority > 0:
                        background_budget -= num_new
                index += 1

        # Admitting new work while others were just preempted would only thrash the pool.
        if not preempted:
            self._admit_waiting(
                min(budget, prefill_budget), background_budget, scheduled, preempted
            )

        if any(item.num_new_tokens > 1 for item in scheduled):
            scheduled.sort(key=lambda s: (s.num_new_tokens > 1, s.num_spec_tokens == 0))
        self._count(scheduled)
        return SchedulerOutput(scheduled=scheduled, preempted=preempted)

    def _count(self, scheduled: list[ScheduledRequest]) -> None:
        """Stamps when each request first runs (its queue wait ends) and counts the step's
        prompt positions (a chunk computes only part of its prompt)."""
        now = time.time()
        for item in scheduled:
            request = item.request
            if request.first_scheduled_at is None:
                request.first_scheduled_at = now
            computed = request.num_computed_tokens
            if computed < len(request.prompt_token_ids):
                prompt_end = min(request.num_prompt_tokens, request.num_tokens)
                step_end = min(prompt_end, computed + item.num_new_tokens)
                self.num_prompt_tokens_computed += max(step_end - computed, 0)

    def _background_budget(self, budget: int) -> int:
        """Background prompt tokens this step may carry: capped while interactive work is about
        (now, or within the last `background_cap_linger_steps` steps)."""
        cap = self.config.background_prefill_budget
        if cap is None:
            return budget
        if any(request.priority <= 0 for request in self.requests()):
            self.steps_since_interactive = 0
        else:
            self.steps_since_interactive += 1
        lingering = self.steps_since_interactive <= self.config.background_cap_linger_steps
        return cap if lingering else budget

    def _prefill_budget(self, budget: int) -> int:
        """Prompt tokens this step may carry: capped when it also runs interactive decodes
        (priority <= 0); beside background decodes alone, prompts take the whole budget."""
        cap = self.prefill_budget_with_decodes
        if cap is None:
            return budget
        decodes = any(
            request.num_uncomputed_tokens == 1 and request.priority <= 0 for request in self.running
        )
        return min(cap, budget) if decodes else budget

    def _admit_waiting(
        self,
        budget: int,
        background_budget: int,
        scheduled: list[ScheduledRequest],
        preempted: list[Request],
    ) -> None:
        # Once requests were preempted for a more urgent one, only requests more urgent than all
        # of them may start in this step: the others would take the freed blocks straight back.
        floor: int | None = None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if floor is not None and request.priority >= floor:
                break
            if request.priority > 0:
                # The queue is in priority order: everything from here on is background work.
                budget = min(budget, background_budget)
                if budget <= 0:
                    break
            prefix = self.block_manager.find_cached_prefix(request)
            num_computed = request.num_computed_tokens + len(prefix) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if self.running and not self._leaves_watermark(request, num_computed + num_new, prefix):
                break
            if not self.block_manager.allocate(request, num_new, prefix):
                victims = self.preempt_for(request, num_new, prefix)
                if not victims:
                    break
                # A victim may have been scheduled earlier in this step: it no longer runs in it
                # (the budget it had is simply left unused).
                scheduled[:] = [item for item in scheduled if item.request not in victims]
                preempted.extend(victims)
                floor = min(victim.priority for victim in preempted)
                allocated = self.block_manager.allocate(request, num_new, prefix)
                assert allocated, "preemption freed fewer blocks than it counted"
            self.waiting.popleft()
            self._start(request, num_new, scheduled)
            budget -= num_new
            if request.priority > 0:
                background_budget -= num_new

    def _leaves_watermark(self, request: Request, num_tokens: int, prefix: list[int]) -> bool:
        """Whether admitting still leaves the running requests blocks to grow into.

        The blocks of running requests less important than `request` count as room: when the
        pool runs dry they are the ones preempted, whoever needs the blocks.
        """
        manager = self.block_manager
        needed = manager.blocks_needed(num_tokens) - len(prefix)
        watermark = int(self.config.admission_watermark * manager.num_blocks)
        room = manager.num_free_blocks - needed
        if room >= watermark:
            return True
        outranked = self._outranked(request)
        if not outranked:
            return False
        *_, reclaimable = manager.blocks_freed_by(outranked, keep=set(prefix))
        return room + reclaimable >= watermark

    def _outranked(self, request: Request) -> list[Request]:
        """The running requests less important than `request` (a strictly larger priority
        value), in preemption order: the least important first, the newest among equals."""
        return list(takewhile(lambda r: r.priority > request.priority, reversed(self.running)))

    def preempt_for(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[int] = ()
    ) -> list[Request]:
        """Preempts running requests less important than `request` (never `request` itself)
        until the pool can give it `num_new_tokens` more tokens' blocks after `cached_prefix`:
        the fewest in preemption order, and none when all of them together would free too few.
        Returns those preempted; like any preempted request they lose nothing but time, being
        recomputed later (from the prefix cache, while their blocks stay there).
        """
        manager = self.block_manager
        missing = manager.num_missing_blocks(request, num_new_tokens, cached_prefix)
        if missing == 0:
            return []
        candidates = self._outranked(request)
        freed_after = manager.blocks_freed_by(candidates, keep=set(cached_prefix))
        for count, freed in enumerate(freed_after, start=1):
            if freed >= missing:
                victims = candidates[:count]
                for victim in victims:
                    self._preempt(victim)
                return victims
        return []

    def _start(self, request: Request, num_new: int, scheduled: list[ScheduledRequest]) -> None:
        request.status = RequestStatus.RUNNING
        _queue_behind_equals(self.running, request)
        if num_new > 0:
            scheduled.append(ScheduledRequest(request, num_new))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        _queue_ahead_of_equals(self.waiting, request)

    # ---------------------------------------------------------------------- after a step

    def update(
        self, output: SchedulerOutput, num_rejected: Mapping[str, int] | None = None
    ) -> None:
        """Advances the counters of what was computed and publishes full blocks to the cache.

        `num_rejected`: draft tokens the model rejected, by request id. Their K/V is computed but
        stale: they do not count as computed, and blocks only they used are given back. The
        accepted drafts must already be in `request.token_ids` (the cache hashes those tokens).
        """
        num_rejected = num_rejected or {}
        for item in output.scheduled:
            request = item.request
            rejected = num_rejected.get(request.request_id, 0)
            assert 0 <= rejected <= item.num_spec_tokens, "more drafts rejected than verified"
            request.num_computed_tokens += item.num_new_tokens - rejected
            if item.num_spec_tokens:
                # Room for the tokens known now and the one sampled from this step.
                self.block_manager.trim(request, request.num_tokens + 1)
            self.block_manager.cache_full_blocks(request)
