// Per-token activation scales around the x86 int8 GEMM (see row_scale.py): its dynamic
// quantization takes one scale per call, so each row is brought to magnitude 1 on the way in
// and multiplied back on the way out. Two passes in C++ instead of five small torch ops per
// linear layer, whose dispatch cost a decode step at batch 16 (13% slower in torch ops).
// Tested against the PyTorch reference (row_scale.py).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {
// Rows per parallel chunk: a decode batch's few rows stay on one thread.
int64_t grain_for(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }
}  // namespace

std::tuple<torch::Tensor, torch::Tensor> rows_to_unit(const torch::Tensor& input,
                                                      double smallest_max) {
  TORCH_CHECK(input.dim() == 2 && input.is_contiguous() && input.scalar_type() == at::kFloat,
              "input must be a contiguous float32 [T, K] tensor");
  const int64_t rows = input.size(0);
  const int64_t width = input.size(1);
  auto scaled = torch::empty_like(input);
  auto row_max = torch::empty({rows, 1}, input.options());
  const float* x = input.data_ptr<float>();
  float* out = scaled.data_ptr<float>();
  float* maxima = row_max.data_ptr<float>();
  const float floor = static_cast<float>(smallest_max);
  at::parallel_for(0, rows, grain_for(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ row = x + r * width;
      float* __restrict__ dst = out + r * width;
      float largest = 0.f;
      for (int64_t i = 0; i < width; ++i) largest = std::max(largest, std::fabs(row[i]));
      largest = std::max(largest, floor);
      maxima[r] = largest;
      const float inverse = 1.f / largest;
      for (int64_t i = 0; i < width; ++i) dst[i] = row[i] * inverse;
    }
  });
  return {scaled, row_max};
}

void scale_rows_back(torch::Tensor& output, const torch::Tensor& row_max,
                     const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(output.dim() == 2 && output.is_contiguous() && output.scalar_type() == at::kFloat,
              "output must be a contiguous float32 [T, N] tensor");
  const int64_t rows = output.size(0);
  const int64_t width = output.size(1);
  TORCH_CHECK(row_max.numel() == rows && row_max.is_contiguous() &&
                  row_max.scalar_type() == at::kFloat,
              "row_max must hold one float32 per row");
  const float* add = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == width && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "bias must be a contiguous float32 [N] tensor");
    add = bias->data_ptr<float>();
  }
  float* out = output.data_ptr<float>();
  const float* maxima = row_max.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* __restrict__ row = out + r * width;
      const float factor = maxima[r];
      if (add != nullptr) {
        for (int64_t i = 0; i < width; ++i) row[i] = row[i] * factor + add[i];
      } else {
        for (int64_t i = 0; i < width; ++i) row[i] *= factor;
      }
    }
  });
}
