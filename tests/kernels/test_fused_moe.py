"""The fused mixture-of-experts layer on CPU: the PyTorch reference against a dense computation
written here, and the C++ kernel (`fused_experts_cpu`) against the reference.

The routings cover what a grouping by expert can get wrong: experts that no token chose, that
exactly one token chose and that every token chose, one token, ids outside [0, E) (expert
parallelism), int32 and int64 ids, weights stored in [in, out] memory order, int8 weights, and
many rows per expert (many tiles of rows in one expert's product). The tolerances are tight enough that a token's output landing on another token (a
wrong permutation or scatter index) fails them: `test_a_swapped_routing_is_caught` shows the
error such a mix-up makes is at least ten times past them.
"""

from __future__ import annotations

import pytest
import torch

from nori.kernels.cpu_build import cpu_kernels
from nori.kernels.fused_moe import (
    fused_experts,
    fused_experts_cpu,
    fused_experts_reference,
    pack_expert_panels,
    unpack_expert_panels,
)
from nori.kernels.quantized_linear import quantize_weight

needs_cpu_kernels = pytest.mark.skipif(
    cpu_kernels() is None, reason="the C++ CPU kernels need a C++ compiler"
)

# Widths that are not multiples of the streamed kernel's 16-column tiles (2I = H = 40).
HIDDEN, INTERMEDIATE = 40, 20
# float32: the same sums in another order (GEMM blocking, float32 accumulation of the slots).
FLOAT32_ATOL = FLOAT32_RTOL = 1e-5
# bfloat16 against the float32 reference: each GEMM's output and the activation round to 8 bits.
BFLOAT16_ATOL = BFLOAT16_RTOL = 3e-2


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _layer(num_experts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H], w2 [E, H, I] float32, scaled so that outputs are of order one."""
    generator = _generator(seed)
    w13 = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=generator)
    w2 = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=generator)
    return w13 / HIDDEN**0.5, w2 / INTERMEDIATE**0.5


def _routing(
    tokens: int, num_experts: int, top_k: int, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """As a router makes it: top-k of random logits (distinct ids per row), softmax weights."""
    logits = torch.randn(tokens, num_experts, generator=_generator(seed))
    weights, ids = logits.topk(top_k, dim=-1)
    return weights.softmax(dim=-1), ids


def _hidden(tokens: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=_generator(seed))


def _dense_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Token by token, slot by slot, in float64: the definition, independent of any grouping."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        x = hidden[token].double()
        for slot in range(topk_ids.shape[1]):
            expert = int(topk_ids[token, slot])
            if not 0 <= expert < w13.shape[0]:
                continue
            gate_up = w13[expert].double() @ x
            gate, up = gate_up[:INTERMEDIATE], gate_up[INTERMEDIATE:]
            expert_out = w2[expert].double() @ (gate * torch.sigmoid(gate) * up)
            out[token] += float(topk_weights[token, slot]) * expert_out
    return out


# How the weights are stored: PyTorch's [out, in] rows (the kernel copies them to [in, out]), each expert's
# matrix [in, out] (the streamed route), or packed in panels of 16 outputs (the streamed route
# over contiguous blocks; what the CPU model keeps).
LAYOUTS = ["out-in", "in-out", "panels"]


def _stored(weights: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as `layout` stores them."""
    if layout == "in-out":
        return weights.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "panels":
        return pack_expert_panels(weights)
    return weights


# (tokens, experts, top-k, a note): random routings plus the edge cases of the grouping.
ROUTINGS = [
    pytest.param(1, 8, 2, id="one-token"),
    pytest.param(5, 16, 2, id="most-experts-unused"),
    pytest.param(37, 8, 2, id="random"),
    pytest.param(24, 4, 4, id="every-expert-every-token"),
    pytest.param(80, 2, 1, id="over-32-rows-per-expert"),
]


@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), ROUTINGS)
def test_reference_matches_the_dense_definition(tokens: int, num_experts: int, top_k: int) -> None:
    w13, w2 = _layer(num_experts)
    weights, ids = _routing(tokens, num_experts, top_k)
    hidden = _hidden(tokens)
    out = fused_experts_reference(hidden, w13, w2, weights, ids)
    expected = _dense_experts(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=FLOAT32_ATOL, rtol=FLOAT32_RTOL)


def test_reference_skips_ids_outside_the_rank() -> None:
    w13, w2 = _layer(4)
    weights, ids = _routing(9, 8, 2)
    ids = ids - 2  # this rank holds experts 2..5 of 8: the others read as -2..-1 or 4..5
    hidden = _hidden(9)
    out = fused_experts_reference(hidden, w13, w2, weights, ids)
    expected = _dense_experts(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=FLOAT32_ATOL, rtol=FLOAT32_RTOL)


@needs_cpu_kernels
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), ROUTINGS)
def test_cpu_kernel_matches_reference_float32(
    tokens: int, num_experts: int, top_k: int, id_dtype: torch.dtype, layout: str
) -> None:
    w13, w2 = _layer(num_experts)
    weights, ids = _routing(tokens, num_experts, top_k)
    hidden = _hidden(tokens)
    stored13, stored2 = (_stored(w13, layout), _stored(w2, layout))
    out = fused_experts_cpu(hidden, stored13, stored2, weights, ids.to(id_dtype))
    expected = fused_experts_reference(hidden, w13, w2, weights, ids)
    assert out.dtype == torch.float32 and out.shape == hidden.shape
    torch.testing.assert_close(out, expected, atol=FLOAT32_ATOL, rtol=FLOAT32_RTOL)


@needs_cpu_kernels
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_kernel_experts_with_one_token_and_none(layout: str) -> None:
    """Expert 0 chosen by every token, 1..3 by exactly one each, 4..7 by none."""
    w13, w2 = _layer(8)
    ids = torch.tensor([[0, 1], [2, 0], [0, 3]])
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.5, 0.5]])
    hidden = _hidden(3)
    stored13, stored2 = (_stored(w13, layout), _stored(w2, layout))
    out = fused_experts_cpu(hidden, stored13, stored2, weights, ids)
    expected = _dense_experts(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=FLOAT32_ATOL, rtol=FLOAT32_RTOL)


@needs_cpu_kernels
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_kernel_skips_ids_outside_the_rank(layout: str) -> None:
    w13, w2 = _layer(4)
    weights, ids = _routing(33, 8, 2)
    hidden = _hidden(33)
    stored13, stored2 = (_stored(w13, layout), _stored(w2, layout))
    for start in (0, 2, 4):  # the ranks of two-way expert parallelism, and one in between
        rank_ids = ids - start
        out = fused_experts_cpu(hidden, stored13, stored2, weights, rank_ids)
        expected = fused_experts_reference(hidden, w13, w2, weights, rank_ids)
        torch.testing.assert_close(out, expected, atol=FLOAT32_ATOL, rtol=FLOAT32_RTOL)
    # No id on this rank at all: zeros.
    out = fused_experts_cpu(hidden, stored13, stored2, weights, ids + 100)
    assert torch.equal(out, torch.zeros_like(hidden))


@needs_cpu_kernels
def test_cpu_kernel_no_tokens() -> None:
    w13, w2 = _layer(4)
    hidden = _hidden(0)
    out = fused_experts_cpu(
        hidden, w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64)
    )
    assert out.shape == (0, HIDDEN)


@needs_cpu_kernels
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 16, 70])
def test_cpu_kernel_bfloat16(tokens: int, layout: str) -> None:
    w13, w2 = _layer(8)
    weights, ids = _routing(tokens, 8, 2)
    hidden = _hidden(tokens)
    w13_bf16, w2_bf16 = w13.bfloat16(), w2.bfloat16()
    stored13, stored2 = _stored(w13_bf16, layout), _stored(w2_bf16, layout)
    out = fused_experts_cpu(hidden.bfloat16(), stored13, stored2, weights, ids)
    # The reference in float32 on the same (bfloat16-rounded) values.
    expected = fused_experts_reference(
        hidden.bfloat16().float(), w13_bf16.float(), w2_bf16.float(), weights, ids
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=BFLOAT16_ATOL, rtol=BFLOAT16_RTOL)


def _quantized(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert, `quantize_weight`'s int8 rows and float32 scales, stacked."""
    pairs = [quantize_weight(expert, "int8") for expert in weights]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


@needs_cpu_kernels
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 70])
def test_cpu_kernel_int8_weights(tokens: int, dtype: torch.dtype, layout: str) -> None:
    w13, w2 = _layer(8)
    (q13, s13), (q2, s2) = _quantized(w13), _quantized(w2)
    weights, ids = _routing(tokens, 8, 2)
    hidden = _hidden(tokens).to(dtype)
    stored13, stored2 = (_stored(q13, layout), _stored(q2, layout))
    out = fused_experts_cpu(hidden, stored13, stored2, weights, ids, s13, s2)
    # The reference dequantizes (in float32 here, on the same rounded activations).
    expected = fused_experts_reference(hidden.float(), q13, q2, weights, ids, s13, s2)
    assert out.dtype == dtype
    tolerance = (
        (FLOAT32_ATOL, FLOAT32_RTOL) if dtype == torch.float32 else (BFLOAT16_ATOL, BFLOAT16_RTOL)
    )
    torch.testing.assert_close(out.float(), expected, atol=tolerance[0], rtol=tolerance[1])
    # ... and the quantization itself stays close to the float weights' layer.
    unquantized = fused_experts_reference(hidden.float(), w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), unquantized, atol=5e-2, rtol=5e-2)


@needs_cpu_kernels
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_swapped_routing_is_caught(layout: str) -> None:
    """Two tokens' routings exchanged (what a wrong permutation or scatter index does) move
    the output by ten times the loosest tolerance above or more: the equality tests would fail on it."""
    w13, w2 = _layer(8)
    weights, ids = _routing(16, 8, 2)
    hidden = _hidden(16)
    expected = fused_experts_reference(hidden, w13, w2, weights, ids)
    w13, w2 = _stored(w13, layout), _stored(w2, layout)
    swapped = ids.clone()
    swapped[[3, 11]] = ids[[11, 3]]
    out = fused_experts_cpu(hidden, w13, w2, weights, swapped)
    error = (out - expected).abs().amax(dim=1)
    assert float(error[[3, 11]].min()) > 10 * BFLOAT16_ATOL
    # ... and only those two tokens move.
    untouched = [token for token in range(16) if token not in (3, 11)]
    assert float(error[untouched].max()) <= FLOAT32_ATOL
    # Weights exchanged between a token's slots: a scatter that paired a row with the wrong
    # slot's weight.
    slots_swapped = fused_experts_cpu(hidden, w13, w2, weights.flip(1), ids)
    assert float((slots_swapped - expected).abs().max()) > 10 * BFLOAT16_ATOL


@needs_cpu_kernels
def test_cpu_kernel_under_inference_mode() -> None:
    """The model runs under torch.inference_mode, where the kernel (and its copy of [out, in]
    weights to [in, out]) runs as well."""
    w13, w2 = _layer(8)
    weights, ids = _routing(8, 8, 2)
    hidden = _hidden(8)
    with torch.inference_mode():
        out = fused_experts_cpu(hidden, w13, w2, weights, ids)
        expected = fused_experts_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out, expected, atol=FLOAT32_ATOL, rtol=FLOAT32_RTOL)


@needs_cpu_kernels
def test_fused_experts_takes_the_cpu_kernel() -> None:
    w13, w2 = _layer(8)
    weights, ids = _routing(16, 8, 2)
    hidden = _hidden(16)
    for dtype in (torch.float32, torch.bfloat16):
        args = (hidden.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)
        assert torch.equal(fused_experts(*args), fused_experts_cpu(*args))
    # A dtype the kernel does not serve takes the reference.
    args = (hidden.half(), w13.half(), w2.half(), weights, ids)
    assert torch.equal(fused_experts(*args), fused_experts_reference(*args))


def test_cpu_kernel_rejects_bad_shapes() -> None:
    if cpu_kernels() is None:
        with pytest.raises(RuntimeError, match="not built"):
            fused_experts_cpu(_hidden(2), *_layer(4), *_routing(2, 4, 2))
        return
    w13, w2 = _layer(4)
    weights, ids = _routing(2, 4, 2)
    with pytest.raises(RuntimeError, match="w13 must be"):
        fused_experts_cpu(_hidden(2), w13[:, :, :-1], w2, weights, ids)
    with pytest.raises(RuntimeError, match="topk_ids must be"):
        fused_experts_cpu(_hidden(3), w13, w2, weights, ids)
    with pytest.raises(RuntimeError, match="int8"):
        fused_experts_cpu(
            _hidden(2),
            w13,
            w2,
            weights,
            ids,
            torch.ones(4, 2 * INTERMEDIATE),
            torch.ones(4, HIDDEN),
        )


@pytest.mark.parametrize("outputs", [16, 37])
def test_panels_pack_and_unpack(outputs: int) -> None:
    """Panel p, line k holds outputs 16p..16p+15 of input k (zeros past the end)."""
    weights = torch.randn(3, outputs, 5)
    panels = pack_expert_panels(weights)
    assert panels.shape == (3, -(-outputs // 16), 5, 16) and panels.is_contiguous()
    last = outputs - 1
    assert float(panels[1, last // 16, 4, last % 16]) == float(weights[1, last, 4])
    assert float(panels[:, -1, :, outputs - 16 * (panels.shape[1] - 1) :].abs().sum()) == 0.0
    torch.testing.assert_close(unpack_expert_panels(panels, outputs), weights, rtol=0, atol=0)


def test_fused_experts_unpacks_panels_for_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the C++ kernels (NORI_CPU_KERNELS=0 or no compiler) packed weights still work."""
    import nori.kernels.fused_moe as fused_moe

    monkeypatch.setattr(fused_moe, "cpu_kernels", lambda: None)
    w13, w2 = _layer(8)
    weights, ids = _routing(9, 8, 2)
    hidden = _hidden(9)
    out = fused_experts(hidden, pack_expert_panels(w13), pack_expert_panels(w2), weights, ids)
    expected = fused_experts_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
