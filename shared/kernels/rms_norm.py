"""RMSNorm, alone or fused with the residual add before it: C++ on CPU, PyTorch elsewhere.

The reference is Hugging Face's arithmetic (statistics in float32, back to the input dtype
before the weight multiply), which the model must match; the C++ kernel (rms_norm_cpu.cpp) does
the same in one pass per row and is tested against it.
"""

from __future__ import annotations

import torch

from nori.kernels.cpu_build import CPU_KERNEL_DTYPES, cpu_kernels


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(input_dtype)


def _kernels_for(x: torch.Tensor) -> object | None:
    """The C++ module for contiguous float32/bfloat16 CPU rows, None where the reference must
    run."""
    if x.device.type != "cpu" or x.dtype not in CPU_KERNEL_DTYPES or not x.is_contiguous():
        return None
    return cpu_kernels()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(h) * weight, h) where h = x + residual, or h = x without a residual.

    With a residual, the C++ path updates `x` and `residual` in place (vLLM's
    fused_add_rms_norm): callers pass tensors they own and use only the returned ones.
    """
    kernels = _kernels_for(x)
    if residual is None:
        if kernels is not None:
            return kernels.rms_norm(x, weight, eps), x  # type: ignore[attr-defined]
        return rms_norm_reference(x, weight, eps), x
    if kernels is not None and residual.is_contiguous() and residual.dtype == x.dtype:
        kernels.fused_add_rms_norm(x, residual, weight, eps)  # type: ignore[attr-defined]
        return x, residual
    hidden = x + residual
    return rms_norm_reference(hidden, weight, eps), hidden
