// What the C++ CPU kernels share: element types, the parallel loop, argument checks and errors.
//
// The kernels are plain C++ behind an `extern "C"` interface (raw pointers, dtype codes, sizes,
// strides and layout flags), loaded with ctypes by cpu_build.py (CpuKernels), which allocates the
// outputs. Each returns 0, or 1 when an argument check failed, with a message for
// nori_last_error() (per thread: ctypes calls and reads it on the same thread).

#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

namespace nori {

// The dtype codes cpu_build.py passes (`_CODE`; -1 for any other dtype).
enum Dtype : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kInt8 = 3,
  kFloat8E4M3 = 4,
  kInt32 = 5,
  kInt64 = 6,
};

// bfloat16 as torch stores it: the high half of a float32.
struct BFloat16 {
  uint16_t x;
  BFloat16() = default;
  // Round to nearest even; a NaN stays a (quiet) NaN. Branch-free, so loops vectorise.
  explicit BFloat16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    x = static_cast<uint16_t>(nan ? 0x7fc0u : rounded);
  }
  operator float() const {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
};

// float16: the compiler's type (F16C conversions, round to nearest even).
using Half = _Float16;

// float8_e4m3fn, as torch stores it (no infinities; 0x7f and 0xff are NaN).
struct Float8E4M3 {
  uint8_t x;
  Float8E4M3() = default;
  // torch's conversion (c10 fp8e4m3fn_from_fp32_value): round to nearest even, NaN past 448
  // (callers clamp to +-448 first).
  explicit Float8E4M3(float value) {
    uint32_t bits = __builtin_bit_cast(uint32_t, value);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t result;
    if (bits >= (1087u << 20)) {
      result = 0x7f;
    } else if (bits < (121u << 23)) {  // below 2^-6, the smallest normal: a subnormal code
      constexpr uint32_t kDenormMask = 141u << 23;
      const float sum = __builtin_bit_cast(float, bits) + __builtin_bit_cast(float, kDenormMask);
      result = static_cast<uint8_t>(__builtin_bit_cast(uint32_t, sum) - kDenormMask);
    } else {
      const uint32_t odd = (bits >> 20) & 1u;
      bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + odd;
      result = static_cast<uint8_t>(bits >> 20);
    }
    x = static_cast<uint8_t>(result | (sign >> 24));
  }
  // In plain integer arithmetic, which the compiler vectorises (a 256-entry table keeps the
  // loops scalar). Exact for every code but NaN, which the store never writes; no float
  // subnormal is formed, so it holds whatever the denormals-are-zero mode.
  operator float() const {
    const uint32_t bits = x;
    const uint32_t magnitude = bits & 0x7f;
    // Normal codes: exponent and mantissa moved into float's, the bias raised from 7 to 127.
    // Subnormal codes (exponent 0) are mantissa * 2^-9.
    const float normal = __builtin_bit_cast(float, (magnitude << 20) + (120u << 23));
    const float value = magnitude < 8 ? static_cast<float>(magnitude) * 0x1p-9f : normal;
    return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, value) | ((bits & 0x80) << 24));
  }
};

// Calls f(begin, end) on chunks of [begin, end) across `threads` OpenMP threads, as
// at::parallel_for does: one chunk per thread, no more chunks than grain-sized pieces, and
// inline (no fork) when the range is at most `grain`, one thread is asked for, or the caller is
// already inside a parallel region. `threads` is torch.get_num_threads() of the calling thread.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, int64_t threads, const F& f) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  if (threads <= 1 || range <= std::max<int64_t>(grain, 1) || omp_in_parallel()) {
    f(begin, end);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    int64_t team = omp_get_num_threads();
    if (grain > 0) team = std::min<int64_t>(team, (range + grain - 1) / grain);
    const int64_t chunk = (range + team - 1) / team;
    const int64_t first = begin + omp_get_thread_num() * chunk;
    if (first < end) f(first, std::min(end, first + chunk));
  }
}

// silu(gate) * up over `rows` rows of [gate | up] (2 * width each, as the fused gate_up
// projection writes them) into `rows` rows of width `width`, in float: the gated MLP's
// activation, for silu_and_mul_cpu.cpp and the fused MoE.
template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* gate_up, scalar_t* out, int64_t rows, int64_t width,
                       int64_t threads) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  parallel_for(0, rows, grain, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* __restrict__ gate = gate_up + r * 2 * width;
      const scalar_t* __restrict__ up = gate + width;
      scalar_t* __restrict__ row = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        row[i] = static_cast<scalar_t>(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
      }
    }
  });
}

// Calls f(T{}) for the element type T of a float dtype code (float32, bfloat16 or float16);
// returns 0, a kernel's success status.
template <typename F>
int with_float_type(int64_t dtype, const F& f) {
  switch (dtype) {
    case kFloat32: f(float{}); break;
    case kBFloat16: f(BFloat16{}); break;
    default: f(Half{}); break;
  }
  return 0;
}

// Each kernel's ctypes signature, "name:ARGUMENTS" with a letter per argument (P: a pointer or
// an int64_t, passed as c_void_p; F: a float), written beside its extern "C" function and
// gathered at load for nori_signatures(), from which cpu_build.py sets every argtypes.
inline std::string& signatures() {
  static std::string all;
  return all;
}
struct Signature {
  explicit Signature(const char* entry) { signatures().append(entry).append(" "); }
};
#define NORI_SIGNATURE(name, arguments) \
  static const nori::Signature name##_signature(#name ":" arguments)

// The calling thread's last error message.
inline char* error_buffer() {
  static thread_local char message[512];
  return message;
}

// Returns 1 (a kernel's failure status) with a printf-style message unless `condition` holds:
// the check of an argument, as TORCH_CHECK was.
#define NORI_REQUIRE(condition, ...) \
  do {                               \
    if (!(condition)) return nori::fail(__VA_ARGS__); \
  } while (0)

// Whether `code` names a float dtype (float32, bfloat16 or float16).
inline bool is_float(int64_t code) {
  return code == kFloat32 || code == kBFloat16 || code == kFloat16;
}

// Records a printf-style message and returns 1 (a kernel's failure status).
__attribute__((format(printf, 1, 2))) inline int fail(const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vsnprintf(error_buffer(), 512, format, args);
  va_end(args);
  return 1;
}

}  // namespace nori
