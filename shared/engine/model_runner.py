"""Owns the model weights and the KV cache tensors; runs one scheduler step on them."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.batch_inputs import build_batch_inputs
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
from nori.engine.scheduler import SchedulerOutput
from nori.engine.step_sampling import SampledTokens, StepSampler
from nori.models.config import ModelConfig
from nori.models.loader import load_model
from nori.models.shard import local_model_config
from nori.parallel.group import TensorParallelGroup
from nori.sampling.batch import make_generator
from nori.sampling.logprobs import TokenLogprobs

logger = logging.getLogger(__name__)


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
        self.sampling = StepSampler(self.device, eos_token_ids, self.generator)
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
        prompt_chunks = self.sampling.prompt_logprob_chunks(inputs.prompt_logprob_rows)
        logits_rows = (*prompt_chunks, *([inputs.logits_indices] if sampling else []))
        if self.followers is not None:
            self.followers.send(
                StepCommand(inputs.input_ids, inputs.positions, inputs.attention, logits_rows)
            )
        logits = self._forward(inputs.input_ids, inputs.positions, inputs.attention, logits_rows)
        if self.draft is not None:
            self.draft.mirror(inputs)
        prompt_logprobs = self.sampling.prompt_logprobs(
            logits[: len(prompt_chunks)], inputs.prompt_logprob_rows
        )
        if not sampling:
            return StepResult([], prompt_logprobs)
        sampled = self.sampling.sample(sampling, logits[-1], generators)
        return StepResult(sampled, prompt_logprobs)

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
