"""The engine loop: admit requests, step the batch (schedule -> execute -> update), turn
sampled tokens into outputs, and hand requests' K/V between engines.

A remote-KV request's life (`abort_request` frees its blocks from any state):
- decode side: `add_request(remote_kv=KVFromRemote())` reserves its blocks -> WAITING_FOR_KV
  (a transport writes the K/V) -> `finish_kv_transfer` -> READY (batch full) -> RUNNING.
- prefill side: `add_request(remote_kv=KVToRemote())` -> WAITING -> RUNNING -> first token:
  PREFILLED (blocks held; `prefilled_kv`, `export_request`) -> `finish_kv_transfer` -> freed."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from nori.engine.block_manager import BlockManager
from nori.engine.config import EngineConfig, SchedulerConfig
from nori.engine.kv_cache import KVCacheView
from nori.engine.launched_step import LaunchedStep
from nori.engine.model_runner import ModelRunner
from nori.engine.outputs import (
    EngineLoad,
    ExpertRoutingCounts,
    ServedModel,
    SpecDecodeCounts,
    StepOutput,
    aborted_output,
    add_known_tokens,
    check_stop,
    make_output,
    resume_text,
)
from nori.engine.request import (
    KVExport,
    KVFromRemote,
    KVToRemote,
    NoFreeBlocks,
    RemoteKV,
    Request,
    RequestStatus,
    TransferState,
    validate_prompt,
)
from nori.engine.scheduler import Scheduler
from nori.engine.speculative import Speculator
from nori.engine.step_cost import StepCosts
from nori.engine.step_sampling import SampledTokens
from nori.models.demo import resolve_model
from nori.sampling.detokenizer import IncrementalDetokenizer
from nori.sampling.params import SamplingParams
from nori.sampling.tokenizer import Tokenizer


class LLMEngine:
    """One model's engine; nobody outside reaches its scheduler, block manager or runner.

    Its members, all of them (a test holds this list to the class): `config` (EngineConfig),
    `model` (ServedModel: model config, tokenizer, max_model_len); `add_request` (every request
    comes in here), `step`, `abort_request`, `abort_all`, `has_unfinished_requests`; the
    remote-KV hand-off: `finish_kv_transfer`, `prefilled_kv` (state and block ids, for a reader
    of the cache), `export_request` and `import_request` (within one process); `load`
    (EngineLoad), `kv_cache` (KVCacheView: tensors, block reads, prefix-cache events,
    invariants), `expert_routing_counts` (tokens per expert), `close`."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner | None = None,
        scheduler_class: type[Scheduler] = Scheduler,
    ) -> None:
        """`runner` lets engines share loaded weights, and `scheduler_class` replaces the
        scheduling policy (benchmarks comparing policies)."""
        self.config = config
        model_dir = resolve_model(config.model)
        tokenizer = Tokenizer.from_dir(
            model_dir if config.tokenizer is None else resolve_model(config.tokenizer)
        )
        self._runner = runner or ModelRunner(config, model_dir, tokenizer.eos_token_ids)
        self.model = ServedModel(self._runner.model_config, tokenizer, self._runner.max_model_len)
        self._eos_token_ids = tokenizer.eos_token_ids
        self._block_manager = BlockManager(
            self._runner.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching
        )
        budget = config.prefill_budget_with_decodes
        self._costs = StepCosts(budget, config.block_size, config.max_num_batched_tokens)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefill_budget_with_decodes=StepCosts.initial_budget(budget),
            background_prefill_budget=config.background_prefill_budget,
        )
        self._scheduler = scheduler_class(scheduler_config, self._block_manager)
        self.kv_cache = KVCacheView(self._runner, self._block_manager, self._scheduler.requests)
        # The requests this engine knows, from add until they finish or leave.
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        # The step launched last, until its tokens are resolved (see `step`).
        self._launched: LaunchedStep | None = None
        speculative = config.speculative_config
        self._speculator = (
            None
            if speculative is None
            else Speculator(speculative, self._runner, self.model.max_model_len)
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        remote_kv: RemoteKV | None = None,
        output_token_ids: Sequence[int] = (),
        num_emitted_chars: int = 0,
    ) -> list[int]:
        """Queues a request. Raises ValueError for input the engine can never serve.

        `priority`: vLLM's; lower values first, arrival order among equals; a request may
        preempt running ones of a larger value when the KV pool has no room for it.
        `remote_kv`: None, the prompt is computed here. KVToRemote: the prompt and first token
        only, then its K/V waits to be sent (PREFILLED). KVFromRemote: blocks are reserved now
        for its prompt's K/V and first token (preempting if need be; else NoFreeBlocks) and the
        prompt's block ids returned, in order; others return [].
        `output_token_ids`: a request resumed after its worker died (migration): the tokens it
        sampled, `num_emitted_chars` of their text already streamed; sampling goes on after."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = (
            self.model.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        )
        validate_prompt(prompt_ids, self.model.config.vocab_size, self.model.max_model_len)
        request = Request(
            request_id,
            prompt_ids,
            params,
            arrival_index=next(self._arrivals),
            prefill_only=isinstance(remote_kv, KVToRemote),
            max_new_tokens=min(params.max_tokens, self.model.max_model_len - len(prompt_ids)),
            priority=priority,
        )
        if isinstance(remote_kv, KVFromRemote):
            if output_token_ids:
                raise ValueError("a request whose K/V comes from elsewhere has no output yet")
            return self._reserve(request)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first token has none; the rest as computed
        for token_id in output_token_ids:
            request.append_token(token_id)
        self._track(request)
        if output_token_ids:
            resume_text(request, list(output_token_ids), num_emitted_chars)
        self._scheduler.add(request)
        return []

    def abort_request(self, request_id: str) -> None:
        """Ends a request wherever it is; its blocks are free when this returns."""
        request = self._requests.pop(request_id, None)
        if request is not None and not request.status.is_finished:
            self._scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def abort_all(self) -> list[StepOutput]:
        """Ends every running and waiting request; one finished (aborted) output each."""
        scheduler = self._scheduler
        outputs = []
        self._launched = None
        for request in [*scheduler.running, *scheduler.waiting, *scheduler.ready]:
            self.abort_request(request.request_id)
            outputs.append(aborted_output(request))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self._scheduler.num_unfinished > 0

    def step(self) -> list[StepOutput]:
        """Schedules and launches a step, then turns the step before into outputs. A step's
        tokens stay on the device while the next one is scheduled and launched (it reads them),
        unless what follows needs them on the host (`LaunchedStep.defers`): a stop is seen a
        step late and the token sampled past it dropped, as if every step resolved at once."""
        self._costs.before_schedule(self._scheduler)
        speculator = self._speculator
        running = self._scheduler.running
        output = self._scheduler.schedule(None if speculator is None else speculator.plan(running))
        if output.is_empty:
            return self._resolve()
        if speculator is not None:
            speculator.propose(output, self._scheduler.running)
        step = LaunchedStep(output, self._runner.device)
        previous = None if self._launched is None else self._launched.sampled
        sampled, prompt_logprobs = self._runner.execute(output, output.generators, previous)
        for request, entries in prompt_logprobs:
            assert request.prompt_logprobs is not None
            request.prompt_logprobs.extend(entries)
        if speculator is None:
            self._scheduler.update(output)
        else:
            verified = [] if sampled is None else sampled.resolve()
            self._scheduler.update(output, speculator.accept(verified))
            speculator.record(verified)
        step.launched(sampled)
        outputs = self._resolve()
        self._launched = step
        if not step.defers(speculating=speculator is not None):
            outputs += self._resolve()
        return outputs

    def _resolve(self) -> list[StepOutput]:
        """The launched step's outputs (waits for its tokens); requests that ended meanwhile (a
        stop in the step before, an abort) drop theirs."""
        step, self._launched = self._launched, None
        if step is None:
            return []
        results = step.resolve()
        self._costs.after_execute(step.output, step.seconds())
        return [self._postprocess(r) for r in results if not r.request.status.is_finished]

    def _postprocess(self, sample: SampledTokens) -> StepOutput:
        """The step's tokens for one request, one at a time: the first that ends it ends it (a
        verification's later tokens are dropped, as a plain run would never sample them)."""
        request = sample.request
        finish = None
        eos_token_ids, max_model_len = self._eos_token_ids, self.model.max_model_len
        for index, token_id in enumerate(sample.token_ids):
            request.token_ids.append(token_id)
            if sample.logprobs is not None:
                request.logprobs = request.logprobs or []
                request.logprobs.append(sample.logprobs[index])
            finish = check_stop(request, token_id, eos_token_ids, max_model_len)
            if finish is not None:
                break
        if finish is not None:
            self._scheduler.finish(request, finish)
        elif request.prefill_only:
            self._scheduler.hold(request, RequestStatus.PREFILLED)
        output = make_output(request)
        if output.finished:
            del self._requests[request.request_id]
        return output

    def _reserve(self, request: Request) -> list[int]:
        """Blocks for the prompt's K/V, then for the first sampled token (computed right after
        the K/V is in); preemption frees room for both at once."""
        num_prompt = request.num_tokens
        if not self._allocate(request, num_prompt, room_for=num_prompt + 1):
            raise NoFreeBlocks(f"no free KV blocks for request {request.request_id!r}")
        request.num_computed_tokens = num_prompt
        if not self._allocate(request, 1, room_for=1):
            self._block_manager.free(request)
            raise NoFreeBlocks(f"no free KV blocks for request {request.request_id!r}")
        self._track(request)
        self._scheduler.hold(request, RequestStatus.WAITING_FOR_KV)
        return list(request.block_ids[: self._block_manager.blocks_needed(num_prompt)])

    def _allocate(self, request: Request, num_new_tokens: int, room_for: int) -> bool:
        """`num_new_tokens` more tokens' blocks, preempting for `room_for` tokens if need be."""
        if self._block_manager.allocate(request, num_new_tokens):
            return True
        if not self._scheduler.preempt_for(request, room_for):
            return False
        allocated = self._block_manager.allocate(request, num_new_tokens)
        assert allocated, "preemption freed fewer blocks than it counted"
        return True

    def finish_kv_transfer(
        self,
        request_id: str,
        output_token_ids: Sequence[int] = (),
        generator_state: bytes | None = None,
        blocks: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        """Ends the hand-off of a remote-KV request. Prefill side (PREFILLED): its K/V was sent;
        it ends and its blocks are free. Decode side (WAITING_FOR_KV): its K/V is in its blocks (a
        transport's writes, or `blocks` here: one tensor per KV tensor with every kv head, split
        over the ranks under tensor parallelism), with the first token (`output_token_ids` from
        the prefill side: counted as emitted, still seen by the detokenizer) and the seeded
        sampler's state. It decodes from the next step if a row is free, else waits (READY)."""
        request = self._requests.get(request_id)
        if request is not None and request.status is RequestStatus.PREFILLED:
            del self._requests[request_id]
            self._scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            return
        if request is None or request.status is not RequestStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id!r} has no reserved blocks")
        if blocks is not None:
            self._runner.write_blocks(request.block_ids[: blocks[0].shape[2]], blocks)
        for token_id in output_token_ids:
            request.append_token(token_id)
        add_known_tokens(request, list(output_token_ids))
        request.num_emitted_tokens = len(request.output_token_ids)
        request.num_emitted_chars = len(request.text)
        if request.generator is not None and generator_state is not None:
            state = torch.frombuffer(bytearray(generator_state), dtype=torch.uint8)
            request.generator.set_state(state)
        self._scheduler.activate(request_id)

    def prefilled_kv(self, request_id: str) -> tuple[TransferState, list[int]]:
        """A prefilled (KVToRemote) request's state and the cache block ids that hold its K/V,
        held until `finish_kv_transfer`: for a reader that shares the cache (the worker of an
        engine process reads them from `kv_cache.tensors`; one rank only)."""
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
            generator_state=(
                None if request.generator is None else bytes(request.generator.get_state().tolist())
            ),
            priority=request.priority,
        )
        return state, list(request.block_ids[: state.num_blocks])

    def export_request(self, request_id: str) -> KVExport:
        """`prefilled_kv` with a copy of the blocks (every kv head, gathered from the ranks);
        the blocks stay held until `finish_kv_transfer`."""
        state, block_ids = self.prefilled_kv(request_id)
        return KVExport(state=state, blocks=self.kv_cache.read_blocks(block_ids))

    def import_request(self, export: KVExport) -> bool:
        """Takes over an exported request: reserve, write its K/V and finish the transfer in
        one call (both engines in one process). False when the pool has no room now."""
        state = export.state
        if state.block_size != self.config.block_size:
            raise ValueError(
                f"block size {state.block_size} of the sender differs from {self.config.block_size}"
            )
        try:
            self.add_request(
                state.request_id,
                list(state.prompt_token_ids),
                state.sampling_params,
                priority=state.priority,
                remote_kv=KVFromRemote(),
            )
        except NoFreeBlocks:
            return False
        self.finish_kv_transfer(
            state.request_id, state.output_token_ids, state.generator_state, export.blocks
        )
        return True

    def _track(self, request: Request) -> None:
        """Gives the request its text side and sampler, and keeps it until it ends."""
        params = request.sampling_params
        if params.seed is not None:
            request.generator = self._runner.make_generator(params.seed)
        request.detokenizer = IncrementalDetokenizer(
            self.model.tokenizer, params, request.prompt_token_ids
        )
        self._requests[request.request_id] = request

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
            running_request_ids=frozenset(request.request_id for request in scheduler.running),
            num_prompt_tokens_computed=scheduler.num_prompt_tokens_computed,
            spec_decode=SpecDecodeCounts() if self._speculator is None else self._speculator.counts,
            step_cost_fit=self._costs.fit,
        )

    def expert_routing_counts(self) -> ExpertRoutingCounts | None:
        """Tokens routed to each expert of each routed layer since the model loaded (None for a
        dense model). Waits for the device: read it when asked, never per step."""
        return self._runner.expert_routing_counts()

    def close(self) -> None:
        """Ends what the engine started besides itself (a tensor-parallel engine's other
        ranks); the engine takes no steps after it."""
        self._runner.close()
