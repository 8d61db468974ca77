"""RMSNorm, alone or fused with the residual add before it: C++ on CPU, Triton on GPU.

The reference is Hugging Face's arithmetic (the residual add rounded to the input dtype,
statistics in float32, back to the input dtype before the weight multiply); the kernels match it."""

from __future__ import annotations

import contextlib

import torch

from nori.kernels._common import jit, next_power_of_2, should_use_triton
from nori.kernels.cpu_build import CPU_KERNEL_DTYPES, cpu_kernels

with contextlib.suppress(ImportError):
    import triton.language as tl


def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Rounded to the input dtype, as the reference's add is.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_residual + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inverse = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / size + eps)
    normed = (x32 * inverse).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(x.dtype), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm`'s contract over rows of x [..., N] with a weight of x's dtype; with a residual
    (both contiguous), x and residual are updated in place and returned."""
    rows = _as_rows(x)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = rows if residual is not None else torch.empty_like(rows)
    residual_rows = rows if residual is None else _as_rows(residual)
    jit(_rms_norm_kernel)[(rows.shape[0],)](
        rows,
        residual_rows,
        weight,
        out,
        rows.stride(0),
        residual_rows.stride(0),
        out.stride(0),
        rows.shape[1],
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=next_power_of_2(rows.shape[1]),
    )
    if residual is None:
        return (out if out.dim() == x.dim() else out.view(x.shape)), x
    return x, residual


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as rows [R, N]: itself when already 2-D."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(input_dtype)


def _kernels_for(x: torch.Tensor) -> object | None:
    """The C++ module for contiguous float32/bfloat16 CPU rows; None: the reference runs."""
    if x.device.type != "cpu" or x.dtype not in CPU_KERNEL_DTYPES or not x.is_contiguous():
        return None
    return cpu_kernels()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(h) * weight, h) where h = x + residual, or h = x without a residual. With a
    residual, the C++ and Triton paths update `x` and `residual` in place (vLLM's
    fused_add_rms_norm): callers pass tensors they own and use only the returned ones."""
    in_place_ok = residual is None or (
        residual.dtype == x.dtype and x.is_contiguous() and residual.is_contiguous()
    )
    if should_use_triton(None, [x]) and weight.dtype == x.dtype and in_place_ok:
        return rms_norm_triton(x, weight, eps, residual)
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
