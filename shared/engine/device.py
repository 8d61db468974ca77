"""Choosing the device and dtype the engine runs on."""

from __future__ import annotations

import torch

from nori.models.config import ModelConfig
from nori.models.dtypes import DTYPES, checkpoint_dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but PyTorch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device, model: ModelConfig) -> torch.dtype:
    if name != "auto":
        dtype = DTYPES[name]
        if device.type == "cpu" and dtype is torch.float16:
            # x86 has bf16 GEMMs (AVX-512 BF16, AMX) but no fast float16 ones.
            raise ValueError("dtype float16 is not supported on CPU; use bfloat16 or float32")
        return dtype
    stored = checkpoint_dtype(model)
    if device.type == "cpu":
        # bfloat16 where the CPU computes in it; emulated it is slower than float32.
        half = stored in (torch.float16, torch.bfloat16)
        return torch.bfloat16 if half and cpu_has_bf16() else torch.float32
    if stored in (torch.float16, torch.bfloat16):
        return stored
    # A float32 checkpoint is served in bfloat16 on GPU, as vLLM does by default.
    return torch.bfloat16


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX-512 BF16 or AMX), per /proc/cpuinfo."""
    from nori.kernels.cpu_build import cpu_flags

    return "avx512_bf16" in cpu_flags() or "amx_bf16" in cpu_flags()


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """ "auto" -> "triton" on GPU; on CPU "cpu" (the C++ decode kernel) where it builds, else
    "reference". Builds the C++ kernels now, at start, rather than in the first step."""
    from nori.kernels.cpu_build import cpu_kernels

    if name == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if cpu_kernels() is not None else "reference"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention_backend 'cpu' runs on CPU tensors only")
        if cpu_kernels() is None:
            raise ValueError("attention_backend 'cpu': the C++ kernels could not be built here")
    return name
