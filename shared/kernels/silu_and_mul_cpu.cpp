// The gated MLP's activation for the CPU engine: silu(gate) * up in one pass over [T, 2I] rows
// (gate first, then up, as the fused gate_up projection writes them), instead of slicing, a silu
// and a multiply. Tested against the PyTorch reference (silu_and_mul.py).

#include "cpu_common.h"

// input [tokens, width] (dims, contiguous: its rank and flag) -> out [tokens, width / 2].
NORI_SIGNATURE(silu_and_mul, "PPPPPPPP");
extern "C" int nori_silu_and_mul(int64_t dtype, const void* input, int64_t dims,
                                 int64_t contiguous, int64_t tokens, int64_t width, void* out,
                                 int64_t threads) {
  NORI_REQUIRE(nori::is_float(dtype) && dims == 2 && contiguous && width % 2 == 0,
               "input must be a contiguous float [T, 2I] tensor");
  return nori::with_float_type(dtype, [&](auto type) {
    using scalar_t = decltype(type);
    nori::silu_and_mul_rows(static_cast<const scalar_t*>(input), static_cast<scalar_t*>(out),
                            tokens, width / 2, threads);
  });
}
