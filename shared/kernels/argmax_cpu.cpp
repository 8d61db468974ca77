// Greedy sampling's argmax over each row of float32 logits for the CPU engine (torch.argmax's
// reduction over the last dim is slow: docs/benchmarks.md#cpu-kernels-and-weight-layouts). Same
// answer as torch.argmax: the first index of the maximum, and a NaN counts as the maximum
// (tested against it).

#include "cpu_common.h"

namespace {

// The kernels are built with -ffast-math, under which `x != x` may be folded to false: test the
// bits instead.
inline bool is_nan(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

}  // namespace

// logits [rows, width] (dims, contiguous: its rank and flag) float32 -> out [rows] int64.
NORI_SIGNATURE(argmax_rows, "PPPPPPPP");
extern "C" int nori_argmax_rows(int64_t dtype, const float* logits, int64_t dims,
                                int64_t contiguous, int64_t rows, int64_t width, int64_t* out,
                                int64_t threads) {
  NORI_REQUIRE(dtype == nori::kFloat32 && dims == 2 && contiguous,
               "logits must be contiguous float32 [B, V]");
  NORI_REQUIRE(width >= 1, "logits must have at least one column");
  nori::parallel_for(0, rows, 4, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = logits + r * width;
      // Vectorisable pass for the maximum; a NaN anywhere is the answer at its first index.
      float best = row[0];
      bool any_nan = false;
      for (int64_t i = 0; i < width; ++i) {
        any_nan |= is_nan(row[i]);
        best = row[i] > best ? row[i] : best;
      }
      int64_t index = 0;
      if (any_nan) {
        while (!is_nan(row[index])) ++index;
      } else {
        while (row[index] != best) ++index;
      }
      out[r] = index;
    }
  });
  return 0;
}
