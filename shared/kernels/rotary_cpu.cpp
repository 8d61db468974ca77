// Rotary position embedding for the CPU engine, in place on the q and k heads of the fused qkv
// projection (Hugging Face's rotate_half layout): one pass instead of the reference's four
// tensor ops and two temporaries per layer (rope.py, which this is tested against).
//
// x [T, H, D] with the last dim contiguous (rows may be strided: q and k sit inside the qkv
// output); cos, sin [T, D / 2]: the angles of each token's position, computed once per step.

#include <ATen/Parallel.h>
#include <torch/extension.h>

void rotary_inplace(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, H, D] with contiguous rows");
  const int64_t tokens = x.size(0);
  const int64_t heads = x.size(1);
  const int64_t half = x.size(2) / 2;
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == tokens &&
                  cos.size(1) == half && cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous [T, head_dim / 2]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos, sin and x must share a dtype");
  const int64_t stride_t = x.stride(0);
  const int64_t stride_h = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "rotary", [&] {
        scalar_t* base = x.data_ptr<scalar_t>();
        const scalar_t* cos_ptr = cos.data_ptr<scalar_t>();
        const scalar_t* sin_ptr = sin.data_ptr<scalar_t>();
        const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * half, 1));
        at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            const scalar_t* __restrict__ c = cos_ptr + t * half;
            const scalar_t* __restrict__ s = sin_ptr + t * half;
            for (int64_t h = 0; h < heads; ++h) {
              scalar_t* __restrict__ x1 = base + t * stride_t + h * stride_h;
              scalar_t* __restrict__ x2 = x1 + half;
              for (int64_t i = 0; i < half; ++i) {
                const float a = static_cast<float>(x1[i]);
                const float b = static_cast<float>(x2[i]);
                const float ci = static_cast<float>(c[i]);
                const float si = static_cast<float>(s[i]);
                // rotate_half(x) = cat(-x2, x1)
                x1[i] = static_cast<scalar_t>(a * ci - b * si);
                x2[i] = static_cast<scalar_t>(b * ci + a * si);
              }
            }
          }
        });
      });
}
