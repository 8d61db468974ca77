// int8 x int8 products for a few token rows (a decode step at small batch) on CPU.
//
// torch's x86 int8 GEMM (quantized.linear_dynamic) costs about 20 us a call whatever the
// layer's size at one row: it quantizes, packs and dispatches through a blocked GEMM built
// for many rows. A decode step at batch 1 makes four such calls per layer. Here each row is
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

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int kLanes = 16;      // outputs in a panel: one 512-bit register of int32 sums
constexpr int kGroup = 4;       // K positions in one 32-bit group
constexpr int kBlockRows = 16;  // token rows summed together over one panel

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// VNNI multiplies unsigned by signed bytes: the codes go in offset by 128 (1..255) and the
// weight row's sum times 128 comes off afterwards (row_sums, computed once per layer).
constexpr int kCodeOffset = 128;

// One panel times ROWS rows of a block: sums[r][lane], int32. groups: the block's codes as
// [num_groups][kBlockRows] 32-bit groups of four bytes.
template <int ROWS>
void panel_times_rows(const uint32_t* groups, const int8_t* panel, int64_t num_groups,
                      int32_t (*sums)[kLanes]) {
  __m512i acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m512i weights = _mm512_loadu_si512(panel + g * kGroup * kLanes);
    const uint32_t* row_groups = groups + g * kBlockRows;
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r)
      acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(static_cast<int>(row_groups[r])),
                                   weights);
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_si512(sums[r], acc[r]);
}
#else
constexpr int kCodeOffset = 0;

template <int ROWS>
void panel_times_rows(const uint32_t* groups, const int8_t* panel, int64_t num_groups,
                      int32_t (*sums)[kLanes]) {
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
    std::memcpy(sums[r], acc, sizeof(acc));
  }
}
#endif

using PanelFn = void (*)(const uint32_t*, const int8_t*, int64_t, int32_t (*)[kLanes]);

template <int... I>
constexpr std::array<PanelFn, sizeof...(I)> panel_functions(std::integer_sequence<int, I...>) {
  return {&panel_times_rows<I + 1>...};
}
// kPanelTimes[r - 1] sums r rows.
constexpr auto kPanelTimes = panel_functions(std::make_integer_sequence<int, kBlockRows>{});

}  // namespace

torch::Tensor int8_gemv(const torch::Tensor& input, const torch::Tensor& packed_weight,
                        int64_t outputs, const torch::Tensor& weight_scale,
                        const torch::Tensor& row_sums, const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2 && input.is_contiguous() && input.scalar_type() == at::kFloat,
              "input must be a contiguous float32 [M, K] tensor");
  const int64_t rows = input.size(0);
  const int64_t width = input.size(1);
  const int64_t num_groups = (width + kGroup - 1) / kGroup;
  const int64_t panels = (outputs + kLanes - 1) / kLanes;
  TORCH_CHECK(packed_weight.dim() == 4 && packed_weight.is_contiguous() &&
                  packed_weight.scalar_type() == at::kChar && packed_weight.size(0) == panels &&
                  packed_weight.size(1) == num_groups && packed_weight.size(2) == kLanes &&
                  packed_weight.size(3) == kGroup,
              "packed_weight must be pack_int8_gemv_weight's [N/16, ceil(K/4), 16, 4] of an "
              "int8 [N, K] weight with the input's K");
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
  auto out = torch::empty({rows, outputs}, input.options());
  if (rows == 0 || outputs == 0) return out;

  // Quantize each row (symmetric, its largest magnitude to 127) straight into the block
  // layout [block][group][kBlockRows]: one group of every row of a block is one line. Codes past
  // K meet the packed weight's zero padding.
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  std::vector<uint32_t> groups(static_cast<size_t>(blocks * num_groups * kBlockRows), 0u);
  std::vector<float> row_scale(rows);
  const float* x = input.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * width;
    float largest = 0.f;
    for (int64_t k = 0; k < width; ++k) largest = std::max(largest, std::fabs(row[k]));
    const float scale = largest > 0.f ? largest / 127.f : 1.f;
    const float inverse = 1.f / scale;
    row_scale[r] = scale;
    auto* dst = reinterpret_cast<uint8_t*>(groups.data() +
                                           (r / kBlockRows) * num_groups * kBlockRows +
                                           r % kBlockRows);
    for (int64_t k = 0; k < width; ++k) {
      const int code = static_cast<int>(std::nearbyint(std::clamp(row[k] * inverse, -127.f, 127.f)));
      // The byte of code + offset: read back as uint8 by VNNI, as int8 by the plain loop.
      dst[(k / kGroup) * kBlockRows * kGroup + k % kGroup] = static_cast<uint8_t>(code + kCodeOffset);
    }
  }

  const int8_t* w = packed_weight.data_ptr<int8_t>();
  const float* w_scale = weight_scale.data_ptr<float>();
  const int32_t* w_sums = row_sums.data_ptr<int32_t>();
  float* y = out.data_ptr<float>();
  const int64_t panel_elements = num_groups * kGroup * kLanes;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    int32_t sums[kBlockRows][kLanes];
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t first = panel * kLanes;
      const int64_t lanes = std::min<int64_t>(kLanes, outputs - first);
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t block_rows = std::min<int64_t>(kBlockRows, rows - block * kBlockRows);
        kPanelTimes[block_rows - 1](groups.data() + block * num_groups * kBlockRows,
                                    w + panel * panel_elements, num_groups, sums);
        for (int64_t r = 0; r < block_rows; ++r) {
          const int64_t row = block * kBlockRows + r;
          float* y_row = y + row * outputs + first;
          for (int64_t lane = 0; lane < lanes; ++lane) {
            const int32_t sum = sums[r][lane] - kCodeOffset * w_sums[first + lane];
            float value = static_cast<float>(sum) * row_scale[row] * w_scale[first + lane];
            if (add != nullptr) value += add[first + lane];
            y_row[lane] = value;
          }
        }
      }
    }
  });
  return out;
}
