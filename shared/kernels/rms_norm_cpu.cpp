// RMSNorm for the CPU engine, alone or fused with the residual add that precedes it in every
// decoder layer: one pass over each row instead of the six tensor ops (and temporaries) of the
// PyTorch reference (rms_norm.py), which these are tested against.
//
// Arithmetic in float32 in Hugging Face's order: x * rsqrt(mean(x^2) + eps), then * weight.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>

namespace {

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

void check_rows(const torch::Tensor& input, const torch::Tensor& weight) {
  TORCH_CHECK(input.dim() >= 1 && input.is_contiguous(), "input must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(-1) && weight.is_contiguous(),
              "weight must be [hidden] for input [..., hidden]");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), "input and weight dtypes differ");
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& input, const torch::Tensor& weight, double eps) {
  check_rows(input, weight);
  auto out = torch::empty_like(input);
  const int64_t hidden = input.size(-1);
  const int64_t rows = hidden ? input.numel() / hidden : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::BFloat16, at::ScalarType::Half, input.scalar_type(), "rms_norm", [&] {
        const scalar_t* x = input.data_ptr<scalar_t>();
        const scalar_t* w = weight.data_ptr<scalar_t>();
        scalar_t* o = out.data_ptr<scalar_t>();
        at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            norm_row(x + r * hidden, w, o + r * hidden, hidden, static_cast<float>(eps));
          }
        });
      });
  return out;
}

void fused_add_rms_norm(torch::Tensor& input, torch::Tensor& residual,
                        const torch::Tensor& weight, double eps) {
  check_rows(input, weight);
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == input.scalar_type(),
              "residual must be contiguous, with input's shape and dtype");
  const int64_t hidden = input.size(-1);
  const int64_t rows = hidden ? input.numel() / hidden : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::BFloat16, at::ScalarType::Half, input.scalar_type(), "fused_add_rms_norm",
      [&] {
        scalar_t* x = input.data_ptr<scalar_t>();
        scalar_t* res = residual.data_ptr<scalar_t>();
        const scalar_t* w = weight.data_ptr<scalar_t>();
        at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            scalar_t* xr = x + r * hidden;
            scalar_t* rr = res + r * hidden;
            for (int64_t i = 0; i < hidden; ++i) rr[i] = rr[i] + xr[i];
            norm_row(rr, w, xr, hidden, static_cast<float>(eps));
          }
        });
      });
}
