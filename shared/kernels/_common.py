"""Helpers shared by the kernel wrappers: argument checks, lazy Triton compilation, dispatch.
Nothing here imports Triton at module import time (it is optional)."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def should_use_triton(use_triton: bool | None, tensors: Sequence[torch.Tensor]) -> bool:
    """None means: Triton exactly when the data lives on a GPU."""
    if use_triton is None:
        return tensors[0].is_cuda and triton_available()
    if use_triton and not triton_available():
        raise ValueError("use_triton=True but triton is not installed")
    return use_triton


def jit(fn: Callable[..., Any]) -> Any:
    """Wraps `fn` with triton.jit on first use, keyed on TRITON_INTERPRET, so tests can switch
    the interpreter on after import and the import needs no Triton."""
    return _jit_for_mode(fn, os.environ.get("TRITON_INTERPRET", ""))


def device_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a helper that kernels call; `jit` compiles it with each kernel that calls it."""
    fn.__nori_device_function__ = True  # type: ignore[attr-defined]
    return fn


@functools.cache
def _jit_for_mode(fn: Callable[..., Any], interpret: str) -> Any:
    import triton

    return triton.jit(_with_jitted_helpers(fn, interpret))


def _with_jitted_helpers(fn: Callable[..., Any], interpret: str) -> Callable[..., Any]:
    """`fn`, seeing its device functions as Triton functions jitted for the same mode (a kernel
    may only call Triton functions, and the mode is fixed when triton.jit runs)."""
    helpers = {
        name: _jit_for_mode(value, interpret)
        for name in fn.__code__.co_names
        if getattr(value := fn.__globals__.get(name), "__nori_device_function__", False)
    }
    if not helpers:
        return fn
    clone = types.FunctionType(
        fn.__code__, {**fn.__globals__, **helpers}, fn.__name__, fn.__defaults__, fn.__closure__
    )
    clone.__module__, clone.__qualname__ = fn.__module__, fn.__qualname__
    clone.__annotations__ = fn.__annotations__
    return clone


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.cache
def multiprocessor_count(device_index: int | None) -> int:
    return int(torch.cuda.get_device_properties(device_index or 0).multi_processor_count)


def sm_count(device: torch.device) -> int:
    # The interpreter has no SMs; a big GPU's count keeps CPU tests on the GPU's heuristics.
    if device.type != "cuda":
        return 132
    return multiprocessor_count(device.index)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast_dot_operands(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands must be cast to float32 first: the CPU interpreter multiplies
    bfloat16 operands as raw bits; compiled kernels never need this."""
    return interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    # TF32 would cost float32 callers about three decimal digits.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_tensor(
    name: str,
    tensor: object,
    ndim: int,
    dtypes: Sequence[torch.dtype],
) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {tensor.dtype}")
    return tensor


def check_same_device(tensors: dict[str, torch.Tensor]) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    if tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a unit stride in its last dimension, got strides {tensor.stride()}"
        )


def check_kv_caches(k_cache: object, v_cache: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Both caches: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, same shape."""
    k = check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    v = check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    if k.shape != v.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.dtype != v.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k.dtype} and {v.dtype}")
    for name, cache in (("k_cache", k), ("v_cache", v)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {cache.stride()}")
    return k, v


def check_query_heads(query: torch.Tensor, k_cache: torch.Tensor, same_dtype: bool = True) -> None:
    num_heads, head_dim = query.shape[-2], query.shape[-1]
    num_kv_heads, cache_head_dim = k_cache.shape[2], k_cache.shape[3]
    if head_dim != cache_head_dim:
        raise ValueError(
            f"query head_dim {head_dim} does not match the cache's head_dim {cache_head_dim}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if same_dtype and query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} does not match cache dtype {k_cache.dtype}")


def check_block_tables(block_tables: object, batch: int) -> torch.Tensor:
    tables = check_tensor("block_tables", block_tables, 2, (torch.int32,))
    if tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must have one row per sequence ({batch}), got shape {tuple(tables.shape)}"
        )
    if tables.shape[1] == 0:
        raise ValueError("block_tables must have at least one column")
    check_last_dim_contiguous("block_tables", tables)
    return tables


def check_seq_lens(seq_lens: object, batch: int) -> torch.Tensor:
    """A contiguous int32 vector of one length per sequence."""
    lens = check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    if lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have {batch} entries, got shape {tuple(lens.shape)}")
    if not lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    return lens


class PagedAttentionArgs(NamedTuple):
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor | None
    batch: int


def check_paged_attention_args(
    query: object,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    seq_lens: object,
    scale: float,
    query_start_loc: object | None = None,
    *,
    k_scale: object | None = None,
    v_scale: object | None = None,
) -> PagedAttentionArgs:
    """Checks what decode and prefill attention share; raises ValueError naming the argument.
    Decode passes query [B, Hq, D]; prefill passes query [T, Hq, D] split by query_start_loc
    (int32 [B + 1]). An 8-bit cache comes with its k_scale/v_scale (kv_quant.py)."""
    from nori.kernels.kv_quant import QUANTIZED_KV_DTYPES, check_quantized_kv_caches

    quantized = k_scale is not None or v_scale is not None
    if quantized and (k_scale is None or v_scale is None):
        raise ValueError("k_scale and v_scale must be given together")
    if not quantized and isinstance(k_cache, torch.Tensor) and k_cache.dtype in QUANTIZED_KV_DTYPES:
        raise ValueError(f"a {k_cache.dtype} cache needs its k_scale and v_scale")
    q = check_tensor("query", query, 3, FLOAT_DTYPES)
    tensors: dict[str, torch.Tensor]
    if quantized:
        k, v, ks, vs = check_quantized_kv_caches(k_cache, v_cache, k_scale, v_scale)
        tensors = {"query": q, "k_cache": k, "v_cache": v, "k_scale": ks, "v_scale": vs}
    else:
        k, v = check_kv_caches(k_cache, v_cache)
        tensors = {"query": q, "k_cache": k, "v_cache": v}
    check_query_heads(q, k, same_dtype=not quantized)
    starts = None
    if query_start_loc is None:
        batch = q.shape[0]
    else:
        starts = check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
        batch = starts.shape[0] - 1
        if batch < 0:
            raise ValueError("query_start_loc must have B + 1 entries, got none")
        if not starts.is_contiguous():
            raise ValueError("query_start_loc must be contiguous")
    tensors["block_tables"] = tables = check_block_tables(block_tables, batch)
    if starts is not None:
        tensors["query_start_loc"] = starts
    tensors["seq_lens"] = lens = check_seq_lens(seq_lens, batch)
    check_same_device(tensors)
    check_last_dim_contiguous("query", q)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return PagedAttentionArgs(q, k, v, tables, lens, starts, batch)


def gather_context(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = cdiv(length, block_size)
    blocks = cache.index_select(0, block_table_row[:num_blocks])
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


# Outputs in one panel of a CPU GEMV's packed weight: one 512-bit register of 32-bit sums.
PANEL_OUTPUTS = 16


def pack_weight_panels(weight: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), ceil(K/group), 16, group]: element (n, k) at [n // 16, k // group,
    n % 16, k % group], zero-padded; a 64-byte line is `group` K positions of 16 outputs."""
    outputs, width = weight.shape
    padded = weight.new_zeros(
        -(-outputs // PANEL_OUTPUTS) * PANEL_OUTPUTS, -(-width // group) * group
    )
    padded[:outputs, :width] = weight
    panels = padded.view(-1, PANEL_OUTPUTS, padded.shape[1] // group, group)
    return panels.permute(0, 2, 1, 3).contiguous()


def unpack_weight_panels(packed: torch.Tensor, outputs: int, width: int) -> torch.Tensor:
    """The [N, K] weight back from `pack_weight_panels`' layout."""
    plain = packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * PANEL_OUTPUTS, -1)
    return plain[:outputs, :width]
