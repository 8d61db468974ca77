"""bfloat16 on CPU (`--dtype bfloat16`): every linear layer's weight prepacked for oneDNN."""

from __future__ import annotations

import torch
from torch import nn

from nori.kernels.bf16_gemv import bf16_gemv
from nori.kernels.cpu_build import cpu_kernels
from nori.models.llama import CausalLM
from nori.models.module_swap import replace_linears

# One row takes the C++ GEMV (bf16_gemv_cpu.cpp) rather than the packed GEMM, whose call
# costs about 23 us at any size (measured in docs/benchmark-results.md).
GEMV_MAX_ROWS = 1


class PackedBf16Linear(nn.Module):
    """A bfloat16 layer on CPU with its weight prepacked for oneDNN's bf16 GEMM.

    The AVX-512 BF16 kernels want the weight in their own blocked layout; F.linear re-lays it
    out on every call, which at decode batch sizes costs more than the product (a 2752x512
    layer at batch 1: 40 us prepacked, 84 us through F.linear, 95 us in float32 on this CPU).
    torch.compile's CPU backend packs frozen weights the same way; the results are identical.
    A decode step's single row takes the C++ GEMV over the plain weight instead, kept
    beside the packed copy (two more bytes a weight).
    """

    packed_weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch-size hint only tunes the layout; any batch size runs on it.
        self.register_buffer(
            "packed_weight",
            torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16().contiguous(), 16),
        )
        self.register_buffer("bias", None if bias is None else bias.bfloat16().contiguous())
        self._plain_weight = weight.bfloat16().contiguous() if cpu_kernels() is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._plain_weight is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            return bf16_gemv(x, self._plain_weight, self.bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.bfloat16(), self.packed_weight, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weight=bfloat16 (oneDNN packed)"


def bf16_packing_supported() -> bool:
    """Whether oneDNN's bf16 GEMM runs on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT. On an AVX2-only host (some AMD EPYC hosts of this kind) its weight reorder
    raises; bfloat16 layers stay plain nn.Linear there (torch's own, slower, bf16 path)."""
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_bf16_linears(model: CausalLM) -> int:
    """Prepacks every nn.Linear left in a bfloat16 CPU model, the head included (as
    `model.head_module`); returns how many. A no-op (0) where oneDNN is not built in or its
    bf16 GEMM does not run on this CPU (`bf16_packing_supported`)."""
    if not bf16_packing_supported():
        return 0
    with torch.no_grad():
        packed = replace_linears(
            model,
            lambda linear: PackedBf16Linear(linear.weight, linear.bias),
            skip=lambda name: name == "lm_head",  # the head is packed below, as head_module
        )
        if model.head_module is None:
            model.head_module = PackedBf16Linear(model.head_weight(), None)
            packed += 1
    return packed
