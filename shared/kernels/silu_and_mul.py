"""The gated MLP's activation, silu(gate) * up over a fused [T, 2I] projection: C++ on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nori.kernels.cpu_build import CPU_KERNEL_DTYPES, cpu_kernels


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate, then up) -> [T, I]; the C++ kernel for contiguous float32/bfloat16
    CPU rows."""
    if (
        x.device.type == "cpu"
        and x.dtype in CPU_KERNEL_DTYPES
        and x.dim() == 2
        and x.is_contiguous()
    ):
        kernels = cpu_kernels()
        if kernels is not None:
            result: torch.Tensor = kernels.silu_and_mul(x)
            return result
    return silu_and_mul_reference(x)
