"""Per-token activation scales around a GEMM that takes one activation scale per call.

torch's x86 int8 GEMM (`quantized.linear_dynamic`) quantizes its input with one scale per call,
so one row of large activations costs every other row precision. As y_i = m_i * ((x_i / m_i)
W^T), m_i the row's largest magnitude, the C++ `rows_to_unit` (`row_scale_cpu.cpp`) gives the
GEMM rows of magnitude 1 and `scale_rows_back` restores each output row and adds the bias (the
GEMM must then not add it). These are their references."""

from __future__ import annotations

import torch

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
