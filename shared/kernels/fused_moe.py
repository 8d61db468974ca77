"""A mixture-of-experts layer's experts: each token's hidden row through its top-k experts' gated
MLPs, weighted by its routing weights and summed.

    out[t] = sum_j weight[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]

Weights are stacked per expert: `w13` [E, 2I, H] holds each expert's gate rows then its up rows
(as one fused projection), `w2` [E, H, I] its down projection; any strides (the CPU model keeps
them in [in, out] memory order). With `w13_scale` [E, 2I] and `w2_scale` [E, H] the weights are
int8, one float32 scale per output row (`quantize_weight` per expert).

An id outside [0, E) is skipped: with expert parallelism a rank holds experts [start, start + E)
and the caller passes ids shifted by `start`, so the other ranks' experts read as negative or
past the end; that token's row then gets only this rank's share (summed over the ranks later).

Three paths, one contract:
- `fused_experts_reference`: the loop over experts that transformers runs, in PyTorch;
- the C++ CPU kernel (`fused_moe_cpu.cpp`): tokens grouped by expert, one GEMM per expert group,
  then a weighted scatter back;
- the Triton kernel: a grouped GEMM over expert-sorted tokens (`fused_moe_triton.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nori.kernels.cpu_build import CPU_KERNEL_DTYPES, cpu_kernels


def fused_experts_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H] in hidden's dtype; see the module docstring for the rest.

    As transformers computes it: per expert that any token chose, its tokens' rows through the
    expert in the hidden dtype, times the routing weight (float32 when the weights are), added
    into the output in the hidden dtype.
    """
    num_experts = w13.shape[0]
    out = torch.zeros_like(hidden)
    for expert in range(num_experts):
        token_rows, slots = torch.where(topk_ids == expert)
        if token_rows.numel() == 0:
            continue
        gate_up_weight = _expert_weight(w13, w13_scale, expert, hidden.dtype)
        down_weight = _expert_weight(w2, w2_scale, expert, hidden.dtype)
        gate, up = F.linear(hidden[token_rows], gate_up_weight).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down_weight)
        weighted = expert_out * topk_weights[token_rows, slots, None]
        out.index_add_(0, token_rows, weighted.to(out.dtype))
    return out


def _expert_weight(
    weights: torch.Tensor, scale: torch.Tensor | None, expert: int, dtype: torch.dtype
) -> torch.Tensor:
    if scale is None:
        return weights[expert].to(dtype)
    return (weights[expert].float() * scale[expert, :, None].float()).to(dtype)


def fused_experts_cpu(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The C++ CPU kernel (`fused_moe_cpu.cpp`); raises RuntimeError where the C++ kernels are
    not built. `hidden` float32 or bfloat16, the weights in its dtype or int8 with scales.

    The weights' memory order picks the route. Stored [in, out] (each expert's output dimension
    contiguous: `w.transpose(1, 2).contiguous().transpose(1, 2)`) they take the streamed kernel,
    which reads each weight line once per 4 rows and widens bfloat16/int8 in registers; any
    other strides take one library GEMM per expert group (at::mm; int8 through torch's int8
    GEMM for bfloat16 rows). Measured on a 2-core AMD EPYC (Zen 2: AVX2, no AVX-512) at the
    small preset's shape (`nori bench moe-layer`), [in, out] is as fast or faster in every
    case: float32 alike at batch 1 and ~1.2x faster at 16-64 (both bound by reading the
    weights); bfloat16 2-7x (torch's bfloat16 GEMM without AVX-512 BF16 is slow); int8 1.4-2x
    for bfloat16 rows and 2-9x for float32 ones.
    The model should store its experts [in, out].
    """
    kernels = cpu_kernels()
    if kernels is None:
        raise RuntimeError(
            "the C++ CPU kernels are not built (or NORI_CPU_KERNELS=0): "
            "fused_experts_cpu has no fallback, call fused_experts or fused_experts_reference"
        )
    result: torch.Tensor = kernels.fused_experts(
        hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale
    )
    return result


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fastest path for the data's device: Triton on a GPU, C++ on CPU where it is built
    (float32/bfloat16 activations, weights in that dtype or int8), else the reference."""
    if hidden.device.type == "cuda":
        from nori.kernels.fused_moe_triton import fused_experts_triton

        return fused_experts_triton(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    weight_dtype = hidden.dtype if w13_scale is None else torch.int8
    if (
        hidden.device.type == "cpu"
        and hidden.dtype in CPU_KERNEL_DTYPES
        and w13.dtype == weight_dtype
        and w2.dtype == weight_dtype
        and cpu_kernels() is not None
    ):
        return fused_experts_cpu(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    return fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
