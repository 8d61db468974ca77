"""bfloat16 weights times a few bfloat16 token rows: the CPU decode step's GEMV in bf16.

oneDNN's prepacked bf16 GEMM costs about 23 us a call at one row whatever the layer's size;
this C++ kernel (`bf16_gemv_cpu.cpp`) reads each plain [N, K] weight row once for a decode
step's few rows and sums the bf16 products in float32. The reference computes the same in
PyTorch: float32 products of the bf16 values, rounded to bf16 once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nori.kernels.cpu_build import cpu_kernels


def bf16_gemv_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.bfloat16()


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bfloat16 (few rows), weight [N, K] bfloat16 -> [M, N] bfloat16."""
    kernels = cpu_kernels()
    if kernels is not None and x.device.type == "cpu":
        result: torch.Tensor = kernels.bf16_gemv(x.bfloat16().contiguous(), weight, bias)
        return result
    return bf16_gemv_reference(x, weight, bias)
