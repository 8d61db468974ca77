// RMSNorm for the CPU engine, alone or fused with the residual add that precedes it in every
// decoder layer: one pass over each row instead of the six tensor ops (and temporaries) of the
// PyTorch reference (rms_norm.py), which these are tested against.
//
// Arithmetic in float32 in Hugging Face's order: x * rsqrt(mean(x^2) + eps), then * weight.
// Rows are contiguous [rows, hidden]; weight [hidden] has the rows' dtype.

#include <cmath>

#include "cpu_common.h"

namespace {

using namespace nori;

// Rows per parallel task: enough work per task to amortise the hand-off.
int64_t grain_rows(int64_t hidden) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1)); }

template <typename scalar_t>
void norm_row(const scalar_t* __restrict__ x, const scalar_t* __restrict__ weight,
              scalar_t* __restrict__ out, int64_t hidden, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    out[i] = static_cast<scalar_t>(static_cast<float>(x[i]) * scale * static_cast<float>(weight[i]));
  }
}

template <typename scalar_t>
void rms_norm(const void* input, const void* weight, void* out, int64_t rows, int64_t hidden,
              float eps, int64_t threads) {
  const auto* x = static_cast<const scalar_t*>(input);
  const auto* w = static_cast<const scalar_t*>(weight);
  auto* o = static_cast<scalar_t*>(out);
  parallel_for(0, rows, grain_rows(hidden), threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(x + r * hidden, w, o + r * hidden, hidden, eps);
  });
}

template <typename scalar_t>
void fused_add_rms_norm(void* input, void* residual, const void* weight, int64_t rows,
                        int64_t hidden, float eps, int64_t threads) {
  auto* x = static_cast<scalar_t*>(input);
  auto* res = static_cast<scalar_t*>(residual);
  const auto* w = static_cast<const scalar_t*>(weight);
  parallel_for(0, rows, grain_rows(hidden), threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = x + r * hidden;
      scalar_t* rr = res + r * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        rr[i] = static_cast<scalar_t>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
      norm_row(rr, w, xr, hidden, eps);
    }
  });
}

}  // namespace

// out = rms_norm(input) * weight. input: `numel` elements in rows of `hidden` (contiguous: its
// flag); weight of its dtype (weight_ok: contiguous [hidden]).
NORI_SIGNATURE(rms_norm, "PPPPPPPPPFP");
extern "C" int nori_rms_norm(int64_t dtype, int64_t weight_dtype, const void* input,
                             int64_t contiguous, int64_t numel, int64_t hidden,
                             const void* weight, int64_t weight_ok, void* out, float eps,
                             int64_t threads) {
  NORI_REQUIRE(is_float(dtype) && weight_dtype == dtype,
               "input and weight must share a float32, bfloat16 or float16 dtype");
  NORI_REQUIRE(contiguous, "input must be contiguous");
  NORI_REQUIRE(weight_ok, "weight must be contiguous [hidden] for input [..., hidden]");
  return with_float_type(dtype, [&](auto type) {
    rms_norm<decltype(type)>(input, weight, out, hidden ? numel / hidden : 0, hidden, eps,
                             threads);
  });
}

// residual += input; input = rms_norm(residual) * weight, both in place; as nori_rms_norm's, and
// residual_ok: residual contiguous, with input's shape and dtype.
NORI_SIGNATURE(fused_add_rms_norm, "PPPPPPPPPPFP");
extern "C" int nori_fused_add_rms_norm(int64_t dtype, int64_t weight_dtype, void* input,
                                       int64_t contiguous, int64_t numel, int64_t hidden,
                                       const void* weight, int64_t weight_ok, void* residual,
                                       int64_t residual_ok, float eps, int64_t threads) {
  NORI_REQUIRE(is_float(dtype) && weight_dtype == dtype,
               "input and weight must share a float32, bfloat16 or float16 dtype");
  NORI_REQUIRE(contiguous, "input must be contiguous");
  NORI_REQUIRE(weight_ok, "weight must be contiguous [hidden] for input [..., hidden]");
  NORI_REQUIRE(residual_ok, "residual must be contiguous, with input's shape and dtype");
  return with_float_type(dtype, [&](auto type) {
    fused_add_rms_norm<decltype(type)>(input, residual, weight, hidden ? numel / hidden : 0,
                                       hidden, eps, threads);
  });
}
