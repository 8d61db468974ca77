"""Speculative decoding's draft model: a smaller model with the target's tokenizer that drafts
tokens autoregressively, with its own paged K/V indexed by the target's block ids.

One block table for both: whatever moves or frees a request's blocks moves or frees the draft's
K/V too (`ModelRunner.kv_tensors`). Invariant: the draft computes every step the target computes,
on the same tokens and slots (`mirror`). `propose` writes K/V at the verification's slots, which
the verification's mirror rewrites."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.config import EngineConfig
from nori.engine.kv_cache import KVCache, bytes_per_block
from nori.engine.paged_attention import PagedAttention
from nori.engine.request import Request
from nori.models.config import ModelConfig
from nori.models.demo import resolve_model
from nori.models.loader import load_model
from nori.sampling.batch import RowState, SamplingBatch
from nori.sampling.sampler import target_probs
from nori.sampling.speculative import draw_tokens

if TYPE_CHECKING:
    from nori.engine.step_inputs import BatchInputs


class DraftModel:
    def __init__(
        self,
        config: EngineConfig,
        target: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str,
        eos_token_ids: frozenset[int],
    ) -> None:
        """Loads the weights; the cache comes with `allocate_kv_cache` once the pool size is known."""
        speculative = config.speculative_config
        assert speculative is not None and speculative.model is not None
        model_dir = resolve_model(speculative.model)
        self.model, self.model_config = load_model(
            model_dir,
            dtype,
            device,
            config.load_format,
            seed=config.seed + 1,
            quantization=config.quantization,
        )
        if self.model_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model {speculative.model!r} has a vocabulary of "
                f"{self.model_config.vocab_size} tokens, the model {target.vocab_size}: "
                "a draft model must share the model's tokenizer"
            )
        self.kv_cache: KVCache | None = None
        self.block_size = config.block_size
        self.device = device
        self.attention_backend = attention_backend
        self.eos_token_ids = eos_token_ids

    def bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        return bytes_per_block(self.model_config, self.block_size, kv_dtype)

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> KVCache:
        """The draft's cache tensors, as many blocks as the model's pool."""
        self.kv_cache = KVCache.allocate(
            self.model_config, num_blocks, self.block_size, kv_dtype, self.device
        )
        return self.kv_cache

    def mirror(self, inputs: BatchInputs) -> None:
        """The draft's K/V for the tokens the target computes in this step, at the same slots."""
        assert self.kv_cache is not None
        attention = PagedAttention(self.kv_cache, inputs.attention, self.attention_backend)
        self.model(inputs.input_ids, inputs.positions, attention)

    def propose(
        self,
        drafting: Sequence[tuple[Request, int]],
        generator: torch.Generator | None,
    ) -> None:
        """Sets each request's `spec_token_ids` (`count` drafts) and, for a sampled request,
        `spec_draft_probs`; greedy drafts are the draft model's argmax."""
        drafts: dict[int, list[int]] = {id(request): [] for request, _ in drafting}
        probs: dict[int, list[torch.Tensor]] = {id(request): [] for request, _ in drafting}
        for step in range(max(count for _, count in drafting)):
            rows = [request for request, count in drafting if count > step]
            tokens = [drafts[id(r)][-1] if step else r.token_ids[-1] for r in rows]
            positions = [r.num_tokens - 1 + step for r in rows]
            logits = self._decode(rows, tokens, positions)
            batch = SamplingBatch.build(
                [
                    RowState(
                        params=r.sampling_params,
                        prompt_token_ids=r.prompt_token_ids,
                        output_token_ids=r.output_token_ids + drafts[id(r)],
                        generator=r.generator,
                    )
                    for r in rows
                ],
                self.device,
                self.eos_token_ids,
            )
            row_probs = target_probs(logits, batch)
            chosen = draw_tokens(row_probs, batch.generators, generator)
            for index, (request, token) in enumerate(zip(rows, chosen, strict=True)):
                drafts[id(request)].append(token)
                probs[id(request)].append(row_probs[index])
        for request, _ in drafting:
            request.spec_token_ids = drafts[id(request)]
            greedy = request.sampling_params.is_greedy
            request.spec_draft_probs = None if greedy else torch.stack(probs[id(request)])

    def _decode(
        self, requests: list[Request], tokens: list[int], positions: list[int]
    ) -> torch.Tensor:
        """One single-token step of the draft over `requests`: the logits [rows, vocab]."""
        size = self.block_size
        slots = [
            r.block_ids[p // size] * size + p % size
            for r, p in zip(requests, positions, strict=True)
        ]
        width = max(len(r.block_ids) for r in requests)
        tables = [r.block_ids + [0] * (width - len(r.block_ids)) for r in requests]
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decodes=len(requests),
            seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device),
            query_start_loc=torch.arange(len(requests) + 1, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            max_seq_len=max(positions) + 1,
        )
        assert self.kv_cache is not None
        attention = PagedAttention(self.kv_cache, metadata, self.attention_backend)
        hidden = self.model(
            torch.tensor(tokens, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            attention,
        )
        return self.model.compute_logits(hidden)
