"""Builds the C++ CPU kernels (plain C++) with g++ on first use, once per machine and checkout,
linked against torch's libgomp, and loads them with ctypes; a build lands by an atomic rename (no
lock). Without g++ the references run. CpuKernels' methods allocate outputs and pass pointers,
dtype codes, sizes, strides and the layout facts only Python sees, which C checks; integers as
c_void_p (the fastest; C reads int64_t), `threads` = torch.get_num_threads() (at::parallel_for's).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nori.settings import Environment

logger = logging.getLogger(__name__)

# -march=native: built where it runs. -ffast-math vectorises float sums (float32 rounding is the
# promise, not bit-exactness); not when linking, where it adds crtfastmath.o (flush-to-zero).
CFLAGS = ("-std=c++17", "-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
TORCH_LIB = Path(torch.__file__).resolve().parent / "lib"
LINK_FLAGS: tuple[str, ...] = (f"-L{TORCH_LIB}", "-l:libgomp.so.1", f"-Wl,-rpath,{TORCH_LIB}")
if not (TORCH_LIB / "libgomp.so.1").exists():  # a torch on the system's OpenMP runtime
    LINK_FLAGS = ("-fopenmp",)
# Compiled beside one unit that includes all the other files: the two take about as long.
SEPARATE = "decode_attention_cpu.cpp"
# The dtypes the per-layer C++ kernels serve; others take the PyTorch references.
CPU_KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


def build_root() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache/torch_extensions")


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """This CPU's feature flags (the first `flags` line of /proc/cpuinfo); () where unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ()
    return tuple(line.partition(":")[2].split())


def build_tag(folder: Path) -> str:
    """Of the machine, flags, sources and folder: no two checkouts or machines share a build."""
    digest = hashlib.sha256(" ".join([*cpu_flags(), *CFLAGS, *LINK_FLAGS, str(folder)]).encode())
    for path in sorted([*folder.glob("*.cpp"), *folder.glob("*.h"), *folder.glob("*/*/*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def build_library(folder: Path, root: Path) -> Path:
    """`folder`'s kernels under `root`, built unless there; RuntimeError with g++'s first error."""
    compiler, target = shutil.which("g++"), root / f"nori_cpu_kernels_{build_tag(folder)}.so"
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on the PATH")
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.stem}_", dir=root) as scratch:
        others = [path for path in sorted(folder.glob("*.cpp")) if path.name != SEPARATE]
        Path(scratch, "others.cpp").write_text("".join(f'#include "{p}"\n' for p in others))
        units = {folder / SEPARATE: f"{scratch}/0.o", Path(scratch, "others.cpp"): f"{scratch}/1.o"}
        compiles = [[compiler, *CFLAGS, "-c", str(unit), "-o", obj] for unit, obj in units.items()]
        with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
            list(pool.map(_run, compiles))
        _run([compiler, "-shared", *units.values(), "-o", f"{scratch}/lib.so", *LINK_FLAGS])
        os.replace(f"{scratch}/lib.so", target)
    return target


def _run(command: list[str]) -> None:
    """Runs a compiler command; RuntimeError with its first error line if it fails."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        lines = done.stderr.splitlines()
        raise RuntimeError(([line for line in lines if "error" in line] or lines or ["failed"])[0])


# Element type codes (cpu_common.h's `Dtype`); -1 for the others, which the C side refuses.
_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}
_CODE.update({torch.float8_e4m3fn: 4, torch.int32: 5, torch.int64: 6}.items())
_code, _threads, _F32, _I64 = _CODE.get, torch.get_num_threads, torch.float32, torch.int64
_F16, _SCALES = torch.float16, " [num_blocks, block_size, Hkv] of an 8-bit cache"


def _ptr(x: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> int | None:
    """The data pointer of x, a contiguous `shape` tensor of `dtype`; None for None."""
    if x is None:
        return None
    if x.dtype != dtype or x.shape != shape or not x.is_contiguous():
        raise RuntimeError(f"{name} must be a contiguous {dtype} tensor of shape {list(shape)}")
    return x.data_ptr()


class CpuKernels:
    """A method per kernel with the contract of its C function (`_name`, in its .cpp file): 0, or
    1 for a failure whose message nori_last_error() holds. References: in the kernel modules."""

    def __init__(self, library: ctypes.CDLL) -> None:
        kinds = {"P": ctypes.c_void_p, "F": ctypes.c_float}
        for name in ("signatures", "last_error"):  # the kernels' ctypes signatures; messages
            getattr(library, "nori_" + name).restype = ctypes.c_char_p
            getattr(library, "nori_" + name).argtypes = []
        for signature in library.nori_signatures().decode().split():
            name, arguments = signature.split(":")
            function = getattr(library, "nori_" + name)
            function.restype, function.argtypes = ctypes.c_int, [kinds[a] for a in arguments]
            setattr(self, "_" + name, function)
        self._error = library.nori_last_error

    def __getattr__(self, name: str) -> Any:  # the C functions, set in __init__
        raise AttributeError(name)

    def _check(self, status: int) -> None:
        if status:
            raise RuntimeError(self._error().decode())

    def rms_norm(self, input: Tensor, weight: Tensor, eps: float) -> Tensor:
        out, shape = torch.empty_like(input), input.shape
        self._check(self._rms_norm(
            _code(input.dtype, -1), _code(weight.dtype, -2), input.data_ptr(),
            input.is_contiguous(), input.numel(), shape[-1], weight.data_ptr(),
            weight.shape == shape[-1:] and weight.is_contiguous(), out.data_ptr(), eps,
            _threads()))  # fmt: skip
        return out

    def fused_add_rms_norm(self, input: Tensor, residual: Tensor, weight: Tensor,
                           eps: float) -> None:  # fmt: skip
        shape = input.shape
        self._check(self._fused_add_rms_norm(
            _code(input.dtype, -1), _code(weight.dtype, -2), input.data_ptr(),
            input.is_contiguous(), input.numel(), shape[-1], weight.data_ptr(),
            weight.shape == shape[-1:] and weight.is_contiguous(), residual.data_ptr(),
            residual.shape == shape and residual.dtype == input.dtype
            and residual.is_contiguous(), eps, _threads()))  # fmt: skip

    def silu_and_mul(self, input: Tensor) -> Tensor:
        tokens, width = input.shape[0], input.shape[-1]
        out = torch.empty(tokens, width // 2, dtype=input.dtype)
        self._check(self._silu_and_mul(
            _code(input.dtype, -1), input.data_ptr(), input.dim(), input.is_contiguous(), tokens,
            width, out.data_ptr(), _threads()))  # fmt: skip
        return out

    def rotary_inplace(self, x: Tensor, cos: Tensor, sin: Tensor) -> None:
        if x.dim() != 3:
            raise RuntimeError("x must be [T, H, D]")
        tokens, heads, dim = x.shape
        angles = (tokens, dim // 2)
        self._check(self._rotary_inplace(
            _code(x.dtype, -1), x.data_ptr(), tokens, heads, dim, *x.stride(),
            _ptr(cos, angles, x.dtype, "cos [T, D/2]"), _ptr(sin, angles, x.dtype, "sin [T, D/2]"),
            _threads()))  # fmt: skip

    def store_kv(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                 slots: Tensor) -> None:  # fmt: skip
        self._store(key, value, k_cache, v_cache, slots, None, None)

    def store_kv_quantized(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                           k_scale: Tensor, v_scale: Tensor, slots: Tensor) -> None:  # fmt: skip
        shape = k_cache.shape[:3]
        self._store(key, value, k_cache, v_cache, slots,
                    _ptr(k_scale, shape, _F16, "k_scale" + _SCALES),
                    _ptr(v_scale, shape, _F16, "v_scale" + _SCALES))  # fmt: skip

    def _store(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
               k_scale: int | None, v_scale: int | None) -> None:  # fmt: skip
        if key.dim() != 3 or k_cache.dim() != 4:
            raise RuntimeError("key and value must be [T, Hkv, D], the caches 4-D")
        (tokens, heads, dim), strides, value_strides = key.shape, key.stride(), value.stride()
        self._check(self._store_kv(
            _code(key.dtype, -1), key.data_ptr(), value.data_ptr(), tokens, heads, dim, *strides,
            value_strides[0], value.shape == key.shape and value.dtype == key.dtype
            and value_strides[1:] == strides[1:], _code(k_cache.dtype, -1), k_cache.data_ptr(),
            v_cache.data_ptr(), *k_cache.shape, v_cache.shape == k_cache.shape
            and v_cache.dtype == k_cache.dtype and k_cache.is_contiguous()
            and v_cache.is_contiguous(), slots.data_ptr(), slots.dtype == _I64
            and slots.shape == (tokens,) and slots.is_contiguous(), k_scale, v_scale,
            _threads()))  # fmt: skip

    def copy_pieces(self, pieces: Tensor, digest: Any = None) -> None:
        rows = _ptr(pieces, (pieces.shape[0], 3), _I64, "pieces (int64 [n, 3])")
        self._check(self._copy_pieces(rows, pieces.shape[0], digest))

    def copy_and_hash_pieces(self, pieces: Tensor) -> int:
        digest = ctypes.c_uint64()
        self.copy_pieces(pieces, ctypes.byref(digest))
        return digest.value

    def argmax_rows(self, logits: Tensor) -> Tensor:
        rows, width = logits.shape[0], logits.shape[-1]
        out = torch.empty(rows, dtype=_I64)
        self._check(self._argmax_rows(
            _code(logits.dtype, -1), logits.data_ptr(), logits.dim(), logits.is_contiguous(),
            rows, width, out.data_ptr(), _threads()))  # fmt: skip
        return out

    def rows_to_unit(self, input: Tensor, smallest_max: float) -> tuple[Tensor, Tensor]:
        rows, width = input.shape[0], input.shape[-1]
        scaled, row_max = torch.empty_like(input), torch.empty(rows, 1, dtype=_F32)
        self._check(self._rows_to_unit(
            _code(input.dtype, -1), input.data_ptr(), input.dim(), input.is_contiguous(), rows,
            width, scaled.data_ptr(), row_max.data_ptr(), smallest_max, _threads()))  # fmt: skip
        return scaled, row_max

    def scale_rows_back(self, output: Tensor, row_max: Tensor, bias: Tensor | None) -> None:
        rows, width = output.shape[0], output.shape[-1]
        self._check(self._scale_rows_back(
            _code(output.dtype, -1), output.data_ptr(), output.dim(), output.is_contiguous(), rows,
            width, _ptr(row_max, (rows, 1), _F32, "row_max"), _ptr(bias, (width,), _F32, "bias"),
            _threads()))  # fmt: skip

    def bf16_gemv(self, input: Tensor, packed_weight: Tensor, outputs: int,
                  bias: Tensor | None) -> Tensor:  # fmt: skip
        rows, width = input.shape[0], input.shape[-1]
        panels = ((outputs + 15) // 16, (width + 1) // 2, 16, 2)
        bias = None if bias is None else bias.float().contiguous()
        out = torch.empty(rows, outputs, dtype=input.dtype)
        self._check(self._bf16_gemv(
            _code(input.dtype, -1), input.data_ptr(), input.dim(), input.is_contiguous(), rows,
            width, _ptr(packed_weight, panels, torch.bfloat16, "packed_weight (pack_bf16_gemv)"),
            _ptr(bias, (outputs,), _F32, "bias"), out.data_ptr(), outputs, _threads()))  # fmt: skip
        return out

    def int8_gemv(self, input: Tensor, packed_weight: Tensor, outputs: int, weight_scale: Tensor,
                  row_sums: Tensor, bias: Tensor | None) -> Tensor:  # fmt: skip
        rows, width = input.shape[0], input.shape[-1]
        panels = ((outputs + 15) // 16, (width + 3) // 4, 16, 4)
        out = torch.empty(rows, outputs, dtype=_F32)
        self._check(self._int8_gemv(
            _code(input.dtype, -1), input.data_ptr(), input.dim(), input.is_contiguous(), rows,
            width, _ptr(packed_weight, panels, torch.int8, "packed_weight (pack_int8_gemv)"),
            _ptr(weight_scale, (outputs,), _F32, "weight_scale"), _ptr(row_sums, (outputs,),
            torch.int32, "row_sums"), _ptr(bias, (outputs,), _F32, "bias"), out.data_ptr(),
            outputs, _threads()))  # fmt: skip
        return out

    def fused_experts(self, hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor,
                      topk_ids: Tensor, w13_scale: Tensor | None,
                      w2_scale: Tensor | None) -> Tensor:  # fmt: skip
        """Weights neither in panels nor [in, out] (outputs contiguous) are copied to [in, out]."""
        panels = w13.dim() == 4
        if hidden.dim() != 2 or topk_ids.dim() != 2 or w13.dim() != w2.dim() or w2.dim() < 3:
            raise RuntimeError("hidden must be [T, H], topk_ids [T, k], w13 [E, 2I, H] and w2 "
                               "[E, H, I] (or both packed in panels of 16)")  # fmt: skip
        if not panels and not (w13.stride(1) == 1 and w2.stride(1) == 1):
            w13, w2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w13, w2))
        hidden, ids = hidden.contiguous(), topk_ids.contiguous()
        routing, (tokens, size) = topk_weights.float().contiguous(), hidden.shape
        s13, s2 = (None if s is None else s.float().contiguous() for s in (w13_scale, w2_scale))
        out, experts, inner = torch.empty_like(hidden), w13.shape[0], w2.shape[2]
        self._check(self._fused_experts(
            _code(hidden.dtype, -1), hidden.data_ptr(), tokens, size, _code(w13.dtype, -1),
            _code(w2.dtype, -1), panels, w13.data_ptr(), *w13.shape[:3], w13.shape[-1],
            w13.stride(0), w13.stride(2), w13.is_contiguous(), w2.data_ptr(), *w2.shape[:3],
            w2.shape[-1], w2.stride(0), w2.stride(2), w2.is_contiguous(),
            _ptr(s13, (experts, 2 * inner), _F32, "w13_scale [E, 2I]"),
            _ptr(s2, (experts, size), _F32, "w2_scale [E, H]"), _code(ids.dtype, -1),
            ids.data_ptr(), *ids.shape, routing.data_ptr(), routing.shape == ids.shape,
            out.data_ptr(), _threads()))  # fmt: skip
        return out

    def paged_decode_attention(self, query: Tensor, k_cache: Tensor, v_cache: Tensor,
                               block_tables: Tensor, seq_lens: Tensor, scale: float,
                               k_scale: Tensor | None = None,
                               v_scale: Tensor | None = None) -> Tensor:  # fmt: skip
        """For a float32, bfloat16 or float16 query; computed in float32, out in its dtype."""
        if (query.dim(), k_cache.dim(), block_tables.dim(), seq_lens.dim()) != (3, 4, 2, 1):
            raise RuntimeError("query must be [B, Hq, D], the caches [num_blocks, block_size, Hkv,"
                               " D], block_tables [B, M] and seq_lens [B]")  # fmt: skip
        tables, lengths, shape = block_tables.contiguous(), seq_lens.contiguous(), k_cache.shape
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        scales = (None, None) if k_scale is None and v_scale is None else (
            _ptr(k_scale, shape[:3], _F16, "k_scale" + _SCALES),
            _ptr(v_scale, shape[:3], _F16, "v_scale" + _SCALES))  # fmt: skip
        self._check(self._paged_decode_attention(
            _code(query.dtype, -1), query.data_ptr(), *query.shape, *query.stride(),
            _code(k_cache.dtype, -1), k_cache.data_ptr(), v_cache.data_ptr(), *shape,
            v_cache.shape == shape and v_cache.dtype == k_cache.dtype and k_cache.is_contiguous()
            and v_cache.is_contiguous(), *scales, _code(tables.dtype, -1), tables.data_ptr(),
            *tables.shape, _code(lengths.dtype, -1), lengths.data_ptr(), lengths.shape[0],
            out.data_ptr(), scale, _threads()))  # fmt: skip
        return out


def required_cpu_kernels() -> CpuKernels:
    """cpu_kernels(), or RuntimeError where they are not built (see the log) or disabled."""
    kernels = cpu_kernels()
    if kernels is None:
        raise RuntimeError("the C++ CPU kernels are not built here (see the log, NORI_CPU_KERNELS)")
    return kernels


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The compiled kernels; None where they cannot be built (logged once) or NORI_CPU_KERNELS=0."""
    if not Environment.read().cpu_kernels:
        return None
    try:
        library = build_library(Path(__file__).resolve().parent, build_root())
        return CpuKernels(ctypes.CDLL(str(library)))
    except Exception as error:  # no compiler, an unsupported platform, ...
        logger.warning("the C++ CPU kernels could not be built (%s); the references run", error)
        return None
