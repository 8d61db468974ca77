"""Benchmarks the Triton kernels against their PyTorch references on a CUDA GPU.

Run by hand on a GPU machine: `python bench/kernels_gpu.py`. Prints one JSON line per case with
the largest absolute difference from the reference, time per call (triton.testing.do_bench,
median ms) and achieved bandwidth or throughput. Sizes follow Llama-3-8B attention: 32 query
heads, 8 kv heads, head_dim 128, bfloat16, block_size 16; the fused-MoE cases follow
OLMoE-1B-7B's experts (64 experts, top-8, H 2048, I 1024). Not imported by the tests.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
# The tests' bfloat16 tolerance; reported, not enforced.
ATOL = 3e-2


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def _paged_context(
    seq_lens: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks_per_seq = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=device, dtype=DTYPE)
    v_cache = torch.randn(shape, device=device, dtype=DTYPE)
    # Shuffled ids: the engine's allocator hands out blocks in no particular order.
    ids = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    used = 0
    for b, count in enumerate(blocks_per_seq):
        tables[b, :count] = ids[used : used + count]
        used += count
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, lens


def bench_store_kv(num_tokens: int, device: torch.device) -> None:
    from nori.kernels.store_kv import store_kv_cache, store_kv_cache_reference

    k_cache, v_cache, _, _ = _paged_context([num_tokens * 2], device)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    value = torch.randn_like(key)
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device=device)[:num_tokens]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache(key, value, k_cache, v_cache, slots)
    store_kv_cache_reference(key, value, k_ref, v_ref, slots)
    error = max((k_cache - k_ref).abs().max().item(), (v_cache - v_ref).abs().max().item())
    triton_ms = _time_ms(lambda: store_kv_cache(key, value, k_cache, v_cache, slots))
    reference_ms = _time_ms(lambda: store_kv_cache_reference(key, value, k_ref, v_ref, slots))
    moved = 2 * 2 * key.numel() * key.element_size()  # read key+value, write both caches
    _emit(
        {
            "kernel": "store_kv_cache",
            "tokens": num_tokens,
            "max_abs_err": error,
            "triton_ms": triton_ms,
            "reference_ms": reference_ms,
            "triton_gbps": moved / triton_ms / 1e6,
        }
    )


def bench_decode(batch: int, context: int, device: torch.device) -> None:
    from nori.kernels.decode_attention import paged_decode_attention
    from nori.kernels.decode_attention_reference import paged_decode_attention_reference

    k_cache, v_cache, tables, lens = _paged_context([context] * batch, device)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    args = (query, k_cache, v_cache, tables, lens, scale)
    out = paged_decode_attention(*args, max_seq_len=context)
    expected = paged_decode_attention_reference(*args)
    error = (out.float() - expected.float()).abs().max().item()
    triton_ms = _time_ms(lambda: paged_decode_attention(*args, max_seq_len=context))
    auto_ms = _time_ms(lambda: paged_decode_attention(*args))
    reference_ms = _time_ms(lambda: paged_decode_attention_reference(*args))
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    moved = kv_bytes + 2 * query.numel() * query.element_size()
    _emit(
        {
            "kernel": "paged_decode_attention",
            "batch": batch,
            "context": context,
            "max_abs_err": error,
            "ok": error <= ATOL,
            "triton_ms": triton_ms,
            "triton_ms_without_max_seq_len": auto_ms,
            "reference_ms": reference_ms,
            "triton_gbps": moved / triton_ms / 1e6,
        }
    )


def bench_prefill(new_tokens: int, prefix: int, device: torch.device) -> None:
    from nori.kernels.prefill_attention import (
        paged_prefill_attention,
        paged_prefill_attention_reference,
    )

    seq_len = prefix + new_tokens
    k_cache, v_cache, tables, lens = _paged_context([seq_len], device)
    query = torch.randn(new_tokens, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    starts = torch.tensor([0, new_tokens], dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5
    args = (query, k_cache, v_cache, tables, starts, lens, scale)
    out = paged_prefill_attention(*args)
    expected = paged_prefill_attention_reference(*args)
    error = (out.float() - expected.float()).abs().max().item()
    triton_ms = _time_ms(lambda: paged_prefill_attention(*args))
    reference_ms = _time_ms(lambda: paged_prefill_attention_reference(*args))
    # Two matrix products of 2 * D flops per (query, attended key) pair and head.
    attended = sum(prefix + i + 1 for i in range(new_tokens))
    flops = 4 * NUM_HEADS * HEAD_DIM * attended
    _emit(
        {
            "kernel": "paged_prefill_attention",
            "new_tokens": new_tokens,
            "prefix": prefix,
            "max_abs_err": error,
            "ok": error <= ATOL,
            "triton_ms": triton_ms,
            "reference_ms": reference_ms,
            "triton_tflops": flops / triton_ms / 1e9,
        }
    )


@dataclass(frozen=True)
class MoeShape:
    num_experts: int = 64
    top_k: int = 8
    hidden_size: int = 2048
    intermediate_size: int = 1024


def bench_fused_moe(
    num_tokens: int, device: torch.device, quant: str | None = None, shape: MoeShape = MoeShape()
) -> None:
    """The Triton grouped GEMM against the loop over experts, on a softmax-top-k routing."""
    from nori.kernels.fused_moe import fused_experts_reference
    from nori.kernels.fused_moe_triton import fused_experts_triton
    from nori.kernels.quantized_linear import quantize_weight

    experts, top_k = shape.num_experts, shape.top_k
    hidden_size, intermediate = shape.hidden_size, shape.intermediate_size
    hidden = torch.randn(num_tokens, hidden_size, device=device, dtype=DTYPE)
    w13 = torch.randn(experts, 2 * intermediate, hidden_size, device=device) * hidden_size**-0.5
    w2 = torch.randn(experts, hidden_size, intermediate, device=device) * intermediate**-0.5
    logits = torch.randn(num_tokens, experts, device=device)
    topk_weights, topk_ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if quant is None:
        w13, w2 = w13.to(DTYPE), w2.to(DTYPE)
    else:
        pairs13 = [quantize_weight(w, quant) for w in w13]
        pairs2 = [quantize_weight(w, quant) for w in w2]
        w13 = torch.stack([q for q, _ in pairs13])
        w2 = torch.stack([q for q, _ in pairs2])
        scales = (torch.stack([s for _, s in pairs13]), torch.stack([s for _, s in pairs2]))
    args = (hidden, w13, w2, topk_weights, topk_ids, *scales)
    out = fused_experts_triton(*args)
    expected = fused_experts_reference(*args)
    error = (out.float() - expected.float()).abs().max().item()
    triton_ms = _time_ms(lambda: fused_experts_triton(*args))
    reference_ms = _time_ms(lambda: fused_experts_reference(*args))
    # Decode reads the weights of every expert chosen; prefill does 3 GEMMs of 2*H*I flops per
    # (token, slot) pair.
    touched = topk_ids.unique().numel()
    weight_bytes = touched * (
        w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size()
    )
    flops = 6 * num_tokens * top_k * hidden_size * intermediate
    _emit(
        {
            "kernel": "fused_experts",
            "tokens": num_tokens,
            "quant": quant,
            "experts": experts,
            "top_k": top_k,
            "max_abs_err": error,
            "ok": error <= ATOL,
            "triton_ms": triton_ms,
            "reference_ms": reference_ms,
            "triton_weight_gbps": weight_bytes / triton_ms / 1e6,
            "triton_tflops": flops / triton_ms / 1e9,
        }
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device; nothing to benchmark", file=sys.stderr)
        return 0
    device = torch.device("cuda")
    torch.manual_seed(0)
    _emit({"device": torch.cuda.get_device_name(device), "torch": torch.__version__})
    bench_store_kv(64, device)
    bench_store_kv(2048, device)
    bench_decode(64, 2048, device)
    bench_decode(8, 32768, device)
    bench_prefill(2048, 4096, device)
    bench_fused_moe(16, device)
    bench_fused_moe(16, device, quant="int8")
    bench_fused_moe(2048, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
