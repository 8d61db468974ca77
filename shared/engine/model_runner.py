"""Owns the model weights and the KV cache tensors; runs one scheduler step on them, flattened
into the tensors the model and kernels read (`StepInputs`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.config import EngineConfig
from nori.engine.decode_graphs import DecodeGraphs, capture_sizes
from nori.engine.device import resolve_attention_backend, resolve_device, resolve_dtype
from nori.engine.draft_model import DraftModel
from nori.engine.dummy_step import profile_memory_budget
from nori.engine.follower_ranks import (
    Command,
    FollowerRanks,
    ReadBlocks,
    StepCommand,
    WriteBlocks,
    rank_group,
)
from nori.engine.kv_cache import KVCache, kv_cache_dtype, num_blocks_in_budget
from nori.engine.memory_profile import budget_summary, pool_summary
from nori.engine.outputs import ExpertRoutingCounts
from nori.engine.paged_attention import PagedAttention
from nori.engine.request import Request
from nori.engine.scheduler import SchedulerOutput
from nori.engine.step_inputs import StepInputs
from nori.engine.step_sampling import SampledStep, StepSampler
from nori.models.config import ModelConfig
from nori.models.loader import load_model
from nori.models.shard import local_model_config
from nori.parallel.group import TensorParallelGroup
from nori.sampling.batch import make_generator
from nori.sampling.logprobs import TokenLogprobs

logger = logging.getLogger(__name__)


class StepResult(NamedTuple):
    # None when no request samples in the step.
    sampled: SampledStep | None
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
        if config.dtype == "auto" and self.device.type == "cpu" and rank == 0:
            logger.info(
                "dtype %s (auto: %s)",
                str(self.dtype).removeprefix("torch."),
                "this CPU has bf16 instructions"
                if self.dtype is torch.bfloat16
                else "a float32 checkpoint, or a CPU without bf16 instructions",
            )
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
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        try:
            self._load(config, model_dir)
        except BaseException:
            self.close()  # the followers would otherwise wait for a rank 0 that is gone
            raise
        self.max_model_len = self._max_model_len(self.kv_cache.num_blocks)
        logger.info(pool_summary(self.kv_cache.num_blocks, config.block_size, self.max_model_len))
        self._inputs = StepInputs(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            -(-self.max_model_len // config.block_size),
            self.device,
        )
        # Unseeded requests' draws (plain sampling and speculative verification).
        self.generator = make_generator(config.seed, self.device)
        self.sampling = StepSampler(self.device, eos_token_ids, self.generator)
        self.graphs: DecodeGraphs | None = None
        if self._wants_graphs():
            self.capture_graphs(DecodeGraphs(capture_sizes(config.max_num_seqs)))
        parallel = ""
        if self.parallel is not None:
            expert = ", expert parallel" if self.parallel.expert_parallel else ""
            parallel = f", rank {rank} of {config.tensor_parallel_size}{expert}"
        quantized = f", {config.quantization} weights" if config.quantization else ""
        kv_dtype = str(self.kv_cache_dtype).replace("torch.", "")
        logger.info(
            f"model {model_dir.name} on {self.device} ({self.dtype}{quantized}{parallel}, "
            f"{self.attention_backend} attention): {self.kv_cache.num_blocks} KV blocks of "
            f"{config.block_size} tokens ({kv_dtype}, {self.kv_cache_bytes / 2**20:.1f} MiB), "
            f"max_model_len {self.max_model_len}"
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
        draft_bytes = 0 if self.draft is None else self.draft.bytes_per_block(self.kv_cache_dtype)
        profile = None
        if self.device.type == "cuda" and config.num_kv_blocks is None:
            graph_sizes = capture_sizes(config.max_num_seqs) if self._wants_graphs() else ()
            profile = profile_memory_budget(
                *(self.model, config, self.local_model_config, self.dtype, self.kv_cache_dtype),
                *(self.attention_backend, graph_sizes),
            )
            logger.info(budget_summary(profile, config.gpu_memory_utilization))
        num_blocks = num_blocks_in_budget(
            config, self.model_config, self.kv_cache_dtype, self.device, draft_bytes, profile
        )
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

    def _wants_graphs(self) -> bool:
        """Decode graphs run on one CUDA device with the Triton kernels, for dense models (a
        MoE layer's routing counts would include the padding rows)."""
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and self.followers is None
            and self.parallel is None
            and self.attention_backend == "triton"
            and not self.model_config.is_moe
        )

    @torch.inference_mode()
    def capture_graphs(self, graphs: DecodeGraphs) -> None:
        """Captures `graphs` over the step-input buffers, which hold padding meanwhile."""
        self._inputs.pad_decodes(0, graphs.sizes[-1])
        graphs.capture(self._decode_forward, self.device)
        self.graphs = graphs

    def _decode_forward(self, size: int) -> torch.Tensor:
        """The model over the first `size` rows of the step-input buffers, all decodes."""
        input_ids, positions, metadata = self._inputs.decode_batch(size, self.max_model_len)
        attention = PagedAttention(self.kv_cache, metadata, self.attention_backend)
        return self.model(input_ids, positions, attention)

    def make_generator(self, seed: int) -> torch.Generator:
        return make_generator(seed, self.device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(
        self,
        output: SchedulerOutput,
        generators: Mapping[str, torch.Generator],
        previous: SampledStep | None = None,
    ) -> StepResult:
        """Runs the step. `previous`: the step before, if its tokens are still pending; the
        rows that continue from them read their input ids from its device tensor."""
        inputs = self._inputs.build(output, self.config.block_size, previous)
        sampling = [s for s in output.scheduled if s.samples]
        # The prompt-logprob rows in chunks, then the sampled rows: decided before the forward
        # pass, so that tensor-parallel followers gather the same batches in the same order.
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
            return StepResult(None, prompt_logprobs)
        sampled = self.sampling.sample(sampling, logits[-1], generators)
        return StepResult(sampled, prompt_logprobs)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_rows: Sequence[torch.Tensor],
    ) -> list[torch.Tensor]:
        """The model over the step's tokens, then the logits of each batch of rows. A pure
        decode step replays the graph of its padded size, if there is one."""
        num_seqs, graphs = metadata.seq_lens.shape[0], self.graphs
        size = None
        if graphs is not None and metadata.num_decodes == num_seqs:
            size = graphs.padded_size(num_seqs)
        if graphs is None or size is None:
            attention = PagedAttention(self.kv_cache, metadata, self.attention_backend)
            hidden = self.model(input_ids, positions, attention)
        else:
            self._inputs.pad_decodes(num_seqs, size)
            hidden = graphs.replay(size)
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

    @property
    def kv_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a request's blocks live in (`KVCache.tensors`): the model's, then a
        draft model's (speculative decoding), all indexed by the same block ids."""
        if self.draft is None or self.draft.kv_cache is None:
            return self.kv_cache.tensors
        return self.kv_cache.tensors + self.draft.kv_cache.tensors

    def expert_routing_counts(self) -> ExpertRoutingCounts | None:
        """Tokens routed to each expert of each routed layer since the model loaded (None for a
        dense model). Waits for the device. Every rank counts every token, so rank 0's counts
        are the whole count; engines sharing this runner read the counts of all of them."""
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
