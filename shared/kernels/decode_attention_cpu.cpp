// Paged decode attention for the CPU engine: one query token per sequence over its cached context,
// read straight from the paged cache.
//
// The PyTorch reference (decode_attention.py) gathers every context into a padded copy and then
// runs scaled_dot_product_attention on it: K and V cross memory three times and the padding is
// computed. Here each (sequence, kv head) task reads its K and V rows once, in place, for all the
// query heads that share the kv head. Tested against the reference (tests/kernels).
//
// Layouts: query [B, Hq, D] (last dim contiguous, rows strided); k_cache, v_cache [num_blocks,
// block_size, Hkv, D] contiguous; block_tables [B, M] int32 (rows strided); seq_lens [B] int32;
// out [B, Hq, D] contiguous in the query's dtype (computed in float32).
// An 8-bit cache (int8 or float8_e4m3fn codes, kv_quant.py) comes with k_scale, v_scale
// [num_blocks, block_size, Hkv] float16; its codes are read in place, never dequantized to a copy.

#include <immintrin.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

using namespace nori;

// The cache slot (block * block_size + offset) holding a sequence's token at `position`.
inline int64_t slot_of(const int32_t* block_table, int64_t position, int64_t block_size) {
  return static_cast<int64_t>(block_table[position / block_size]) * block_size +
         position % block_size;
}

// Softmax weights in place: rows of `length` scores, `stride` apart, each minus its maximum
// and exponentiated; returns each row's 1 / sum (applied to the finished weighted sum).
inline std::vector<float> softmax_weights(float* scores, int64_t stride, int64_t rows,
                                          int64_t length, const std::vector<float>& row_max) {
  std::vector<float> inverse_sum(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * stride;
    float sum = 0.f;
    for (int64_t t = 0; t < length; ++t) {
      s[t] = std::exp(s[t] - row_max[r]);
      sum += s[t];
    }
    inverse_sum[r] = 1.f / sum;
  }
  return inverse_sum;
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
    const float* query,  // this task's query rows [rows, D], float32
    const scalar_t* k_cache,
    const scalar_t* v_cache,
    const Half* k_scales,  // [num_blocks * block_size * Hkv] when QUANTIZED, else unused
    const Half* v_scales,
    const int32_t* block_table,
    int64_t length,  // context tokens
    int64_t head_begin,
    int64_t head_end,
    int64_t num_kv_heads,
    int64_t group,
    int64_t head_dim,
    int64_t block_size,
    float scale,
    std::vector<float>& scores,  // scratch, reused across tasks of one thread
    float* out) {                // this task's output rows [rows, D], float32
  const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t rows = (head_end - head_begin) * group;  // query heads of this task
  scores.resize(static_cast<size_t>(rows * length));
  const int64_t token_stride = num_kv_heads * head_dim;
  const float* q = query;
  
  // Pass 1: the scores of every visible token for each query head, and each head's maximum.
  // Built with -ffast-math (vectorised exp), which assumes no infinities: start the running
  // maximum at the lowest finite value instead of -inf.
  std::vector<float> row_max(rows, std::numeric_limits<float>::lowest());
  for (int64_t t = 0; t < length; ++t) {
    const int64_t slot = slot_of(block_table, t, block_size);
    const scalar_t* k_token = k_cache + slot * token_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* __restrict__ k = k_token + (head_begin + r / group) * dim;
      const float* __restrict__ qr = q + r * dim;
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += qr[d] * static_cast<float>(k[d]);
      dot *= scale;
      if constexpr (QUANTIZED) {
        dot *= static_cast<float>(k_scales[slot * num_kv_heads + head_begin + r / group]);
      }
      scores[r * length + t] = dot;
      row_max[r] = std::max(row_max[r], dot);
    }
  }
  const std::vector<float> inverse_sum =
      softmax_weights(scores.data(), length, rows, length, row_max);
  // Pass 2: the weighted sum of V rows.
  float* o = out;
  std::fill(o, o + rows * dim, 0.f);
  for (int64_t t = 0; t < length; ++t) {
    const int64_t slot = slot_of(block_table, t, block_size);
    const scalar_t* v_token = v_cache + slot * token_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* __restrict__ v = v_token + (head_begin + r / group) * dim;
      float p = scores[r * length + t];
      if constexpr (QUANTIZED) {
        p *= static_cast<float>(v_scales[slot * num_kv_heads + head_begin + r / group]);
      }
      float* __restrict__ orow = o + r * dim;
      for (int64_t d = 0; d < dim; ++d) orow[d] += p * static_cast<float>(v[d]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* orow = o + r * dim;
    for (int64_t d = 0; d < dim; ++d) orow[d] *= inverse_sum[r];
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define NORI_BF16_DECODE 1
// bfloat16 query over a bfloat16 cache, head_dim 32 * KC (64 and 128), on AVX-512 BF16.
//
// The general task above costs a horizontal sum per (token, query head) and reads a cache
// block at a time from a random place. Here the context goes by tiles of 16 tokens:
// - scores: each query head's dot products with the tile's K rows (dpbf16: bf16 pairs summed
//   in float32; a bf16 query times a bf16 key is exact in float32), then one transposing
//   reduction turns the 16 accumulators into a vector of 16 scores;
// - the weighted sum: each V row is widened to float32 once and added into the output rows of
//   up to 8 / KC query heads at a time, held in registers over the tile;
// - the tiles two ahead are prefetched into L2.
// The softmax and the float32 output are the general task's.

// Sixteen float vectors -> one whose lane i is the sum of v[i]'s lanes.
inline __m512 sum_lanes_16(const __m512* v) {
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 quads[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]);
    const __m512d b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                       _mm512_shuffle_f32x4(low, high, 0xDD));
}

// out[j] += sum over tokens [0, count) of weights[j][t] * V[t], for HEADS query heads of one kv
// head (out rows in float32, accumulated over the context's tiles).
template <int KC, int HEADS>
void add_weighted_values_bf16(const uint16_t* v_head, const int64_t* offsets, int64_t count,
                              const float* weights, int64_t weight_stride, float* out) {
  constexpr int kVectors = 2 * KC;  // float32 vectors per row
  // Vector 2c holds the even elements of the row's 32 values from 32c, vector 2c + 1 the odd
  // ones: two instructions widen 32 bf16 values (`out` is kept in this order as well).
  __m512 acc[HEADS][kVectors];
  for (int j = 0; j < HEADS; ++j)
    for (int c = 0; c < kVectors; ++c) acc[j][c] = _mm512_loadu_ps(out + j * 32 * KC + 16 * c);
  const __m512i high_halves = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t t = 0; t < count; ++t) {
    const uint16_t* v = v_head + offsets[t];
    __m512 row[kVectors];
    for (int c = 0; c < KC; ++c) {
      const __m512i pairs = _mm512_loadu_si512(v + 32 * c);
      row[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      row[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_halves));
    }
    for (int j = 0; j < HEADS; ++j) {
      const __m512 p = _mm512_set1_ps(weights[j * weight_stride + t]);
      for (int c = 0; c < kVectors; ++c) acc[j][c] = _mm512_fmadd_ps(p, row[c], acc[j][c]);
    }
  }
  for (int j = 0; j < HEADS; ++j)
    for (int c = 0; c < kVectors; ++c) _mm512_storeu_ps(out + j * 32 * KC + 16 * c, acc[j][c]);
}

// The query row's dot products with 16 tokens' K rows of one kv head ([count, 16) are 0).
template <int KC, bool FULL>
inline __m512 dot_tile_bf16(const __m512bh* qv, const uint16_t* k_head, const int64_t* offsets,
                            int64_t count) {
  __m512 dots[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    __m512 dot = _mm512_setzero_ps();
    if (FULL || i < count) {
      const uint16_t* k = k_head + offsets[i];
      for (int c = 0; c < KC; ++c)
        dot = _mm512_dpbf16_ps(dot, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    }
    dots[i] = dot;
  }
  return sum_lanes_16(dots);
}

// Asks for the tile of tokens [t0, t0 + 16) of kv heads [head_begin, head_end) ahead of use: a
// cache block is a few KiB at a random place, too short for the hardware prefetcher to learn.
template <int KC>
inline void prefetch_tile(const uint16_t* cache, const int64_t* offsets, int64_t t0,
                          int64_t length, int64_t head_begin, int64_t head_end) {
  const int64_t end = std::min<int64_t>(t0 + 16, length);
  const int64_t lines = (head_end - head_begin) * KC;  // 64-byte lines per token: 32 bf16 each
  for (int64_t t = t0; t < end; ++t) {
    const char* row = reinterpret_cast<const char*>(cache + offsets[t] + head_begin * 32 * KC);
    // As an asm statement: GCC 12 at -O1 and above deleted these loops of _mm_prefetch.
    for (int64_t line = 0; line < lines; ++line)
      asm volatile("prefetcht1 %0" : : "m"(*(row + 64 * line)));
  }
}

// One task as decode_task's, over 16-token tiles: each tile's K (then V) rows of every kv head
// in the task are read together, so a cache block streams front to back once.
template <int KC>
void decode_task_bf16(
    const uint16_t* query,  // this task's query rows [rows, D], bfloat16
    const uint16_t* k_cache,
    const uint16_t* v_cache,
    const int32_t* block_table,
    int64_t length,  // context tokens
    int64_t head_begin,
    int64_t head_end,
    int64_t num_kv_heads,
    int64_t group,
    int64_t block_size,
    float scale,
    std::vector<float>& scores,      // scratch, reused across tasks of one thread
    std::vector<int64_t>& offsets,   // scratch
    float* out) {                    // this task's output rows [rows, D], float32
  constexpr int64_t kDim = 32 * KC;
  constexpr int kHeadTile = 8 / KC;  // output rows kept in registers in the weighted sum
  const int64_t padded = (length + 15) / 16 * 16;
  const int64_t rows = (head_end - head_begin) * group;  // query heads of this task
  scores.resize(static_cast<size_t>(rows * padded));
  offsets.resize(static_cast<size_t>(length));
  const int64_t token_stride = num_kv_heads * kDim;
  // Each visible token's element offset in the caches, one block at a time.
  for (int64_t t = 0; t < length;) {
    const int64_t block = block_table[t / block_size];
    const int64_t offset = t % block_size;
    const int64_t run = std::min<int64_t>(block_size - offset, length - t);
    const int64_t first = (block * block_size + offset) * token_stride;
    for (int64_t i = 0; i < run; ++i) offsets[t + i] = first + i * token_stride;
    t += run;
  }
  const uint16_t* q_task = query;
  float* o_task = out;
  const __m512 scale_v = _mm512_set1_ps(scale);

  // Pass 1: scores, and each query head's maximum.
  std::vector<float> row_max(static_cast<size_t>(rows), std::numeric_limits<float>::lowest());
  constexpr int64_t kAhead = 32;  // tokens prefetched ahead: two tiles
  for (int64_t t0 = 0; t0 < std::min<int64_t>(kAhead, length); t0 += 16)
    prefetch_tile<KC>(k_cache, offsets.data(), t0, length, head_begin, head_end);
  for (int64_t t0 = 0; t0 < length; t0 += 16) {
    if (t0 + kAhead < length)
      prefetch_tile<KC>(k_cache, offsets.data(), t0 + kAhead, length, head_begin, head_end);
    else  // all of K is asked for: start on V's first tiles
      prefetch_tile<KC>(v_cache, offsets.data(), t0 + kAhead - length, length, head_begin,
                        head_end);
    const int64_t count = std::min<int64_t>(16, length - t0);
    const __mmask16 mask = count == 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* q = q_task + r * kDim;
      const uint16_t* k_head = k_cache + (head_begin + r / group) * kDim;
      __m512bh qv[KC];
      for (int c = 0; c < KC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
      const __m512 tile = _mm512_mul_ps(
          count == 16 ? dot_tile_bf16<KC, true>(qv, k_head, offsets.data() + t0, count)
                      : dot_tile_bf16<KC, false>(qv, k_head, offsets.data() + t0, count),
          scale_v);
      _mm512_mask_storeu_ps(scores.data() + r * padded + t0, mask, tile);
      row_max[r] = std::max(row_max[r], _mm512_mask_reduce_max_ps(mask, tile));
    }
  }
  const std::vector<float> inverse_sum =
      softmax_weights(scores.data(), padded, rows, length, row_max);
  // Pass 2: the weighted sum of V rows, tile by tile.
  std::fill(o_task, o_task + rows * kDim, 0.f);
  for (int64_t t0 = 0; t0 < length; t0 += 16) {
    if (t0 + kAhead < length)
      prefetch_tile<KC>(v_cache, offsets.data(), t0 + kAhead, length, head_begin, head_end);
    const int64_t count = std::min<int64_t>(16, length - t0);
    for (int64_t h = head_begin; h < head_end; ++h) {
      const uint16_t* v_head = v_cache + h * kDim;
      const int64_t first_row = (h - head_begin) * group;
      for (int64_t r0 = 0; r0 < group; r0 += kHeadTile) {
        const int64_t heads = std::min<int64_t>(kHeadTile, group - r0);
        const float* weights = scores.data() + (first_row + r0) * padded + t0;
        float* o = o_task + (first_row + r0) * kDim;
        const int64_t* tile_offsets = offsets.data() + t0;
        switch (heads) {
          case 1:
            add_weighted_values_bf16<KC, 1>(v_head, tile_offsets, count, weights, padded, o);
            break;
          case 2:
            add_weighted_values_bf16<KC, 2>(v_head, tile_offsets, count, weights, padded, o);
            break;
          case 3:
            if constexpr (kHeadTile >= 3)
              add_weighted_values_bf16<KC, 3>(v_head, tile_offsets, count, weights, padded, o);
            break;
          default:
            if constexpr (kHeadTile >= 4)
              add_weighted_values_bf16<KC, 4>(v_head, tile_offsets, count, weights, padded, o);
            break;
        }
      }
    }
  }
  // Normalised, and the even/odd halves interleaved back into element order.
  const __m512i low_order =
      _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i high_order =
      _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 norm = _mm512_set1_ps(inverse_sum[r]);
    float* orow = o_task + r * kDim;
    for (int c = 0; c < KC; ++c) {
      const __m512 even = _mm512_mul_ps(_mm512_loadu_ps(orow + 32 * c), norm);
      const __m512 odd = _mm512_mul_ps(_mm512_loadu_ps(orow + 32 * c + 16), norm);
      _mm512_storeu_ps(orow + 32 * c, _mm512_permutex2var_ps(even, low_order, odd));
      _mm512_storeu_ps(orow + 32 * c + 16, _mm512_permutex2var_ps(even, high_order, odd));
    }
  }
}
#endif


// A thread's scratch buffers, reused by its tasks.
struct Scratch {
  std::vector<float> scores, query, out;
  std::vector<int64_t> offsets;
  std::vector<uint16_t> query_bf16;
};

// One task: sequence b's kv heads [head_begin, head_end), whose `rows` query rows start at
// `query_rows` and whose float32 output rows go to `out_rows`.
struct Task {
  const char* query_rows;
  int64_t b, head_begin, head_end, rows;
  const int32_t* table;
  Scratch& scratch;
  float* out_rows;
};

// `rows` query rows (`stride` elements apart) of `dtype` into float32 [rows, dim].
void query_to_float(int dtype, const void* query, int64_t stride, int64_t rows, int64_t dim,
                    float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    float* d = dst + r * dim;
    if (dtype == kFloat32) {
      std::memcpy(d, static_cast<const float*>(query) + r * stride, dim * sizeof(float));
    } else if (dtype == kBFloat16) {
      const BFloat16* q = static_cast<const BFloat16*>(query) + r * stride;
      for (int64_t i = 0; i < dim; ++i) d[i] = static_cast<float>(q[i]);
    } else {
      const Half* q = static_cast<const Half*>(query) + r * stride;
      for (int64_t i = 0; i < dim; ++i) d[i] = static_cast<float>(q[i]);
    }
  }
}

// `count` float32 values into `dtype` (bfloat16 or float16).
void float_to(int dtype, const float* src, int64_t count, void* dst) {
  if (dtype == kBFloat16) {
    BFloat16* d = static_cast<BFloat16*>(dst);
    for (int64_t i = 0; i < count; ++i) d[i] = BFloat16(src[i]);
  } else {
    Half* d = static_cast<Half*>(dst);
    for (int64_t i = 0; i < count; ++i) d[i] = static_cast<Half>(src[i]);
  }
}

}  // namespace

// query [batch, num_heads, head_dim] (strides in elements, rows contiguous) of query_dtype
// (kFloat32, kBFloat16 or kFloat16; also out's, contiguous); k_cache, v_cache [num_blocks,
// block_size, num_kv_heads, cache_head_dim] of cache_dtype (caches_ok: contiguous, of one shape
// and dtype), 8-bit ones (kInt8, kFloat8E4M3) with k_scale, v_scale (contiguous float16
// [num_blocks, block_size, num_kv_heads]; else nullptr); block_tables [table_rows,
// table_width] and seq_lens [num_seq_lens], contiguous, of tables_dtype and lengths_dtype (int32).
// Checks every size, seq_len and block id before reading anything.
NORI_SIGNATURE(paged_decode_attention, "PPPPPPPPPPPPPPPPPPPPPPPPPPFP");
extern "C" int nori_paged_decode_attention(
    int64_t query_dtype, const void* query, int64_t batch, int64_t num_heads, int64_t head_dim,
    int64_t query_stride_b, int64_t query_stride_h, int64_t query_stride_d, int64_t cache_dtype,
    const void* k_cache, const void* v_cache, int64_t num_blocks, int64_t block_size,
    int64_t num_kv_heads, int64_t cache_head_dim, int64_t caches_ok, const void* k_scale,
    const void* v_scale, int64_t tables_dtype, const int32_t* block_tables,
    int64_t table_rows, int64_t table_width, int64_t lengths_dtype, const int32_t* seq_lens,
    int64_t num_seq_lens, void* out, float scale, int64_t threads) {
  NORI_REQUIRE(is_float(query_dtype) && query_stride_d == 1,
               "query must be float32, bfloat16 or float16 [B, Hq, D] with contiguous rows");
  NORI_REQUIRE(caches_ok && (is_float(cache_dtype) || cache_dtype == kInt8 ||
                             cache_dtype == kFloat8E4M3),
               "k_cache and v_cache must both be contiguous [num_blocks, block_size, Hkv, D] of "
               "one float or 8-bit dtype");
  NORI_REQUIRE(tables_dtype == kInt32 && lengths_dtype == kInt32,
               "block_tables and seq_lens must be int32");
  const bool quantized = cache_dtype == kInt8 || cache_dtype == kFloat8E4M3;
  NORI_REQUIRE((k_scale == nullptr) == (v_scale == nullptr),
               "k_scale and v_scale must be given together");
  NORI_REQUIRE(!quantized || k_scale != nullptr,
               "an 8-bit cache needs k_scale and v_scale (float16 [num_blocks, block_size, Hkv])");
  NORI_REQUIRE(quantized || k_scale == nullptr,
               "k_scale and v_scale go with an int8 or float8_e4m3fn cache only");
  NORI_REQUIRE(cache_head_dim == head_dim, "query and cache head_dim differ");
  NORI_REQUIRE(num_kv_heads >= 1 && num_heads % num_kv_heads == 0,
               "query heads must be a multiple of kv heads");
  NORI_REQUIRE(table_rows == batch && num_seq_lens == batch,
               "block_tables must be [B, M] and seq_lens [B] for a query of B rows");
  const int64_t table_stride = table_width;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t seq_len = seq_lens[b];
    if (seq_len < 1 || seq_len > table_width * block_size)
      return fail("row %lld: seq_len %lld outside its block table", static_cast<long long>(b),
                  static_cast<long long>(seq_len));
    const int32_t* table = block_tables + b * table_stride;
    for (int64_t j = 0; j * block_size < seq_len; ++j) {
      if (table[j] < 0 || table[j] >= num_blocks)
        return fail("row %lld: block id %d outside the cache", static_cast<long long>(b),
                    table[j]);
    }
  }
  const int64_t group = num_heads / num_kv_heads;
  const auto* k_scales = static_cast<const Half*>(k_scale);
  const auto* v_scales = static_cast<const Half*>(v_scale);

  // One task per sequence keeps each block's reads sequential; a small batch is cut further by
  // kv head so that every thread still gets work. `run_task(const Task&)` computes one task.
  const int64_t splits = batch >= 4 * threads ? 1 : num_kv_heads;
  const auto for_each_task = [&](auto run_task) {
    parallel_for(0, batch * splits, 1, threads, [&](int64_t begin, int64_t end) {
      // Kept by each pool thread across calls: no allocation per call once the sizes are seen.
      static thread_local Scratch scratch;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / splits;
        const int64_t part = task % splits;
        const int64_t head_begin = part * num_kv_heads / splits;
        const int64_t head_end = (part + 1) * num_kv_heads / splits;
        const int64_t first = head_begin * group;  // the task's first query head
        const int64_t count = (head_end - head_begin) * group * head_dim;
        const int64_t out_offset = (b * num_heads + first) * head_dim;
        float* out_rows = static_cast<float*>(out) + out_offset;
        if (query_dtype != kFloat32) {
          scratch.out.resize(count);
          out_rows = scratch.out.data();
        }
        const char* query_rows = static_cast<const char*>(query) +
                                 (b * query_stride_b + first * query_stride_h) *
                                     (query_dtype == kFloat32 ? 4 : 2);
        run_task(Task{query_rows, b, head_begin, head_end, (head_end - head_begin) * group,
                      block_tables + b * table_stride, scratch, out_rows});
        if (query_dtype != kFloat32) {
          float_to(query_dtype, out_rows, count, static_cast<char*>(out) + 2 * out_offset);
        }
      }
    });
  };

#ifdef NORI_BF16_DECODE
  if (cache_dtype == kBFloat16 && query_dtype == kBFloat16 &&
      (head_dim == 64 || head_dim == 128)) {
    const auto* k_ptr = static_cast<const uint16_t*>(k_cache);
    const auto* v_ptr = static_cast<const uint16_t*>(v_cache);
    for_each_task([&](const Task& t) {
      std::vector<uint16_t>& query_rows = t.scratch.query_bf16;
      query_rows.resize(t.rows * head_dim);
      for (int64_t r = 0; r < t.rows; ++r)
        std::memcpy(query_rows.data() + r * head_dim, t.query_rows + 2 * r * query_stride_h,
                    2 * head_dim);
      const auto task = head_dim == 64 ? decode_task_bf16<2> : decode_task_bf16<4>;
      task(query_rows.data(), k_ptr, v_ptr, t.table, seq_lens[t.b], t.head_begin, t.head_end,
           num_kv_heads, group, block_size, scale, t.scratch.scores, t.scratch.offsets,
           t.out_rows);
    });
    return 0;
  }
#endif

  const auto launch = [&](auto cache_tag, auto quantized_constant) {
    using cache_t = decltype(cache_tag);
    constexpr bool kQuantized = decltype(quantized_constant)::value;
    const auto* k_ptr = static_cast<const cache_t*>(k_cache);
    const auto* v_ptr = static_cast<const cache_t*>(v_cache);
    for_each_task([&](const Task& t) {
      std::vector<float>& query_rows = t.scratch.query;
      query_rows.resize(t.rows * head_dim);
      query_to_float(query_dtype, t.query_rows, query_stride_h, t.rows, head_dim,
                     query_rows.data());
      const auto run = [&](auto head_dim_constant) {
        decode_task<cache_t, decltype(head_dim_constant)::value, kQuantized>(
            query_rows.data(), k_ptr, v_ptr, k_scales, v_scales, t.table, seq_lens[t.b],
            t.head_begin, t.head_end, num_kv_heads, group, head_dim, block_size, scale,
            t.scratch.scores, t.out_rows);
      };
      switch (head_dim) {
        case 32: run(std::integral_constant<int, 32>{}); break;
        case 64: run(std::integral_constant<int, 64>{}); break;
        case 128: run(std::integral_constant<int, 128>{}); break;
        default: run(std::integral_constant<int, 0>{}); break;
      }
    });
  };

  switch (cache_dtype) {
    case kInt8: launch(int8_t{}, std::true_type{}); break;
    case kFloat8E4M3: launch(Float8E4M3{}, std::true_type{}); break;
    case kFloat32: launch(float{}, std::false_type{}); break;
    case kBFloat16: launch(BFloat16{}, std::false_type{}); break;
    default: launch(Half{}, std::false_type{}); break;
  }
  return 0;
}
