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
//   2. one gather of the chosen rows, grouped by expert, contiguous;
//   3. per expert, gate_up = rows @ w13[e]^T for all its rows at once;
//   4. silu(gate) * up over all rows in one pass, in float32;
//   5. per expert, down = act @ w2[e]^T;
//   6. per token, out[t] = sum over its slots of weight * down[pair], in float32, written once
//      in hidden's dtype (no scatter races: each token is summed by one thread).
// The products take one of three routes, by the weights' layout (panels of 16 outputs,
// `pack_expert_panels`, [E, ceil(N/16), K, 16], are what the CPU model stores: the streamed kernel
// reading each tile's weights as one contiguous block; otherwise by memory order):
// - [in, out] (each expert's matrix with its output dimension contiguous, as
//   `w.transpose(1, 2).contiguous().transpose(1, 2)` stores it): the streamed kernel below,
//   which reads each weight line once per 6 rows and widens bfloat16/int8 in registers; the
//   faster route for every dtype measured (docs in fused_moe.py), and the one the model should
//   store its experts in;
// - [out, in] (or any other strides): the library GEMMs (at::mm, oneDNN/MKL), int8 widened to
//   the rows' dtype first. At a decode step's few rows per expert the
//   experts' GEMMs run side by side on the cores, each single-threaded; past that one after
//   another, each using them all.

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/extension.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

namespace {

// Up to this many rows in the busiest expert, the experts' GEMMs run in parallel with each
// other (each a GEMV-like product that one core streams); beyond it each GEMM is big enough
// for the library's own threads.
constexpr int64_t kMaxRowsForExpertParallel = 32;

// The (token, slot) pairs grouped by expert: positions [offsets[e], offsets[e + 1]) of
// `pair_of_position` are expert e's, in token order; `position_of_pair[t * k + j]` is pair
// (t, j)'s position, or -1 for an id outside [0, E).
struct ExpertGroups {
  std::vector<int64_t> offsets;
  std::vector<int64_t> pair_of_position;
  std::vector<int64_t> position_of_pair;
};

template <typename id_t>
ExpertGroups group_by_expert(const torch::Tensor& topk_ids, int64_t num_experts) {
  const int64_t pairs = topk_ids.numel();
  const id_t* ids = topk_ids.data_ptr<id_t>();
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

// out = rows @ weight^T for weight [N, K] in the rows' dtype (any strides), or int8 with one
// float32 scale per output row (scale [N]).
void expert_product(torch::Tensor& out, const torch::Tensor& rows, const torch::Tensor& weight,
                    const std::optional<torch::Tensor>& scale) {
  if (!scale.has_value()) {
    at::mm_out(out, rows, weight.t());
    return;
  }
  // Widen the expert's int8 weight to the rows' dtype and scale the product's columns. Not
  // torch's int8 GEMM (at::_weight_int8pack_mm): it is slow for float32 rows, reads past a row
  // whose length is not a multiple of 8, and on an Intel Xeon with AVX-512 it crashed for
  // bfloat16 rows called from the experts' parallel loop (tests/kernels/test_fused_moe.py).
  // The model's weights take the streamed kernel; this route serves other strides only.
  at::mm_out(out, rows, weight.to(rows.scalar_type()).t());
  out.mul_(*scale);
}

// Runs product(e) for every expert that holds rows: side by side on the cores while each has
// few rows, one after another (each using all cores) otherwise.
template <typename Product>
void for_each_expert(const std::vector<int64_t>& offsets, const Product& product) {
  std::vector<int64_t> busy;
  int64_t most_rows = 0;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    busy.push_back(static_cast<int64_t>(e));
    most_rows = std::max(most_rows, rows);
  }
  if (busy.size() > 1 && most_rows <= kMaxRowsForExpertParallel) {
    // The caller's inference/grad mode travels to the pool's threads with the products.
    const at::ThreadLocalState caller_state;
    at::parallel_for(0, static_cast<int64_t>(busy.size()), 1, [&](int64_t begin, int64_t end) {
      const at::ThreadLocalStateGuard state_guard(caller_state);
      for (int64_t i = begin; i < end; ++i) product(busy[i]);
    });
  } else {
    for (const int64_t e : busy) product(e);
  }
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
inline float widen(c10::BFloat16 value) {
  const uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

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
inline Float8 load8(const c10::BFloat16* p) {
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
                    const float* scale, float* out) {
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (expert, first column)
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    for (int64_t c = 0; c < width; c += kTaskCols) tasks.emplace_back(e, c);
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [e, c] = tasks[i];
      const int64_t first = offsets[e], rows = offsets[e + 1] - offsets[e];
      streamed_product(in + first * depth, depth, rows, w + e * stride_e, ldw, panels, depth,
                       scale == nullptr ? nullptr : scale + e * width, c,
                       std::min(width, c + kTaskCols), out + first * width, width);
    }
  });
}

template <typename scalar_t>
void silu_and_mul_rows(const torch::Tensor& gate_up, torch::Tensor& act) {
  const int64_t rows = gate_up.size(0);
  const int64_t width = act.size(1);
  const scalar_t* x = gate_up.data_ptr<scalar_t>();
  scalar_t* o = act.data_ptr<scalar_t>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* __restrict__ gate = x + r * 2 * width;
      const scalar_t* __restrict__ up = gate + width;
      scalar_t* __restrict__ row = o + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        row[i] = static_cast<scalar_t>(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
      }
    }
  });
}

template <typename down_t, typename scalar_t>
void weighted_sum_back(const torch::Tensor& down, const torch::Tensor& weights,
                       const std::vector<int64_t>& position_of_pair, int64_t slots,
                       torch::Tensor& out) {
  const int64_t tokens = out.size(0);
  const int64_t hidden = out.size(1);
  const down_t* d = down.data_ptr<down_t>();
  const float* w = weights.data_ptr<float>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(hidden * slots, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t j = 0; j < slots; ++j) {
        const int64_t position = position_of_pair[t * slots + j];
        if (position < 0) continue;
        const float weight = w[t * slots + j];
        const down_t* __restrict__ row = d + position * hidden;
        float* __restrict__ acc = sum.data();
        for (int64_t i = 0; i < hidden; ++i) acc[i] += weight * static_cast<float>(row[i]);
      }
      scalar_t* __restrict__ dst = o + t * hidden;
      for (int64_t i = 0; i < hidden; ++i) dst[i] = static_cast<scalar_t>(sum[i]);
    }
  });
}

void check_scale(const std::optional<torch::Tensor>& scale, const torch::Tensor& weight,
                 int64_t outputs, const char* name) {
  if (!scale.has_value()) return;
  TORCH_CHECK(weight.scalar_type() == at::kChar, name, " must be int8 when its scale is given");
  TORCH_CHECK(scale->dim() == 2 && scale->size(0) == weight.size(0) && scale->size(1) == outputs,
              name, "_scale must be [E, ", outputs, "], one scale per output row");
}

}  // namespace

torch::Tensor fused_experts(const torch::Tensor& hidden, const torch::Tensor& w13,
                            const torch::Tensor& w2, const torch::Tensor& topk_weights,
                            const torch::Tensor& topk_ids,
                            const std::optional<torch::Tensor>& w13_scale,
                            const std::optional<torch::Tensor>& w2_scale) {
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [T, H]");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16,
              "hidden must be float32 or bfloat16");
  // Panel-packed weights (`pack_expert_panels`): w13 [E, ceil(2I/16), H, 16], w2
  // [E, ceil(H/16), I, 16], contiguous.
  const bool panels = w13.dim() == 4 && w2.dim() == 4;
  TORCH_CHECK((w13.dim() == 3 && w2.dim() == 3) || panels,
              "w13 must be [E, 2I, H] and w2 [E, H, I] (or both packed in panels of 16)");
  const int64_t tokens = hidden.size(0);
  const int64_t hidden_size = hidden.size(1);
  const int64_t num_experts = w13.size(0);
  const int64_t intermediate = w2.size(2);
  if (panels) {
    TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous() && w13.size(3) == kTileCols &&
                    w2.size(3) == kTileCols && w13.size(2) == hidden_size &&
                    w13.size(1) == (2 * intermediate + kTileCols - 1) / kTileCols &&
                    w2.size(0) == num_experts &&
                    w2.size(1) == (hidden_size + kTileCols - 1) / kTileCols,
                "packed w13 must be [E, ceil(2I/16), H, 16] and w2 [E, ceil(H/16), I, 16]");
  } else {
    TORCH_CHECK(w13.size(1) == 2 * intermediate && w13.size(2) == hidden_size &&
                    w2.size(0) == num_experts && w2.size(1) == hidden_size,
                "w13 must be [E, 2I, H] and w2 [E, H, I] for hidden [T, H]");
  }
  TORCH_CHECK(w13_scale.has_value() == w2_scale.has_value(),
              "w13_scale and w2_scale come together (int8 weights) or not at all");
  check_scale(w13_scale, w13, 2 * intermediate, "w13");
  check_scale(w2_scale, w2, hidden_size, "w2");
  if (!w13_scale.has_value()) {
    TORCH_CHECK(w13.scalar_type() == hidden.scalar_type() &&
                    w2.scalar_type() == hidden.scalar_type(),
                "w13 and w2 must have hidden's dtype (or be int8 with scales)");
  }
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens,
              "topk_ids must be [T, k] for hidden [T, H]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must be [T, k] like ids");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
              "topk_ids must be int32 or int64");
  const int64_t slots = topk_ids.size(1);

  const auto ids = topk_ids.contiguous();
  const ExpertGroups groups = topk_ids.scalar_type() == at::kInt
                                  ? group_by_expert<int32_t>(ids, num_experts)
                                  : group_by_expert<int64_t>(ids, num_experts);
  const int64_t pairs = groups.offsets[num_experts];
  auto out = torch::empty({tokens, hidden_size}, hidden.options());
  if (pairs == 0) return out.zero_();

  const auto options = hidden.options();
  std::vector<int64_t> token_of_position(pairs);
  for (int64_t position = 0; position < pairs; ++position)
    token_of_position[position] = groups.pair_of_position[position] / slots;
  const auto rows = hidden.index_select(
      0, torch::from_blob(token_of_position.data(), {pairs}, torch::kLong));
  const auto weights = topk_weights.to(torch::kFloat).contiguous();

  // Weights packed in panels or stored [in, out] (output dimension contiguous): the streamed
  // path.
  if (panels || (w13.stride(1) == 1 && w2.stride(1) == 1)) {
    const auto rows_f = rows.to(torch::kFloat).contiguous();
    const auto float_options = options.dtype(torch::kFloat);
    auto gate_up_f = torch::empty({pairs, 2 * intermediate}, float_options);
    auto act_f = torch::empty({pairs, intermediate}, float_options);
    auto down_f = torch::empty({pairs, hidden_size}, float_options);
    torch::Tensor scale13, scale2;
    if (w13_scale.has_value()) {
      scale13 = w13_scale->to(torch::kFloat).contiguous();
      scale2 = w2_scale->to(torch::kFloat).contiguous();
    }
    const auto phases = [&](auto weight_tag) {
      using weight_t = decltype(weight_tag);
      streamed_phase<weight_t>(groups.offsets, rows_f.data_ptr<float>(), hidden_size,
                               w13.data_ptr<weight_t>(), w13.stride(0),
                               panels ? 0 : w13.stride(2), panels, 2 * intermediate,
                               scale13.defined() ? scale13.data_ptr<float>() : nullptr,
                               gate_up_f.data_ptr<float>());
      silu_and_mul_rows<float>(gate_up_f, act_f);
      streamed_phase<weight_t>(groups.offsets, act_f.data_ptr<float>(), intermediate,
                               w2.data_ptr<weight_t>(), w2.stride(0),
                               panels ? 0 : w2.stride(2), panels, hidden_size,
                               scale2.defined() ? scale2.data_ptr<float>() : nullptr,
                               down_f.data_ptr<float>());
    };
    switch (w13.scalar_type()) {
      case at::kFloat: phases(float{}); break;
      case at::kBFloat16: phases(c10::BFloat16{}); break;
      default: phases(int8_t{});
    }
    AT_DISPATCH_FLOATING_TYPES_AND(
        at::ScalarType::BFloat16, hidden.scalar_type(), "weighted_sum_back", [&] {
          weighted_sum_back<float, scalar_t>(down_f, weights, groups.position_of_pair, slots, out);
        });
    return out;
  }

  // Weights stored [out, in]: one library GEMM per expert group, in hidden's dtype.
  auto gate_up = torch::empty({pairs, 2 * intermediate}, options);
  auto act = torch::empty({pairs, intermediate}, options);
  auto down = torch::empty({pairs, hidden_size}, options);

  const auto w13_scale_per_expert = [&](int64_t e) -> std::optional<torch::Tensor> {
    if (!w13_scale.has_value()) return std::nullopt;
    return (*w13_scale)[e];
  };
  const auto w2_scale_per_expert = [&](int64_t e) -> std::optional<torch::Tensor> {
    if (!w2_scale.has_value()) return std::nullopt;
    return (*w2_scale)[e];
  };
  const auto& offsets = groups.offsets;
  for_each_expert(offsets, [&](int64_t e) {
    const int64_t begin = offsets[e], count = offsets[e + 1] - offsets[e];
    auto gate_up_rows = gate_up.narrow(0, begin, count);
    expert_product(gate_up_rows, rows.narrow(0, begin, count), w13[e], w13_scale_per_expert(e));
  });
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, hidden.scalar_type(), "silu_and_mul",
                                 [&] { silu_and_mul_rows<scalar_t>(gate_up, act); });
  for_each_expert(offsets, [&](int64_t e) {
    const int64_t begin = offsets[e], count = offsets[e + 1] - offsets[e];
    auto down_rows = down.narrow(0, begin, count);
    expert_product(down_rows, act.narrow(0, begin, count), w2[e], w2_scale_per_expert(e));
  });

  AT_DISPATCH_FLOATING_TYPES_AND(
      at::ScalarType::BFloat16, hidden.scalar_type(), "weighted_sum_back", [&] {
        weighted_sum_back<scalar_t, scalar_t>(down, weights, groups.position_of_pair, slots, out);
      });
  return out;
}
