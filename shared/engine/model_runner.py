"""Owns the model weights and the KV cache tensors; runs one scheduler step on them."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.batch_inputs import PromptLogprobRows, build_batch_inputs
from nori.engine.config import EngineConfig
from nori.engine.device import resolve_attention_backend, resolve_device, resolve_dtype
from nori.engine.draft_model import DraftModel
from nori.engine.follower_ranks import (
    Command,
    FollowerRanks,
    ReadBlocks,
    StepCommand,
    WriteBlocks,
    rank_group,
)
from nori.engine.kv_cache import KVCache, bytes_per_block, kv_cache_dtype
from nori.engine.outputs import ExpertRoutingCounts
from nori.engine.paged_attention import PagedAttention
from nori.engine.request import Request
from nori.engine.scheduler import ScheduledRequest, SchedulerOutput
from nori.kernels.argmax import argmax_rows
from nori.models.config import ModelConfig
from nori.models.loader import load_model
from nori.models.shard import local_model_config
from nori.parallel.group import TensorParallelGroup
from nori.sampling.batch import RowState, SamplingBatch, make_generator
from nori.sampling.logprob_math import compute_logprobs
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.sampler import Sampler
from nori.sampling.speculative import DraftProposal, verify_drafts

logger = logging.getLogger(__name__)

# Prompt-logprob rows go through the LM head this many at a time: a long prompt's [rows, vocab]
# logits would otherwise take as much memory as the KV of thousands of tokens.
PROMPT_LOGPROB_ROWS = 512


@dataclass(frozen=True)
class SampledTokens:
    """What a step sampled for one request: one token, or for a verification (speculative
    decoding) its accepted drafts and then one token from the model."""

    request: Request
    token_ids: list[int]
    # One per token, or None when the request asked for no logprobs.
    logprobs: list[TokenLogprobs] | None
    # Draft tokens verified in the step (0: a plain decode or prompt).
    num_drafts: int = 0

    @property
    def num_rejected(self) -> int:
        return self.num_drafts - (len(self.token_ids) - 1)


class StepResult(NamedTuple):
    sampled: list[SampledTokens]
    # Requests that want prompt logprobs and computed prompt tokens in the step: the log-probs of
    # the prompt tokens they scored, in order, to append to `Request.prompt_logprobs`.
    prompt_logprobs: list[tuple[Request, list[TokenLogprobs]]]


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        eos_token_ids: frozenset[int] = frozenset(),
        rank: int = 0,
    ) -> None:
        """rank > 0: a follower of a tensor-parallel engine (nori.engine.follower_ranks), which
        rank 0 starts; rank 0 with tensor_parallel_size > 1 starts its followers here."""
        self.config = config
        # Masked until a request reaches min_tokens.
        self.eos_token_ids = eos_token_ids
        self.device = resolve_device(config.device)
        model_config = ModelConfig.from_dir(model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        self.parallel: TensorParallelGroup | None = None
        self.followers: FollowerRanks | None = None
        if config.enable_expert_parallel and rank == 0 and not model_config.is_moe:
            logger.info("--enable-expert-parallel: %s has no experts; ignored", model_dir.name)
        if config.tensor_parallel_size > 1:
            # Checked before any process starts.
            local_model_config(model_config, rank_group(config, 0))
            if rank == 0:
                self.followers = FollowerRanks.start(config, model_dir, self.device.type)
            self.parallel = rank_group(config, rank)
        try:
            self._load(config, model_dir)
        except BaseException:
            self.close()  # the followers would otherwise wait for a rank 0 that is gone
            raise
        self.max_model_len = self._max_model_len(self.kv_cache.num_blocks)
        # Unseeded requests' draws (plain sampling and speculative verification).
        self.generator = make_generator(config.seed, self.device)
        self.sampler = Sampler(self.generator)
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        logger.info(
            "model %s on %s (%s%s%s, %s attention): %d KV blocks of %d tokens (%s, %.1f MiB), "
            "max_model_len %d",
            model_dir.name,
            self.device,
            self.dtype,
            f", {config.quantization} weights" if config.quantization else "",
            (
                f", rank {rank} of {config.tensor_parallel_size}"
                + (", expert parallel" if self.parallel.expert_parallel else "")
            )
            if self.parallel
            else "",
            self.attention_backend,
            self.kv_cache.num_blocks,
            config.block_size,
            str(self.kv_cache_dtype).replace("torch.", ""),
            self.kv_cache_bytes / 2**20,
            self.max_model_len,
        )

    def _load(self, config: EngineConfig, model_dir: Path) -> None:
        """The weights (this rank's shard) and the KV cache."""
        self.model, self.model_config = load_model(
            model_dir,
            self.dtype,
            self.device,
            config.load_format,
            seed=config.seed,
            quantization=config.quantization,
            quantize_lm_head=config.quantize_lm_head,
            tensor_parallel=self.parallel,
        )
        self.kv_cache_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        # This rank's heads: its shard of every block.
        self.local_model_config = (
            self.model_config
            if self.parallel is None
            else local_model_config(self.model_config, self.parallel)
        )
        speculative = config.speculative_config
        self.draft: DraftModel | None = None
        if speculative is not None and speculative.method == "draft_model":
            self.draft = DraftModel(
                config,
                self.model_config,
                self.dtype,
                self.device,
                resolve_attention_backend(config.attention_backend, self.device),
                self.eos_token_ids,
            )
        num_blocks = self._num_kv_blocks()
        if self.parallel is not None:
            num_blocks = self.parallel.min_int(num_blocks)  # every rank holds every block
        self.kv_cache = KVCache.allocate(
            self.local_model_config,
            num_blocks,
            config.block_size,
            self.kv_cache_dtype,
            self.device,
        )
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks, self.kv_cache_dtype)

    def make_generator(self, seed: int) -> torch.Generator:
        return make_generator(seed, self.device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput, generators: Mapping[str, torch.Generator]
    ) -> StepResult:
        inputs = build_batch_inputs(output, self.config.block_size, self.device)
        sampling = [s for s in output.scheduled if s.samples]
        # Every logits the step needs, as batches of hidden rows: the prompt-logprob rows in
        # chunks, then the sampled rows. Decided before the forward pass so that followers of a
        # tensor-parallel engine compute (and gather) the same batches in the same order.
        prompt_chunks = self._prompt_logprob_chunks(inputs.prompt_logprob_rows)
        logits_rows = (*prompt_chunks, *([inputs.logits_indices] if sampling else []))
        if self.followers is not None:
            self.followers.send(
                StepCommand(inputs.input_ids, inputs.positions, inputs.attention, logits_rows)
            )
        logits = self._forward(inputs.input_ids, inputs.positions, inputs.attention, logits_rows)
        if self.draft is not None:
            self.draft.mirror(inputs)
        prompt_logprobs = self._prompt_logprobs(
            logits[: len(prompt_chunks)], inputs.prompt_logprob_rows
        )
        if not sampling:
            return StepResult([], prompt_logprobs)
        return StepResult(self.sample(sampling, logits[-1], generators), prompt_logprobs)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_rows: Sequence[torch.Tensor],
    ) -> list[torch.Tensor]:
        """The model over the step's tokens, then the logits of each batch of rows."""
        attention = PagedAttention(self.kv_cache, metadata, self.attention_backend)
        hidden = self.model(input_ids, positions, attention)
        return [self.model.compute_logits(hidden[rows]) for rows in logits_rows]

    @torch.inference_mode()
    def follow(self, command: Command) -> None:
        """A follower rank's share of rank 0's operation (see nori.engine.follower_ranks)."""
        if isinstance(command, StepCommand):
            self._forward(
                command.input_ids, command.positions, command.attention, command.logits_rows
            )
        elif isinstance(command, ReadBlocks):
            self.read_blocks(command.block_ids)
        elif isinstance(command, WriteBlocks):
            self.write_blocks(command.block_ids, command.blocks)

    # ------------------------------------------------------------ KV blocks in and out

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, ...]:
        """A copy of the blocks (`KVCache.read_blocks`) with every kv head: each rank's heads
        gathered on rank 0 under tensor parallelism, so the export has one layout whatever the
        sender's size (on a follower, an empty tuple)."""
        if self.followers is not None:
            self.followers.send(ReadBlocks(block_ids))
        local = self.kv_cache.read_blocks(block_ids)
        if self.draft is not None and self.draft.kv_cache is not None:
            local += self.draft.kv_cache.read_blocks(block_ids)
        if self.parallel is None:
            return local
        # Heads are dimension 4 of both the values [L, 2, n, bs, H, D] and scales [L, 2, n, bs, H].
        gathered = [self.parallel.gather_dim(tensor, dim=4) for tensor in local]
        return tuple(t for t in gathered if t is not None)

    def write_blocks(self, block_ids: list[int], blocks: tuple[torch.Tensor, ...]) -> None:
        """Writes whole-model blocks (every kv head) into block_ids; each rank keeps its heads."""
        if self.followers is not None:
            self.followers.send(WriteBlocks(block_ids, blocks))
        if self.parallel is not None:
            heads = self.local_model_config.num_key_value_heads
            blocks = tuple(
                block.narrow(4, self.parallel.rank * heads, heads).contiguous() for block in blocks
            )
        num_target = len(self.kv_cache.tensors)
        if self.draft is not None and self.draft.kv_cache is not None:
            self.draft.kv_cache.write_blocks(block_ids, blocks[num_target:])
            blocks = blocks[:num_target]
        self.kv_cache.write_blocks(block_ids, blocks)

    def block_layouts(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Each KV tensor's dtype and shape without its block dimension, with every kv head
        ([layers, 2, block_size, heads, ...]): what `read_blocks` gives per block."""
        world_size = 1 if self.parallel is None else self.parallel.world_size
        layouts = []
        for tensor in self.kv_tensors:
            shape = [*tensor.shape[:2], *tensor.shape[3:]]
            shape[3] *= world_size
            layouts.append((tensor.dtype, tuple(shape)))
        return layouts

    @property
    def num_draft_kv_tensors(self) -> int:
        """How many of `kv_tensors` (the last ones) are a draft model's."""
        return len(self.kv_tensors) - len(self.kv_cache.tensors)

    @property
    def kv_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a request's blocks live in (`KVCache.tensors`): the model's, then a
        draft model's (speculative decoding), all indexed by the same block ids."""
        if self.draft is None or self.draft.kv_cache is None:
            return self.kv_cache.tensors
        return self.kv_cache.tensors + self.draft.kv_cache.tensors

    def expert_routing_counts(self) -> ExpertRoutingCounts | None:
        """Tokens routed to each expert of each routed layer since the model loaded (None for a
        dense model): a copy of the mixture-of-experts blocks' counters, for load-balance
        metrics (a worker's /metrics, `nori bench offline`).

        The counters live on the model's device and grow inside the forward pass; reading them
        waits for the device (one copy of all layers at once), so it is done when asked (a
        scrape, the end of a benchmark run), never per step. Under tensor or expert
        parallelism every rank runs the router on every token identically and counts into a
        full [num_experts] counter, so this rank's (the leader's) counts are the whole count.
        Engines sharing this runner read the counts of all of them.
        """
        blocks = self.model.moe_blocks()
        if not blocks:
            return None
        counts = torch.stack([block.routed_tokens for block in blocks.values()]).tolist()
        return ExpertRoutingCounts(
            top_k=self.model_config.num_experts_per_tok,
            layers=tuple(
                (layer, tuple(layer_counts))
                for layer, layer_counts in zip(blocks, counts, strict=True)
            ),
        )

    def close(self) -> None:
        """Ends the follower ranks of a tensor-parallel engine (nothing to do otherwise)."""
        if self.followers is not None:
            self.followers.close()
            self.followers = None

    def _prompt_logprob_chunks(self, rows: list[PromptLogprobRows]) -> list[torch.Tensor]:
        """The hidden rows scoring prompt tokens, PROMPT_LOGPROB_ROWS at a time."""
        indices = [r.first_row + k for r in rows for k in range(len(r.target_token_ids))]
        return [
            torch.tensor(indices[low : low + PROMPT_LOGPROB_ROWS], device=self.device)
            for low in range(0, len(indices), PROMPT_LOGPROB_ROWS)
        ]

    def _prompt_logprobs(
        self, chunk_logits: list[torch.Tensor], rows: list[PromptLogprobRows]
    ) -> list[tuple[Request, list[TokenLogprobs]]]:
        """log_softmax of the raw logits at each scored prompt position (as vLLM reports prompt
        logprobs), with the requested number of most likely alternatives; `chunk_logits` are
        the logits of `_prompt_logprob_chunks(rows)`."""
        if not rows:
            return []
        targets = [token for r in rows for token in r.target_token_ids]
        counts = [r.request.sampling_params.prompt_logprobs for r in rows]
        requested = tuple(
            count for r, count in zip(rows, counts, strict=True) for _ in r.target_token_ids
        )
        max_top = max(count or 0 for count in counts)
        entries: list[TokenLogprobs | None] = []
        for chunk, logits in enumerate(chunk_logits):
            low, high = chunk * PROMPT_LOGPROB_ROWS, (chunk + 1) * PROMPT_LOGPROB_ROWS
            token_ids = torch.tensor(targets[low:high], device=self.device)
            entries.extend(compute_logprobs(logits, token_ids, requested[low:high], max_top))
        result = []
        offset = 0
        for r in rows:
            count = len(r.target_token_ids)
            scored = [entry for entry in entries[offset : offset + count] if entry is not None]
            result.append((r.request, scored))
            offset += count
        return result

    def sample(
        self,
        items: list[ScheduledRequest],
        logits: torch.Tensor,
        generators: Mapping[str, torch.Generator],
    ) -> list[SampledTokens]:
        """One token per plain request; a verification's kept tokens (`verify_drafts`). The rows
        of `logits` are the items' in order: one each, 1 + drafts for a verification."""
        if all(item.num_spec_tokens == 0 for item in items):
            return self._sample_rows([item.request for item in items], logits, generators)
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        row = 0
        for item in items:
            count = 1 + item.num_spec_tokens
            (spec_rows if item.num_spec_tokens else plain_rows).extend(range(row, row + count))
            row += count
        index = {id(item.request): i for i, item in enumerate(items)}
        results: list[SampledTokens | None] = [None] * len(items)
        plain = [item.request for item in items if not item.num_spec_tokens]
        if plain:
            rows_tensor = torch.tensor(plain_rows, device=logits.device)
            for result in self._sample_rows(plain, logits[rows_tensor], generators):
                results[index[id(result.request)]] = result
        verified = [item for item in items if item.num_spec_tokens]
        rows_tensor = torch.tensor(spec_rows, device=logits.device)
        for result in self._verify(verified, logits[rows_tensor], generators):
            results[index[id(result.request)]] = result
        assert all(result is not None for result in results)
        return [result for result in results if result is not None]

    def _sample_rows(
        self,
        requests: list[Request],
        logits: torch.Tensor,
        generators: Mapping[str, torch.Generator],
    ) -> list[SampledTokens]:
        if all(
            r.sampling_params.is_plain_greedy
            and r.num_output_tokens >= r.sampling_params.min_tokens
            for r in requests
        ):
            # The common benchmark and evaluation case: one argmax, no per-row tensors.
            token_ids: list[int] = argmax_rows(logits).tolist()
            return [
                SampledTokens(request, [token_id], None)
                for request, token_id in zip(requests, token_ids, strict=True)
            ]
        rows = [
            RowState(
                params=r.sampling_params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=generators.get(r.request_id),
            )
            for r in requests
        ]
        batch = SamplingBatch.build(rows, self.device, self.eos_token_ids)
        result = self.sampler(logits, batch)
        logprobs = result.logprobs or [None] * len(requests)
        return [
            SampledTokens(request, [token_id], None if entry is None else [entry])
            for request, token_id, entry in zip(requests, result.token_ids, logprobs, strict=True)
        ]

    def _verify(
        self,
        items: list[ScheduledRequest],
        logits: torch.Tensor,
        generators: Mapping[str, torch.Generator],
    ) -> list[SampledTokens]:
        """Speculative verification: row i of a request scores the token after its draft i - 1
        (row 0: after its last token), sampled as a plain run would at that position (penalties
        and min_tokens see the drafts before it as output)."""
        rows: list[RowState] = []
        proposals: list[DraftProposal] = []
        for item in items:
            r = item.request
            drafts = list(r.spec_token_ids)
            output = r.output_token_ids
            rows.extend(
                RowState(
                    params=r.sampling_params,
                    prompt_token_ids=r.prompt_token_ids,
                    output_token_ids=output + drafts[:i],
                    generator=generators.get(r.request_id),
                )
                for i in range(len(drafts) + 1)
            )
            proposals.append(DraftProposal(drafts, r.spec_draft_probs))
        batch = SamplingBatch.build(rows, self.device, self.eos_token_ids)
        kept = verify_drafts(logits, batch, proposals, self.generator)
        logprobs: list[TokenLogprobs | None] = []
        if batch.max_logprobs >= 0:
            # The log-probs of each kept token at its own row (row j holds token j's).
            first_rows = itertools.accumulate((len(p.token_ids) + 1 for p in proposals), initial=0)
            kept_rows = [
                first + j
                for first, tokens in zip(first_rows, kept, strict=False)
                for j in range(len(tokens))
            ]
            requested = tuple(batch.logprobs[row] for row in kept_rows)
            logprobs = compute_logprobs(
                logits[torch.tensor(kept_rows, device=logits.device)],
                torch.tensor([t for tokens in kept for t in tokens], device=logits.device),
                requested,
                batch.max_logprobs,
            )
        results = []
        offset = 0
        for item, tokens in zip(items, kept, strict=True):
            entries = None
            if item.request.sampling_params.logprobs is not None:
                entries = [e for e in logprobs[offset : offset + len(tokens)] if e is not None]
            offset += len(tokens)
            results.append(SampledTokens(item.request, tokens, entries, item.num_spec_tokens))
        return results

    # ------------------------------------------------------------------------ sizing

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's memory, scales included."""
        return sum(tensor.nbytes for tensor in self.kv_tensors)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = bytes_per_block(self.model_config, self.config.block_size, self.kv_cache_dtype)
        if self.draft is not None:
            per_block += self.draft.bytes_per_block(self.kv_cache_dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            budget = total * self.config.gpu_memory_utilization - used_by_others
            # Leave room for activations of the largest step and the logits.
            budget -= self._activation_reserve_bytes()
        else:
            budget = self.config.cpu_kv_cache_gib * 2**30
        num_blocks = int(budget // per_block)
        if num_blocks < 1:
            raise ValueError(
                "no memory left for the KV cache; lower the model size or raise "
                "gpu_memory_utilization / cpu_kv_cache_gib"
            )
        if self.device.type != "cuda":
            # Host memory is every process's: a small model takes no more than max_num_seqs
            # full-length sequences can fill, rather than the whole --cpu-kv-cache-gib.
            context = self.config.max_model_len or self.model_config.max_position_embeddings
            blocks_per_seq = -(-context // self.config.block_size)
            num_blocks = min(num_blocks, self.config.max_num_seqs * blocks_per_seq + 1)
        return num_blocks

    def _activation_reserve_bytes(self) -> int:
        tokens = self.config.max_num_batched_tokens
        cfg = self.model_config
        element = torch.empty((), dtype=self.dtype).element_size()
        per_token = 4 * (cfg.hidden_size + cfg.intermediate_size * 2) * element
        logits = self.config.max_num_seqs * cfg.vocab_size * 4 * 3
        return tokens * per_token + logits + 512 * 2**20

    def _max_model_len(self, num_blocks: int) -> int:
        positions = self.model_config.max_position_embeddings
        if self.config.max_model_len is not None and self.config.max_model_len > positions:
            # As vLLM does: positions past the trained ones give garbage, not an error.
            raise ValueError(
                f"max_model_len {self.config.max_model_len} exceeds the model's "
                f"max_position_embeddings ({positions}); leave it unset or use at most {positions}"
            )
        limit = self.config.max_model_len or positions
        pool_tokens = num_blocks * self.config.block_size
        if pool_tokens < limit:
            # A request longer than the whole pool could never be scheduled.
            logger.warning(
                "KV pool holds %d tokens, less than max_model_len %d: capping", pool_tokens, limit
            )
            limit = pool_tokens
        return limit
