// Rotary position embedding for the CPU engine, in place on the q and k heads of the fused qkv
// projection (Hugging Face's rotate_half layout): one pass instead of the reference's four
// tensor ops and two temporaries per layer (rotary.py, which this is tested against).
//
// x [T, H, D] with the last dim contiguous (rows may be strided: q and k sit inside the qkv
// output); cos, sin [T, D / 2] contiguous, x's dtype: each token's angles, computed once a step.

#include "cpu_common.h"

namespace {

using namespace nori;

template <typename scalar_t>
void rotary(void* x, const void* cos, const void* sin, int64_t tokens, int64_t heads,
            int64_t half, int64_t stride_t, int64_t stride_h, int64_t threads) {
  auto* base = static_cast<scalar_t*>(x);
  const auto* cos_ptr = static_cast<const scalar_t*>(cos);
  const auto* sin_ptr = static_cast<const scalar_t*>(sin);
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * half, 1));
  parallel_for(0, tokens, grain, threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* __restrict__ c = cos_ptr + t * half;
      const scalar_t* __restrict__ s = sin_ptr + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* __restrict__ x1 = base + t * stride_t + h * stride_h;
        scalar_t* __restrict__ x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(x1[i]);
          const float b = static_cast<float>(x2[i]);
          const float ci = static_cast<float>(c[i]);
          const float si = static_cast<float>(s[i]);
          // rotate_half(x) = cat(-x2, x1)
          x1[i] = static_cast<scalar_t>(a * ci - b * si);
          x2[i] = static_cast<scalar_t>(b * ci + a * si);
        }
      }
    }
  });
}

}  // namespace

// Rotates x [tokens, heads, head_dim] in place (strides in elements; each row contiguous) by
// cos and sin, contiguous [tokens, head_dim / 2] of x's dtype.
NORI_SIGNATURE(rotary_inplace, "PPPPPPPPPPP");
extern "C" int nori_rotary_inplace(int64_t dtype, void* x, int64_t tokens, int64_t heads,
                                   int64_t head_dim, int64_t stride_t, int64_t stride_h,
                                   int64_t stride_d, const void* cos, const void* sin,
                                   int64_t threads) {
  NORI_REQUIRE(is_float(dtype) && stride_d == 1, "x must be float [T, H, D] with contiguous rows");
  NORI_REQUIRE(head_dim % 2 == 0, "head_dim must be even");
  return with_float_type(dtype, [&](auto type) {
    rotary<decltype(type)>(x, cos, sin, tokens, heads, head_dim / 2, stride_t, stride_h, threads);
  });
}
