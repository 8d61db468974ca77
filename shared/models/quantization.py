"""Weight-only quantization of a loaded model's linear layers (`--quantization int8|fp8`).

Every projection of every decoder layer is replaced after loading by a module holding 8-bit
weights with one float32 scale per output channel (the LM head too with `--quantize-lm-head`; the
embedding table stays). CPU int8 runs torch's x86 int8 GEMM over activations quantized per row
on the fly, so every token keeps its 8 bits whatever the other rows hold; up to `GEMV_MAX_ROWS`
rows take the C++ int8 GEMV (`nori.kernels.int8_gemv`) instead. GPU int8 or fp8 runs the Triton
weight-only kernel (`nori.kernels.quantized_linear`); CPU fp8 runs that kernel's PyTorch
reference, exact to the fp8 weights, for fidelity, not speed.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
from torch import nn

from nori.kernels.cpu_build import cpu_kernels
from nori.kernels.int8_gemv import pack_int8_gemv_weight, weight_row_sums
from nori.kernels.quantized_linear import QUANT_METHODS, quantize_weight, weight_only_linear
from nori.kernels.row_scale import (
    SMALLEST_ROW_MAX,
    rows_to_unit_reference,
    scale_rows_back_reference,
)
from nori.models.llama import CausalLM
from nori.models.module_swap import replace_linears


class WeightOnlyLinear(nn.Module):
    """y = x @ (qweight * scale).T + bias, with qweight int8 or float8_e4m3fn [out, in]."""

    qweight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, method: str
    ) -> WeightOnlyLinear:
        qweight, scale = quantize_weight(weight, method)
        return cls(qweight, scale.to(weight.device), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weight_only_linear(x, self.qweight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weight={self.qweight.dtype}"


# Up to this many rows the C++ GEMV beats torch's int8 GEMM
# (docs/benchmarks.md#cpu-kernels-and-weight-layouts).
GEMV_MAX_ROWS = 8


class CpuInt8Linear(nn.Module):
    """int8 weights per output channel on torch's x86 int8 GEMM (dynamic activation scales).

    The weight is prepacked once into the GEMM library's own blocked layout; each call then
    quantizes its float32 activations to uint8. The GEMM's one scale per call would let a row
    of large activations (a long prompt's outlier token, another request in the batch) leave
    the others a few levels of 8 bits, so rows are brought to one magnitude first
    (`nori.kernels.row_scale`). Up to GEMV_MAX_ROWS rows take the C++ int8 GEMV instead.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        qweight, scale = quantize_weight(weight, "int8")
        with warnings.catch_warnings():
            # torch deprecates its quantized-tensor constructors in favour of torchao, whose
            # CPU kernels this x86 GEMM still is; the prepacked op itself is not deprecated.
            warnings.simplefilter("ignore", UserWarning)
            per_channel = torch._make_per_channel_quantized_tensor(
                qweight, scale.double(), torch.zeros(self.out_features, dtype=torch.long), 0
            )
            # The bias is added after the rows are scaled back, so it is not packed.
            self._packed = torch.ops.quantized.linear_prepack(per_channel, None)
        self._bias = None if bias is None else bias.float().contiguous()
        # A decode step's few rows take the C++ GEMV instead (int8_gemv_cpu.cpp), which reads
        # its own packed copy of the int8 rows, kept beside the GEMM's (one more byte a weight).
        self._gemv_weight = (
            pack_int8_gemv_weight(qweight),
            scale.float().contiguous(),
            weight_row_sums(qweight),
        )
        self._reduce_range = cpu_int8_activation_bits() == 7

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float().reshape(-1, self.in_features).contiguous()
        kernels = cpu_kernels()
        if kernels is None:
            # The PyTorch references of the two passes (NORI_CPU_KERNELS=0, or no compiler).
            unit_rows, row_max = rows_to_unit_reference(rows)
            out = torch.ops.quantized.linear_dynamic(unit_rows, self._packed, self._reduce_range)
            out = scale_rows_back_reference(out, row_max, self._bias)
        elif rows.shape[0] <= GEMV_MAX_ROWS:
            packed, scale, row_sums = self._gemv_weight
            out = kernels.int8_gemv(rows, packed, self.out_features, scale, row_sums, self._bias)
        else:
            # Straight to the C++ passes: this runs four times per layer and step.
            unit_rows, row_max = kernels.rows_to_unit(rows, SMALLEST_ROW_MAX)
            out = torch.ops.quantized.linear_dynamic(unit_rows, self._packed, self._reduce_range)
            kernels.scale_rows_back(out, row_max, self._bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weight=int8 (x86 GEMM)"


def quantize_model(model: CausalLM, method: str, include_lm_head: bool = False) -> int:
    """Replaces the decoder's nn.Linear layers in place; returns how many were replaced.

    With `include_lm_head`, the head is quantized too and set as `model.head_module` (a tied
    head is quantized from the embedding table, which itself stays in full precision).
    """
    if method not in QUANT_METHODS:
        raise ValueError(f"unknown quantization {method!r}; expected one of {QUANT_METHODS}")
    with torch.no_grad():
        # A mixture-of-experts router stays in full precision (as vLLM keeps it): its
        # logits pick the experts, and a flipped pick costs more than its few bytes save.
        replaced = replace_linears(
            model.model.layers,
            lambda linear: quantized_linear(linear.weight, linear.bias, method),
            skip=lambda name: name in ("gate", "shared_expert_gate"),
        )
        for block in model.moe_blocks().values():
            block.experts.quantize_(method)
            replaced += 1
        if include_lm_head and model.head_module is not None:
            # A head already in a module of its own (a tensor-parallel shard): its linear.
            replaced += replace_linears(
                model.head_module, lambda linear: quantized_linear(linear.weight, None, method)
            )
        elif include_lm_head:
            model.head_module = quantized_linear(model.head_weight(), None, method)
            replaced += 1
    return replaced


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, method: str) -> nn.Module:
    """The fastest quantized module for this weight's device and the method."""
    if weight.device.type == "cpu" and method == "int8":
        return CpuInt8Linear(weight, bias)
    return WeightOnlyLinear.from_linear(weight, bias, method)


@functools.cache
def cpu_int8_activation_bits() -> int:
    """The bits an activation keeps in torch's x86 int8 GEMM on this CPU. Without VNNI
    (AVX-512 VNNI or AVX-VNNI) the kernel sums pairs of u8 x s8 products in int16, which
    saturates unless activations keep 7 bits (`reduce_range`); with VNNI they keep all 8."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.is_file() else ""
    return 8 if "avx512_vnni" in flags or "avx_vnni" in flags else 7
