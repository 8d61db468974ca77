"""A mixture-of-experts layer's experts, each token through its top-k experts' gated MLPs:

    out[t] = sum_j weight[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]

`w13` [E, 2I, H] stacks gate then up rows, `w2` [E, H, I] is down, any strides; `w13_scale`
[E, 2I] / `w2_scale` [E, H] go with int8 weights. An id outside [0, E) is skipped (expert
parallelism passes shifted ids). Paths: `fused_experts_reference`, C++ (`fused_moe_cpu.cpp`) and
Triton (`fused_moe_triton.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nori.kernels.cpu_build import CPU_KERNEL_DTYPES, cpu_kernels, required_cpu_kernels


def fused_experts_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H] in hidden's dtype, as transformers computes it: per chosen expert,
    its tokens through it in the hidden dtype, times the routing weight, added into the output.
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
    """The C++ kernel (RuntimeError where not built): float32/bfloat16 `hidden`, weights in panels
    or [in, out], else copied so (docs/benchmarks.md#cpu-kernels-and-weight-layouts)."""
    arguments = (hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    return required_cpu_kernels().fused_experts(*arguments)


PANEL_WIDTH = 16


def pack_expert_panels(weights: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> [E, ceil(N/16), K, 16], contiguous, the last panel zero-padded: the C++
    kernel's fastest layout (a tile of 16 outputs reads one contiguous block)."""
    experts, outputs, depth = weights.shape
    num_panels = -(-outputs // PANEL_WIDTH)
    padded = torch.zeros(
        experts, num_panels * PANEL_WIDTH, depth, dtype=weights.dtype, device=weights.device
    )
    padded[:, :outputs] = weights
    return padded.view(experts, num_panels, PANEL_WIDTH, depth).transpose(2, 3).contiguous()


def unpack_expert_panels(panels: torch.Tensor, outputs: int) -> torch.Tensor:
    """`pack_expert_panels`' inverse: [E, P, K, 16] -> [E, outputs, K]."""
    experts, num_panels, depth, width = panels.shape
    rows = panels.transpose(2, 3).reshape(experts, num_panels * width, depth)
    return rows[:, :outputs]


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fastest path for the data's device: Triton on a GPU, C++ on CPU where built, else the
    reference. Weights packed in panels (both 4-D) are read as they are only by the C++ kernel."""
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
    if w13.dim() == 4:
        hidden_size = w13.shape[2]
        w13 = unpack_expert_panels(w13, 2 * w2.shape[2])
        w2 = unpack_expert_panels(w2, hidden_size)
    return fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
