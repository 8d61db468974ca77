// Quantizes the new tokens' keys and values into an 8-bit paged cache for the CPU engine
// (kv_quant.py's format): each (token, kv head) row gets a float16 scale and int8 or
// float8_e4m3fn codes, written in one pass; the reference builds the codes in temporaries and
// then does four index_copy_ calls.
//
// key, value [T, Hkv, D] float32 or bfloat16 (each token's rows contiguous, tokens `*_stride`
// elements apart: they sit inside the qkv output); k_cache, v_cache [num_slots, Hkv, D] int8 or
// float8_e4m3fn; k_scale, v_scale [num_slots, Hkv] float16; slots [T] int64 (-1 skips). Called
// by nori_store_kv (store_kv_cpu.cpp), which checks the arguments and the slots.

#include <cmath>
#include <type_traits>

#include "cpu_common.h"

namespace {

using namespace nori;

// One row of `dim` elements into codes and its scale, as quantize_kv_reference does.
// The build's -ffast-math turns float divisions into multiplications by a rounded reciprocal,
// which can move a quotient by an ulp and so a float16 scale by a step. In double, a product with
// the reciprocal is within an ulp of double of the exact quotient, and a float divided by 127,
// 448 or a float16 is never that close to a float rounding boundary: rounding it to float gives
// the IEEE float32 quotient the reference computes, so scales and codes match bit for bit.
template <typename input_t, typename code_t>
void quantize_row(const input_t* __restrict__ x, code_t* __restrict__ codes,
                  Half* __restrict__ scale_out, int64_t dim) {
  constexpr bool kInt8 = std::is_same_v<code_t, int8_t>;
  constexpr float kLimit = kInt8 ? 127.f : 448.f;
  // Not 1.0 / kLimit in float: a float reciprocal would bring back the rounding above.
  constexpr double kInverseLimit = kInt8 ? 1.0 / 127.0 : 1.0 / 448.0;
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::abs(static_cast<float>(x[d])));
  const float ratio = static_cast<float>(static_cast<double>(amax) * kInverseLimit);
  Half scale = static_cast<Half>(std::min(ratio, 65504.f));
  // A zero row, or one too small for float16: 1 keeps the codes finite (they are all 0).
  if (static_cast<float>(scale) == 0.f) scale = static_cast<Half>(1.f);
  *scale_out = scale;
  const double inverse = 1.0 / static_cast<double>(static_cast<float>(scale));
  for (int64_t d = 0; d < dim; ++d) {
    float q = static_cast<float>(static_cast<double>(static_cast<float>(x[d])) * inverse);
    // Clamping guards the row maximum against a float16 scale rounded below amax / limit.
    q = std::min(std::max(q, -kLimit), kLimit);
    if constexpr (kInt8) {
      codes[d] = static_cast<int8_t>(std::nearbyint(q));
    } else {
      codes[d] = Float8E4M3(q);
    }
  }
}

template <typename input_t, typename code_t>
void store(const void* key, const void* value, void* k_cache, void* v_cache, Half* k_scale,
           Half* v_scale, const int64_t* slots, int64_t tokens, int64_t num_kv_heads,
           int64_t head_dim, int64_t k_stride, int64_t v_stride, int64_t threads) {
  const auto* k_src = static_cast<const input_t*>(key);
  const auto* v_src = static_cast<const input_t*>(value);
  auto* k_dst = static_cast<code_t*>(k_cache);
  auto* v_dst = static_cast<code_t*>(v_cache);
  // A token costs Hkv * D quantized elements twice: a grain of 16 tokens keeps a decode step's
  // few tokens on one thread, where a fork would cost more than the work.
  parallel_for(0, tokens, 16, threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t row = slot * num_kv_heads + h;
        quantize_row(k_src + t * k_stride + h * head_dim, k_dst + row * head_dim, k_scale + row,
                     head_dim);
        quantize_row(v_src + t * v_stride + h * head_dim, v_dst + row * head_dim, v_scale + row,
                     head_dim);
      }
    }
  });
}

}  // namespace

// input_dtype: kFloat32 or kBFloat16; code_dtype: kInt8 or kFloat8E4M3; slots checked.
namespace nori {
void store_quantized(int64_t input_dtype, int64_t code_dtype, const void* key, const void* value,
                     void* k_cache, void* v_cache, void* k_scale, void* v_scale,
                     const int64_t* slots, int64_t tokens, int64_t num_kv_heads, int64_t head_dim,
                     int64_t k_stride, int64_t v_stride, int64_t threads) {
  auto* ks = static_cast<Half*>(k_scale);
  auto* vs = static_cast<Half*>(v_scale);
  const auto run = [&](auto input_tag, auto code_tag) {
    store<decltype(input_tag), decltype(code_tag)>(key, value, k_cache, v_cache, ks, vs, slots,
                                                   tokens, num_kv_heads, head_dim, k_stride,
                                                   v_stride, threads);
  };
  if (input_dtype == kFloat32) {
    if (code_dtype == kInt8) run(float{}, int8_t{});
    else run(float{}, Float8E4M3{});
  } else {
    if (code_dtype == kInt8) run(BFloat16{}, int8_t{});
    else run(BFloat16{}, Float8E4M3{});
  }
}
}  // namespace nori
