// The decoder layers of a Llama forward on the CPU in one call (models/llama.py's loop, op for op), so that a decode
// or verify step runs its ~10 ops a layer without Python or the dispatcher between them: a private op,
// torch.ops.specdec_internal.llama_layers, not one of the library's ops. Every step is the CPU kernel the Python
// loop calls (cpu/cpu_ops.h) on the same arguments, so the two give the same bits.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "checks/skinny_linear.h"
#include "cpu/cpu_ops.h"
#include "specdec/gguf_blocks.h"

namespace specdec {
namespace {

// x @ W^T (+ bias) for W given as `count` parts from weights[first] (formats: 0 a float32 / bfloat16 tensor [N, K],
// else the GGUF block type of a [N, row_bytes] uint8 tensor): llama.py's linear(). Several parts are a
// QuantizedRowStack: one product each, concatenated. x [..., K] -> [..., N].
at::Tensor project(const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats, int64_t first, int64_t count,
                   const std::optional<at::Tensor>& bias, c10::string_view activations) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  std::vector<at::Tensor> ys;
  int64_t n0 = 0;
  for (int64_t p = first; p < first + count; ++p) {
    const at::Tensor& w = weights[p];
    const int64_t n = w.size(0);
    std::optional<at::Tensor> b;
    if (bias.has_value()) b = count == 1 ? *bias : bias->narrow(0, n0, n);
    if (formats[p] != 0) {
      ys.push_back(quantized_linear_cpu(rows, w, formats[p], b, activations));
    } else if (rows.size(0) <= kMaxSkinnyRows && rows.scalar_type() == w.scalar_type() &&
               (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16)) {
      ys.push_back(skinny_linear_cpu(rows, w, b));
    } else {  // the orientation llama.py uses for more rows
      at::Tensor y = at::mm(w, rows.t()).t().contiguous();
      ys.push_back(b.has_value() ? y + *b : y);
    }
    n0 += n;
  }
  at::Tensor y = ys.size() == 1 ? ys[0] : at::cat(ys, -1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(n0);
  return y.view(shape);
}

// x [B, Q, H] (the flat form: [1, T, H] with qo_indptr), the residual stream after the embedding: every layer applied
// in place, and returned. weights / formats: the layers' projections in order (qkv, o, gate_up, down per layer),
// parts[4 l + j] tensors each (more than one: a row stack). The KV cache: k_cache / v_cache stacked over layers
// ([L, B, S, Hkv, D], requests row_start .. row_stop of it; or paged [L, pages, page, Hkv, D] with block_table),
// cache_seqlens and block_table already those requests'. layer_outputs [B, Q, len(capture_layers) x H]: the
// residual stream after each layer of capture_layers copied into its H columns (EAGLE-3's features).
// cache_layers: the layers given are a subset of the model's (a self-speculative draft); the l-th of them reads and
// writes layer cache_layers[l] of the cache (empty: layer l, the cache holding exactly these layers).
at::Tensor llama_layers_cpu(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                            at::IntArrayRef formats, at::IntArrayRef parts,
                            const c10::List<std::optional<at::Tensor>>& qkv_biases, at::TensorList input_norms,
                            at::TensorList post_norms, double eps, int64_t hq, int64_t hkv,
                            c10::string_view activations, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
                            int64_t row_start, int64_t row_stop, const std::optional<at::Tensor>& tree_mask,
                            const std::optional<at::Tensor>& qo_indptr,
                            const std::optional<at::Tensor>& layer_outputs, at::IntArrayRef capture_layers,
                            at::IntArrayRef cache_layers) {
  const int64_t layers = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK_VALUE(x.dim() == 3 && x.is_contiguous() && layers > 0 &&
                        static_cast<int64_t>(post_norms.size()) == layers &&
                        static_cast<int64_t>(parts.size()) == 4 * layers &&
                        static_cast<int64_t>(qkv_biases.size()) == layers && formats.size() == weights.size() &&
                        k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() &&
                        (cache_layers.empty() ? k_cache.size(0) == layers
                                              : static_cast<int64_t>(cache_layers.size()) == layers),
                    "llama_layers: inconsistent arguments (", layers, " layers)");
  for (const int64_t c : cache_layers) {  // a subset of the model's layers: each one's layer of the cache
    TORCH_CHECK_VALUE(c >= 0 && c < k_cache.size(0), "llama_layers: cache layer ", c, " outside the cache's ",
                      k_cache.size(0));
  }
  const int64_t B = x.size(0), Q = x.size(1), H = x.size(2);
  TORCH_CHECK_VALUE(capture_layers.empty() ||
                        (layer_outputs.has_value() && layer_outputs->dim() == 3 && layer_outputs->size(0) == B &&
                         layer_outputs->size(1) == Q &&
                         layer_outputs->size(2) == static_cast<int64_t>(capture_layers.size()) * H &&
                         layer_outputs->scalar_type() == x.scalar_type()),
                    "llama_layers: layer_outputs must be [B, Q, len(capture_layers) x H] of x's dtype");
  at::Tensor h = rms_norm_cpu(x, input_norms[0], eps);
  int64_t w = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* p = parts.data() + 4 * l;
    const at::Tensor qkv = project(h, weights, formats, w, p[0], qkv_biases.get(l), activations);
    w += p[0];
    auto [q, k, v] = rotary_split_cpu(qkv, cos, sin, hq, hkv);
    const int64_t cl = cache_layers.empty() ? l : cache_layers[l];
    const at::Tensor kc = block_table.has_value() ? k_cache.select(0, cl)
                                                  : k_cache.select(0, cl).slice(0, row_start, row_stop);
    const at::Tensor vc = block_table.has_value() ? v_cache.select(0, cl)
                                                  : v_cache.select(0, cl).slice(0, row_start, row_stop);
    if (qo_indptr.has_value()) {  // flat rows of a ragged batch: q [T, Hq, D]
      q = q.select(0, 0);
      k = k.select(0, 0);
      v = v.select(0, 0);
    }
    const at::Tensor attn = at::empty_like(q, at::MemoryFormat::Contiguous);
    verify_attention_cpu(q, kc, vc, cache_seqlens, k, v, block_table, tree_mask, std::nullopt, attn, std::nullopt,
                         std::nullopt, qo_indptr, std::nullopt, std::nullopt, std::nullopt, "NHD", -1, 0.0);
    const at::Tensor o = project(attn.reshape({B, Q, -1}), weights, formats, w, p[1], std::nullopt, activations);
    w += p[1];
    h = add_rms_norm_cpu(x, o, post_norms[l], eps);
    const at::Tensor gate_up = project(h, weights, formats, w, p[2], std::nullopt, activations);
    w += p[2];
    const at::Tensor mlp = project(silu_mul_cpu(gate_up), weights, formats, w, p[3], std::nullopt, activations);
    w += p[3];
    if (l + 1 < layers) {
      h = add_rms_norm_cpu(x, mlp, input_norms[l + 1], eps);
    } else {
      x.add_(mlp);
    }
    for (size_t j = 0; j < capture_layers.size(); ++j) {
      if (capture_layers[j] == l) layer_outputs->narrow(2, static_cast<int64_t>(j) * H, H).copy_(x);
    }
  }
  return x;
}

}  // namespace

TORCH_LIBRARY(specdec_internal, m) {
  m.def(
      "llama_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor[] weights, int[] formats, int[] parts, "
      "Tensor?[] qkv_biases, Tensor[] input_norms, Tensor[] post_norms, float eps, int num_q_heads, int num_kv_heads, "
      "str activations, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor cache_seqlens, Tensor? block_table, "
      "int row_start, int row_stop, Tensor? tree_mask, Tensor? qo_indptr, Tensor(d!)? layer_outputs, "
      "int[] capture_layers, int[] cache_layers) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(specdec_internal, CPU, m) { m.impl("llama_layers", &llama_layers_cpu); }

}  // namespace specdec
