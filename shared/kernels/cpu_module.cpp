// Python bindings of the C++ CPU kernels: one extension module, built by cpu_build.py.
//
// Every kernel releases the GIL while it runs (arguments are converted before, the result
// after): a worker's event loop keeps serving gRPC and streams during a step, as it does
// during PyTorch's own ops.

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <tuple>

torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale, const std::optional<torch::Tensor>& k_scale,
                                     const std::optional<torch::Tensor>& v_scale);
torch::Tensor rms_norm(const torch::Tensor& input, const torch::Tensor& weight, double eps);
void fused_add_rms_norm(torch::Tensor& input, torch::Tensor& residual,
                        const torch::Tensor& weight, double eps);
torch::Tensor silu_and_mul(const torch::Tensor& input);
void rotary_inplace(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
void store_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache,
              torch::Tensor& v_cache, const torch::Tensor& slots);
void store_kv_quantized(const torch::Tensor& key, const torch::Tensor& value,
                        torch::Tensor& k_cache, torch::Tensor& v_cache, torch::Tensor& k_scale,
                        torch::Tensor& v_scale, const torch::Tensor& slots);
torch::Tensor argmax_rows(const torch::Tensor& logits);
void copy_pieces(const torch::Tensor& pieces);
uint64_t copy_and_hash_pieces(const torch::Tensor& pieces);
std::tuple<torch::Tensor, torch::Tensor> rows_to_unit(const torch::Tensor& input,
                                                      double smallest_max);
void scale_rows_back(torch::Tensor& output, const torch::Tensor& row_max,
                     const std::optional<torch::Tensor>& bias);
torch::Tensor bf16_gemv(const torch::Tensor& input, const torch::Tensor& packed_weight,
                        int64_t outputs, const std::optional<torch::Tensor>& bias);
torch::Tensor fused_experts(const torch::Tensor& hidden, const torch::Tensor& w13,
                            const torch::Tensor& w2, const torch::Tensor& topk_weights,
                            const torch::Tensor& topk_ids,
                            const std::optional<torch::Tensor>& w13_scale,
                            const std::optional<torch::Tensor>& w2_scale);
torch::Tensor int8_gemv(const torch::Tensor& input, const torch::Tensor& packed_weight,
                        int64_t outputs, const torch::Tensor& weight_scale,
                        const torch::Tensor& row_sums, const std::optional<torch::Tensor>& bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, release(),
        "Paged decode attention over a [num_blocks, block_size, Hkv, D] cache (8-bit with "
        "k_scale/v_scale)");
  m.def("rms_norm", &rms_norm, release(), "RMSNorm of the rows of input, times weight");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, release(),
        "residual += input; input = rms_norm(residual) * weight, both in place");
  m.def("silu_and_mul", &silu_and_mul, release(), "silu(x[:, :I]) * x[:, I:] for x [T, 2I]");
  m.def("rotary_inplace", &rotary_inplace, release(),
        "rotate x [T, H, D] in place (rotate_half layout)");
  m.def("store_kv", &store_kv, release(), "write key/value rows into the paged caches at slots");
  m.def("store_kv_quantized", &store_kv_quantized, release(),
        "quantize key/value rows into 8-bit paged caches and their float16 scales at slots");
  m.def("copy_pieces", &copy_pieces, release(),
        "memcpy of each (destination, source, nbytes) row of int64 [n, 3]");
  m.def("copy_and_hash_pieces", &copy_and_hash_pieces, release(),
        "copy_pieces, returning xxh3-64 of the copied bytes in order");
  m.def("argmax_rows", &argmax_rows, release(), "torch.argmax(logits, -1) for float32 [B, V]");
  m.def("rows_to_unit", &rows_to_unit, release(),
        "each row of float32 [T, K] divided by its largest magnitude, and those [T, 1]");
  m.def("scale_rows_back", &scale_rows_back, release(),
        "output[i] = output[i] * row_max[i] (+ bias), in place");
  m.def("bf16_gemv", &bf16_gemv, release(),
        "a few bfloat16 rows times bfloat16 weights packed as [N/16, ceil(K/2), 16, 2] (+ bias), "
        "float32 sums");
  m.def("fused_experts", &fused_experts, release(),
        "a mixture-of-experts layer's experts: hidden [T, H] through each token's top-k "
        "experts' gated MLPs (w13 [E, 2I, H], w2 [E, H, I], int8 with per-row scales), "
        "weighted and summed; ids outside [0, E) skipped");
  m.def("int8_gemv", &int8_gemv, release(),
        "a few float32 rows, each quantized to int8, times int8 weights packed as "
        "[N/16, ceil(K/4), 16, 4] (+ bias)");
}
