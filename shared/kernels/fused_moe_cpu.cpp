// A mixture-of-experts layer's experts on CPU (the contract and the PyTorch reference are in
// fused_moe.py): the (token, slot) pairs grouped by expert, ONE gate/up product and ONE down
// product per expert that any token chose, then each token's rows summed back with its routing
// weights.
//
// The reference loops over every expert in Python (a torch.where, an index, two linears, a
// silu, an index_add per expert); at a decode step's few tokens that overhead is a large part
// of the layer's time. Here one call does it all:
//   1. a counting sort of the pairs by expert id (ids outside [0, E) are skipped: expert
//      parallelism hands a rank only its own experts' ids);
//   2. one gather of the chosen rows, grouped by expert, contiguous, in float32;
//   3. per expert, gate_up = rows @ w13[e]^T for all its rows at once;
//   4. silu(gate) * up over all rows in one pass, in float32;
//   5. per expert, down = act @ w2[e]^T;
//   6. per token, out[t] = sum over its slots of weight * down[pair], in float32, written once
//      in hidden's dtype (no scatter races: each token is summed by one thread).
// The weights are packed in panels of 16 outputs (`pack_expert_panels`, [E, ceil(N/16), K, 16],
// what the CPU model stores: each tile's weights one contiguous block) or stored [in, out]
// (each expert's matrix with its output dimension contiguous); cpu_build.py brings any other
// strides to [in, out] first.

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <cmath>
#include <utility>
#include <vector>

#include "cpu_common.h"

namespace {

using namespace nori;

// The (token, slot) pairs grouped by expert: positions [offsets[e], offsets[e + 1]) of
// `pair_of_position` are expert e's, in token order; `position_of_pair[t * k + j]` is pair
// (t, j)'s position, or -1 for an id outside [0, E).
struct ExpertGroups {
  std::vector<int64_t> offsets;
  std::vector<int64_t> pair_of_position;
  std::vector<int64_t> position_of_pair;
};

template <typename id_t>
ExpertGroups group_by_expert(const id_t* ids, int64_t pairs, int64_t num_experts) {
  ExpertGroups groups;
  groups.offsets.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t expert = static_cast<int64_t>(ids[p]);
    if (expert >= 0 && expert < num_experts) ++groups.offsets[expert + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) groups.offsets[e + 1] += groups.offsets[e];
  std::vector<int64_t> next(groups.offsets.begin(), groups.offsets.end() - 1);
  groups.pair_of_position.resize(groups.offsets[num_experts]);
  groups.position_of_pair.assign(pairs, -1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t expert = static_cast<int64_t>(ids[p]);
    if (expert < 0 || expert >= num_experts) continue;
    const int64_t position = next[expert]++;
    groups.pair_of_position[position] = p;
    groups.position_of_pair[p] = position;
  }
  return groups;
}

// ---- The streamed path: weights stored [in, out] (each expert's matrix with its output
// dimension contiguous, `w.transpose(1, 2).contiguous().transpose(1, 2)`).
//
// A group of a few rows times a [K, N] weight should be bound by reading the weight; the
// libraries' small-M products fall short of that, bfloat16 most (ATen's bfloat16 GEMM without
// AVX-512 BF16 is several times slower than its float32 one). Here each weight line k (N outputs, contiguous) is read
// once per tile of 6 rows and 16 outputs, widened to float32 in registers (bfloat16 by a
// shift, int8 by a conversion) and multiplied into the 6 x 16 float32 sums (12 of AVX2's 16 vector registers): the compiler
// vectorises the 16 outputs (2 AVX2 or 1 AVX-512 register per row). The activations are float32
// rows throughout (gate_up, silu * up, down), rounded only on the way out.

inline float widen(float value) { return value; }
inline float widen(int8_t value) { return static_cast<float>(value); }
inline float widen(BFloat16 value) { return static_cast<float>(value); }

// Eight float32 lanes (one AVX2 register; GCC's vector extensions, so the same source builds
// for any x86 -march=native) and the loads that widen 8 weights into them.
typedef float Float8 __attribute__((vector_size(32)));
typedef int32_t Int8x32 __attribute__((vector_size(32)));
typedef uint32_t Uint8x32 __attribute__((vector_size(32)));
typedef uint16_t Uint8x16 __attribute__((vector_size(16)));
typedef int8_t Int8x8 __attribute__((vector_size(8)));

inline Float8 load8(const float* p) {
  Float8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline Float8 load8(const BFloat16* p) {
#ifdef __AVX2__
  const __m256i bits = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<Float8>(_mm256_castsi256_ps(bits));
#else
  Uint8x16 half;
  std::memcpy(&half, p, sizeof(half));
  const Uint8x32 bits = __builtin_convertvector(half, Uint8x32) << 16;
  Float8 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}
inline Float8 load8(const int8_t* p) {
#ifdef __AVX2__
  const __m256i wide =
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<Float8>(_mm256_cvtepi32_ps(wide));
#else
  Int8x8 bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  return __builtin_convertvector(__builtin_convertvector(bytes, Int8x32), Float8);
#endif
}

constexpr int64_t kTileCols = 16;
constexpr int64_t kTileRows = 6;
constexpr int64_t kPrefetchLines = 8;
// Output columns per parallel task: 4 tiles, a 128-byte stripe of each bfloat16 weight line.
constexpr int64_t kTaskCols = 4 * kTileCols;

// out[r, j] = scale[j] * sum_k x[r, k] * w[k, j] for r < kRows (<= kTileRows), j < cols
// (<= kTileCols); x float32 rows (stride ldx), w [K, *] with line stride ldw.
template <typename weight_t, int64_t kRows>
void streamed_tile(const float* __restrict__ x, int64_t ldx, const weight_t* __restrict__ w,
                   int64_t ldw, int64_t depth, int64_t cols, const float* scale,
                   float* __restrict__ out, int64_t ldo) {
  if (cols == kTileCols) {
    Float8 acc[kRows][2] = {};
    for (int64_t k = 0; k < depth; ++k) {
      const weight_t* line = w + k * ldw;
      // The lines are a page or more apart: the hardware prefetcher does not follow them.
      __builtin_prefetch(line + kPrefetchLines * ldw);
      const Float8 low = load8(line), high = load8(line + 8);
      for (int64_t r = 0; r < kRows; ++r) {
        const float xv = x[r * ldx + k];
        acc[r][0] += xv * low;
        acc[r][1] += xv * high;
      }
    }
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t half = 0; half < 2; ++half) {
        Float8 sum = acc[r][half];
        if (scale != nullptr) sum *= load8(scale + 8 * half);
        std::memcpy(out + r * ldo + 8 * half, &sum, sizeof(sum));
      }
    }
    return;
  }
  // The last, narrower tile of a width that is not a multiple of 16.
  float acc[kRows][kTileCols] = {};
  for (int64_t k = 0; k < depth; ++k) {
    const weight_t* __restrict__ line = w + k * ldw;
    for (int64_t r = 0; r < kRows; ++r) {
      const float xv = x[r * ldx + k];
      for (int64_t j = 0; j < cols; ++j) acc[r][j] += xv * widen(line[j]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      out[r * ldo + j] = scale == nullptr ? acc[r][j] : acc[r][j] * scale[j];
}

// out [rows, N] (float32, stride ldo) = x [rows, K] (float32, stride ldx) @ w [K, N] for the
// columns [col_begin, col_end), tile by tile: each stripe of weight lines stays in cache while
// the row tiles reuse it.
// With `panels` the weight is packed in panels of 16 outputs ([N/16, K, 16]: `w` points at the
// expert's first panel and `ldw` is ignored): each tile then reads one contiguous block, which
// the hardware prefetcher streams, instead of one line per page of an [in, out] matrix.
template <typename weight_t>
void streamed_product(const float* x, int64_t ldx, int64_t rows, const weight_t* w, int64_t ldw,
                      bool panels, int64_t depth, const float* scale, int64_t col_begin,
                      int64_t col_end, float* out, int64_t ldo) {
  for (int64_t c = col_begin; c < col_end; c += kTileCols) {
    const int64_t cols = std::min(kTileCols, col_end - c);
    const float* col_scale = scale == nullptr ? nullptr : scale + c;
    const weight_t* tile_w = panels ? w + (c / kTileCols) * depth * kTileCols : w + c;
    const int64_t tile_ldw = panels ? kTileCols : ldw;
    for (int64_t r = 0; r < rows; r += kTileRows) {
      const float* xr = x + r * ldx;
      float* o = out + r * ldo + c;
      switch (std::min(kTileRows, rows - r)) {
        case 6: streamed_tile<weight_t, 6>(xr, ldx, tile_w, tile_ldw, depth, cols, col_scale, o, ldo); break;
        case 5: streamed_tile<weight_t, 5>(xr, ldx, tile_w, tile_ldw, depth, cols, col_scale, o, ldo); break;
        case 4: streamed_tile<weight_t, 4>(xr, ldx, tile_w, tile_ldw, depth, cols, col_scale, o, ldo); break;
        case 3: streamed_tile<weight_t, 3>(xr, ldx, tile_w, tile_ldw, depth, cols, col_scale, o, ldo); break;
        case 2: streamed_tile<weight_t, 2>(xr, ldx, tile_w, tile_ldw, depth, cols, col_scale, o, ldo); break;
        default: streamed_tile<weight_t, 1>(xr, ldx, tile_w, tile_ldw, depth, cols, col_scale, o, ldo);
      }
    }
  }
}

// One phase of the streamed path: for every expert with rows, out[group] = in[group] @ w[e]
// (w [E, K, N] viewed with strides (stride_e, ldw, 1)), split into (expert, 64 columns) tasks
// that the cores share: at a decode step's one or two experts both cores still work.
template <typename weight_t>
void streamed_phase(const std::vector<int64_t>& offsets, const float* in, int64_t depth,
                    const weight_t* w, int64_t stride_e, int64_t ldw, bool panels, int64_t width,
                    const float* scale, float* out, int64_t threads) {
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (expert, first column)
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    for (int64_t c = 0; c < width; c += kTaskCols) tasks.emplace_back(e, c);
  }
  parallel_for(0, static_cast<int64_t>(tasks.size()), 1, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [e, c] = tasks[i];
      const int64_t first = offsets[e], rows = offsets[e + 1] - offsets[e];
      streamed_product(in + first * depth, depth, rows, w + e * stride_e, ldw, panels, depth,
                       scale == nullptr ? nullptr : scale + e * width, c,
                       std::min(width, c + kTaskCols), out + first * width, width);
    }
  });
}

// out[t] = sum over t's slots j of weights[t, j] * down[position of (t, j)], rounded once.
template <typename scalar_t>
void weighted_sum_back(const float* down, const float* weights,
                       const std::vector<int64_t>& position_of_pair, int64_t tokens,
                       int64_t hidden, int64_t slots, scalar_t* out, int64_t threads) {
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(hidden * slots, 1));
  parallel_for(0, tokens, grain, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t j = 0; j < slots; ++j) {
        const int64_t position = position_of_pair[t * slots + j];
        if (position < 0) continue;
        const float weight = weights[t * slots + j];
        const float* __restrict__ row = down + position * hidden;
        float* __restrict__ acc = sum.data();
        for (int64_t i = 0; i < hidden; ++i) acc[i] += weight * row[i];
      }
      scalar_t* __restrict__ dst = out + t * hidden;
      for (int64_t i = 0; i < hidden; ++i) dst[i] = static_cast<scalar_t>(sum[i]);
    }
  });
}

template <typename scalar_t>
void gather_rows(const scalar_t* hidden, int64_t stride, const std::vector<int64_t>& pairs_of,
                 int64_t slots, int64_t width, float* rows) {
  for (size_t position = 0; position < pairs_of.size(); ++position) {
    const scalar_t* src = hidden + (pairs_of[position] / slots) * stride;
    float* dst = rows + position * width;
    for (int64_t i = 0; i < width; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

}  // namespace

// hidden [tokens, hidden_size] contiguous float32 or bfloat16 -> out, the same. w13 [E, 2I, H],
// w2 [E, H, I] (each dN their sizes) stored [in, out] (strides (stride_e, ldw, 1)), or with
// `panels` packed contiguous [E, ceil(2I/16), H, 16] and [E, ceil(H/16), I, 16]; of hidden's
// dtype, or int8 with w13_scale [E, 2I] and w2_scale [E, H] float32 (else nullptr). topk_ids
// [id_rows, slots] int32 or int64 and topk_weights (routing_ok: float32 of its shape), contiguous.
NORI_SIGNATURE(fused_experts, "PPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPP");
extern "C" int nori_fused_experts(
    int64_t hidden_dtype, const void* hidden, int64_t tokens, int64_t hidden_size,
    int64_t w13_dtype, int64_t w2_dtype, int64_t panels, const void* w13, int64_t w13_d0,
    int64_t w13_d1, int64_t w13_d2, int64_t w13_d3, int64_t w13_stride_e, int64_t w13_ldw,
    int64_t w13_contiguous, const void* w2, int64_t w2_d0, int64_t w2_d1, int64_t w2_d2,
    int64_t w2_d3, int64_t w2_stride_e, int64_t w2_ldw, int64_t w2_contiguous,
    const float* w13_scale, const float* w2_scale, int64_t ids_dtype, const void* topk_ids,
    int64_t id_rows, int64_t slots, const float* topk_weights, int64_t routing_ok, void* out,
    int64_t threads) {
  NORI_REQUIRE(hidden_dtype == kFloat32 || hidden_dtype == kBFloat16,
               "hidden must be [T, H], float32 or bfloat16");
  const int64_t num_experts = w13_d0, intermediate = w2_d2;
  const auto panels_of = [](int64_t n) { return (n + 15) / 16; };
  if (panels) {
    NORI_REQUIRE(w13_contiguous && w2_contiguous && w13_d1 == panels_of(2 * intermediate) &&
                     w13_d2 == hidden_size && w13_d3 == 16 && w2_d0 == num_experts &&
                     w2_d1 == panels_of(hidden_size) && w2_d3 == 16,
                 "packed w13 must be [E, ceil(2I/16), H, 16] and w2 [E, ceil(H/16), I, 16]");
  } else {
    NORI_REQUIRE(w13_d1 == 2 * intermediate && w13_d2 == hidden_size &&
                     w2_d0 == num_experts && w2_d1 == hidden_size,
                 "w13 must be [E, 2I, H] and w2 [E, H, I] for hidden [T, H]");
  }
  NORI_REQUIRE((w13_scale == nullptr) == (w2_scale == nullptr),
               "w13_scale and w2_scale come together (int8 weights) or not at all");
  if (w13_scale != nullptr) {
    NORI_REQUIRE(w13_dtype == kInt8 && w2_dtype == kInt8,
                 "w13 and w2 must be int8 when their scales are given");
  } else {
    NORI_REQUIRE(w13_dtype == hidden_dtype && w2_dtype == hidden_dtype,
                 "w13 and w2 must have hidden's dtype (or be int8 with scales)");
  }
  NORI_REQUIRE(ids_dtype == kInt32 || ids_dtype == kInt64, "topk_ids must be int32 or int64");
  NORI_REQUIRE(id_rows == tokens, "topk_ids must be [T, k] for hidden [T, H]");
  NORI_REQUIRE(routing_ok, "topk_weights must be [T, k] like ids");
  const int64_t weight_dtype = w13_dtype;
  const bool ids_int64 = ids_dtype == kInt64;
  const int64_t hidden_stride = hidden_size;
  const ExpertGroups groups =
      ids_int64 ? group_by_expert(static_cast<const int64_t*>(topk_ids), tokens * slots,
                                  num_experts)
                : group_by_expert(static_cast<const int32_t*>(topk_ids), tokens * slots,
                                  num_experts);
  const int64_t pairs = groups.offsets[num_experts];
  const size_t out_bytes = tokens * hidden_size * (hidden_dtype == kFloat32 ? 4 : 2);
  if (pairs == 0) {
    std::memset(out, 0, out_bytes);
    return 0;
  }
  std::vector<float> rows(pairs * hidden_size), gate_up(pairs * 2 * intermediate),
      act(pairs * intermediate), down(pairs * hidden_size);
  if (hidden_dtype == kFloat32) {
    gather_rows(static_cast<const float*>(hidden), hidden_stride, groups.pair_of_position, slots,
                hidden_size, rows.data());
  } else {
    gather_rows(static_cast<const BFloat16*>(hidden), hidden_stride, groups.pair_of_position,
                slots, hidden_size, rows.data());
  }
  const auto phases = [&](auto weight_tag) {
    using weight_t = decltype(weight_tag);
    streamed_phase<weight_t>(groups.offsets, rows.data(), hidden_size,
                             static_cast<const weight_t*>(w13), w13_stride_e, w13_ldw, panels,
                             2 * intermediate, w13_scale, gate_up.data(), threads);
    silu_and_mul_rows(gate_up.data(), act.data(), pairs, intermediate, threads);
    streamed_phase<weight_t>(groups.offsets, act.data(), intermediate,
                             static_cast<const weight_t*>(w2), w2_stride_e, w2_ldw, panels,
                             hidden_size, w2_scale, down.data(), threads);
  };
  switch (weight_dtype) {
    case kFloat32: phases(float{}); break;
    case kBFloat16: phases(BFloat16{}); break;
    default: phases(int8_t{});
  }
  if (hidden_dtype == kFloat32) {
    weighted_sum_back(down.data(), topk_weights, groups.position_of_pair, tokens, hidden_size,
                      slots, static_cast<float*>(out), threads);
  } else {
    weighted_sum_back(down.data(), topk_weights, groups.position_of_pair, tokens, hidden_size,
                      slots, static_cast<BFloat16*>(out), threads);
  }
  return 0;
}
