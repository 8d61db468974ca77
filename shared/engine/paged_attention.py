"""The engine's `Attention`: write new K/V into the paged cache, then attend over it."""

from __future__ import annotations

import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.kv_cache import KVCache
from nori.kernels import paged_decode_attention, paged_prefill_attention, store_kv_cache


class PagedAttention:
    def __init__(
        self, kv_cache: KVCache, metadata: AttentionMetadata, use_triton: bool | None = None
    ) -> None:
        """use_triton None: the kernels decide by device (Triton on GPU)."""
        self.kv_cache = kv_cache
        self.metadata = metadata
        self.use_triton = use_triton

    def __call__(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        meta = self.metadata
        k_cache, v_cache = self.kv_cache.layer(layer_index)
        store_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping, use_triton=self.use_triton)
        num_decodes = meta.num_decodes
        if num_decodes == meta.seq_lens.shape[0]:
            return self._decode(query, k_cache, v_cache, slice(None), scale)
        if num_decodes == 0:
            return self._prefill(query, k_cache, v_cache, 0, scale)
        # Mixed step: decodes go through the split-context kernel, prefill chunks through the
        # tiled one; each is the faster path for its shape.
        output = torch.empty_like(query)
        output[:num_decodes] = self._decode(
            query[:num_decodes], k_cache, v_cache, slice(num_decodes), scale
        )
        output[num_decodes:] = self._prefill(
            query[num_decodes:], k_cache, v_cache, num_decodes, scale
        )
        return output

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: slice,
        scale: float,
    ) -> torch.Tensor:
        """The decode kernel over the sequences in `rows` (one query token each)."""
        meta = self.metadata
        return paged_decode_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables[rows],
            meta.seq_lens[rows],
            scale,
            max_seq_len=meta.max_seq_len,
            context_starts=None if meta.context_starts is None else meta.context_starts[rows],
            use_triton=self.use_triton,
        )

    def _prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        first: int,
        scale: float,
    ) -> torch.Tensor:
        """The prefill kernel over sequences `first:` (which are also query rows `first:`)."""
        meta = self.metadata
        query_start_loc = meta.query_start_loc[first:]
        if first:
            query_start_loc = query_start_loc - first
        return paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables[first:],
            query_start_loc,
            meta.seq_lens[first:],
            scale,
            context_starts=None if meta.context_starts is None else meta.context_starts[first:],
            use_triton=self.use_triton,
        )
