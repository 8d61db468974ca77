// Greedy sampling's argmax over each row of float32 logits for the CPU engine. torch.argmax's
// CPU reduction over the last dim ran at about 3 ns per element here (100 us for 16 x 2048),
// a few percent of a decode step. Same answer as torch.argmax: the first index of the maximum,
// and a NaN counts as the maximum (tested against it).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace {

// The kernels are built with -ffast-math, under which `x != x` may be folded to false: test the
// bits instead.
inline bool is_nan(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

}  // namespace

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat32,
              "logits must be contiguous float32 [B, V]");
  const int64_t rows = logits.size(0);
  const int64_t width = logits.size(1);
  TORCH_CHECK(width > 0, "logits must have at least one column");
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const float* data = logits.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * width;
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
      result[r] = index;
    }
  });
  return out;
}
