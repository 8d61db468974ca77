"""The engine loop: admit requests, step the batch, turn sampled tokens into outputs.

One step is schedule -> run the model -> postprocess. Everything about memory and batching is
the scheduler's; everything about tensors is the model runner's; this file owns the per-request
text state (detokenizer, stop conditions) and the hand-off of a request's K/V between engines.

The surface, all of it (nobody outside reaches the scheduler, block manager or runner):
`LLMEngine`'s eleven members
- `config` (EngineConfig), `model` (ServedModel: model config, tokenizer, max_model_len);
- `add_request` (every request comes in here; `remote_kv` says when its K/V is computed
  elsewhere), `step`, `abort_request`, `has_unfinished_requests`;
- `finish_kv_transfer`: the K/V of a remote-KV request is in (decode side) or was sent (prefill);
- `load()` (EngineLoad: queue, blocks, preemptions, the running batch); `kv_cache` (KVCacheView:
  tensors, block layouts and reads, prefix-cache events, `check_invariants`);
  `expert_routing_counts()` (a mixture-of-experts model's tokens per expert, read when asked);
  `close()`;
and four module functions an engine core sends by name like the methods: `abort_all`,
`prefilled_kv` (a prefilled request's state and block ids, for a reader of the cache),
`export_request` and `import_request` (the hand-off within one process).

A remote-KV request's life (`abort_request` frees its blocks from any state):

- decode side: `add_request(remote_kv=KVFromRemote())` reserves blocks for the prompt's K/V and
  the first sampled token and returns the prompt's block ids (NoFreeBlocks: no room)
  -> WAITING_FOR_KV (skipped by the scheduler; a transport writes the K/V into the blocks)
  -> `finish_kv_transfer(id, first tokens, generator state[, blocks])` -> READY (when the
  batch is full) -> RUNNING (decoding) -> finished.
- prefill side: `add_request(remote_kv=KVToRemote())` -> WAITING -> RUNNING (the prompt) ->
  first token: PREFILLED (blocks held; `prefilled_kv` or `export_request` reads them)
  -> `finish_kv_transfer(id)` -> FINISHED_STOPPED (blocks freed).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

import torch

from nori.engine.block_manager import BlockManager
from nori.engine.config import EngineConfig, SchedulerConfig
from nori.engine.kv_cache_view import KVCacheView
from nori.engine.kv_transfer import (
    KVExport,
    KVFromRemote,
    KVToRemote,
    NoFreeBlocks,
    RemoteKV,
    TransferState,
    generator_state,
    set_generator_state,
)
from nori.engine.model_runner import ModelRunner, SampledTokens
from nori.engine.outputs import (
    EngineLoad,
    ExpertRoutingCounts,
    ServedModel,
    SpecDecodeCounts,
    StepOutput,
)
from nori.engine.prompt_checks import validate_prompt
from nori.engine.request import Request, RequestStatus
from nori.engine.request_text import add_known_tokens, check_stop, make_output, resume_text
from nori.engine.scheduler import Scheduler, SchedulerOutput
from nori.engine.speculative import Speculator
from nori.engine.step_cost import StepCostFit, StepCostModel
from nori.models.demo import resolve_model
from nori.sampling.detokenizer import IncrementalDetokenizer
from nori.sampling.params import SamplingParams
from nori.sampling.tokenizer import Tokenizer

# The "auto" prompt cap before any step has been timed.
AUTO_PREFILL_BUDGET_START = 256
# Seconds between solves of the published step-cost fit (EngineLoad.step_cost_fit).
_STEP_COST_FIT_EVERY_S = 0.25


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        """`runner` lets engines share loaded weights (benchmarks comparing policies)."""
        self.config = config
        model_dir = resolve_model(config.model)
        tokenizer = Tokenizer.from_dir(
            model_dir if config.tokenizer is None else resolve_model(config.tokenizer)
        )
        self._runner = runner or ModelRunner(config, model_dir, tokenizer.eos_token_ids)
        self.model = ServedModel(self._runner.model_config, tokenizer, self._runner.max_model_len)
        # Static batching (a benchmark baseline) has no prefix cache: a dense padded batch has
        # none, and its identical pad blocks would otherwise be served from the cache.
        self._block_manager = BlockManager(
            self._runner.kv_cache.num_blocks,
            config.block_size,
            config.enable_prefix_caching and config.scheduling_policy == "continuous",
        )
        budget = config.prefill_budget_with_decodes
        # What steps cost (step_cost.py), fitted over every timed step: published in the load
        # (the gateway weighs where to compute prompts by it), and with "auto" the cap on a
        # step's prompt tokens follows it, updated before every step.
        self._step_costs = StepCostModel()
        self._auto_prefill_budget = budget == "auto"
        # The fit as of the last solve, refreshed at most every _STEP_COST_FIT_EVERY_S (a 3x3
        # solve per step would cost more than it tells; the registry hears of it once a second).
        self._step_cost_fit: StepCostFit | None = None
        self._step_cost_fit_at = -math.inf
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            prefill_budget_with_decodes=AUTO_PREFILL_BUDGET_START if budget == "auto" else budget,
            background_prefill_budget=config.background_prefill_budget,
        )
        self._scheduler = Scheduler(scheduler_config, self._block_manager)
        self.kv_cache = KVCacheView(self._runner, self._block_manager, self._scheduler.requests)
        # The requests this engine knows, from add until they finish or leave.
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        speculative = config.speculative_config
        self._speculator = (
            None
            if speculative is None
            else Speculator(speculative, self._runner, self.model.max_model_len)
        )
        self._num_prompt_tokens_computed = 0

    # ------------------------------------------------------------------------ requests

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

        `priority`: vLLM's; lower values are served first, in arrival order among equals, and a
        request may preempt running ones of a larger value when the KV pool has no room for it.

        `remote_kv`: None, the prompt is computed here. KVToRemote: the prompt and first token
        only; its K/V then waits to be sent (PREFILLED). KVFromRemote: its prompt's K/V comes from
        elsewhere: blocks are reserved now for it and the first sampled token (preempting less
        important running requests if need be; else NoFreeBlocks), and the prompt's block ids
        are returned, in order, for the K/V to land in. Others return [].

        `output_token_ids`: a request resumed here after the worker decoding it died (migration):
        the tokens it had sampled, already streamed with `num_emitted_chars` of their text,
        computed with the prompt and counted as output; sampling goes on after the last.
        """
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
        """Ends the hand-off of a remote-KV request.

        Prefill side (PREFILLED): its K/V was sent; it ends and its blocks are free. Decode side
        (WAITING_FOR_KV): its K/V is in its blocks (a transport's writes, or `blocks` here: one
        tensor per KV tensor with every kv head, which a tensor-parallel engine splits over its
        ranks), with the first token (`output_token_ids`, reported by the prefill side: it counts
        as emitted, and the detokenizer still sees it) and the seeded sampler's state. It decodes
        from the next step when the batch has a row for it, else queues (READY) for one.
        """
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
        set_generator_state(request.generator, generator_state)
        self._scheduler.activate(request_id)

    def abort_request(self, request_id: str) -> None:
        """Ends a request wherever it is; its blocks are free when this returns."""
        request = self._requests.pop(request_id, None)
        if request is not None and not request.status.is_finished:
            self._scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self._scheduler.num_unfinished > 0

    # ------------------------------------------------------------------------ one step

    def step(self) -> list[StepOutput]:
        if self._auto_prefill_budget:
            self._scheduler.prefill_budget_with_decodes = self._step_costs.prompt_budget(
                # The running requests are (about) the decode rows of the coming step.
                num_decodes=len(self._scheduler.running),
                ratio=1.0,
                low=self.config.block_size,
                high=self.config.max_num_batched_tokens,
                default=AUTO_PREFILL_BUDGET_START,
            )
        speculator = self._speculator
        running = self._scheduler.running
        output = self._scheduler.schedule(None if speculator is None else speculator.plan(running))
        if output.is_empty:
            return []
        if speculator is not None:
            speculator.propose(output, self._scheduler.running)
        now = time.time()
        for item in output.scheduled:
            request = item.request
            if request.first_scheduled_at is None:
                request.first_scheduled_at = now  # its queue wait ends (metrics, traces)
            # This step's positions that are prompt positions (a chunk computes only part).
            prompt_end = min(request.num_prompt_tokens, request.num_tokens)
            step_end = min(prompt_end, request.num_computed_tokens + item.num_new_tokens)
            self._num_prompt_tokens_computed += max(step_end - request.num_computed_tokens, 0)
        started = time.perf_counter()
        sampled, prompt_logprobs = self._runner.execute(output, self._generators(output))
        num_decodes = sum(1 for item in output.scheduled if item.num_new_tokens == 1)
        self._step_costs.observe(
            num_decodes, output.num_batched_tokens - num_decodes, time.perf_counter() - started
        )
        fit_age_s = time.monotonic() - self._step_cost_fit_at
        if fit_age_s >= _STEP_COST_FIT_EVERY_S or self._step_costs.adds_to(self._step_cost_fit):
            self._step_cost_fit = self._step_costs.fit()
            self._step_cost_fit_at = time.monotonic()
        # Accepted drafts are computed tokens: in the request before the cache hashes its blocks.
        num_rejected = {}
        for result in sampled:
            if result.num_drafts:
                result.request.token_ids.extend(result.token_ids[:-1])
                num_rejected[result.request.request_id] = result.num_rejected
        self._scheduler.update(output, num_rejected)
        if speculator is not None:
            speculator.record(sampled)
        for request, entries in prompt_logprobs:
            assert request.prompt_logprobs is not None
            request.prompt_logprobs.extend(entries)
        outputs = []
        for result in sampled:
            accepted = len(result.token_ids) - 1
            if accepted:
                # Taken out again: the text side and stop checks see them one by one below.
                del result.request.token_ids[-accepted:]
            if result.request.status.is_finished:
                # A static batch's padding row: computed like the others, reported to nobody.
                result.request.token_ids.extend(result.token_ids)
            else:
                outputs.append(self._postprocess(result))
        return outputs

    def _generators(self, output: SchedulerOutput) -> dict[str, torch.Generator]:
        generators = {}
        for item in output.scheduled:
            request = self._requests.get(item.request.request_id)
            # A finished static padding row is no longer tracked: it samples for nobody.
            if request is not None and request.generator is not None:
                generators[request.request_id] = request.generator
        return generators

    def _postprocess(self, sample: SampledTokens) -> StepOutput:
        """The step's tokens for one request, one at a time: the first that ends it ends it (a
        verification's later tokens are dropped, as a plain run would never sample them)."""
        request = sample.request
        finish = None
        for index, token_id in enumerate(sample.token_ids):
            request.append_token(token_id)
            if sample.logprobs is not None:
                request.logprobs = request.logprobs or []
                request.logprobs.append(sample.logprobs[index])
            finish = check_stop(
                request, token_id, self.model.tokenizer.eos_token_ids, self.model.max_model_len
            )
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

    # ------------------------------------------------------------------------ internals

    def _track(self, request: Request) -> None:
        """Gives the request its text side and sampler, and keeps it until it ends."""
        params = request.sampling_params
        if params.seed is not None:
            request.generator = self._runner.make_generator(params.seed)
        request.detokenizer = IncrementalDetokenizer(
            self.model.tokenizer, params, request.prompt_token_ids
        )
        self._requests[request.request_id] = request

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
            running_request_ids=frozenset(request.request_id for request in scheduler.running),
            num_prompt_tokens_computed=self._num_prompt_tokens_computed,
            spec_decode=SpecDecodeCounts() if self._speculator is None else self._speculator.counts,
            step_cost_fit=self._step_cost_fit,
        )

    def expert_routing_counts(self) -> ExpertRoutingCounts | None:
        """Tokens routed to each expert of each routed layer since the model loaded (None for a
        dense model): a copy of the mixture-of-experts blocks' counters, for load-balance
        metrics (a worker's /metrics, `nori bench offline`).

        The counters live on the model's device and grow inside the forward pass; reading them
        waits for the device (one copy of all layers at once), so it is done when asked (a
        scrape, the end of a benchmark run), never per step. Under tensor or expert
        parallelism every rank runs the router on every token identically and counts into a
        full [num_experts] counter, so this rank's (the leader's) counts are the whole count.
        An engine given a shared runner (`runner=`) reads the counts of every engine on it.
        """
        blocks = self._runner.model.moe_blocks()
        if not blocks:
            return None
        counts = torch.stack([block.routed_tokens for block in blocks.values()]).tolist()
        return ExpertRoutingCounts(
            top_k=self._runner.model_config.num_experts_per_tok,
            layers=tuple(
                (layer, tuple(layer_counts))
                for layer, layer_counts in zip(blocks, counts, strict=True)
            ),
        )

    def close(self) -> None:
        """Ends what the engine started besides itself (a tensor-parallel engine's other
        ranks); the engine takes no steps after it."""
        self._runner.close()


# ---------------------------------------------------------------- operations sent by name


def abort_all(engine: LLMEngine) -> list[StepOutput]:
    """Ends every running and waiting request; one finished (aborted) output each."""
    scheduler = engine._scheduler
    outputs = []
    for request in [*scheduler.running, *scheduler.waiting, *scheduler.ready]:
        engine.abort_request(request.request_id)
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


def prefilled_kv(engine: LLMEngine, request_id: str) -> tuple[TransferState, list[int]]:
    """A prefilled (KVToRemote) request's state and the cache block ids that hold its K/V, held
    until `finish_kv_transfer`: for a reader that shares the cache (the worker of an engine
    process reads them from `kv_cache.tensors`; one rank only)."""
    request = engine._requests.get(request_id)
    if request is None or request.status is not RequestStatus.PREFILLED:
        raise ValueError(f"request {request_id!r} is not a prefilled request")
    state = TransferState(
        request_id=request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=request.output_token_ids,
        sampling_params=request.sampling_params,
        num_computed_tokens=request.num_computed_tokens,
        block_size=engine.config.block_size,
        generator_state=generator_state(request.generator),
        priority=request.priority,
    )
    return state, list(request.block_ids[: state.num_blocks])


def export_request(engine: LLMEngine, request_id: str) -> KVExport:
    """`prefilled_kv` with a copy of the blocks (every kv head, gathered from the ranks); the
    blocks stay held until `finish_kv_transfer`."""
    state, block_ids = prefilled_kv(engine, request_id)
    return KVExport(state=state, blocks=engine.kv_cache.read_blocks(block_ids))


def import_request(engine: LLMEngine, export: KVExport) -> bool:
    """Takes over an exported request: reserve, write its K/V and finish the transfer in one
    call (both engines in one process). False when the pool has no room now."""
    state = export.state
    if state.block_size != engine.config.block_size:
        raise ValueError(
            f"block size {state.block_size} of the sender differs from {engine.config.block_size}"
        )
    try:
        engine.add_request(
            state.request_id,
            list(state.prompt_token_ids),
            state.sampling_params,
            priority=state.priority,
            remote_kv=KVFromRemote(),
        )
    except NoFreeBlocks:
        return False
    engine.finish_kv_transfer(
        state.request_id, state.output_token_ids, state.generator_state, export.blocks
    )
    return True
