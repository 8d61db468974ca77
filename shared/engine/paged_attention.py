"""The engine's `Attention`: write new K/V into the paged cache, then attend over it.

One instance serves one step, whose rows are decodes, then speculative verifications, then
prompt chunks (the first two take the decode kernels, chunks the prefill kernels); metadata work
is done at the first layer and reused. With an 8-bit cache every attention reads K/V as stored,
new prompt tokens included, so a token's result does not depend on where its prefix came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.kv_cache import KVCache
from nori.kernels import paged_decode_attention, paged_prefill_attention, store_kv_cache
from nori.kernels.decode_attention_reference import (
    ReferenceDecodePlan,
    paged_decode_attention_cpu,
    plan_reference_decode,
    run_reference_decode,
)
from nori.kernels.kv_quant import (
    dequantize_kv_reference,
    store_quantized_kv_cache,
    store_quantized_kv_cache_cpu,
    store_quantized_kv_cache_reference,
)
from nori.kernels.multi_query_decode_attention import (
    MultiQueryRows,
    multi_query_rows,
    paged_multi_query_decode_attention,
)
from nori.kernels.prefill_attention import paged_prefill_attention_reference
from nori.kernels.prefill_attention_cpu import CpuPrefillPlan, plan_cpu_prefill, run_cpu_prefill
from nori.kernels.store_kv import store_kv_cache_cpu


class PagedAttention:
    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata, backend: str) -> None:
        """backend: "triton", "cpu" (the C++ decode kernel, PyTorch otherwise) or "reference"."""
        self.kv_cache = kv_cache
        self.metadata = metadata
        self.backend = backend
        self.use_triton = backend == "triton"
        self._decode_plan: ReferenceDecodePlan | None = None
        self._prefill_plan: CpuPrefillPlan | None = None
        self._verify: _VerifyRows | None = None
        self._decode_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prefill_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def __call__(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        meta = self.metadata
        k_cache, v_cache = self._layer_caches(layer_index)
        self._store(key, value, k_cache, v_cache)
        num_decodes, num_sequences = meta.num_decodes, meta.seq_lens.shape[0]
        if num_decodes == num_sequences:
            return self._decode(query, k_cache, v_cache, scale)
        if num_decodes == 0 and meta.num_verifies == 0:
            return self._prefill(query, key, value, k_cache, v_cache, 0, 0, scale)
        if num_decodes == 0 and meta.num_verifies == num_sequences:
            verify = self._verify_rows(query.shape[0])
            return self._multi_query_decode(query, k_cache, v_cache, verify, scale)
        # Mixed step: decodes and verifications take the split-context kernel, chunks the tiled one.
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], k_cache, v_cache, scale)
        first_sequence = first_row = num_decodes
        if meta.num_verifies:
            verify = self._verify_rows(query.shape[0])
            rows = slice(num_decodes, verify.end_row)
            output[rows] = self._multi_query_decode(query[rows], k_cache, v_cache, verify, scale)
            first_sequence, first_row = num_decodes + meta.num_verifies, verify.end_row
        if first_sequence < num_sequences:
            output[first_row:] = self._prefill(
                query[first_row:],
                key[first_row:],
                value[first_row:],
                k_cache,
                v_cache,
                first_sequence,
                first_row,
                scale,
            )
        return output

    def _layer_caches(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V caches (`KVCache.layer`), its scales into `_scales`."""
        self._scales = self.kv_cache.layer_scales(layer_index)
        return self.kv_cache.layer(layer_index)

    def _store(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        slots = self.metadata.slot_mapping
        k_scale, v_scale = self._scales
        if k_scale is not None and v_scale is not None:
            quantized_args = (key, value, k_cache, v_cache, k_scale, v_scale, slots)
            if self.use_triton:
                store_quantized_kv_cache(*quantized_args, use_triton=True)
            elif self.backend == "cpu":
                store_quantized_kv_cache_cpu(*quantized_args)
            else:
                store_quantized_kv_cache_reference(*quantized_args)
            return
        if self.use_triton:
            store_kv_cache(key, value, k_cache, v_cache, slots, use_triton=True)
            return
        if self.backend == "cpu":
            store_kv_cache_cpu(key, value, k_cache, v_cache, slots)
            return
        # The engine never emits the kernel's "skip" slot (-1), so no masking is needed.
        flat_shape = (-1, *k_cache.shape[2:])
        k_cache.view(flat_shape).index_copy_(0, slots, key)
        v_cache.view(flat_shape).index_copy_(0, slots, value)

    def _decode(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention of the decode rows (the first query.shape[0] sequences, one token each)."""
        meta = self.metadata
        if self._decode_rows is None:
            rows = query.shape[0]
            self._decode_rows = (meta.block_tables, meta.seq_lens)
            if rows != meta.seq_lens.shape[0]:
                self._decode_rows = (meta.block_tables[:rows], meta.seq_lens[:rows])
        tables, seq_lens = self._decode_rows
        k_scale, v_scale = self._scales
        if self.use_triton:
            return paged_decode_attention(
                query,
                k_cache,
                v_cache,
                tables,
                seq_lens,
                scale,
                max_seq_len=meta.max_seq_len,
                use_triton=True,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        if self.backend == "cpu":
            return paged_decode_attention_cpu(
                query,
                k_cache,
                v_cache,
                tables,
                seq_lens,
                scale,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        if self._decode_plan is None:
            self._decode_plan = plan_reference_decode(tables, seq_lens, self.kv_cache.block_size)
        return run_reference_decode(
            query, k_cache, v_cache, self._decode_plan, scale, k_scale, v_scale
        )

    def _verify_rows(self, num_rows: int) -> _VerifyRows:
        """The verification rows' sequences and context lengths, built at the first layer."""
        if self._verify is not None:
            return self._verify
        meta = self.metadata
        first, end = meta.num_decodes, meta.num_decodes + meta.num_verifies
        # Their end is read from the device only when prompt chunks follow and it is unknown.
        if end == meta.seq_lens.shape[0]:
            end_row = num_rows
        elif meta.num_verify_end_row:
            end_row = meta.num_verify_end_row
        else:
            end_row = int(meta.query_start_loc[end])
        query_start_loc = meta.query_start_loc[first : end + 1] - first
        seq_lens = meta.seq_lens[first:end]
        rows = multi_query_rows(query_start_loc, seq_lens, end_row - first)
        tables = meta.block_tables[first:end]
        if self.use_triton:
            self._verify = _VerifyRows(end_row, query_start_loc, rows, tables, seq_lens)
            return self._verify
        # The CPU kernel and the reference take one decode row per verification row.
        row_tables = rows.expand(tables)
        plan = None
        if self.backend == "reference":
            plan = plan_reference_decode(row_tables, rows.seq_lens, self.kv_cache.block_size)
        self._verify = _VerifyRows(end_row, query_start_loc, rows, row_tables, seq_lens, plan)
        return self._verify

    def _multi_query_decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        verify: _VerifyRows,
        scale: float,
    ) -> torch.Tensor:
        """Attention of the verification rows, each a decode row over its visible context."""
        k_scale, v_scale = self._scales
        if self.use_triton:
            return paged_multi_query_decode_attention(
                *(query, k_cache, v_cache, verify.block_tables, verify.query_start_loc),
                *(verify.seq_lens, scale),
                max_seq_len=self.metadata.max_seq_len,
                k_scale=k_scale,
                v_scale=v_scale,
                use_triton=True,
                rows=verify.rows,
            )
        if verify.reference_plan is None:
            return paged_decode_attention_cpu(
                *(query, k_cache, v_cache, verify.block_tables, verify.rows.seq_lens, scale),
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return run_reference_decode(
            query, k_cache, v_cache, verify.reference_plan, scale, k_scale, v_scale
        )

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        first: int,
        first_row: int,
        scale: float,
    ) -> torch.Tensor:
        """The prefill kernel over sequences `first:`, whose rows start at `first_row`."""
        meta = self.metadata
        if self._prefill_rows is None:
            query_start_loc = meta.query_start_loc[first:]
            if first_row:
                query_start_loc = query_start_loc - first_row
            tables, seq_lens = meta.block_tables[first:], meta.seq_lens[first:]
            self._prefill_rows = (query_start_loc, tables, seq_lens)
        query_start_loc, tables, seq_lens = self._prefill_rows
        k_scale, v_scale = self._scales
        if self.backend == "cpu":
            if self._prefill_plan is None:
                self._prefill_plan = plan_cpu_prefill(query_start_loc, seq_lens)
            if k_scale is not None and v_scale is not None:
                slots = meta.slot_mapping[first_row:]
                key = _stored_rows(k_cache, k_scale, slots)
                value = _stored_rows(v_cache, v_scale, slots)
            return run_cpu_prefill(
                *(query, key, value, k_cache, v_cache, tables, query_start_loc, seq_lens, scale),
                self._prefill_plan,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        attention_args = (query, k_cache, v_cache, tables, query_start_loc, seq_lens, scale)
        if not self.use_triton:
            return paged_prefill_attention_reference(
                *attention_args, k_scale=k_scale, v_scale=v_scale
            )
        return paged_prefill_attention(
            *attention_args,
            use_triton=True,
            k_scale=k_scale,
            v_scale=v_scale,
        )


@dataclass(frozen=True)
class _VerifyRows:
    end_row: int  # the row after the last verification row
    query_start_loc: torch.Tensor  # [V + 1], counted from the first verification row
    rows: MultiQueryRows
    # Triton: the verifications' own block tables [V, M]; CPU kernel and reference: per row [R, M].
    block_tables: torch.Tensor
    seq_lens: torch.Tensor  # [V], the verifications' context lengths
    reference_plan: ReferenceDecodePlan | None = None  # the reference's gather plan


def _stored_rows(
    cache: torch.Tensor, cache_scale: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """The rows an 8-bit cache holds at `slots` [T], dequantized to [T, Hkv, D] float32."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    codes = cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_select(0, slots)
    scales = cache_scale.view(-1, num_kv_heads).index_select(0, slots)
    return dequantize_kv_reference(codes.view(cache.dtype), scales)
