// bfloat16 weights times a few bfloat16 token rows (a decode step at small batch) on CPU.
//
// oneDNN's prepacked bf16 GEMM (PackedBf16Linear) has a fixed cost per call that at a few rows
// is more than the product (docs/benchmarks.md). Here the weight is packed once into panels
// of 16 outputs, [N/16][ceil(K/2)][16][2] (bf16_gemv.py's pack_bf16_gemv_weight): one 64-byte
// line holds two K positions of 16 outputs, the pair AVX-512 BF16's dpbf16 multiplies by one
// broadcast 32-bit pair of a token row. A panel then streams front to back once, each line read
// once for every row of the step, the 16 sums stay in one register per row with no horizontal
// reduction, and the hardware prefetcher sees one sequential stream per thread. The rows are
// re-laid out first as [block of 16 rows][pair][16] so that one pair of all rows is one line.
// Tested against float32 products of the same bf16 values (bf16_gemv.py).

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_common.h"

// A namespace of its own: its names repeat int8_gemv_cpu.cpp's in the unity build.
namespace nori::bf16_gemv {
namespace {

constexpr int kLanes = 16;    // outputs in a panel: one 512-bit register of float32 sums
constexpr int kBlockRows = 16;  // token rows summed together over one panel
constexpr int kPrefetchPanels = 2;  // how far ahead a one-row pass asks for its weights

inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// One panel (16 outputs) times `ROWS` rows of one row block: y[r][0..lanes) = sums (+ bias).
// pairs: the block's rows as [pairs][kBlockRows] 32-bit (two bf16) values.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <int ROWS>
void panel_times_rows(const uint32_t* pairs, const uint16_t* panel, int64_t num_pairs,
                      const float* bias, uint16_t* y, int64_t y_stride, int64_t lanes,
                      const char* ahead) {
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  if (ROWS == 1 && ahead != nullptr) {
    // One row is bound by memory: each line of this panel also asks for the same line of a
    // panel further on into L2 (at more rows the same prefetch slows the product down).
    for (int64_t p = 0; p < num_pairs; ++p) {
      const __m512bh weights = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kLanes);
      // As an asm statement: GCC 12 deletes plain _mm_prefetch loops (decode_attention_cpu.cpp).
      asm volatile("prefetcht1 %0" : : "m"(*(ahead + 64 * p)));
      const int pair = static_cast<int>(pairs[p * kBlockRows]);
      acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_set1_epi32(pair), weights);
    }
  } else {
    for (int64_t p = 0; p < num_pairs; ++p) {
      const __m512bh weights = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kLanes);
      const uint32_t* row_pairs = pairs + p * kBlockRows;
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r)
        acc[r] = _mm512_dpbf16_ps(
            acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(row_pairs[r])), weights);
    }
  }
  const __mmask16 mask = lanes >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << lanes) - 1);
  const __m512 add = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < ROWS; ++r) {
    const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r], add));
    _mm256_mask_storeu_epi16(y + r * y_stride, mask, (__m256i)out);
  }
}
#else
template <int ROWS>
void panel_times_rows(const uint32_t* pairs, const uint16_t* panel, int64_t num_pairs,
                      const float* bias, uint16_t* y, int64_t y_stride, int64_t lanes,
                      const char* /*ahead*/) {
  for (int r = 0; r < ROWS; ++r) {
    for (int64_t lane = 0; lane < lanes; ++lane) {
      float total = 0.f;
      for (int64_t p = 0; p < num_pairs; ++p) {
        const uint32_t pair = pairs[p * kBlockRows + r];
        const uint16_t* w = panel + p * 2 * kLanes + 2 * lane;
        total += bf16_to_float(static_cast<uint16_t>(pair & 0xffffu)) * bf16_to_float(w[0]) +
                 bf16_to_float(static_cast<uint16_t>(pair >> 16)) * bf16_to_float(w[1]);
      }
      if (bias != nullptr) total += bias[lane];
      y[r * y_stride + lane] = float_to_bf16(total);
    }
  }
}
#endif

using PanelFn = void (*)(const uint32_t*, const uint16_t*, int64_t, const float*, uint16_t*,
                         int64_t, int64_t, const char*);

template <int... I>
constexpr std::array<PanelFn, sizeof...(I)> panel_functions(std::integer_sequence<int, I...>) {
  return {&panel_times_rows<I + 1>...};
}
// kPanelTimes[r - 1] sums r rows.
constexpr auto kPanelTimes = panel_functions(std::make_integer_sequence<int, kBlockRows>{});

}  // namespace

// input [rows, width] (dims, contiguous: its rank and flag) bfloat16 times the [outputs,
// width] weight packed as [ceil(outputs/16), ceil(width/2), 16, 2] (+ bias [outputs] float32,
// or nullptr) -> out [rows, outputs] bfloat16.
NORI_SIGNATURE(bf16_gemv, "PPPPPPPPPPP");
extern "C" int nori_bf16_gemv(int64_t dtype, const uint16_t* input, int64_t dims,
                              int64_t contiguous, int64_t rows, int64_t width,
                              const uint16_t* packed_weight, const float* bias, uint16_t* out,
                              int64_t outputs, int64_t threads) {
  NORI_REQUIRE(dtype == kBFloat16 && dims == 2 && contiguous,
               "input must be a contiguous bfloat16 [M, K] tensor");
  if (rows == 0 || outputs == 0) return 0;
  const int64_t num_pairs = (width + 1) / 2;
  const int64_t panels = (outputs + kLanes - 1) / kLanes;

  // The rows as [block][pair][kBlockRows]: the pair p of every row of a block is one line. An
  // odd K's last pair is (x[K-1], +0), against a packed weight padded with +0.
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  std::vector<uint32_t> row_pairs(static_cast<size_t>(blocks * num_pairs * kBlockRows), 0u);
  for (int64_t m = 0; m < rows; ++m) {
    uint32_t* dst = row_pairs.data() + (m / kBlockRows) * num_pairs * kBlockRows + m % kBlockRows;
    const uint16_t* row = input + m * width;
    for (int64_t p = 0; p < width / 2; ++p) std::memcpy(dst + p * kBlockRows, row + 2 * p, 4);
    if (width % 2 != 0) dst[(width / 2) * kBlockRows] = row[width - 1];
  }

  const int64_t panel_elements = num_pairs * 2 * kLanes;
  nori::parallel_for(0, panels, 1, threads, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t lanes = std::min<int64_t>(kLanes, outputs - panel * kLanes);
      // Within this thread's panels: the next thread's are its own to fetch.
      const char* ahead =
          panel + kPrefetchPanels < end
              ? reinterpret_cast<const char*>(packed_weight +
                                              (panel + kPrefetchPanels) * panel_elements)
              : nullptr;
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t block_rows = std::min<int64_t>(kBlockRows, rows - block * kBlockRows);
        kPanelTimes[block_rows - 1](row_pairs.data() + block * num_pairs * kBlockRows,
                                    packed_weight + panel * panel_elements, num_pairs,
                                    bias != nullptr ? bias + panel * kLanes : nullptr,
                                    out + block * kBlockRows * outputs + panel * kLanes, outputs,
                                    lanes, ahead);
      }
    }
  });  return 0;
}

}  // namespace nori::bf16_gemv
