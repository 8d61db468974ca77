"""Weight-only quantized linear layers: int8 or fp8 (e4m3) weights, one float32 scale per output
channel, activations and output in the model's float dtype; a PyTorch reference (dequantizing in
float32) for the CPU engine, a Triton kernel for the GPU."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from nori.kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    check_last_dim_contiguous,
    check_same_device,
    check_tensor,
    dot_precision,
    jit,
    next_power_of_2,
    should_use_triton,
    sm_count,
    upcast_dot_operands,
)

with contextlib.suppress(ImportError):
    import triton.language as tl

QUANT_METHODS: tuple[str, ...] = ("int8", "fp8")
QWEIGHT_DTYPES: tuple[torch.dtype, ...] = (torch.int8, torch.float8_e4m3fn)

# int8 is kept symmetric (-128 unused); 448 is the largest finite float8_e4m3fn.
_QUANT_MAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}
_QUANT_DTYPE: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}

MIN_DOT_DIM = 16
# Up to this many token rows one row tile covers them all (each weight tile read once).
MAX_DECODE_ROWS = 64


def quantize_weight(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (qweight [out, in], scale [out] float32), symmetric per output row:
    qweight * scale[:, None] ~ weight; int8 rounds to nearest, fp8 casts; zero rows get scale 1."""
    _check_method(method)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-D [out, in] tensor, got {shape}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point tensor, got {weight.dtype}")
    weight32 = weight.float()
    amax = weight32.abs().amax(dim=1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("weight holds inf or NaN, which has no quantized value")
    limit = _QUANT_MAX[method]
    scale = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
    scaled = (weight32 / scale[:, None]).clamp(-limit, limit)
    if method == "int8":
        scaled = scaled.round()
    return scaled.to(_QUANT_DTYPE[method]).contiguous(), scale.contiguous()


def dequantize_weight(
    qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """qweight [out, in], scale [out] -> the weight [out, in] in `dtype`."""
    _check_quantized_weight(qweight, scale)
    return (qweight.float() * scale[:, None]).to(dtype)


def weight_only_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, in] @ (qweight * scale)^T + bias -> [T, out] in x.dtype, computed in float32."""
    out = (x.float() @ qweight.float().t()) * scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _weight_only_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
) -> None:
    """out[rows, cols] = (x[rows, :] @ w[cols, :]^T) * scale[cols] + bias[cols]; one program per
    output tile, the weight read in its stored [N, K] layout."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = ks < K - k_start
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST_DOT:
            x = x.to(tl.float32)
        # Masked weights must be zeros: a stray fp8 byte 0x7F is NaN, and NaN * 0 is NaN.
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        # Both formats convert exactly to every float dtype: the dot sees the stored weights.
        acc = tl.dot(x, w.to(x.dtype), acc=acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    acc = acc * tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(
        out_ptrs,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


class _LaunchConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _launch_config(num_tokens: int, out_features: int, device: torch.device) -> _LaunchConfig:
    """Tile sizes: decode batches are bound by reading the weight, prefill by the math."""
    if num_tokens > MAX_DECODE_ROWS:
        return _LaunchConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
    block_m = max(MIN_DOT_DIM, next_power_of_2(num_tokens))
    # Narrower column tiles give every SM work on small layers (not below 32 columns).
    block_n = 64
    if cdiv(out_features, block_n) < sm_count(device):
        block_n = 32
    return _LaunchConfig(block_m, block_n, block_k=128, num_warps=4, num_stages=4)


def weight_only_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """x [T, in] @ (qweight [out, in] * scale [out])^T + bias [out] -> [T, out] in x.dtype, with
    qweight from `quantize_weight`; accumulates in float32. use_triton None: Triton for CUDA."""
    _check_linear_args(x, qweight, scale, bias)
    if not should_use_triton(use_triton, [x]):
        return weight_only_linear_reference(x, qweight, scale, bias)
    num_tokens, in_features = x.shape
    out_features = qweight.shape[0]
    out = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or out_features == 0:
        return out
    config = _launch_config(num_tokens, out_features, x.device)
    grid = (cdiv(num_tokens, config.block_m), cdiv(out_features, config.block_n))
    jit(_weight_only_linear_kernel)[grid](
        x,
        qweight,
        scale,
        scale if bias is None else bias,
        out,
        num_tokens,
        out_features,
        in_features,
        x.stride(0),
        qweight.stride(0),
        out.stride(0),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST_DOT=upcast_dot_operands(x.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _check_method(method: object) -> None:
    if method not in QUANT_METHODS:
        raise ValueError(f"unknown quantization method {method!r}; expected one of {QUANT_METHODS}")


def _check_quantized_weight(qweight: object, scale: object) -> tuple[torch.Tensor, torch.Tensor]:
    """qweight [out, in] int8/float8_e4m3fn and scale [out] float32, both unit-stride."""
    weight = check_tensor("qweight", qweight, 2, QWEIGHT_DTYPES)
    scales = check_tensor("scale", scale, 1, (torch.float32,))
    if scales.shape[0] != weight.shape[0]:
        raise ValueError(
            f"scale must have one entry per output row of qweight ({weight.shape[0]}), "
            f"got shape {tuple(scales.shape)}"
        )
    check_same_device({"qweight": weight, "scale": scales})
    check_last_dim_contiguous("qweight", weight)
    check_last_dim_contiguous("scale", scales)
    return weight, scales


def _check_linear_args(x: object, qweight: object, scale: object, bias: object | None) -> None:
    activations = check_tensor("x", x, 2, FLOAT_DTYPES)
    weight, scales = _check_quantized_weight(qweight, scale)
    out_features, in_features = weight.shape
    if activations.shape[1] != in_features:
        raise ValueError(
            f"x has {activations.shape[1]} input features but qweight is "
            f"[out, in] = [{out_features}, {in_features}]"
        )
    tensors = {"x": activations, "qweight": weight, "scale": scales}
    if bias is not None:
        tensors["bias"] = biases = check_tensor("bias", bias, 1, FLOAT_DTYPES)
        if biases.shape[0] != out_features:
            raise ValueError(
                f"bias must have {out_features} entries (one per output row of qweight), "
                f"got shape {tuple(biases.shape)}"
            )
        check_last_dim_contiguous("bias", biases)
    check_same_device(tensors)
    check_last_dim_contiguous("x", activations)
