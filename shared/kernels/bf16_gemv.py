"""bfloat16 weights times a few bfloat16 token rows: the CPU decode step's GEMV in bf16.

The C++ kernel (`bf16_gemv_cpu.cpp`; why: docs/benchmarks.md#cpu-kernels-and-weight-layouts)
reads a weight packed once by `pack_bf16_gemv_weight` (panels of 16 outputs, each line two K
positions of those 16 outputs: dpbf16's operand) once per call for all rows, summing in float32;
the reference does the same in PyTorch over the plain weight, rounding to bf16 once at the end."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nori.kernels._common import pack_weight_panels, unpack_weight_panels
from nori.kernels.cpu_build import cpu_kernels


def bf16_gemv_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.bfloat16()


def pack_bf16_gemv_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> bfloat16 [ceil(N/16), ceil(K/2), 16, 2] (`pack_weight_panels`, pairs)."""
    return pack_weight_panels(weight.bfloat16(), group=2)


def bf16_gemv(
    x: torch.Tensor, packed_weight: torch.Tensor, outputs: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] bf16 (few rows) @ the [N, K] weight `pack_bf16_gemv_weight` made -> [M, N] bf16."""
    kernels = cpu_kernels()
    if kernels is not None and x.device.type == "cpu":
        return kernels.bf16_gemv(x.bfloat16().contiguous(), packed_weight, outputs, bias)
    weight = unpack_weight_panels(packed_weight, outputs, x.shape[-1])
    return bf16_gemv_reference(x, weight, bias)
