"""Per-token activation scales around a GEMM that takes one activation scale per call.

torch's x86 int8 GEMM (`quantized.linear_dynamic`) quantizes its float32 input to 8 bits with
one scale for the whole call, so one row of large activations (an outlier token of a prompt,
another request of the batch) leaves the other rows a few of the 256 levels. A linear layer is
linear in each row: y_i = m_i * ((x_i / m_i) W^T) with m_i the row's largest magnitude, exactly,
before rounding. `rows_to_unit` gives the GEMM rows of magnitude 1 and `scale_rows_back`
restores each output row (adding the bias after, which the GEMM must then not add).
C++ on CPU (`row_scale_cpu.cpp`); these references elsewhere.
"""

from __future__ import annotations

import torch

from nori.kernels.cpu_build import cpu_kernels

# An all-zero row (padding) is divided by this instead of by zero: its output is the bias.
SMALLEST_ROW_MAX = 1e-12


def rows_to_unit_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    row_max = x.abs().amax(-1, keepdim=True).clamp_min_(SMALLEST_ROW_MAX)
    return x / row_max, row_max


def scale_rows_back_reference(
    out: torch.Tensor, row_max: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out.mul_(row_max)
    return out if bias is None else out.add_(bias)


def _kernel_fits(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu" and x.dtype is torch.float32 and x.dim() == 2 and x.is_contiguous()
    )


def rows_to_unit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float32 -> (x with every row divided by its largest magnitude, those [T, 1])."""
    if _kernel_fits(x):
        kernels = cpu_kernels()
        if kernels is not None:
            scaled, row_max = kernels.rows_to_unit(x, SMALLEST_ROW_MAX)
            return scaled, row_max
    return rows_to_unit_reference(x)


def scale_rows_back(
    out: torch.Tensor, row_max: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """In place: out[i] = out[i] * row_max[i] (+ bias); returns out."""
    if _kernel_fits(out):
        kernels = cpu_kernels()
        if kernels is not None:
            kernels.scale_rows_back(out, row_max, bias)
            return out
    return scale_rows_back_reference(out, row_max, bias)
