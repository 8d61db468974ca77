"""Owns the model weights and the KV cache tensors; runs one scheduler step on them."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from nori.engine.batch_inputs import PromptLogprobRows, build_batch_inputs
from nori.engine.config import EngineConfig
from nori.engine.device import resolve_attention_backend, resolve_device, resolve_dtype
from nori.engine.kv_cache import KVCache, bytes_per_block, kv_cache_dtype
from nori.engine.paged_attention import PagedAttention
from nori.engine.request import Request
from nori.engine.scheduler import SchedulerOutput
from nori.kernels.argmax import argmax_rows
from nori.models.config import ModelConfig
from nori.models.loader import load_model
from nori.sampling.batch import RowState, SamplingBatch, make_generator
from nori.sampling.logprob_math import compute_logprobs
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

# Prompt-logprob rows go through the LM head this many at a time: a long prompt's [rows, vocab]
# logits would otherwise take as much memory as the KV of thousands of tokens.
PROMPT_LOGPROB_ROWS = 512


@dataclass(frozen=True)
class SampledToken:
    request: Request
    token_id: int
    logprobs: TokenLogprobs | None


class StepResult(NamedTuple):
    sampled: list[SampledToken]
    # Requests that want prompt logprobs and computed prompt tokens in the step: the log-probs of
    # the prompt tokens they scored, in order, to append to `Request.prompt_logprobs`.
    prompt_logprobs: list[tuple[Request, list[TokenLogprobs]]]


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_dir: Path, eos_token_ids: frozenset[int] = frozenset()
    ) -> None:
        self.config = config
        # Masked until a request reaches min_tokens.
        self.eos_token_ids = eos_token_ids
        self.device = resolve_device(config.device)
        model_config = ModelConfig.from_dir(model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        self.model, self.model_config = load_model(
            model_dir,
            self.dtype,
            self.device,
            config.load_format,
            seed=config.seed,
            quantization=config.quantization,
            quantize_lm_head=config.quantize_lm_head,
        )
        self.kv_cache_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        num_blocks = self._num_kv_blocks()
        self.kv_cache = KVCache.allocate(
            self.model_config, num_blocks, config.block_size, self.kv_cache_dtype, self.device
        )
        self.max_model_len = self._max_model_len(num_blocks)
        self.sampler = Sampler(make_generator(config.seed, self.device))
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        logger.info(
            "model %s on %s (%s%s, %s attention): %d KV blocks of %d tokens (%s, %.1f MiB), "
            "max_model_len %d",
            model_dir.name,
            self.device,
            self.dtype,
            f", {config.quantization} weights" if config.quantization else "",
            self.attention_backend,
            num_blocks,
            config.block_size,
            str(self.kv_cache_dtype).replace("torch.", ""),
            self.kv_cache_bytes / 2**20,
            self.max_model_len,
        )

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
        attention = PagedAttention(self.kv_cache, inputs.attention, self.attention_backend)
        hidden = self.model(inputs.input_ids, inputs.positions, attention)
        prompt_logprobs = self._prompt_logprobs(hidden, inputs.prompt_logprob_rows)
        requests = [s.request for s in output.scheduled if s.samples]
        if not requests:
            return StepResult([], prompt_logprobs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return StepResult(self.sample(requests, logits, generators), prompt_logprobs)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: list[PromptLogprobRows]
    ) -> list[tuple[Request, list[TokenLogprobs]]]:
        """log_softmax of the raw logits at each scored prompt position (as vLLM reports prompt
        logprobs), with the requested number of most likely alternatives."""
        if not rows:
            return []
        indices = [r.first_row + k for r in rows for k in range(len(r.target_token_ids))]
        targets = [token for r in rows for token in r.target_token_ids]
        counts = [r.request.sampling_params.prompt_logprobs for r in rows]
        requested = tuple(
            count for r, count in zip(rows, counts, strict=True) for _ in r.target_token_ids
        )
        max_top = max(count or 0 for count in counts)
        entries: list[TokenLogprobs | None] = []
        for low in range(0, len(indices), PROMPT_LOGPROB_ROWS):
            high = low + PROMPT_LOGPROB_ROWS
            index = torch.tensor(indices[low:high], device=self.device)
            logits = self.model.compute_logits(hidden[index])
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
        requests: list[Request],
        logits: torch.Tensor,
        generators: Mapping[str, torch.Generator],
    ) -> list[SampledToken]:
        if all(
            r.sampling_params.is_plain_greedy
            and r.num_output_tokens >= r.sampling_params.min_tokens
            for r in requests
        ):
            # The common benchmark and evaluation case: one argmax, no per-row tensors.
            token_ids: list[int] = argmax_rows(logits).tolist()
            return [
                SampledToken(request, token_id, None)
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
            SampledToken(request, token_id, token_logprobs)
            for request, token_id, token_logprobs in zip(
                requests, result.token_ids, logprobs, strict=True
            )
        ]

    # ------------------------------------------------------------------------ sizing

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's memory, scales included."""
        return sum(tensor.nbytes for tensor in self.kv_cache.tensors)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = bytes_per_block(self.model_config, self.config.block_size, self.kv_cache_dtype)
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
