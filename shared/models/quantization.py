"""Weight-only quantization of a loaded model's linear layers (`--quantization int8|fp8`).

Every decoder projection (and with `--quantize-lm-head` the head) becomes 8-bit weights with one
float32 scale per output channel; the embedding table stays."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from nori.kernels.cpu_build import cpu_flags, cpu_kernels
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


# Up to this many rows the C++ GEMV is faster (docs/benchmarks.md#cpu-kernels-and-weight-layouts).
GEMV_MAX_ROWS = 8


class CpuInt8Linear(nn.Module):
    """int8 weights per output channel on torch's x86 int8 GEMM, prepacked once; activations are
    quantized to uint8 per call, rows first brought to one magnitude (`nori.kernels.row_scale`);
    up to GEMV_MAX_ROWS rows take the C++ GEMV."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        qweight, scale = quantize_weight(weight, "int8")
        with warnings.catch_warnings():
            # The prepacked op is not deprecated, only the quantized-tensor constructors.
            warnings.simplefilter("ignore", UserWarning)
            per_channel = torch._make_per_channel_quantized_tensor(
                qweight, scale.double(), torch.zeros(self.out_features, dtype=torch.long), 0
            )
            # The bias is added after the rows are scaled back, so it is not packed.
            self._packed = torch.ops.quantized.linear_prepack(per_channel, None)
        self._bias = None if bias is None else bias.float().contiguous()
        # The C++ GEMV's own packed copy of the int8 rows, beside the GEMM's.
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
            unit_rows, row_max = rows_to_unit_reference(rows)
            out = torch.ops.quantized.linear_dynamic(unit_rows, self._packed, self._reduce_range)
            out = scale_rows_back_reference(out, row_max, self._bias)
        elif rows.shape[0] <= GEMV_MAX_ROWS:
            packed, scale, row_sums = self._gemv_weight
            out = kernels.int8_gemv(rows, packed, self.out_features, scale, row_sums, self._bias)
        else:
            unit_rows, row_max = kernels.rows_to_unit(rows, SMALLEST_ROW_MAX)
            out = torch.ops.quantized.linear_dynamic(unit_rows, self._packed, self._reduce_range)
            kernels.scale_rows_back(out, row_max, self._bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weight=int8 (x86 GEMM)"


def quantize_model(model: CausalLM, method: str, include_lm_head: bool = False) -> int:
    """Replaces the decoder's nn.Linear layers in place; returns how many. With
    `include_lm_head`, the head too, as `model.head_module` (a tied one from the embeddings)."""
    if method not in QUANT_METHODS:
        raise ValueError(f"unknown quantization {method!r}; expected one of {QUANT_METHODS}")
    with torch.no_grad():
        # A MoE router stays in full precision (as vLLM): a flipped expert pick costs too much.
        replaced = replace_linears(
            model.model.layers,
            lambda linear: quantized_linear(linear.weight, linear.bias, method),
            skip=lambda name: name in ("gate", "shared_expert_gate"),
        )
        for block in model.moe_blocks().values():
            block.experts.quantize_(method)
            replaced += 1
        if include_lm_head and model.head_module is not None:
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


def cpu_int8_activation_bits() -> int:
    """The bits an activation keeps in torch's x86 int8 GEMM here: 8 with VNNI, else 7
    (`reduce_range`: the int16 pair sums would saturate)."""
    return 8 if "avx512_vnni" in cpu_flags() or "avx_vnni" in cpu_flags() else 7
