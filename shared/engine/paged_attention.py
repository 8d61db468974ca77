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
        use_triton = self.use_triton
        store_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping, use_triton=use_triton)
        num_decodes = meta.num_decodes
        num_seqs = meta.seq_lens.shape[0]
        if num_decodes == num_seqs:
            return paged_decode_attention(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                max_seq_len=meta.max_seq_len,
                use_triton=use_triton,
            )
        if num_decodes == 0:
            return paged_prefill_attention(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                use_triton=use_triton,
            )
        # Mixed step: decodes go through the split-context kernel, prefill chunks through the
        # tiled one; each is the faster path for its shape.
        output = torch.empty_like(query)
        output[:num_decodes] = paged_decode_attention(
            query[:num_decodes],
            k_cache,
            v_cache,
            meta.block_tables[:num_decodes],
            meta.seq_lens[:num_decodes],
            scale,
            max_seq_len=meta.max_seq_len,
            use_triton=use_triton,
        )
        output[num_decodes:] = paged_prefill_attention(
            query[num_decodes:],
            k_cache,
            v_cache,
            meta.block_tables[num_decodes:],
            meta.query_start_loc[num_decodes:] - num_decodes,
            meta.seq_lens[num_decodes:],
            scale,
            use_triton=use_triton,
        )
        return output
