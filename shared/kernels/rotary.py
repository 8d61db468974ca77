"""Rotary position embedding of q/k heads: C++ in place on CPU, PyTorch elsewhere.

The reference is Hugging Face's formula, x * cos + rotate_half(x) * sin with rotate_half(x) =
cat(-x2, x1). Written with roll(x) = cat(x2, x1) and the minus folded into the first half of sin,
it gives the same products bit for bit in one op instead of four. The C++ kernel
(rotary_cpu.cpp) rotates in place, one pass over each head.
"""

from __future__ import annotations

import torch

from nori.kernels.cpu_build import CPU_KERNEL_DTYPES, cpu_kernels


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D / 2] (each token's angles) -> x rotated (a new tensor)."""
    full_cos = torch.cat((cos, cos), dim=-1)[:, None, :]
    signed_sin = torch.cat((-sin, sin), dim=-1)[:, None, :]
    return x * full_cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, H, D]; on CPU (float32, bfloat16) in place (x is returned), else into a new
    tensor.

    Callers pass a tensor they own (a slice of their own qkv projection) and use the result.
    """
    if (
        x.device.type == "cpu"
        and x.dtype in CPU_KERNEL_DTYPES
        and cos.dtype == sin.dtype == x.dtype
        and x.dim() == 3
        and x.stride(-1) == 1
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        kernels = cpu_kernels()
        if kernels is not None:
            kernels.rotary_inplace(x, cos, sin)
            return x
    return rotary_reference(x, cos, sin)
