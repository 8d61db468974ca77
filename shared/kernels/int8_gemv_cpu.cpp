// int8 x int8 products for a few token rows (a decode step at small batch) on CPU.
//
// torch's x86 int8 GEMM (quantized.linear_dynamic) has a fixed cost per call that at a few rows
// is more than the product (docs/benchmarks.md): it quantizes, packs and dispatches through a
// blocked GEMM built for many rows. Here each row is
// quantized to int8 with its own symmetric scale, and the weight is packed once into panels of
// 16 outputs, [N/16][ceil(K/4)][16][4] (int8_gemv.py's pack_int8_gemv_weight): one 64-byte line
// holds four K positions of 16 outputs, the operand of AVX-512 VNNI's dpbusd against one
// broadcast group of four activation codes. A panel streams front to back once for all the
// rows, the 16 sums stay in one register per row with no horizontal reduction, and each thread
// reads one sequential stream (bf16_gemv_cpu.cpp does the same for bf16).
//
// Integer sums are exact, so the result is the PyTorch reference's (int8_gemv.py) up to
// float32 rounding of the scaling. Plain C++ over the same layout where the build machine has
// no AVX-512 VNNI.

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_common.h"

// A namespace of its own: its names repeat bf16_gemv_cpu.cpp's in the unity build.
namespace nori::int8_gemv {
namespace {

constexpr int kLanes = 16;      // outputs in a panel: one 512-bit register of int32 sums
constexpr int kGroup = 4;       // K positions in one 32-bit group
constexpr int kBlockRows = 16;  // token rows summed together over one panel
constexpr int kPrefetchPanels = 2;  // how far ahead a one-row pass asks for its weights

// What turns one panel's int32 sums of a row block into float32 outputs.
struct PanelOutput {
  const int32_t* weight_sums;  // [lanes] row sums of the panel's weight rows
  const float* weight_scale;   // [lanes]
  const float* bias;           // [lanes] or nullptr
  const float* row_scale;      // [ROWS] the block's rows' scales
  float* y;                    // the block's first row, at the panel's first output
  int64_t y_stride;
  int64_t lanes;
  const char* ahead;  // a panel further on in this thread's share, or nullptr
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// VNNI multiplies unsigned by signed bytes: the codes go in offset by 128 (1..255) and the
// weight row's sum times 128 comes off afterwards (row_sums, computed once per layer).
constexpr int kCodeOffset = 128;

// One panel times ROWS rows of a block, scaled back to float32 from the registers. groups: the
// block's codes as [num_groups][kBlockRows] 32-bit groups of four bytes.
template <int ROWS>
void panel_times_rows(const uint32_t* groups, const int8_t* panel, int64_t num_groups,
                      const PanelOutput& out) {
  __m512i acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_si512();
  if (ROWS == 1 && out.ahead != nullptr) {
    // One row is bound by memory: each line of this panel also asks for the same line of a
    // panel further on into L2 (as bf16_gemv_cpu.cpp; an asm statement, which GCC keeps).
    for (int64_t g = 0; g < num_groups; ++g) {
      const __m512i weights = _mm512_loadu_si512(panel + g * kGroup * kLanes);
      asm volatile("prefetcht1 %0" : : "m"(*(out.ahead + 64 * g)));
      const int codes = static_cast<int>(groups[g * kBlockRows]);
      acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_set1_epi32(codes), weights);
    }
  } else {
    for (int64_t g = 0; g < num_groups; ++g) {
      const __m512i weights = _mm512_loadu_si512(panel + g * kGroup * kLanes);
      const uint32_t* row_groups = groups + g * kBlockRows;
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r)
        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(static_cast<int>(row_groups[r])),
                                     weights);
    }
  }
  const __mmask16 mask =
      out.lanes >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << out.lanes) - 1);
  const __m512i offset = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(mask, out.weight_sums),
                                            _mm512_set1_epi32(kCodeOffset));
  const __m512 w_scale = _mm512_maskz_loadu_ps(mask, out.weight_scale);
  const __m512 add =
      out.bias != nullptr ? _mm512_maskz_loadu_ps(mask, out.bias) : _mm512_setzero_ps();
  for (int r = 0; r < ROWS; ++r) {
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], offset));
    // (sum * row_scale) * weight_scale + bias, in the order the plain path rounds it.
    const __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(sums, _mm512_set1_ps(out.row_scale[r])),
                                        w_scale);
    _mm512_mask_storeu_ps(out.y + r * out.y_stride, mask, _mm512_add_ps(scaled, add));
  }
}

// One row quantized into its block's layout: codes + 128 as bytes, group k / 4 of the row at
// dst + (k / 4) * kBlockRows groups. Returns the row's scale.
float quantize_row(const float* row, int64_t width, uint8_t* dst) {
  __m512 largest = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= width; k += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
  if (k < width) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (width - k)) - 1);
    largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail, row + k)));
  }
  const float top = _mm512_reduce_max_ps(largest);
  const float scale = top > 0.f ? top / 127.f : 1.f;
  const __m512 inverse = _mm512_set1_ps(1.f / scale);
  const __m512 high = _mm512_set1_ps(127.f), low = _mm512_set1_ps(-127.f);
  const __m512i offset = _mm512_set1_epi32(kCodeOffset);
  for (k = 0; k < width; k += 16) {
    const int64_t count = std::min<int64_t>(16, width - k);
    const __mmask16 valid = count == 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
    const __m512 v = _mm512_min_ps(
        high, _mm512_max_ps(low, _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, row + k), inverse)));
    // Round to nearest even, as std::nearbyint and torch.round do.
    const __m512i codes = _mm512_add_epi32(
        _mm512_cvtps_epi32(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
        offset);
    alignas(16) uint8_t bytes[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(bytes), _mm512_cvtepi32_epi8(codes));
    // Four groups of four codes, each to its own line. Past K the codes stay 0 (they meet the
    // packed weight's zero padding).
    for (int64_t j = 0; j < count; ++j) {
      const int64_t at = k + j;
      dst[(at / kGroup) * kBlockRows * kGroup + at % kGroup] = bytes[j];
    }
  }
  return scale;
}
#else
constexpr int kCodeOffset = 0;

template <int ROWS>
void panel_times_rows(const uint32_t* groups, const int8_t* panel, int64_t num_groups,
                      const PanelOutput& out) {
  for (int r = 0; r < ROWS; ++r) {
    int32_t acc[kLanes] = {};
    for (int64_t g = 0; g < num_groups; ++g) {
      int8_t codes[kGroup];
      std::memcpy(codes, groups + g * kBlockRows + r, kGroup);
      const int8_t* w = panel + g * kGroup * kLanes;
      for (int lane = 0; lane < kLanes; ++lane)
        for (int j = 0; j < kGroup; ++j)
          acc[lane] += static_cast<int32_t>(codes[j]) * static_cast<int32_t>(w[lane * kGroup + j]);
    }
    for (int64_t lane = 0; lane < out.lanes; ++lane) {
      const float value = static_cast<float>(acc[lane]) * out.row_scale[r] * out.weight_scale[lane];
      out.y[r * out.y_stride + lane] = out.bias != nullptr ? value + out.bias[lane] : value;
    }
  }
}

float quantize_row(const float* row, int64_t width, uint8_t* dst) {
  float largest = 0.f;
  for (int64_t k = 0; k < width; ++k) largest = std::max(largest, std::fabs(row[k]));
  const float scale = largest > 0.f ? largest / 127.f : 1.f;
  const float inverse = 1.f / scale;
  for (int64_t k = 0; k < width; ++k) {
    const int code = static_cast<int>(std::nearbyint(std::clamp(row[k] * inverse, -127.f, 127.f)));
    dst[(k / kGroup) * kBlockRows * kGroup + k % kGroup] = static_cast<uint8_t>(code);
  }
  return scale;
}
#endif

using PanelFn = void (*)(const uint32_t*, const int8_t*, int64_t, const PanelOutput&);

template <int... I>
constexpr std::array<PanelFn, sizeof...(I)> panel_functions(std::integer_sequence<int, I...>) {
  return {&panel_times_rows<I + 1>...};
}
// kPanelTimes[r - 1] sums r rows.
constexpr auto kPanelTimes = panel_functions(std::make_integer_sequence<int, kBlockRows>{});

}  // namespace

// input [rows, width] (dims, contiguous: its rank and flag) float32, each row quantized to
// int8, times the int8 [outputs, width] weight packed as [ceil(outputs/16), ceil(width/4), 16, 4]
// with its weight_scale [outputs] float32 and row_sums [outputs] int32 (+ bias [outputs]
// float32, or nullptr) -> out [rows, outputs] float32.
NORI_SIGNATURE(int8_gemv, "PPPPPPPPPPPPP");
extern "C" int nori_int8_gemv(int64_t dtype, const float* input, int64_t dims, int64_t contiguous,
                              int64_t rows, int64_t width, const int8_t* packed_weight,
                              const float* weight_scale, const int32_t* row_sums,
                              const float* bias, float* out, int64_t outputs, int64_t threads) {
  NORI_REQUIRE(dtype == kFloat32 && dims == 2 && contiguous,
               "input must be a contiguous float32 [M, K] tensor");
  if (rows == 0 || outputs == 0) return 0;
  const int64_t num_groups = (width + kGroup - 1) / kGroup;
  const int64_t panels = (outputs + kLanes - 1) / kLanes;

  // Quantize each row (symmetric, its largest magnitude to 127) straight into the block
  // layout [block][group][kBlockRows]: one group of every row of a block is one line.
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  std::vector<uint32_t> groups(static_cast<size_t>(blocks * num_groups * kBlockRows), 0u);
  std::vector<float> row_scale(static_cast<size_t>(blocks * kBlockRows), 1.f);
  for (int64_t r = 0; r < rows; ++r) {
    auto* dst = reinterpret_cast<uint8_t*>(groups.data() +
                                           (r / kBlockRows) * num_groups * kBlockRows +
                                           r % kBlockRows);
    row_scale[r] = quantize_row(input + r * width, width, dst);
  }

  const int64_t panel_elements = num_groups * kGroup * kLanes;
  nori::parallel_for(0, panels, 1, threads, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t first = panel * kLanes;
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t block_rows = std::min<int64_t>(kBlockRows, rows - block * kBlockRows);
        const PanelOutput target{row_sums + first,
                                 weight_scale + first,
                                 bias != nullptr ? bias + first : nullptr,
                                 row_scale.data() + block * kBlockRows,
                                 out + block * kBlockRows * outputs + first,
                                 outputs,
                                 std::min<int64_t>(kLanes, outputs - first),
                                 panel + kPrefetchPanels < end
                                     ? reinterpret_cast<const char*>(
                                           packed_weight +
                                           (panel + kPrefetchPanels) * panel_elements)
                                     : nullptr};
        kPanelTimes[block_rows - 1](groups.data() + block * num_groups * kBlockRows,
                                    packed_weight + panel * panel_elements, num_groups, target);
      }
    }
  });  return 0;
}

}  // namespace nori::int8_gemv
