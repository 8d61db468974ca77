// Paged decode attention for the CPU engine: one query token per sequence over its cached context,
// read straight from the paged cache.
//
// The PyTorch reference (decode_attention.py) gathers every context into a padded copy and then
// runs scaled_dot_product_attention on it: K and V cross memory three times and the padding is
// computed. Here each (sequence, kv head) task reads its K and V rows once, in place, for all the
// query heads that share the kv head. Tested against the reference (tests/kernels).
//
// Layouts: query [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables
// [B, M] int32; seq_lens [B] int32; context_starts [B] int32 (left padding to hide) or empty.
// An 8-bit cache (int8 or float8_e4m3fn codes, kv_quant.py) comes with k_scale, v_scale
// [num_blocks, block_size, Hkv] float16; its codes are read in place, never dequantized to a copy.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// Reads a cache element as float.
template <typename cache_t>
struct CodeReader {
  float operator()(cache_t x) const { return static_cast<float>(x); }
};

// float8_e4m3fn -> float in plain integer arithmetic, which the compiler vectorises: a 256-entry
// table (or c10's conversion, with its branch) keeps the inner loops scalar; with a table, fp8
// decode ran 2.5x slower than float32. Exact for every code but NaN (0x7f, 0xff), which the store
// never writes. No float subnormal is formed, so it holds whatever the denormals-are-zero mode.
template <>
struct CodeReader<c10::Float8_e4m3fn> {
  float operator()(c10::Float8_e4m3fn x) const {
    const uint32_t bits = x.x;
    const uint32_t magnitude = bits & 0x7f;
    // Normal codes: the 4 exponent and 3 mantissa bits moved into float's, the exponent bias
    // raised from 7 to 127. Subnormal codes (exponent 0) are mantissa * 2^-9.
    const float normal = __builtin_bit_cast(float, (magnitude << 20) + (120u << 23));
    const float value = magnitude < 8 ? static_cast<float>(magnitude) * 0x1p-9f : normal;
    return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, value) | ((bits & 0x80) << 24));
  }
};

template <typename T>
struct Tag {
  using type = T;
};

// The cache slot (block * block_size + offset) holding a sequence's token at `position`.
inline int64_t slot_of(const int32_t* block_table, int64_t position, int64_t block_size) {
  return static_cast<int64_t>(block_table[position / block_size]) * block_size +
         position % block_size;
}

// One task: sequence `b`, kv heads [head_begin, head_end) and the query heads that share them.
// Tokens are visited in cache order and each token's K (then V) row is read front to back, so a
// block's memory streams sequentially whatever the number of heads in the task.
// HEAD_DIM > 0 fixes the head size at compile time (the common sizes), so the per-token loops
// over it unroll into a few vector instructions; 0 reads it from `head_dim`.
// QUANTIZED: 8-bit codes with a float16 scale per (slot, kv head). The scale is constant over a
// row, so it multiplies the finished dot product (K) or the softmax weight (V) rather than each
// element; as a template argument it costs the float caches nothing.
template <typename scalar_t, int HEAD_DIM, bool QUANTIZED>
void decode_task(
    const float* query,  // this sequence's rows [Hq, D], float32
    const scalar_t* k_cache,
    const scalar_t* v_cache,
    const c10::Half* k_scales,  // [num_blocks * block_size * Hkv] when QUANTIZED, else unused
    const c10::Half* v_scales,
    const int32_t* block_table,
    int64_t seq_len,
    int64_t context_start,
    int64_t head_begin,
    int64_t head_end,
    int64_t num_kv_heads,
    int64_t group,
    int64_t head_dim,
    int64_t block_size,
    float scale,
    std::vector<float>& scores,  // scratch, reused across tasks of one thread
    float* out) {                // this sequence's output rows [Hq, D], float32
  const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t length = seq_len - context_start;
  const int64_t rows = (head_end - head_begin) * group;  // query heads of this task
  scores.resize(static_cast<size_t>(rows * length));
  const int64_t token_stride = num_kv_heads * head_dim;
  const float* q = query + head_begin * group * dim;
  const CodeReader<scalar_t> read;

  // Pass 1: the scores of every visible token for each query head, and each head's maximum.
  // Built with -ffast-math (vectorised exp), which assumes no infinities: start the running
  // maximum at the lowest finite value instead of -inf.
  std::vector<float> row_max(rows, std::numeric_limits<float>::lowest());
  for (int64_t t = 0; t < length; ++t) {
    const int64_t slot = slot_of(block_table, context_start + t, block_size);
    const scalar_t* k_token = k_cache + slot * token_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* __restrict__ k = k_token + (head_begin + r / group) * dim;
      const float* __restrict__ qr = q + r * dim;
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += qr[d] * read(k[d]);
      dot *= scale;
      if constexpr (QUANTIZED) {
        dot *= static_cast<float>(k_scales[slot * num_kv_heads + head_begin + r / group]);
      }
      scores[r * length + t] = dot;
      row_max[r] = std::max(row_max[r], dot);
    }
  }
  // Softmax weights in place.
  std::vector<float> inverse_sum(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores.data() + r * length;
    float sum = 0.f;
    for (int64_t t = 0; t < length; ++t) {
      s[t] = std::exp(s[t] - row_max[r]);
      sum += s[t];
    }
    inverse_sum[r] = 1.f / sum;
  }
  // Pass 2: the weighted sum of V rows.
  float* o = out + head_begin * group * dim;
  std::fill(o, o + rows * dim, 0.f);
  for (int64_t t = 0; t < length; ++t) {
    const int64_t slot = slot_of(block_table, context_start + t, block_size);
    const scalar_t* v_token = v_cache + slot * token_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* __restrict__ v = v_token + (head_begin + r / group) * dim;
      float p = scores[r * length + t];
      if constexpr (QUANTIZED) {
        p *= static_cast<float>(v_scales[slot * num_kv_heads + head_begin + r / group]);
      }
      float* __restrict__ orow = o + r * dim;
      for (int64_t d = 0; d < dim; ++d) orow[d] += p * read(v[d]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* orow = o + r * dim;
    for (int64_t d = 0; d < dim; ++d) orow[d] *= inverse_sum[r];
  }
}

}  // namespace

torch::Tensor paged_decode_attention(
    const torch::Tensor& query,
    const torch::Tensor& k_cache,
    const torch::Tensor& v_cache,
    const torch::Tensor& block_tables,
    const torch::Tensor& seq_lens,
    const std::optional<torch::Tensor>& context_starts,
    double scale,
    const std::optional<torch::Tensor>& k_scale,
    const std::optional<torch::Tensor>& v_scale) {
  TORCH_CHECK(query.dim() == 3, "query must be [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  const auto cache_dtype = k_cache.scalar_type();
  const bool quantized =
      cache_dtype == torch::kInt8 || cache_dtype == at::ScalarType::Float8_e4m3fn;
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(),
              "k_scale and v_scale must be given together");
  if (quantized) {
    TORCH_CHECK(k_scale.has_value(), "an ", cache_dtype,
                " cache needs k_scale and v_scale (float16 [num_blocks, block_size, Hkv])");
    for (const auto* s : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(s->scalar_type() == torch::kHalf, "k_scale and v_scale must be float16, got ",
                  s->scalar_type());
      TORCH_CHECK(s->sizes() == k_cache.sizes().slice(0, 3),
                  "k_scale and v_scale must be [num_blocks, block_size, Hkv] = ",
                  k_cache.sizes().slice(0, 3), ", got ", s->sizes());
      TORCH_CHECK(s->is_contiguous(), "k_scale and v_scale must be contiguous");
    }
  } else {
    TORCH_CHECK(!k_scale.has_value(),
                "k_scale and v_scale go with an int8 or float8_e4m3fn cache, not a ", cache_dtype,
                " one");
  }
  const int64_t batch = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "query and cache head_dim differ");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) &&
                  seq_lens.dim() == 1 && seq_lens.size(0) == query.size(0),
              "block_tables must be [B, M] and seq_lens [B] for a query of B rows");
  const bool has_starts = context_starts.has_value();
  if (has_starts) {
    TORCH_CHECK(context_starts->dim() == 1 && context_starts->size(0) == query.size(0),
                "context_starts must be [B]");
  }

  const auto q32 = query.to(torch::kFloat32).contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto starts =
      has_starts ? context_starts->to(torch::kInt32).contiguous() : torch::Tensor();
  auto out = torch::empty({batch, num_heads, head_dim}, q32.options());
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_width = tables.size(1);
  const int64_t num_blocks = k_cache.size(0);
  const float* q_ptr = q32.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const int32_t* start_ptr = has_starts ? starts.data_ptr<int32_t>() : nullptr;
  const c10::Half* k_scale_ptr = quantized ? k_scale->data_ptr<c10::Half>() : nullptr;
  const c10::Half* v_scale_ptr = quantized ? v_scale->data_ptr<c10::Half>() : nullptr;

  const auto launch = [&](auto cache_tag, auto quantized_constant) {
    using cache_t = typename decltype(cache_tag)::type;
    constexpr bool kQuantized = decltype(quantized_constant)::value;
    const cache_t* k_ptr = static_cast<const cache_t*>(k_cache.data_ptr());
    const cache_t* v_ptr = static_cast<const cache_t*>(v_cache.data_ptr());
    // One task per sequence keeps each block's reads sequential; a small batch is cut
    // further by kv head so that every thread still gets work.
    const int64_t splits = batch >= 4 * at::get_num_threads() ? 1 : num_kv_heads;
    at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / splits;
        const int64_t part = task % splits;
        const int64_t head_begin = part * num_kv_heads / splits;
        const int64_t head_end = (part + 1) * num_kv_heads / splits;
        const int64_t seq_len = len_ptr[b];
        const int64_t start = has_starts ? start_ptr[b] : 0;
        TORCH_CHECK(seq_len >= 1 && seq_len <= table_width * block_size && start >= 0 &&
                        start < seq_len,
                    "row ", b, ": seq_len ", seq_len, " / context_start ", start,
                    " outside its block table");
        const int32_t* table = table_ptr + b * table_width;
        for (int64_t j = start / block_size; j * block_size < seq_len; ++j) {
          TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "row ", b, ": block id ",
                      table[j], " outside the cache");
        }
        const auto run = [&](auto head_dim_constant) {
          decode_task<cache_t, decltype(head_dim_constant)::value, kQuantized>(
              q_ptr + b * num_heads * head_dim, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table,
              seq_len, start, head_begin, head_end, num_kv_heads, group, head_dim, block_size,
              static_cast<float>(scale), scores, out_ptr + b * num_heads * head_dim);
        };
        switch (head_dim) {
          case 32: run(std::integral_constant<int, 32>{}); break;
          case 64: run(std::integral_constant<int, 64>{}); break;
          case 128: run(std::integral_constant<int, 128>{}); break;
          default: run(std::integral_constant<int, 0>{}); break;
        }
      }
    });
  };

  if (cache_dtype == torch::kInt8) {
    launch(Tag<int8_t>{}, std::true_type{});
  } else if (cache_dtype == at::ScalarType::Float8_e4m3fn) {
    launch(Tag<c10::Float8_e4m3fn>{}, std::true_type{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, cache_dtype,
                                    "decode", [&] { launch(Tag<scalar_t>{}, std::false_type{}); });
  }
  return out.to(query.scalar_type());
}
