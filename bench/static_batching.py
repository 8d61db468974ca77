"""Static batching, the baseline `nori bench offline --compare-static` measures continuous
batching against: a `Scheduler` batching as a dense [batch, max_len] tensor does (Hugging Face
`generate`, FasterTransformer).

- A batch forms only when the previous one has completely finished (it waits for its longest
  member), from the waiting requests in order, while max_num_seqs and the free blocks allow.
- Every member reserves its rectangle up front: the blocks of the batch's longest prompt plus
  its largest max_tokens (a row cannot grow later).
- Prompts are as long as the longest: a shorter prompt's left padding is computed beside it, by
  a pad row of its own that holds its blocks to the end. Unlike a dense batch's, its decode
  steps do not read the pads (which it would mask): a shade cheaper than the real thing.
- A member that finishes early keeps its row, computing a pad token a step, until the batch
  ends.

Pad rows are requests only this scheduler knows. They never sample, so the engine never sees
them, and the outputs are token for token those of continuous batching. The run's EngineConfig
turns the prefix cache off (a dense padded batch has none); no speculative decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from nori.engine.request import Request, RequestStatus
from nori.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

# The token pad rows compute. Any id serves: no real token attends to it.
PAD_TOKEN_ID = 0


@dataclass
class StaticBatchScheduler(Scheduler):
    # Every pad row in the running batch, by id: members' left padding ("<member id>/pad") and
    # the rows of finished members ("<member id>/row").
    pad_rows: dict[str, Request] = field(default_factory=dict, init=False)
    # The ids of the left-padding rows.
    left_pads: set[str] = field(default_factory=set, init=False)

    def schedule(self, spec_lengths: Mapping[str, int] | None = None) -> SchedulerOutput:
        if spec_lengths:
            raise ValueError("static batching verifies no draft tokens")
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new(request, budget)
            if num_new == 0:
                index += 1
            elif self.block_manager.allocate(request, num_new):
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1
            elif request.request_id in self.pad_rows:
                self._drop(request)  # a finished row that outgrew its reservation
            else:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
        if not preempted and not self._members():
            self._start_batch(budget, scheduled)
        scheduled.sort(key=lambda item: item.num_new_tokens > 1)
        self._count(scheduled)
        return SchedulerOutput(scheduled=scheduled, preempted=preempted)

    def _num_new(self, request: Request, budget: int) -> int:
        """A member's next tokens; a left pad's up to its last (which it never computes, so it
        never samples); a finished row's next pad token, one a step."""
        if request.request_id not in self.pad_rows:
            if request.awaits_last_token:
                return 0  # it ends when its last token is resolved
            return min(request.num_uncomputed_tokens, budget)
        if request.request_id in self.left_pads:
            return min(request.num_uncomputed_tokens - 1, budget)
        if request.num_uncomputed_tokens < 2:
            request.append_token(PAD_TOKEN_ID)
        return 1

    def _members(self) -> list[Request]:
        return [request for request in self.running if request.request_id not in self.pad_rows]

    def _start_batch(self, budget: int, scheduled: list[ScheduledRequest]) -> None:
        manager = self.block_manager
        pool_tokens = manager.num_blocks * manager.block_size
        batch: list[Request] = []
        longest_prompt = longest_new = padded = 0
        for request in self.waiting:
            if len(batch) == self.config.max_num_seqs:
                break
            prompt = max(longest_prompt, request.num_tokens)
            new = max(longest_new, request.max_new_tokens)
            length = min(prompt + new, pool_tokens)
            if batch and (len(batch) + 1) * manager.blocks_needed(length) > manager.num_free_blocks:
                break
            batch.append(request)
            longest_prompt, longest_new, padded = prompt, new, length
        for request in batch:
            num_pads = longest_prompt - request.num_tokens
            # A recomputed member may already hold more tokens than the capped rectangle.
            if not manager.allocate(request, max(padded - num_pads, request.num_tokens)):
                break
            pad = None
            if num_pads:
                # Its pads and one more that it never computes, so that it never samples.
                pad = self._row(request, "pad", [PAD_TOKEN_ID] * (num_pads + 1))
                if not manager.allocate(pad, num_pads):
                    manager.free(request)
                    break
            self.waiting.popleft()
            if pad is not None:
                self.pad_rows[pad.request_id] = pad
                self.left_pads.add(pad.request_id)
                self._start(pad, min(num_pads, budget), scheduled)
                budget -= min(num_pads, budget)
            self._start(request, min(request.num_tokens, budget), scheduled)
            budget -= min(request.num_tokens, budget)

    @staticmethod
    def _row(member: Request, kind: str, prompt: list[int]) -> Request:
        return Request(
            f"{member.request_id}/{kind}",
            prompt,
            member.sampling_params,
            arrival_index=member.arrival_index,
            priority=member.priority,
        )

    # ------------------------------------------------------------------------- rows

    def finish(self, request: Request, status: RequestStatus) -> None:
        """An early stop keeps the member's row (its blocks, now a pad row's); an abort frees
        its row and its left padding at once. The batch ends with its last member."""
        computed = request.num_computed_tokens
        if status is RequestStatus.FINISHED_ABORTED:
            self._drop(self.pad_rows.get(f"{request.request_id}/pad"))
        elif request in self.running and computed:
            # Its computed tokens as the prompt: what the row computes from here is output.
            row = self._row(request, "row", request.token_ids[:computed])
            row.token_ids.extend(request.token_ids[computed:])
            row.num_computed_tokens = computed
            row.block_ids, request.block_ids = request.block_ids, []
            row.status = RequestStatus.RUNNING
            self.running[self.running.index(request)] = row
            self.pad_rows[row.request_id] = row
        super().finish(request, status)
        self._end_batch_if_done()

    def _preempt(self, request: Request) -> None:
        if request.request_id in self.pad_rows:
            self._drop(request)
            return
        super()._preempt(request)
        self._drop(self.pad_rows.get(f"{request.request_id}/pad"))
        self._end_batch_if_done()

    def _drop(self, row: Request | None) -> None:
        if row is not None:
            del self.pad_rows[row.request_id]
            self.left_pads.discard(row.request_id)
            self._release(row)

    def _end_batch_if_done(self) -> None:
        if not self._members():
            for row in list(self.pad_rows.values()):
                self._drop(row)
