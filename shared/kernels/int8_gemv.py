"""int8 weights times a few token rows quantized to int8 per row: the CPU decode step's GEMV.

The C++ kernel (`int8_gemv_cpu.cpp`) reads a weight packed by `pack_int8_gemv_weight`; rows are
quantized symmetrically, products summed exactly in int32 and scaled back. The reference computes
the same over the plain weight. Why: docs/benchmarks.md#cpu-kernels-and-weight-layouts."""

from __future__ import annotations

import torch

from nori.kernels._common import pack_weight_panels


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (codes [M, K] int8, scale [M] float32), symmetric per row."""
    largest = x.float().abs().amax(-1)
    scale = torch.where(largest > 0, largest / 127.0, torch.ones_like(largest))
    codes = (x.float() / scale[:, None]).clamp(-127, 127).round().to(torch.int8)
    return codes, scale


def int8_gemv_reference(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    codes, scale = quantize_rows_int8(x)
    # int64 sums are exact at any K (float32 would round past 2**24).
    sums = codes.long() @ qweight.long().T
    out = sums.double() * scale.double()[:, None] * weight_scale.double()[None, :]
    out = out.float()
    return out if bias is None else out + bias.float()


def weight_row_sums(qweight: torch.Tensor) -> torch.Tensor:
    """Each int8 weight row's sum, int32 [N] (the VNNI path's offset correction)."""
    return qweight.sum(1, dtype=torch.int32).contiguous()


def pack_int8_gemv_weight(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> int8 [ceil(N/16), ceil(K/4), 16, 4] (`pack_weight_panels`, groups of 4)."""
    return pack_weight_panels(qweight, group=4)
