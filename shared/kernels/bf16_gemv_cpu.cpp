// bfloat16 weights times a few bfloat16 token rows (a decode step at small batch) on CPU.
//
// oneDNN's prepacked bf16 GEMM (PackedBf16Linear) costs about 23 us a call at one row whatever
// the layer's size, more than float32's GEMV on small layers, so `--dtype bfloat16` barely beat
// float32 at batch 1. Here every output is a dot product over the plain [N, K] weight row,
// float32 sums of bf16 pairs (AVX-512 BF16's dpbf16 where the build machine has it), tiles of
// token rows by weight rows so each weight vector is loaded once for all the rows. Tested
// against float32 products of the same bf16 values (bf16_gemv.py).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <int ROWS, int OUTS>
inline void dot_tile(const uint16_t* const* x, const uint16_t* const* w, int64_t width,
                     float (*sums)[OUTS]) {
  __m512 acc[ROWS][OUTS];
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= width; k += 32) {
    __m512bh wv[OUTS];
    for (int o = 0; o < OUTS; ++o) wv[o] = (__m512bh)_mm512_loadu_si512(w[o] + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[r] + k);
      for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv, wv[o]);
    }
  }
  if (k < width) {
    // Masked-off elements load as +0.0 on both sides: they add nothing.
    const __mmask32 mask = (~0U) >> (32 - (width - k));
    __m512bh wv[OUTS];
    for (int o = 0; o < OUTS; ++o) wv[o] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[o] + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[r] + k);
      for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv, wv[o]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) sums[r][o] = _mm512_reduce_add_ps(acc[r][o]);
}
#else
template <int ROWS, int OUTS>
inline void dot_tile(const uint16_t* const* x, const uint16_t* const* w, int64_t width,
                     float (*sums)[OUTS]) {
  for (int r = 0; r < ROWS; ++r) {
    for (int o = 0; o < OUTS; ++o) {
      float total = 0.f;
      for (int64_t k = 0; k < width; ++k) total += bf16_to_float(x[r][k]) * bf16_to_float(w[o][k]);
      sums[r][o] = total;
    }
  }
}
#endif

}  // namespace

torch::Tensor bf16_gemv(const torch::Tensor& input, const torch::Tensor& weight,
                        const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2 && input.is_contiguous() && input.scalar_type() == at::kBFloat16,
              "input must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16,
              "weight must be a contiguous bfloat16 [N, K] tensor");
  const int64_t rows = input.size(0);
  const int64_t width = input.size(1);
  const int64_t outputs = weight.size(0);
  TORCH_CHECK(weight.size(1) == width, "weight's K differs from the input's");
  const uint16_t* add = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == outputs && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16,
                "bias must be a contiguous bfloat16 [N] tensor");
    add = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
  }
  auto out = torch::empty({rows, outputs}, input.options());
  auto* y = out.data_ptr<at::BFloat16>();
  const auto* x_all = reinterpret_cast<const uint16_t*>(input.data_ptr<at::BFloat16>());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto finish = [&](int64_t r, int64_t o, float sum) {
    if (add != nullptr) sum += bf16_to_float(add[o]);
    y[r * outputs + o] = static_cast<at::BFloat16>(sum);
  };
  constexpr int kOuts = 4;
  constexpr int kRows = 4;
  // Outputs per chunk: enough weight rows to be worth a thread (about 64 KiB of weights).
  const int64_t grain = std::max<int64_t>(16, 32768 / std::max<int64_t>(width, 1));
  at::parallel_for(0, outputs, grain, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
    for (; o < end; o += kOuts) {
      const int64_t tile_outs = std::min<int64_t>(kOuts, end - o);
      const uint16_t* wr[kOuts];
      for (int j = 0; j < kOuts; ++j) wr[j] = w + (o + std::min<int64_t>(j, tile_outs - 1)) * width;
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        const int64_t tile_rows = std::min<int64_t>(kRows, rows - r0);
        // Rows (and outputs) past the end repeat the last one; their sums are not written.
        const uint16_t* x[kRows];
        for (int r = 0; r < kRows; ++r) x[r] = x_all + (r0 + std::min<int64_t>(r, tile_rows - 1)) * width;
        float sums[kRows][kOuts];
        switch (tile_rows) {
          case 1: dot_tile<1, kOuts>(x, wr, width, sums); break;
          case 2: dot_tile<2, kOuts>(x, wr, width, sums); break;
          case 3: dot_tile<3, kOuts>(x, wr, width, sums); break;
          default: dot_tile<kRows, kOuts>(x, wr, width, sums); break;
        }
        for (int r = 0; r < tile_rows; ++r)
          for (int j = 0; j < tile_outs; ++j) finish(r0 + r, o + j, sums[r][j]);
      }
    }
  });
  return out;
}
