"""torch.argmax over the last dim of float32 logits, with a C++ kernel on CPU (argmax_cpu.cpp)
giving torch's answer: the first index of the maximum, NaN counting as the maximum. Why:
docs/benchmarks.md#cpu-kernels-and-weight-layouts."""

from __future__ import annotations

import torch

from nori.kernels.cpu_build import cpu_kernels


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> int64 [B]."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.is_contiguous()
    ):
        kernels = cpu_kernels()
        if kernels is not None:
            return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)
