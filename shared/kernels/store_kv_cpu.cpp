// Writes the new tokens' keys and values into the paged cache for the CPU engine, both caches in
// one call: each token's rows copied whole (store_kv.py's reference does two index_copy_ calls),
// or quantized into an 8-bit cache (store_kv_quant_cpu.cpp).

#include "cpu_common.h"

namespace nori {
// store_kv_quant_cpu.cpp: the rows quantized into int8 / float8_e4m3fn caches and float16 scales.
void store_quantized(int64_t input_dtype, int64_t code_dtype, const void* key, const void* value,
                     void* k_cache, void* v_cache, void* k_scale, void* v_scale,
                     const int64_t* slots, int64_t tokens, int64_t num_kv_heads, int64_t head_dim,
                     int64_t k_stride, int64_t v_stride, int64_t threads);
}  // namespace nori

// key and value [tokens, heads, dim] (strides in elements, each token's rows contiguous;
// value_ok: value has key's shape, dtype and row strides) into k_cache, v_cache [num_blocks,
// block_size, heads, dim] (caches_ok: contiguous, of one shape and dtype) at slots (slots_ok:
// contiguous int64 [tokens]; -1 skips): copied into caches of the rows' dtype, or quantized into
// int8 / float8_e4m3fn caches with k_scale, v_scale (contiguous float16 [num_blocks, block_size,
// heads]; nullptr for a copy).
NORI_SIGNATURE(store_kv, "PPPPPPPPPPPPPPPPPPPPPPPP");
extern "C" int nori_store_kv(int64_t dtype, const void* key, const void* value, int64_t tokens,
                             int64_t heads, int64_t dim, int64_t key_stride_t,
                             int64_t key_stride_h, int64_t key_stride_d, int64_t value_stride_t,
                             int64_t value_ok, int64_t cache_dtype, void* k_cache, void* v_cache,
                             int64_t num_blocks, int64_t block_size, int64_t cache_heads,
                             int64_t cache_dim, int64_t caches_ok, const int64_t* slots,
                             int64_t slots_ok, void* k_scale, void* v_scale, int64_t threads) {
  using namespace nori;
  NORI_REQUIRE(key_stride_h == dim && key_stride_d == 1 && value_ok,
               "key and value must be [T, Hkv, D] of one dtype, each token's rows contiguous");
  NORI_REQUIRE(cache_heads == heads && cache_dim == dim,
               "key rows do not match the cache's [Hkv, D]");
  NORI_REQUIRE(caches_ok, "caches must be contiguous [num_blocks, block_size, Hkv, D], alike");
  NORI_REQUIRE(slots_ok, "slots must be contiguous int64 [T]");
  const bool quantized = cache_dtype == kInt8 || cache_dtype == kFloat8E4M3;
  if (quantized) {
    NORI_REQUIRE(dtype == kFloat32 || dtype == kBFloat16,
                 "key and value must be float32 or bfloat16 for an 8-bit cache");
    NORI_REQUIRE(k_scale != nullptr && v_scale != nullptr,
                 "an 8-bit cache needs k_scale and v_scale "
                 "(float16 [num_blocks, block_size, Hkv])");
  } else {
    NORI_REQUIRE(k_scale == nullptr && v_scale == nullptr,
                 "k_scale and v_scale go with an int8 or float8_e4m3fn cache");
    NORI_REQUIRE(is_float(dtype) && cache_dtype == dtype, "key/value and cache dtypes differ");
  }
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t t = 0; t < tokens; ++t) {
    NORI_REQUIRE(slots[t] >= -1 && slots[t] < num_slots, "slot %lld outside the cache",
                 static_cast<long long>(slots[t]));
  }
  if (quantized) {
    store_quantized(dtype, cache_dtype, key, value, k_cache, v_cache, k_scale, v_scale, slots,
                    tokens, heads, dim, key_stride_t, value_stride_t, threads);
    return 0;
  }
  const int64_t size = dtype == kFloat32 ? 4 : 2;
  const int64_t row_bytes = heads * dim * size;
  const char* k_src = static_cast<const char*>(key);
  const char* v_src = static_cast<const char*>(value);
  char* k_dst = static_cast<char*>(k_cache);
  char* v_dst = static_cast<char*>(v_cache);
  parallel_for(0, tokens, 64, threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      std::memcpy(k_dst + slot * row_bytes, k_src + t * key_stride_t * size, row_bytes);
      std::memcpy(v_dst + slot * row_bytes, v_src + t * value_stride_t * size, row_bytes);
    }
  });
  return 0;
}
