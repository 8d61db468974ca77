// Writes the new tokens' keys and values into the paged cache for the CPU engine: both caches in
// one call, each token's rows copied whole (store_kv.py's reference does two index_copy_ calls).
//
// key, value [T, Hkv, D] (last two dims contiguous, rows may be strided: they sit inside the
// qkv output); k_cache, v_cache [num_blocks, block_size, Hkv, D]; slots [T] int64 (-1 skips).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstring>

void store_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache,
              torch::Tensor& v_cache, const torch::Tensor& slots) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key and value must be [T, Hkv, D]");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "each token's key and value rows must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4,
              "caches must be contiguous [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2),
              "key rows do not match the cache's [Hkv, D]");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() &&
                  value.scalar_type() == v_cache.scalar_type(),
              "key/value and cache dtypes differ");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == key.size(0) &&
                  slots.scalar_type() == torch::kInt64 && slots.is_contiguous(),
              "slots must be contiguous int64 [T]");
  const int64_t tokens = key.size(0);
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot_ptr[t] >= -1 && slot_ptr[t] < num_slots, "slot ", slot_ptr[t],
                " outside the cache");
  }
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size();
  const int64_t v_stride = value.stride(0) * value.element_size();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slot_ptr[t];
      if (slot < 0) continue;
      std::memcpy(k_dst + slot * row_bytes, k_src + t * k_stride, row_bytes);
      std::memcpy(v_dst + slot * row_bytes, v_src + t * v_stride, row_bytes);
    }
  });
}
