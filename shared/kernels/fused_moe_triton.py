"""The fused mixture-of-experts layer in Triton: a grouped GEMM over expert-sorted tokens.

Same contract as `fused_experts_reference` (fused_moe.py). The T*k (token, slot) pairs are sorted
by expert and padded to a multiple of BLOCK_M, so an M-block belongs to one expert, with no host
sync; `_grouped_gemm_kernel` runs for gate/up, then for down."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nori.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_same_device,
    check_tensor,
    dot_precision,
    jit,
    upcast_dot_operands,
)
from nori.kernels.silu_and_mul import silu_and_mul_reference

with contextlib.suppress(ImportError):
    import triton.language as tl

QUANTIZED_WEIGHT_DTYPES: tuple[torch.dtype, ...] = (torch.int8, torch.float8_e4m3fn)
MIN_DOT_DIM = 16
# From this many pairs per expert on average, taller M-blocks reuse each weight tile more.
TALL_BLOCK_PAIRS_PER_EXPERT = 64


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes: BLOCK_M rows of one expert by BLOCK_N output columns, stepping BLOCK_K."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < MIN_DOT_DIM or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {MIN_DOT_DIM}, got {value}")


def default_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """16-row blocks for decode-sized batches (little padding per expert), 64 for prefill."""
    if num_pairs >= TALL_BLOCK_PAIRS_PER_EXPERT * num_experts:
        return MoeTiles(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    return MoeTiles()


class ExpertAlignment(NamedTuple):
    """The (token, slot) pairs laid out by expert, in blocks of `block_m` rows.

    sorted_pair_ids: int32 [num_blocks * block_m]; each expert's pairs in ascending pair order,
        its group padded to a multiple of block_m with the sentinel T*k (also filling the
        buffer past the padded total); experts in ascending order, empty ones taking no block.
    block_expert_ids: int32 [num_blocks]; the expert of each block, -1 past the padded total.
    num_padded_pairs: int64 0-d tensor; the padded total (a multiple of block_m), on the device."""

    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    num_padded_pairs: torch.Tensor


def align_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> ExpertAlignment:
    """Sorts the pairs of topk_ids [T, k] by expert and pads each group to block_m; pairs whose
    id is outside [0, num_experts) are dropped. No host sync: blocks past the total are -1."""
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"need num_experts >= 1 and block_m >= 1, got {num_experts}, {block_m}")
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    num_blocks = cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    capacity = num_blocks * block_m

    experts = topk_ids.reshape(-1).long()
    kept = (experts >= 0) & (experts < num_experts)
    # Dropped pairs go to an extra bucket E, which sorts after every expert and gets no block.
    buckets = torch.where(kept, experts, num_experts)
    # scatter_add_ rather than bincount, which reads the largest id back to the host on CUDA.
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, buckets, torch.ones_like(buckets))
    group_starts = counts.cumsum(0) - counts
    padded_counts = _cdiv_tensor(counts[:num_experts], block_m) * block_m
    padded_ends = padded_counts.cumsum(0)
    padded_starts = padded_ends - padded_counts

    order = torch.argsort(buckets, stable=True)
    sorted_buckets = buckets[order]
    rank_in_group = torch.arange(num_pairs, device=device) - group_starts[sorted_buckets]
    kept_sorted = sorted_buckets < num_experts
    group_padded_starts = padded_starts[sorted_buckets.clamp(max=num_experts - 1)]
    destinations = torch.where(kept_sorted, group_padded_starts + rank_in_group, capacity)
    sorted_pair_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, destinations, order.to(torch.int32))

    block_starts = torch.arange(num_blocks, device=device) * block_m
    # The number of groups ending at or before the block's first row (empty ones are passed).
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert_ids = torch.where(block_experts < num_experts, block_experts, -1)
    return ExpertAlignment(
        sorted_pair_ids[:capacity],
        block_expert_ids.to(torch.int32),
        padded_ends[-1],
    )


def _cdiv_tensor(values: torch.Tensor, divisor: int) -> torch.Tensor:
    return (values + divisor - 1) // divisor


def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    scale_ptr,
    routing_weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_pairs,
    a_rows_per_pair_divisor,
    N,
    K,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_se,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    MUL_ROUTING_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
) -> None:
    """c[pair, cols] = a[pair // divisor, :] @ b[expert, cols, :]^T (* scale[expert, cols])
    (* routing_weight[pair]) for the BLOCK_M pairs of this M-block, all of one expert; one
    program per (M-block, N-block), the weight read through its strides (any memory order)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ids_ptr + block)
    if expert < 0:
        return
    pair_ids = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair_ids < num_pairs
    a_rows = pair_ids // a_rows_per_pair_divisor
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    # int64: row * stride passes 2**31 for long prompts times k, and for big expert stacks.
    a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak
    b_ptrs = (
        b_ptr
        + expert.to(tl.int64) * stride_be
        + cols[None, :].to(tl.int64) * stride_bn
        + ks[:, None] * stride_bk
    )

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = ks < K - k_start
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
        # Masked weights must be zeros too: a stray fp8 byte 0x7F is NaN, and NaN * 0 is NaN.
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        # int8 and e4m3 convert exactly to every float dtype, so the dot sees the stored values.
        acc = tl.dot(a, b.to(a.dtype), acc=acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_SCALE:
        scale = tl.load(
            scale_ptr + expert.to(tl.int64) * stride_se + cols * stride_sn,
            mask=col_mask,
            other=0.0,
        )
        acc = acc * scale[None, :]
    if MUL_ROUTING_WEIGHT:
        weights = tl.load(routing_weights_ptr + pair_ids, mask=row_mask, other=0.0)
        acc = acc * weights.to(tl.float32)[:, None]
    c_ptrs = c_ptr + pair_ids[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    weights: torch.Tensor,
    scale: torch.Tensor | None,
    out: torch.Tensor,
    alignment: ExpertAlignment,
    a_rows_per_pair_divisor: int,
    routing_weights: torch.Tensor | None,
    tiles: MoeTiles,
) -> None:
    """out[pair] = a[pair // divisor] @ weights[expert(pair)]^T for every kept pair, in place;
    rows of dropped pairs are left as they were."""
    num_pairs, out_features = out.shape
    in_features = weights.shape[2]
    grid = (alignment.block_expert_ids.shape[0], cdiv(out_features, tiles.block_n))
    jit(_grouped_gemm_kernel)[grid](
        a,
        weights,
        out,
        out if scale is None else scale,
        out if routing_weights is None else routing_weights,
        alignment.sorted_pair_ids,
        alignment.block_expert_ids,
        num_pairs,
        a_rows_per_pair_divisor,
        out_features,
        in_features,
        a.stride(0),
        a.stride(1),
        weights.stride(0),
        weights.stride(1),
        weights.stride(2),
        out.stride(0),
        out.stride(1),
        0 if scale is None else scale.stride(0),
        0 if scale is None else scale.stride(1),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        HAS_SCALE=scale is not None,
        MUL_ROUTING_WEIGHT=routing_weights is not None,
        DOT_PRECISION=dot_precision(a.dtype),
        UPCAST_DOT=upcast_dot_operands(a.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def fused_experts_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    *,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H] in hidden's dtype: `fused_experts_reference`'s contract, as two
    grouped GEMMs over expert-sorted pairs (always Triton; the caller picks the path). w13
    [E, 2I, H] and w2 [E, H, I] in any strides; float, or int8/float8_e4m3fn with w13_scale
    [E, 2I] / w2_scale [E, H] (float32). Accumulates in float32. `tiles`: the tile sizes."""
    _check_args(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate_size = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or num_experts == 0:
        return torch.zeros_like(hidden)
    tiles = tiles or default_tiles(num_pairs, num_experts)
    alignment = align_pairs_by_expert(topk_ids, num_experts, tiles.block_m)

    gate_up = torch.empty(
        num_pairs, 2 * intermediate_size, dtype=hidden.dtype, device=hidden.device
    )
    _grouped_gemm(hidden, w13, w13_scale, gate_up, alignment, top_k, None, tiles)
    activation = silu_and_mul_reference(gate_up)
    # Zeros: a dropped pair's row is never written and must add nothing to its token.
    per_slot = torch.zeros(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    routing_weights = topk_weights.reshape(-1)
    _grouped_gemm(activation, w2, w2_scale, per_slot, alignment, 1, routing_weights, tiles)
    return (
        per_slot.view(num_tokens, top_k, hidden_size)
        .sum(dim=1, dtype=torch.float32)
        .to(hidden.dtype)
    )


def _check_args(
    hidden: object,
    w13: object,
    w2: object,
    topk_weights: object,
    topk_ids: object,
    w13_scale: object | None,
    w2_scale: object | None,
) -> None:
    x = check_tensor("hidden", hidden, 2, FLOAT_DTYPES)
    ids = check_tensor("topk_ids", topk_ids, 2, INDEX_DTYPES)
    routing = check_tensor("topk_weights", topk_weights, 2, FLOAT_DTYPES)
    if routing.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_weights and topk_ids must both be [T, k] with T = {x.shape[0]}, got "
            f"{tuple(routing.shape)} and {tuple(ids.shape)}"
        )
    tensors = {"hidden": x, "topk_ids": ids, "topk_weights": routing}
    gate_up = _check_expert_weight("w13", w13, "w13_scale", w13_scale, tensors)
    down = _check_expert_weight("w2", w2, "w2_scale", w2_scale, tensors)
    num_experts, hidden_size, intermediate_size = down.shape
    if gate_up.shape != (num_experts, 2 * intermediate_size, hidden_size):
        raise ValueError(
            f"w13 must be [E, 2I, H] = [{num_experts}, {2 * intermediate_size}, {hidden_size}] "
            f"to match w2 [E, H, I], got {tuple(gate_up.shape)}"
        )
    if x.shape[1] != hidden_size:
        raise ValueError(
            f"hidden has {x.shape[1]} features but w2 is [E, H, I] with H = {hidden_size}"
        )
    check_same_device(tensors)


def _check_expert_weight(
    name: str,
    weight: object,
    scale_name: str,
    scale: object | None,
    tensors: dict[str, torch.Tensor],
) -> torch.Tensor:
    """A float [E, out, in] stack, or a quantized one with its float32 [E, out] scales."""
    if scale is None:
        stack = check_tensor(name, weight, 3, FLOAT_DTYPES)
    else:
        stack = check_tensor(name, weight, 3, QUANTIZED_WEIGHT_DTYPES)
        scales = check_tensor(scale_name, scale, 2, (torch.float32,))
        if scales.shape != stack.shape[:2]:
            raise ValueError(
                f"{scale_name} must be [E, out] = {tuple(stack.shape[:2])}, "
                f"got {tuple(scales.shape)}"
            )
        tensors[scale_name] = scales
    tensors[name] = stack
    return stack
