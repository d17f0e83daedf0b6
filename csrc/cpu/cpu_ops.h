// The CPU kernels of the library's ops, as C++ functions (their TORCH_LIBRARY_IMPL registrations call these): for
// C++ callers that run several ops in a row without the dispatcher or Python between them (cpu/llama_layers.cpp).
// Each checks its arguments as the op does.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace specdec {

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_cpu(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_split_cpu(const at::Tensor& qkv, const at::Tensor& cos,
                                                                 const at::Tensor& sin, int64_t hq, int64_t hkv);
at::Tensor silu_mul_cpu(const at::Tensor& gate_up);
at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
at::Tensor quantized_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                                const std::optional<at::Tensor>& bias, c10::string_view activations);
void verify_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& k_new,
                          const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
                          const std::optional<at::Tensor>& tree_mask, std::optional<double> softmax_scale,
                          const at::Tensor& out, const std::optional<at::Tensor>& lse,
                          const std::optional<at::Tensor>& error_flags, const std::optional<at::Tensor>& qo_indptr,
                          const std::optional<at::Tensor>& kv_indptr, const std::optional<at::Tensor>& kv_indices,
                          const std::optional<at::Tensor>& kv_last_page_len, c10::string_view kv_layout,
                          int64_t window_left, double logits_soft_cap);

}  // namespace specdec
