"""Attention and KV-cache kernels: Triton on GPU, C++ for CPU decode, PyTorch references.

Importing this package never imports Triton nor builds the C++ kernels, so the CPU engine runs
where Triton is absent (and, on the references, where no C++ compiler is).
"""

from nori.kernels.decode_attention import paged_decode_attention
from nori.kernels.decode_attention_reference import (
    paged_decode_attention_cpu,
    paged_decode_attention_reference,
)
from nori.kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from nori.kernels.store_kv import store_kv_cache, store_kv_cache_reference

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_cpu",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "store_kv_cache",
    "store_kv_cache_reference",
]
