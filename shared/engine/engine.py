"""The engine loop: admit requests, step the batch, turn sampled tokens into outputs.

One step is schedule -> run the model -> postprocess. Everything about memory and batching is
the scheduler's; everything about tensors is the model runner's; this file owns the per-request
text state (detokenizer, stop conditions) and the operations the services need (prefill-only
export, import into another engine).

The surface, all of it (nobody outside reaches the scheduler, block manager or runner):

- requests: `add_request`, `step`, `abort_request`, `abort_all`, `has_unfinished_requests`;
- the hand-off: `export_request` + `release_request` (prefill side); `reserve_prompt` +
  `complete_transfer` (decode side, the KV written in between into `kv_cache_tensors`);
  `import_request` (both engines in one process);
- what a worker reports: `load()`, `running_request_ids()`, and the prefix-cache events
  (`record_block_events`, `drain_block_events`, `cached_block_hashes`);
- `check_invariants()` for tests; `close()` (the follower ranks of a tensor-parallel engine).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence

import torch

from nori.engine.block_manager import BlockEvent, BlockManager
from nori.engine.config import EngineConfig
from nori.engine.kv_export import KVExport, TransferState, generator_state
from nori.engine.model_runner import ModelRunner, SampledToken
from nori.engine.outputs import EngineLoad, StepOutput
from nori.engine.prompt_checks import validate_prompt
from nori.engine.request import Request, RequestStatus
from nori.engine.request_text import add_known_tokens, check_stop, make_output, resume_text
from nori.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from nori.engine.step_cost import StepCostModel
from nori.models.demo import resolve_model
from nori.sampling.detokenizer import IncrementalDetokenizer
from nori.sampling.params import SamplingParams
from nori.sampling.tokenizer import Tokenizer

# The "auto" prompt cap before any step has been timed.
AUTO_PREFILL_BUDGET_START = 256


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        """`runner` lets engines share loaded weights (benchmarks comparing policies)."""
        self.config = config
        model_dir = resolve_model(config.model)
        self.tokenizer = Tokenizer.from_dir(
            model_dir if config.tokenizer is None else resolve_model(config.tokenizer)
        )
        self._runner = runner or ModelRunner(config, model_dir, self.tokenizer.eos_token_ids)
        self.model_config = self._runner.model_config
        self.max_model_len = self._runner.max_model_len
        # Static batching (a benchmark baseline) has no prefix cache: a dense padded batch has
        # none, and its identical pad blocks would otherwise be served from the cache.
        self._block_manager = BlockManager(
            self._runner.kv_cache.num_blocks,
            config.block_size,
            config.enable_prefix_caching and config.scheduling_policy == "continuous",
        )
        budget = config.prefill_budget_with_decodes
        # "auto": the cap follows what steps cost (step_cost.py), updated before every step.
        self._step_costs = StepCostModel() if budget == "auto" else None
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            prefill_budget_with_decodes=AUTO_PREFILL_BUDGET_START if budget == "auto" else budget,  # type: ignore[arg-type]
            background_prefill_budget=config.background_prefill_budget,
        )
        self._scheduler = Scheduler(scheduler_config, self._block_manager)
        # The requests this engine knows, from add (or reserve) until they finish or leave.
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()

    # ------------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        prefill_only: bool = False,
        output_token_ids: Sequence[int] = (),
        num_emitted_chars: int = 0,
        priority: int = 0,
    ) -> None:
        """Queues a request. Raises ValueError for input the engine can never serve.

        `output_token_ids`: a request resumed here after the worker decoding it died (migration):
        the tokens it had sampled, already streamed with `num_emitted_chars` of their text. They
        are computed with the prompt and count as output (max_tokens, penalties, stop checks);
        sampling goes on after the last.

        `priority`: vLLM's; lower values are served first, in arrival order among equals, and a
        request may preempt running ones of a larger value when the KV pool has no room for it.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(prompt_ids)
        request = Request(
            request_id,
            prompt_ids,
            params,
            arrival_index=next(self._arrivals),
            prefill_only=prefill_only,
            max_new_tokens=min(params.max_tokens, self.max_model_len - len(prompt_ids)),
            priority=priority,
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first token has none; the rest as computed
        for token_id in output_token_ids:
            request.append_token(token_id)
        self._track(request)
        if output_token_ids:
            resume_text(request, list(output_token_ids), num_emitted_chars)
        self._scheduler.add(request)

    def abort_request(self, request_id: str) -> None:
        """Ends a request wherever it is; its blocks are free when this returns."""
        request = self._requests.pop(request_id, None)
        if request is not None and not request.status.is_finished:
            self._scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self._scheduler.num_unfinished > 0

    @property
    def num_free_blocks(self) -> int:
        return self._block_manager.num_free_blocks

    # ------------------------------------------------------------------------ one step

    def step(self) -> list[StepOutput]:
        if self._step_costs is not None:
            self._scheduler.prefill_budget_with_decodes = self._step_costs.prompt_budget(
                # The running requests are (about) the decode rows of the coming step.
                num_decodes=len(self._scheduler.running),
                ratio=1.0,
                low=self.config.block_size,
                high=self.config.max_num_batched_tokens,
                default=AUTO_PREFILL_BUDGET_START,
            )
        output = self._scheduler.schedule()
        if output.is_empty:
            return []
        now = time.time()
        for item in output.scheduled:
            if item.request.first_scheduled_at is None:
                item.request.first_scheduled_at = now  # its queue wait ends (metrics, traces)
        started = time.perf_counter()
        sampled, prompt_logprobs = self._runner.execute(output, self._generators(output))
        if self._step_costs is not None:
            num_decodes = sum(1 for item in output.scheduled if item.num_new_tokens == 1)
            self._step_costs.observe(
                num_decodes, output.num_batched_tokens - num_decodes, time.perf_counter() - started
            )
        self._scheduler.update(output)
        for request, entries in prompt_logprobs:
            assert request.prompt_logprobs is not None
            request.prompt_logprobs.extend(entries)
        outputs = []
        for token in sampled:
            if token.request.status.is_finished:
                # A static batch's padding row: computed like the others, reported to nobody.
                token.request.append_token(token.token_id)
            else:
                outputs.append(self._postprocess(token))
        return outputs

    def _generators(self, output: SchedulerOutput) -> dict[str, torch.Generator]:
        generators = {}
        for item in output.scheduled:
            request = self._requests.get(item.request.request_id)
            # A finished static padding row is no longer tracked: it samples for nobody.
            if request is not None and request.generator is not None:
                generators[request.request_id] = request.generator
        return generators

    def _postprocess(self, sample: SampledToken) -> StepOutput:
        request = sample.request
        request.append_token(sample.token_id)
        if sample.logprobs is not None:
            request.logprobs = request.logprobs or []
            request.logprobs.append(sample.logprobs)
        finish = check_stop(
            request, sample.token_id, self.tokenizer.eos_token_ids, self.max_model_len
        )
        if finish is not None:
            self._scheduler.finish(request, finish)
        elif request.prefill_only:
            self._scheduler.hold(request, RequestStatus.PREFILLED)
        output = make_output(request)
        if output.finished:
            del self._requests[request.request_id]
        return output

    # ------------------------------------------------------------- prefill/decode split

    def export_request(self, request_id: str) -> KVExport:
        """The state and K/V blocks of a prefill-only request that has sampled its first token."""
        state, block_ids = self.export_state(request_id)
        return KVExport(state=state, blocks=self._runner.read_blocks(block_ids))

    def export_state(self, request_id: str) -> tuple[TransferState, list[int]]:
        """`export_request` without the copy: the state and the cache block ids that hold its
        K/V (held until `release_request`), for a reader that shares the cache (the worker of
        an engine process, `read_blocks` over `kv_cache_tensors`; one rank only)."""
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.PREFILLED:
            raise ValueError(f"request {request_id!r} is not a prefilled request")
        state = TransferState(
            request_id=request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=request.output_token_ids,
            sampling_params=request.sampling_params,
            num_computed_tokens=request.num_computed_tokens,
            block_size=self.config.block_size,
            generator_state=generator_state(request.generator),
            priority=request.priority,
        )
        return state, list(request.block_ids[: state.num_blocks])

    def release_request(self, request_id: str) -> None:
        """Frees a prefilled request's blocks once its K/V has been sent."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._scheduler.finish(request, RequestStatus.FINISHED_STOPPED)

    def reserve_request(self, state: TransferState) -> list[int] | None:
        """Allocates blocks for a request whose K/V another engine computed.

        Returns the block ids to write into, in order, or None when the pool has no room now,
        not even after preempting running requests less important than it (`state.priority`).
        """
        return self._reserve(state, num_next_tokens=0)

    def _reserve(self, state: TransferState, num_next_tokens: int) -> list[int] | None:
        """`reserve_request`, where preemption frees room for `num_next_tokens` more tokens too:
        those the caller allocates next (`reserve_prompt`'s first sampled token)."""
        if state.block_size != self.config.block_size:
            raise ValueError(
                f"block size {state.block_size} of the sender differs from {self.config.block_size}"
            )
        if state.request_id in self._requests:
            raise ValueError(f"request id {state.request_id!r} is already in use")
        params = state.sampling_params
        self._validate_prompt(state.prompt_token_ids)
        request = Request(
            state.request_id,
            list(state.prompt_token_ids),
            params,
            arrival_index=next(self._arrivals),
            priority=state.priority,
        )
        for token_id in state.output_token_ids:
            request.append_token(token_id)
        # The blocks also cover the next token, which is computed right after activation.
        if not self._block_manager.allocate(request, request.num_tokens):
            if not self._scheduler.preempt_for(request, request.num_tokens + num_next_tokens):
                return None
            allocated = self._block_manager.allocate(request, request.num_tokens)
            assert allocated, "preemption freed fewer blocks than it counted"
        request.num_computed_tokens = state.num_computed_tokens
        self._track(request, state.generator_state)
        add_known_tokens(request, state.output_token_ids)
        self._scheduler.hold(request, RequestStatus.RESERVED)
        return list(request.block_ids[: state.num_blocks])

    def reserve_prompt(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> list[int] | None:
        """Decode side of a transfer, before the prefill has run: blocks for the prompt's K/V.

        The reservation also covers the first sampled token, computed right after activation.
        Returns the block ids the prompt's K/V goes into, in order, or None when the pool has no
        room now, not even after preempting running requests less important than it
        (`priority`, as in `add_request`). `complete_transfer` finishes the hand-over;
        `abort_request` frees the blocks.
        """
        state = TransferState(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=[],
            sampling_params=params,
            num_computed_tokens=len(prompt_token_ids),
            block_size=self.config.block_size,
            priority=priority,
        )
        if self._reserve(state, num_next_tokens=1) is None:
            return None
        request = self._requests[request_id]
        # _reserve sized for the known tokens; leave room for the first sampled one too.
        if not self._block_manager.allocate(request, 1):
            if not self._scheduler.preempt_for(request, 1):
                self.abort_request(request_id)
                return None
            allocated = self._block_manager.allocate(request, 1)
            assert allocated, "preemption freed fewer blocks than it counted"
        return list(request.block_ids[: state.num_blocks])

    def complete_transfer(
        self, request_id: str, output_token_ids: list[int], generator_state: bytes | None
    ) -> None:
        """The K/V of a `reserve_prompt` request has arrived with its first token(s): decode it.

        The first token was already reported by the prefill side, so it counts as emitted here;
        the detokenizer still sees it, so the text of later tokens continues it exactly.
        """
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.RESERVED:
            raise ValueError(f"request {request_id!r} has no reserved blocks")
        if request.output_token_ids:
            raise ValueError(f"request {request_id!r} already has its first token")
        for token_id in output_token_ids:
            request.append_token(token_id)
        add_known_tokens(request, output_token_ids)
        request.num_emitted_tokens = len(request.output_token_ids)
        request.num_emitted_chars = len(request.text)
        if request.generator is not None and generator_state is not None:
            state = torch.frombuffer(bytearray(generator_state), dtype=torch.uint8)
            request.generator.set_state(state)
        self.activate_request(request_id)

    def write_request_kv(self, request_id: str, blocks: tuple[torch.Tensor, ...]) -> None:
        request = self._requests[request_id]
        if request.status is not RequestStatus.RESERVED:
            raise ValueError(f"request {request_id!r} has no reserved blocks")
        self._runner.write_blocks(request.block_ids[: blocks[0].shape[2]], blocks)

    def activate_request(self, request_id: str) -> None:
        """Starts decoding a reserved request whose K/V is in place."""
        self._scheduler.activate(request_id)

    def import_request(self, export: KVExport) -> bool:
        """Reserve, write and activate in one call (the in-process path)."""
        if self.reserve_request(export.state) is None:
            return False
        self.write_request_kv(export.state.request_id, export.blocks)
        self.activate_request(export.state.request_id)
        return True

    # ------------------------------------------------------------------------ internals

    def _track(self, request: Request, generator_state: bytes | None = None) -> None:
        """Gives the request its text side and sampler, and keeps it until it ends."""
        params = request.sampling_params
        if params.seed is not None:
            generator = self._runner.make_generator(params.seed)
            if generator_state is not None:
                generator.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
            request.generator = generator
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer, params, request.prompt_token_ids
        )
        self._requests[request.request_id] = request

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        validate_prompt(prompt_ids, self.model_config.vocab_size, self.max_model_len)

    def requests_holding_blocks(self) -> Iterable[Request]:
        return self._scheduler.requests()

    # ------------------------------------------------------------------ for workers and tests

    def load(self) -> EngineLoad:
        scheduler = self._scheduler
        return EngineLoad(
            num_running=len(scheduler.running),
            num_waiting=scheduler.num_queued,
            num_held=len(scheduler.held),
            num_free_blocks=self._block_manager.num_free_blocks,
            num_total_blocks=self._block_manager.num_blocks,
            num_cached_blocks=self._block_manager.num_cached_blocks,
            num_preemptions=scheduler.num_preemptions,
        )

    @property
    def num_preemptions(self) -> int:
        """Requests preempted (their blocks taken back, to be recomputed) since the start."""
        return self._scheduler.num_preemptions

    def running_request_ids(self) -> set[str]:
        """Requests in the running batch (computing their prompt or decoding)."""
        return {request.request_id for request in self._scheduler.running}

    def abort_all(self) -> list[StepOutput]:
        """Ends every running and waiting request; one finished (aborted) output each."""
        outputs = []
        for request in [*self._scheduler.running, *self._scheduler.waiting, *self._scheduler.ready]:
            self.abort_request(request.request_id)
            outputs.append(
                StepOutput(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    token_ids=request.output_token_ids,
                    text="",
                    new_token_ids=[],
                    new_text="",
                    finished=True,
                    finish_reason=RequestStatus.FINISHED_ABORTED.value,
                )
            )
        return outputs

    @property
    def kv_cache_tensors(self) -> tuple[torch.Tensor, ...]:
        """The paged KV cache's tensors (KVCache.tensors), each [layers, 2, blocks, ...]: a
        decode worker receives transferred blocks straight into them. Under tensor parallelism
        these are rank 0's heads only: blocks go in through `write_request_kv` instead (see
        `kv_block_layouts`)."""
        return self._runner.kv_cache.tensors

    def kv_block_layouts(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Each KV tensor's dtype and per-block shape [layers, 2, block_size, heads, ...] with
        every kv head: what a transfer carries (a staging receiver allocates these)."""
        return self._runner.block_layouts()

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    def close(self) -> None:
        """Ends what the engine started besides itself (a tensor-parallel engine's other
        ranks); the engine takes no steps after it."""
        self._runner.close()

    def record_block_events(self) -> None:
        """From now on, keep a log of blocks entering and leaving the prefix cache."""
        self._block_manager.record_events = True

    def drain_block_events(self) -> list[BlockEvent]:
        return self._block_manager.drain_events()

    def cached_block_hashes(self) -> list[bytes]:
        return self._block_manager.cached_block_hashes()

    def check_invariants(self) -> None:
        """Raises AssertionError when the block bookkeeping is inconsistent."""
        self._block_manager.check_invariants(self._scheduler.requests())
