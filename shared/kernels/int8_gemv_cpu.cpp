// int8 x int8 products for a few token rows (a decode step at small batch) on CPU.
//
// torch's x86 int8 GEMM (quantized.linear_dynamic) costs about 20 us a call whatever the
// layer's size at one row: it quantizes, packs and dispatches through a blocked GEMM built
// for many rows. A decode step at batch 1 makes four such calls per layer, and on a CPU whose
// cache holds the float32 weights the int8 layer was then no faster than float32's GEMV.
// Here each row is quantized to int8 with its own symmetric scale and every output is one
// int8 dot product over the weight row, read once for all the token rows.
//
// Integer sums are exact, so the result is the PyTorch reference's (int8_gemv.py) up to
// float32 rounding of the scaling. AVX-512 VNNI where the build machine has it (tiles of token
// rows by weight rows), AVX2 or plain C++ elsewhere.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// VNNI multiplies unsigned by signed bytes: the codes go in offset by 128 (1..255) and the
// weight row's sum times 128 comes off afterwards (row_sums, computed once per layer).
constexpr bool kOffsetCodes = true;

// ROWS token rows times OUTS weight rows, 64 bytes of K per instruction: ROWS * OUTS
// accumulators stay in registers and each weight vector is loaded once for all the rows.
template <int ROWS, int OUTS>
inline void dot_tile(const uint8_t* const* x, const int8_t* const* w, int64_t width,
                     int32_t (*sums)[OUTS]) {
  __m512i acc[ROWS][OUTS];
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= width; k += 64) {
    __m512i wv[OUTS];
    for (int o = 0; o < OUTS; ++o) wv[o] = _mm512_loadu_si512(w[o] + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i xv = _mm512_loadu_si512(x[r] + k);
      for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm512_dpbusd_epi32(acc[r][o], xv, wv[o]);
    }
  }
  if (k < width) {
    // Masked-off bytes load as zero on both sides: they add nothing.
    const __mmask64 mask = (~0ULL) >> (64 - (width - k));
    __m512i wv[OUTS];
    for (int o = 0; o < OUTS; ++o) wv[o] = _mm512_maskz_loadu_epi8(mask, w[o] + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i xv = _mm512_maskz_loadu_epi8(mask, x[r] + k);
      for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm512_dpbusd_epi32(acc[r][o], xv, wv[o]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) sums[r][o] = _mm512_reduce_add_epi32(acc[r][o]);
}
#else
constexpr bool kOffsetCodes = false;

// |x| (unsigned) times sign(x) * w (signed), for AVX2's maddubs: |x| <= 127 keeps its 16-bit
// pair sums from saturating (2 * 127 * 127 < 32767).
inline int32_t dot_int8(const int8_t* __restrict__ x, const int8_t* __restrict__ w, int64_t n) {
  int64_t k = 0;
  int32_t total = 0;
#if defined(__AVX2__)
  __m256i acc = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (; k + 32 <= n; k += 32) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k));
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  for (int lane = 0; lane < 8; ++lane) total += lanes[lane];
#endif
  for (; k < n; ++k) total += static_cast<int32_t>(x[k]) * static_cast<int32_t>(w[k]);
  return total;
}
#endif

}  // namespace

torch::Tensor int8_gemv(const torch::Tensor& input, const torch::Tensor& qweight,
                        const torch::Tensor& weight_scale, const torch::Tensor& row_sums,
                        const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2 && input.is_contiguous() && input.scalar_type() == at::kFloat,
              "input must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kChar,
              "qweight must be a contiguous int8 [N, K] tensor");
  const int64_t rows = input.size(0);
  const int64_t width = input.size(1);
  const int64_t outputs = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == width, "qweight's K differs from the input's");
  TORCH_CHECK(weight_scale.numel() == outputs && weight_scale.is_contiguous() &&
                  weight_scale.scalar_type() == at::kFloat,
              "weight_scale must hold one float32 per output");
  TORCH_CHECK(row_sums.numel() == outputs && row_sums.is_contiguous() &&
                  row_sums.scalar_type() == at::kInt,
              "row_sums must hold one int32 per output (qweight.sum(1))");
  const float* add = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == outputs && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "bias must be a contiguous float32 [N] tensor");
    add = bias->data_ptr<float>();
  }
  // Quantize each row: symmetric, its largest magnitude to 127.
  std::vector<int8_t> codes(rows * width);
  std::vector<float> row_scale(rows);
  const float* x = input.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * width;
    float largest = 0.f;
    for (int64_t k = 0; k < width; ++k) largest = std::max(largest, std::fabs(row[k]));
    const float scale = largest > 0.f ? largest / 127.f : 1.f;
    const float inverse = 1.f / scale;
    row_scale[r] = scale;
    int8_t* dst = codes.data() + r * width;
    const int offset = kOffsetCodes ? 128 : 0;
    for (int64_t k = 0; k < width; ++k) {
      const int code = static_cast<int>(std::nearbyint(std::clamp(row[k] * inverse, -127.f, 127.f)));
      // Stored as the byte of code + offset: read back as uint8 when offset.
      dst[k] = static_cast<int8_t>(static_cast<uint8_t>(code + offset));
    }
  }
  auto out = torch::empty({rows, outputs}, input.options());
  float* y = out.data_ptr<float>();
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* w_scale = weight_scale.data_ptr<float>();
  const int32_t* w_sums = row_sums.data_ptr<int32_t>();
  auto finish = [&](int64_t r, int64_t o, int32_t sum) {
    if (kOffsetCodes) sum -= 128 * w_sums[o];
    float value = static_cast<float>(sum) * row_scale[r] * w_scale[o];
    if (add != nullptr) value += add[o];
    y[r * outputs + o] = value;
  };
  // Outputs per chunk: enough weight rows to be worth a thread (about 64 KiB of weights).
  const int64_t grain = std::max<int64_t>(16, 65536 / std::max<int64_t>(width, 1));
  at::parallel_for(0, outputs, grain, [&](int64_t begin, int64_t end) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    constexpr int kOuts = 4;
    constexpr int kRows = 4;
    // Weight rows outermost: a tile's 4 weight rows stay in L1 while every token row passes.
    for (int64_t o = begin; o < end; o += kOuts) {
      const int64_t tile_outs = std::min<int64_t>(kOuts, end - o);
      // Outputs past the chunk's end repeat its last row; their sums are not written.
      const int8_t* wr[kOuts];
      for (int j = 0; j < kOuts; ++j) wr[j] = w + (o + std::min<int64_t>(j, tile_outs - 1)) * width;
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        const int64_t tile_rows = std::min<int64_t>(kRows, rows - r0);
        const uint8_t* x[kRows];
        for (int r = 0; r < kRows; ++r) {
          x[r] = reinterpret_cast<const uint8_t*>(codes.data()) +
                 (r0 + std::min<int64_t>(r, tile_rows - 1)) * width;
        }
        int32_t sums[kRows][kOuts];
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
#else
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t r = 0; r < rows; ++r) {
        finish(r, o, dot_int8(codes.data() + r * width, w + o * width, width));
      }
    }
#endif
  });
  return out;
}
