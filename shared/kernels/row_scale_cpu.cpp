// Per-token activation scales around the x86 int8 GEMM (see row_scale.py): its dynamic
// quantization takes one scale per call, so each row is brought to magnitude 1 on the way in
// and multiplied back on the way out. Two passes in C++ instead of five small torch ops per
// linear layer. Tested against the PyTorch reference (row_scale.py). Contiguous float32 rows.

#include <cmath>

#include "cpu_common.h"

namespace {
// Rows per parallel chunk: a decode batch's few rows stay on one thread.
int64_t grain_for(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }
}  // namespace

// scaled[r] = input[r] / row_max[r], row_max[r] = max(max |input[r]|, smallest_max); input
// [rows, width] (dims, contiguous: its rank and flag) float32.
NORI_SIGNATURE(rows_to_unit, "PPPPPPPPFP");
extern "C" int nori_rows_to_unit(int64_t dtype, const float* input, int64_t dims,
                                 int64_t contiguous, int64_t rows, int64_t width, float* scaled,
                                 float* row_max, float smallest_max, int64_t threads) {
  NORI_REQUIRE(dtype == nori::kFloat32 && dims == 2 && contiguous,
               "input must be a contiguous float32 [T, K] tensor");
  nori::parallel_for(0, rows, grain_for(width), threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ row = input + r * width;
      float* __restrict__ dst = scaled + r * width;
      float largest = 0.f;
      for (int64_t i = 0; i < width; ++i) largest = std::max(largest, std::fabs(row[i]));
      largest = std::max(largest, smallest_max);
      row_max[r] = largest;
      const float inverse = 1.f / largest;
      for (int64_t i = 0; i < width; ++i) dst[i] = row[i] * inverse;
    }
  });
  return 0;
}

// output[r] = output[r] * row_max[r] (+ bias, [width], or nullptr), in place; output [rows,
// width] (dims, contiguous: its rank and flag) float32.
NORI_SIGNATURE(scale_rows_back, "PPPPPPPPP");
extern "C" int nori_scale_rows_back(int64_t dtype, float* output, int64_t dims,
                                    int64_t contiguous, int64_t rows, int64_t width,
                                    const float* row_max, const float* bias, int64_t threads) {
  NORI_REQUIRE(dtype == nori::kFloat32 && dims == 2 && contiguous,
               "output must be a contiguous float32 [T, N] tensor");
  nori::parallel_for(0, rows, grain_for(width), threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* __restrict__ row = output + r * width;
      const float factor = row_max[r];
      if (bias != nullptr) {
        for (int64_t i = 0; i < width; ++i) row[i] = row[i] * factor + bias[i];
      } else {
        for (int64_t i = 0; i < width; ++i) row[i] *= factor;
      }
    }
  });
  return 0;
}
