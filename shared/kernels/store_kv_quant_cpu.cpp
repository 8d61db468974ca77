// Quantizes the new tokens' keys and values into an 8-bit paged cache for the CPU engine
// (kv_quant.py's format): each (token, kv head) row gets a float16 scale and int8 or
// float8_e4m3fn codes, written in one pass; the reference builds the codes in temporaries and
// then does four index_copy_ calls.
//
// key, value [T, Hkv, D] float32 or bfloat16 (each token's rows contiguous, tokens may be
// strided: they sit inside the qkv output); k_cache, v_cache [num_blocks, block_size, Hkv, D]
// int8 or float8_e4m3fn; k_scale, v_scale [num_blocks, block_size, Hkv] float16; slots [T]
// int64 (-1 skips).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace {

template <typename T>
struct Tag {
  using type = T;
};

// One row of `dim` elements into codes and its scale, as quantize_kv_reference does.
// The build's -ffast-math turns float divisions into multiplications by a rounded reciprocal,
// which can move a quotient by an ulp and so a float16 scale by a step. In double, a product with
// the reciprocal is within an ulp of double of the exact quotient, and a float divided by 127,
// 448 or a float16 is never that close to a float rounding boundary: rounding it to float gives
// the IEEE float32 quotient the reference computes, so scales and codes match bit for bit.
template <typename input_t, typename code_t>
void quantize_row(const input_t* __restrict__ x, code_t* __restrict__ codes,
                  c10::Half* __restrict__ scale_out, int64_t dim) {
  constexpr bool kInt8 = std::is_same_v<code_t, int8_t>;
  constexpr float kLimit = kInt8 ? 127.f : 448.f;
  // Not 1.0 / kLimit in float: a float reciprocal would bring back the rounding above.
  constexpr double kInverseLimit = kInt8 ? 1.0 / 127.0 : 1.0 / 448.0;
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::abs(static_cast<float>(x[d])));
  const float ratio = static_cast<float>(static_cast<double>(amax) * kInverseLimit);
  c10::Half scale(std::min(ratio, 65504.f));
  // A zero row, or one too small for float16: 1 keeps the codes finite (they are all 0).
  if (static_cast<float>(scale) == 0.f) scale = c10::Half(1.f);
  *scale_out = scale;
  const double inverse = 1.0 / static_cast<double>(static_cast<float>(scale));
  for (int64_t d = 0; d < dim; ++d) {
    float q = static_cast<float>(static_cast<double>(static_cast<float>(x[d])) * inverse);
    // Clamping guards the row maximum against a float16 scale rounded below amax / limit.
    q = std::min(std::max(q, -kLimit), kLimit);
    if constexpr (kInt8) {
      codes[d] = static_cast<int8_t>(std::nearbyint(q));
    } else {
      codes[d] = c10::Float8_e4m3fn(q);
    }
  }
}

}  // namespace

void store_kv_quantized(const torch::Tensor& key, const torch::Tensor& value,
                        torch::Tensor& k_cache, torch::Tensor& v_cache, torch::Tensor& k_scale,
                        torch::Tensor& v_scale, const torch::Tensor& slots) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key and value must be [T, Hkv, D]");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "each token's key and value rows must be contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
                  (key.scalar_type() == torch::kFloat32 || key.scalar_type() == torch::kBFloat16),
              "key and value must both be float32 or bfloat16, got ", key.scalar_type(), " and ",
              value.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4,
              "caches must be contiguous [num_blocks, block_size, Hkv, D]");
  const auto cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cache_dtype &&
                  (cache_dtype == torch::kInt8 || cache_dtype == at::ScalarType::Float8_e4m3fn),
              "k_cache and v_cache must both be int8 or float8_e4m3fn, got ", cache_dtype, " and ",
              v_cache.scalar_type());
  TORCH_CHECK(k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2),
              "key rows do not match the cache's [Hkv, D]");
  for (const auto* s : {&k_scale, &v_scale}) {
    TORCH_CHECK(s->scalar_type() == torch::kHalf, "k_scale and v_scale must be float16, got ",
                s->scalar_type());
    TORCH_CHECK(s->sizes() == k_cache.sizes().slice(0, 3),
                "k_scale and v_scale must be [num_blocks, block_size, Hkv] = ",
                k_cache.sizes().slice(0, 3), ", got ", s->sizes());
    TORCH_CHECK(s->is_contiguous(), "k_scale and v_scale must be contiguous");
  }
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == key.size(0) &&
                  slots.scalar_type() == torch::kInt64 && slots.is_contiguous(),
              "slots must be contiguous int64 [T]");
  const int64_t tokens = key.size(0);
  const int64_t num_kv_heads = key.size(1);
  const int64_t head_dim = key.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot_ptr[t] >= -1 && slot_ptr[t] < num_slots, "slot ", slot_ptr[t],
                " outside the cache");
  }
  const int64_t k_stride = key.stride(0);
  const int64_t v_stride = value.stride(0);
  c10::Half* k_scale_ptr = k_scale.data_ptr<c10::Half>();
  c10::Half* v_scale_ptr = v_scale.data_ptr<c10::Half>();

  const auto launch = [&](auto input_tag, auto code_tag) {
    using input_t = typename decltype(input_tag)::type;
    using code_t = typename decltype(code_tag)::type;
    const input_t* k_src = static_cast<const input_t*>(key.data_ptr());
    const input_t* v_src = static_cast<const input_t*>(value.data_ptr());
    code_t* k_dst = static_cast<code_t*>(k_cache.data_ptr());
    code_t* v_dst = static_cast<code_t*>(v_cache.data_ptr());
    // A token costs Hkv * D quantized elements twice: a grain of 16 tokens keeps a decode step's
    // few tokens on one thread, where a fork would cost more than the work.
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t slot = slot_ptr[t];
        if (slot < 0) continue;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t row = slot * num_kv_heads + h;
          quantize_row(k_src + t * k_stride + h * head_dim, k_dst + row * head_dim,
                       k_scale_ptr + row, head_dim);
          quantize_row(v_src + t * v_stride + h * head_dim, v_dst + row * head_dim,
                       v_scale_ptr + row, head_dim);
        }
      }
    });
  };
  const auto with_codes = [&](auto input_tag) {
    if (cache_dtype == torch::kInt8) {
      launch(input_tag, Tag<int8_t>{});
    } else {
      launch(input_tag, Tag<c10::Float8_e4m3fn>{});
    }
  };
  if (key.scalar_type() == torch::kFloat32) {
    with_codes(Tag<float>{});
  } else {
    with_codes(Tag<c10::BFloat16>{});
  }
}
