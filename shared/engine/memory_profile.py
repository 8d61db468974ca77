"""The KV pool's share of GPU memory, as vLLM's --gpu-memory-utilization means it: what is left of
total × utilization after the weights, the largest step's peak activations (profiled with a
dummy step after loading), the memory outside torch's allocator and the CUDA graph pool."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes of one device, measured after loading (`profile_memory`)."""

    total: int  # the device's memory
    weights: int  # torch memory that outlives a step: the weights and persistent buffers
    peak_activations: int  # the largest step's peak above that
    non_torch: int  # used on the device outside torch's allocator (CUDA context, NCCL, others)
    graph_pool: int  # CUDA graphs' private memory pool


def kv_pool_bytes(profile: MemoryProfile, utilization: float) -> int:
    """total × utilization − weights − peak activations − non-torch memory − graph pool; raises
    ValueError naming --gpu-memory-utilization when nothing is left."""
    pool = (
        int(profile.total * utilization)
        - profile.weights
        - profile.peak_activations
        - profile.non_torch
        - profile.graph_pool
    )
    if pool <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache at --gpu-memory-utilization {utilization}: "
            f"{_gib(profile.total)} × {utilization} = {_gib(profile.total * utilization)}, "
            f"of which the weights take {_gib(profile.weights)}, peak activations "
            f"{_gib(profile.peak_activations)}, non-torch memory {_gib(profile.non_torch)}, "
            f"the CUDA graph pool {_gib(profile.graph_pool)} ({_gib(pool)} left); raise "
            "--gpu-memory-utilization or lower --max-num-batched-tokens / --max-num-seqs"
        )
    return pool


def budget_summary(profile: MemoryProfile, utilization: float) -> str:
    """One log line: how total × utilization splits between its parts and the KV pool."""
    return (
        f"GPU memory {_gib(profile.total)} × {utilization} = "
        f"{_gib(profile.total * utilization)}: weights {_gib(profile.weights)}, peak "
        f"activations {_gib(profile.peak_activations)}, non-torch {_gib(profile.non_torch)}, "
        f"graph pool {_gib(profile.graph_pool)}, KV pool {_gib(kv_pool_bytes(profile, utilization))}"
    )


def pool_summary(num_blocks: int, block_size: int, max_model_len: int) -> str:
    """One log line: the pool's tokens and how many max_model_len requests fit at once (vLLM's
    "Maximum concurrency for L tokens per request")."""
    tokens = num_blocks * block_size
    return (
        f"KV pool: {num_blocks} blocks = {tokens} tokens; max concurrency at max_model_len "
        f"{max_model_len}: {tokens}/{max_model_len} = {tokens / max_model_len:.2f}x"
    )


def decode_graph_pool_bytes(
    decode_peak: int, capture_sizes: Sequence[int], hidden_row_bytes: int
) -> int:
    """An estimate of the decode CUDA graphs' shared pool, wanted before they exist (they are
    captured after the KV cache): the largest graph's activations, `decode_peak` (an eager
    forward of `nori.engine.dummy_step.dummy_decode_shape`, profiled), plus the hidden states
    each graph keeps as its output (`hidden_row_bytes` a row)."""
    return decode_peak + sum(capture_sizes) * hidden_row_bytes


def profile_memory(
    run_dummy_step: Callable[[], None],
    device: torch.device,
    weights_bytes: int,
    graph_pool_bytes: int = 0,
) -> MemoryProfile:
    """CUDA only. Runs `run_dummy_step` (the largest step) once under inference mode; its peak
    activations are torch's peak allocation during it above what was allocated at the call.
    `weights_bytes`: torch memory that stays allocated (the weights and persistent buffers);
    anything else allocated before the call (a scratch KV cache) is taken to be freed after.
    Non-torch memory is the device's used memory outside torch's reserved memory, measured
    after the step: the CUDA context, communicators and any other process's memory."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    allocated_before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        run_dummy_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - allocated_before
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    return MemoryProfile(
        total=total,
        weights=weights_bytes,
        peak_activations=max(peak, 0),
        non_torch=max(non_torch, 0),
        graph_pool=graph_pool_bytes,
    )


def _gib(size: float) -> str:
    return f"{size / GIB:.2f} GiB"
