"""Attention and KV-cache kernels: Triton on GPU, C++ for CPU decode, PyTorch references;
importing this package never imports Triton nor builds the C++ kernels."""

from nori.kernels.decode_attention import paged_decode_attention
from nori.kernels.decode_attention_reference import (
    paged_decode_attention_cpu,
    paged_decode_attention_reference,
)
from nori.kernels.kv_quant import (
    KV_CACHE_DTYPES,
    dequantize_kv_reference,
    quantize_kv_reference,
    store_quantized_kv_cache,
    store_quantized_kv_cache_reference,
)
from nori.kernels.multi_query_decode_attention import (
    paged_multi_query_decode_attention,
    paged_multi_query_decode_attention_cpu,
    paged_multi_query_decode_attention_reference,
)
from nori.kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from nori.kernels.quantized_linear import (
    QUANT_METHODS,
    dequantize_weight,
    quantize_weight,
    weight_only_linear,
    weight_only_linear_reference,
)
from nori.kernels.store_kv import store_kv_cache, store_kv_cache_reference

__all__ = [
    "KV_CACHE_DTYPES",
    "QUANT_METHODS",
    "dequantize_kv_reference",
    "dequantize_weight",
    "paged_decode_attention",
    "paged_decode_attention_cpu",
    "paged_decode_attention_reference",
    "paged_multi_query_decode_attention",
    "paged_multi_query_decode_attention_cpu",
    "paged_multi_query_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "quantize_kv_reference",
    "quantize_weight",
    "store_kv_cache",
    "store_kv_cache_reference",
    "store_quantized_kv_cache",
    "store_quantized_kv_cache_reference",
    "weight_only_linear",
    "weight_only_linear_reference",
]
