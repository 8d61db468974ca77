"""bfloat16 on CPU (`--dtype bfloat16`): every linear layer's weight prepacked for oneDNN."""

from __future__ import annotations

import torch
from torch import nn

from nori.kernels.bf16_gemv import bf16_gemv, pack_bf16_gemv_weight
from nori.kernels.cpu_build import cpu_flags, cpu_kernels
from nori.models.llama import CausalLM
from nori.models.module_swap import replace_linears

# Up to this many rows take the C++ GEMV rather than oneDNN's GEMM (with AMX: one row only)
# (docs/benchmarks.md#cpu-kernels-and-weight-layouts).
GEMV_MAX_ROWS = 8


class PackedBf16Linear(nn.Module):
    """A bfloat16 CPU layer, its weight prepacked for oneDNN's bf16 GEMM (identical results); up
    to GEMV_MAX_ROWS rows (one with AMX) take the C++ GEMV over its own packed copy."""

    packed_weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer(
            "packed_weight",
            torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16().contiguous(), 16),
        )
        self.register_buffer("bias", None if bias is None else bias.bfloat16().contiguous())
        self._gemv_weight = pack_bf16_gemv_weight(weight) if cpu_kernels() is not None else None
        self._gemv_max_rows = 1 if _has_amx() else GEMV_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemv_weight is not None and x.dim() == 2 and x.shape[0] <= self._gemv_max_rows:
            return bf16_gemv(x, self._gemv_weight, self.out_features, self.bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.bfloat16(), self.packed_weight, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weight=bfloat16 (oneDNN packed)"


def _has_amx() -> bool:
    """Whether oneDNN's bf16 GEMM can run on AMX tiles here (the CPU's `amx_bf16` flag)."""
    return "amx_bf16" in cpu_flags()


def bf16_packing_supported() -> bool:
    """Whether oneDNN's bf16 GEMM runs on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); else
    bfloat16 layers stay plain nn.Linear."""
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_bf16_linears(model: CausalLM) -> int:
    """Prepacks every nn.Linear left in a bfloat16 CPU model, the head included (as
    `model.head_module`); returns how many (0 where unsupported)."""
    if not bf16_packing_supported():
        return 0
    with torch.no_grad():
        packed = replace_linears(
            model,
            lambda linear: PackedBf16Linear(linear.weight, linear.bias),
            # The head is packed below, as head_module; a one-output gate gains nothing.
            skip=lambda name: name in ("lm_head", "shared_expert_gate"),
        )
        if model.head_module is None:
            model.head_module = PackedBf16Linear(model.head_weight(), None)
            packed += 1
    return packed
