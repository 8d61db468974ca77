"""The Triton fused-MoE layer (under the CPU interpreter here) against the loop over experts,
and its align step against arrays worked out by hand."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE

from nori.kernels.fused_moe import fused_experts_reference
from nori.kernels.fused_moe_triton import (
    MoeTiles,
    align_pairs_by_expert,
    fused_experts_triton,
)
from nori.kernels.quantized_linear import quantize_weight

# Both paths multiply the same values; float32 differs only in summation order. Half precision
# rounds at different points: the reference rounds each expert's output before weighting it
# and adds the k slots in the hidden dtype, the kernel weights in float32 and sums in float32.
TOLERANCE: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 5e-3, "atol": 5e-3},
    torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2},
}
# H = 72 and 2I = 80 span two 64-column N-blocks; H and I span two or three 32-wide K steps;
# none is a multiple of a tile.
HIDDEN_SIZE = 72
INTERMEDIATE_SIZE = 40


def _expert_weights(
    num_experts: int,
    dtype: torch.dtype,
    in_out_order: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I], scaled so every activation stays O(1).

    in_out_order: stored as [E, in, out] (the CPU model's memory order) and viewed transposed.
    """
    generator = torch.Generator().manual_seed(seed)
    shapes = [
        (num_experts, 2 * INTERMEDIATE_SIZE, HIDDEN_SIZE),
        (num_experts, HIDDEN_SIZE, INTERMEDIATE_SIZE),
    ]
    stacks = []
    for experts, outputs, inputs in shapes:
        if in_out_order:
            weight = torch.randn(experts, inputs, outputs, generator=generator).transpose(1, 2)
        else:
            weight = torch.randn(experts, outputs, inputs, generator=generator)
        stacks.append((weight * inputs**-0.5).to(dtype).to(DEVICE))
    return stacks[0], stacks[1]


def _hidden(num_tokens: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # A view into a wider tensor (row stride > H), as when sliced from a fused output.
    wide = torch.randn(num_tokens, HIDDEN_SIZE + 8, generator=generator).to(dtype)
    return wide[:, 5 : 5 + HIDDEN_SIZE].to(DEVICE)


def _routing(
    num_tokens: int, num_experts: int, top_k: int, seed: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's output: the top-k of a softmax, float32 weights and int64 ids."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


def _weights_for(ids: torch.Tensor, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(ids.shape, generator=generator).to(DEVICE) + 0.5


def _assert_matches_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    actual = fused_experts_triton(hidden, w13, w2, weights, ids, w13_scale, w2_scale, tiles=tiles)
    expected = fused_experts_reference(hidden, w13, w2, weights, ids, w13_scale, w2_scale)
    assert actual.shape == hidden.shape
    assert actual.dtype == hidden.dtype
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[hidden.dtype])
    return actual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [(9, 6, 2, 16), (21, 4, 3, 32)],
)
def test_random_routing_matches_reference(
    dtype: torch.dtype, num_tokens: int, num_experts: int, top_k: int, block_m: int
) -> None:
    w13, w2 = _expert_weights(num_experts, dtype)
    weights, ids = _routing(num_tokens, num_experts, top_k)
    tiles = MoeTiles(block_m=block_m)
    _assert_matches_reference(_hidden(num_tokens, dtype), w13, w2, weights, ids, tiles=tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_with_no_one_and_all_tokens(dtype: torch.dtype) -> None:
    # 16 tokens, k = 3, 6 experts (16-row blocks): expert 0 takes every token, exactly one
    # full block; expert 2 one token; expert 3 the 15 others in slot 1 and tokens 0-9 again in
    # slot 2 (a repeated id counts twice; slot 2 of tokens 10-15 is another rank's), 25 pairs in
    # two blocks; experts 1, 4 and 5 none.
    num_tokens = 16
    ids = torch.zeros(num_tokens, 3, dtype=torch.long)
    ids[:, 1] = 3
    ids[7, 1] = 2
    ids[:, 2] = 3
    ids[10:, 2] = -1
    ids = ids.to(DEVICE)
    w13, w2 = _expert_weights(6, dtype)
    _assert_matches_reference(_hidden(num_tokens, dtype), w13, w2, _weights_for(ids), ids)


def test_single_token() -> None:
    w13, w2 = _expert_weights(8, torch.float32)
    weights, ids = _routing(1, 8, 2)
    _assert_matches_reference(_hidden(1, torch.float32), w13, w2, weights, ids)


def test_ids_outside_the_local_experts_are_skipped() -> None:
    # Expert parallelism: this rank holds 4 experts, and -3, -1, 4, 5 and 9 belong to other
    # ranks (int32 ids, as routers often give them). Token 2 has none here and must come out
    # zero; the others keep only their local slots' share.
    ids = torch.tensor(
        [[0, -1, 3], [4, 2, 9], [-3, 5, 4], [1, 1, 2]], dtype=torch.int32, device=DEVICE
    )
    w13, w2 = _expert_weights(4, torch.float32)
    hidden = _hidden(4, torch.float32)
    out = _assert_matches_reference(hidden, w13, w2, _weights_for(ids), ids)
    assert bool((out[2] == 0).all())
    assert bool((out[[0, 1, 3]].abs().amax(dim=1) > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_in_in_out_order(dtype: torch.dtype) -> None:
    w13, w2 = _expert_weights(4, dtype, in_out_order=True)
    assert w13.stride(1) == 1 and w2.stride(1) == 1
    weights, ids = _routing(11, 4, 2)
    _assert_matches_reference(_hidden(11, dtype), w13, w2, weights, ids)


def _quantized_stack(stack: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's [out, in] weight quantized per output row, stacked again."""
    pairs = [quantize_weight(expert.cpu(), method) for expert in stack]
    qweights = torch.stack([qweight for qweight, _ in pairs]).to(DEVICE)
    scales = torch.stack([scale for _, scale in pairs]).to(DEVICE)
    return qweights, scales


@pytest.mark.parametrize(
    ("method", "dtype"),
    [("int8", torch.float32), ("int8", torch.bfloat16), ("fp8", torch.float32)],
)
def test_quantized_weights_match_reference(method: str, dtype: torch.dtype) -> None:
    w13, w2 = _expert_weights(4, torch.float32)
    q13, s13 = _quantized_stack(w13, method)
    q2, s2 = _quantized_stack(w2, method)
    weights, ids = _routing(10, 4, 2)
    _assert_matches_reference(_hidden(10, dtype), q13, q2, weights, ids, s13, s2)


def test_int8_weights_in_in_out_order() -> None:
    w13, w2 = _expert_weights(4, torch.float32)
    q13, s13 = _quantized_stack(w13, "int8")
    q2, s2 = _quantized_stack(w2, "int8")
    # The same values stored [E, in, out], viewed [E, out, in].
    q13 = q13.transpose(1, 2).contiguous().transpose(1, 2)
    q2 = q2.transpose(1, 2).contiguous().transpose(1, 2)
    weights, ids = _routing(6, 4, 2)
    _assert_matches_reference(_hidden(6, torch.float32), q13, q2, weights, ids, s13, s2)


def test_align_by_hand() -> None:
    # 4 tokens x k = 2, pairs numbered t * 2 + j; 4 experts, blocks of 2 rows.
    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [7, 2]], device=DEVICE)
    # expert 0: pairs 1, 4        -> rows 0-1, one block
    # expert 1: none              -> no block
    # expert 2: pairs 0, 2, 5, 7  -> rows 2-5, two blocks
    # expert 3: none; pairs 3 (id -1) and 6 (id 7) are dropped.
    # Padded total 6 of a capacity of 8 + min(4, 8) * (2 - 1) = 12 rows: 6 blocks.
    alignment = align_pairs_by_expert(ids, num_experts=4, block_m=2)
    sentinel = 8
    expected_pairs = [1, 4, 0, 2, 5, 7] + [sentinel] * 6
    assert alignment.sorted_pair_ids.tolist() == expected_pairs
    assert alignment.block_expert_ids.tolist() == [0, 2, 2, -1, -1, -1]
    assert int(alignment.num_padded_pairs) == 6
    assert alignment.sorted_pair_ids.dtype == torch.int32
    assert alignment.block_expert_ids.dtype == torch.int32


def test_align_pads_each_group_to_the_block() -> None:
    # blocks of 4: expert 0 has 1 pair (3 padding rows), expert 1 has 5 (two blocks, 3
    # padding rows), expert 2 none. Capacity: 6 + min(3, 6) * (4 - 1) = 15 rows, 4 blocks.
    ids = torch.tensor([[1, 0], [1, 1], [1, 1]], device=DEVICE)
    alignment = align_pairs_by_expert(ids, num_experts=3, block_m=4)
    sentinel = 6
    assert alignment.sorted_pair_ids.tolist() == [
        1, sentinel, sentinel, sentinel,
        0, 2, 3, 4,
        5, sentinel, sentinel, sentinel,
        sentinel, sentinel, sentinel, sentinel,
    ]  # fmt: skip
    assert alignment.block_expert_ids.tolist() == [0, 1, 1, -1]
    assert int(alignment.num_padded_pairs) == 12


def test_align_keeps_every_local_pair_once_in_its_experts_blocks() -> None:
    generator = torch.Generator().manual_seed(4)
    num_experts, block_m = 6, 16
    ids = torch.randint(-2, num_experts + 2, (37, 3), generator=generator).to(DEVICE)
    alignment = align_pairs_by_expert(ids, num_experts, block_m)
    flat = ids.reshape(-1).cpu()
    pairs = alignment.sorted_pair_ids.cpu().long()
    is_pair = pairs < flat.numel()
    kept = ((flat >= 0) & (flat < num_experts)).nonzero().flatten()
    assert sorted(pairs[is_pair].tolist()) == kept.tolist()
    block_of_row = torch.arange(pairs.numel()) // block_m
    row_experts = alignment.block_expert_ids.cpu().long()[block_of_row]
    assert torch.equal(row_experts[is_pair], flat[pairs[is_pair]])
    total = int(alignment.num_padded_pairs)
    assert total % block_m == 0
    assert bool((alignment.block_expert_ids.cpu()[total // block_m :] == -1).all())


def test_no_tokens() -> None:
    w13, w2 = _expert_weights(4, torch.float32)
    ids = torch.zeros(0, 2, dtype=torch.long, device=DEVICE)
    out = fused_experts_triton(_hidden(0, torch.float32), w13, w2, ids.float(), ids)
    assert out.shape == (0, HIDDEN_SIZE)


def test_rejects_bad_arguments() -> None:
    w13, w2 = _expert_weights(4, torch.float32)
    weights, ids = _routing(3, 4, 2)
    hidden = _hidden(3, torch.float32)
    with pytest.raises(ValueError, match="w13 must be"):
        fused_experts_triton(hidden, w13[:, :-1], w2, weights, ids)
    with pytest.raises(ValueError, match="hidden has 71 features"):
        fused_experts_triton(hidden[:, :-1], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="topk_weights and topk_ids"):
        fused_experts_triton(hidden, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="w13 must have dtype"):
        fused_experts_triton(hidden, w13, w2, weights, ids, w13_scale=torch.ones(4, 80))
    q13, s13 = _quantized_stack(w13, "int8")
    with pytest.raises(ValueError, match="w13_scale must be"):
        fused_experts_triton(hidden, q13, w2, weights, ids, w13_scale=s13[:, :-1])
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        MoeTiles(block_m=24)
