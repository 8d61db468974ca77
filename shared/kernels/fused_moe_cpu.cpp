// A mixture-of-experts layer's experts on CPU (the contract and the PyTorch reference are in
// fused_moe.py): the (token, slot) pairs grouped by expert, ONE gate/up GEMM and ONE down GEMM
// per expert that any token chose, then each token's rows summed back with its routing weights.
//
// The reference loops over every expert in Python (a torch.where, an index, two linears, a
// silu, an index_add per expert); at a decode step's few tokens that overhead, not the
// arithmetic, is the layer's time. Here one call does it all:
//   1. a counting sort of the pairs by expert id (ids outside [0, E) are skipped: expert
//      parallelism hands a rank only its own experts' ids);
//   2. one gather of the chosen rows, grouped by expert, contiguous;
//   3. per expert, gate_up = rows @ w13[e]^T into one [N, 2I] buffer (oneDNN/MKL GEMMs; the
//      weights may have any strides: w13[e] stored in [in, out] order makes it a plain
//      row-major product), int8 weights through at::_weight_int8pack_mm;
//   4. silu(gate) * up over all rows in one pass, in float32;
//   5. per expert, down = act @ w2[e]^T into one [N, H] buffer;
//   6. per token, out[t] = sum over its slots of weight * down[pair], in float32, written once
//      in hidden's dtype (no scatter races: each token is summed by one thread).
// At a decode step's few rows per expert the experts' GEMMs run side by side on the cores
// (at::parallel_for, each GEMM single-threaded inside it); past that each GEMM uses them all.

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/extension.h>

#include <cmath>
#include <optional>
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
// scale per output row (scale [N], converted to the rows' dtype as the int8 GEMM wants it).
void expert_product(torch::Tensor& out, const torch::Tensor& rows, const torch::Tensor& weight,
                    const std::optional<torch::Tensor>& scale) {
  if (!scale.has_value()) {
    at::mm_out(out, rows, weight.t());
    return;
  }
  out.copy_(at::_weight_int8pack_mm(rows, weight.contiguous(),
                                    scale->to(rows.scalar_type()).contiguous()));
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

template <typename scalar_t>
void weighted_sum_back(const torch::Tensor& down, const torch::Tensor& weights,
                       const std::vector<int64_t>& position_of_pair, int64_t slots,
                       torch::Tensor& out) {
  const int64_t tokens = out.size(0);
  const int64_t hidden = out.size(1);
  const scalar_t* d = down.data_ptr<scalar_t>();
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
        const scalar_t* __restrict__ row = d + position * hidden;
        float* __restrict__ acc = sum.data();
        for (int64_t i = 0; i < hidden; ++i) acc[i] += weight * static_cast<float>(row[i]);
      }
      scalar_t* __restrict__ dst = o + t * hidden;
      for (int64_t i = 0; i < hidden; ++i) dst[i] = static_cast<scalar_t>(sum[i]);
    }
  });
}

void check_scale(const std::optional<torch::Tensor>& scale, const torch::Tensor& weight,
                 const char* name) {
  if (!scale.has_value()) return;
  TORCH_CHECK(weight.scalar_type() == at::kChar, name, " must be int8 when its scale is given");
  TORCH_CHECK(scale->dim() == 2 && scale->size(0) == weight.size(0) &&
                  scale->size(1) == weight.size(1),
              name, "_scale must be [E, ", weight.size(1), "], one scale per output row");
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
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3, "w13 must be [E, 2I, H] and w2 [E, H, I]");
  const int64_t tokens = hidden.size(0);
  const int64_t hidden_size = hidden.size(1);
  const int64_t num_experts = w13.size(0);
  const int64_t intermediate = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * intermediate && w13.size(2) == hidden_size &&
                  w2.size(0) == num_experts && w2.size(1) == hidden_size,
              "w13 must be [E, 2I, H] and w2 [E, H, I] for hidden [T, H]");
  TORCH_CHECK(w13_scale.has_value() == w2_scale.has_value(),
              "w13_scale and w2_scale come together (int8 weights) or not at all");
  check_scale(w13_scale, w13, "w13");
  check_scale(w2_scale, w2, "w2");
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

  const auto weights = topk_weights.to(torch::kFloat).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(
      at::ScalarType::BFloat16, hidden.scalar_type(), "weighted_sum_back",
      [&] { weighted_sum_back<scalar_t>(down, weights, groups.position_of_pair, slots, out); });
  return out;
}
