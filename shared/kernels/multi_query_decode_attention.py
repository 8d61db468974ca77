"""Multi-query decode: a few query rows per sequence over its paged context, causal among
themselves (speculative verification: the last sampled token and its k drafts).

Row i of q_len new rows over seq_len context tokens (new rows included) sees [0, seq_len -
(q_len - 1 - i)), as a decode row with that context: every path is decode attention per row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.kernels._common import check_paged_attention_args, should_use_triton
from nori.kernels.decode_attention import MAX_SPLITS, launch_decode
from nori.kernels.decode_attention_reference import (
    paged_decode_attention_cpu,
    paged_decode_attention_reference,
)


@dataclass(frozen=True)
class MultiQueryRows:
    """Each query row's sequence and visible context length, built once per step."""

    sequences: torch.Tensor  # [T] int32, index into block_tables and seq_lens
    seq_lens: torch.Tensor  # [T] int32, the positions each row sees (its own included)

    def expand(self, per_sequence: torch.Tensor) -> torch.Tensor:
        return per_sequence.index_select(0, self.sequences)


def multi_query_rows(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_rows: int
) -> MultiQueryRows:
    """From query_start_loc [B + 1] and seq_lens [B] (int32), on their device, no host sync."""
    device = seq_lens.device
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    sequences = torch.repeat_interleave(
        torch.arange(seq_lens.shape[0], dtype=torch.int32, device=device),
        q_lens,
        output_size=num_rows,
    )
    rows = torch.arange(num_rows, dtype=torch.int32, device=device)
    # A row sees one position fewer for each later row of its sequence.
    later_rows = query_start_loc[1:].index_select(0, sequences) - 1 - rows
    row_lens = seq_lens.index_select(0, sequences) - later_rows
    return MultiQueryRows(sequences, row_lens.to(torch.int32))


def paged_multi_query_decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PyTorch reference: `paged_decode_attention_reference`, one decode row per query row."""
    rows = multi_query_rows(query_start_loc, seq_lens, query.shape[0])
    tables = rows.expand(block_tables)
    return paged_decode_attention_reference(
        query, k_cache, v_cache, tables, rows.seq_lens, scale, k_scale, v_scale
    )


def paged_multi_query_decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The C++ CPU decode kernel, one decode row per query row; the reference's contract for CPU
    tensors. Raises RuntimeError where the kernel cannot be built."""
    rows = multi_query_rows(query_start_loc, seq_lens, query.shape[0])
    tables = rows.expand(block_tables)
    return paged_decode_attention_cpu(
        query, k_cache, v_cache, tables, rows.seq_lens, scale, k_scale, v_scale
    )


def paged_multi_query_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    use_triton: bool | None = None,
    rows: MultiQueryRows | None = None,
) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D]: sequence b owns rows query_start_loc[b] ..
    query_start_loc[b + 1] (int32 [B + 1]) and has seq_lens[b] (int32 [B]) cached tokens, its
    new rows included (q_len <= seq_lens[b]); row i sees [0, seq_lens[b] - (q_len - 1 - i)).
    Other arguments as `paged_decode_attention`'s; rows: `multi_query_rows` of them, if kept."""
    args = check_paged_attention_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        query_start_loc,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    query, k_cache, v_cache, block_tables, seq_lens, starts, _ = args
    assert starts is not None  # given query_start_loc, the check returns it checked
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    if not should_use_triton(use_triton, [query]):
        reference_args = (block_tables, starts, seq_lens, scale)
        return paged_multi_query_decode_attention_reference(
            query, k_cache, v_cache, *reference_args, k_scale, v_scale
        )
    if rows is None:
        rows = multi_query_rows(starts, seq_lens, query.shape[0])
    kernel_args = (num_splits, max_seq_len, k_scale, v_scale, rows.sequences)
    return launch_decode(query, k_cache, v_cache, block_tables, rows.seq_lens, scale, *kernel_args)
