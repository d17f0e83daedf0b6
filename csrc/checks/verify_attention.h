// The argument checks and error bits of verify_attention (cpu/verify_attention.cpp, cuda/verify_attention.cu).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "checks/common.h"
#include "specdec/attention.h"

namespace specdec {

inline constexpr ErrorBit kAttentionErrorBits[] = {
    {kAttentionBadLength,
     "the block [cache_seqlens[b], cache_seqlens[b] + Q_b) runs outside the cache (or cache_seqlens[b] < 0; with the "
     "CSR table: its kv length holds fewer than Q_b tokens)"},
    {kAttentionBadPage, "block_table points outside the paged cache (kv_indices with the CSR table)"},
    {kAttentionBadQoIndptr, "qo_indptr must be non-decreasing from >= 0 to <= T, with at most 128 rows per request"},
    {kAttentionBadKvIndptr,
     "kv_indptr must be non-decreasing from >= 0 to <= len(kv_indices), and kv_last_page_len in [1, page_size] "
     "(0 for a request without pages)"},
    {kAttentionBadMask, "the flat tree_mask is shorter than sum Q_b^2"},
    {kAttentionPageAlias,
     "block_table (kv_indices with the CSR table) lists a page the new tokens go to twice within one request"},
};

// A 1-D contiguous int32 tensor of n entries (n < 0: any length) on `device`, or a ValueError naming it.
inline const int32_t* attention_index_vector(const at::Tensor& t, const char* name, int64_t n, const at::Device& device) {
  TORCH_CHECK_VALUE(t.dim() == 1 && (n < 0 || t.size(0) == n) && t.scalar_type() == at::kInt && t.is_contiguous(),
                    "verify_attention: ", name, " must be a contiguous 1-D int32 tensor",
                    n >= 0 ? " of " + std::to_string(n) + " entries" : std::string(), ", got ", t.sizes(), " ",
                    t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == device, "verify_attention: ", name, " is on ", t.device(), " but q is on ", device);
  return t.data_ptr<int32_t>();
}

// Checks verify_attention's arguments and gathers them into the kernels' parameters (layouts: specdec/attention.h).
// `out` is written, like q; `lse`, when given, is q's shape without D, float32.
inline AttentionParams make_attention_params(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& k_new,
    const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& tree_mask, std::optional<double> softmax_scale, const at::Tensor& out,
    const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& error_flags,
    const std::optional<at::Tensor>& qo_indptr, const std::optional<at::Tensor>& kv_indptr,
    const std::optional<at::Tensor>& kv_indices, const std::optional<at::Tensor>& kv_last_page_len,
    c10::string_view kv_layout, int64_t window_left, double logits_soft_cap) {
  const char* op = "verify_attention";
  const bool flat = qo_indptr.has_value(), csr = kv_indptr.has_value(), hnd = kv_layout_is_hnd(op, kv_layout);
  const auto device = q.device();
  auto same = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but q is on ", device);
  };
  AttentionParams P{};
  int64_t B, Q, T;
  if (flat) {
    TORCH_CHECK_VALUE(q.dim() == 3 && q.is_contiguous(), op, ": with qo_indptr, q must be a contiguous [T, Hq, D] tensor, got ",
                      q.sizes());
    TORCH_CHECK_VALUE(qo_indptr->dim() == 1 && qo_indptr->size(0) >= 1, op, ": qo_indptr must be [B+1], got ",
                      qo_indptr->sizes());
    B = qo_indptr->size(0) - 1;
    P.qo_indptr = attention_index_vector(*qo_indptr, "qo_indptr", B + 1, device);
    T = q.size(0);
    Q = std::min<int64_t>(T, kMaxVerifyQueries);  // the most rows one request can own
  } else {
    TORCH_CHECK_VALUE(q.dim() == 4 && q.is_contiguous(), op, ": q must be a contiguous [B, Q, Hq, D] tensor, got ", q.sizes());
    B = q.size(0);
    Q = q.size(1);
    T = B * Q;
    TORCH_CHECK_VALUE(Q >= 1 && Q <= kMaxVerifyQueries, op, ": the number of new tokens Q must be in [1, ",
                      kMaxVerifyQueries, "], got ", Q);
  }
  const int64_t Hq = q.size(-2), D = q.size(-1);
  const auto dtype = q.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, op,
                    ": q must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK_VALUE(D >= 1 && D <= kMaxHeadDim, op, ": head dim D must be in [1, ", kMaxHeadDim, "], got ", D);
  TORCH_CHECK_VALUE(Hq >= 1, op, ": q must have at least one head, got Hq = ", Hq);
  TORCH_CHECK_VALUE(!softmax_scale.has_value() ||
                        (std::isfinite(static_cast<float>(*softmax_scale)) && static_cast<float>(*softmax_scale) > 0), op,
                    ": softmax_scale must be finite and > 0, got ", softmax_scale.value_or(0.0));
  TORCH_CHECK_VALUE(window_left >= -1 && window_left <= INT32_MAX, op, ": window_left must be -1 (off) or in [0, 2^31), got ",
                    window_left);
  TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(logits_soft_cap)) && logits_soft_cap >= 0, op,
                    ": logits_soft_cap must be finite and >= 0 (0: off), got ", logits_soft_cap);
  const bool paged = block_table.has_value() || csr;
  TORCH_CHECK_VALUE(!(block_table.has_value() && csr), op, ": give block_table or the CSR table (kv_indptr, kv_indices, "
                    "kv_last_page_len), not both");
  // The cache dims: [page or request, slot, head, D] (NHD) or [page or request, head, slot, D] (HND).
  const int slot_dim = hnd ? 2 : 1, head_dim = hnd ? 1 : 2;
  for (const auto* c : {&k_cache, &v_cache}) {
    const char* name = c == &k_cache ? "k_cache" : "v_cache";
    TORCH_CHECK_VALUE(c->dim() == 4 && c->size(3) == D && c->stride(3) == 1, op, ": ", name, " must be ",
                      hnd ? "[B, Hkv, S_max, D] or [num_pages, Hkv, page_size, D]"
                          : "[B, S_max, Hkv, D] or [num_pages, page_size, Hkv, D]",
                      " (kv_layout \"", std::string(kv_layout), "\") with D = ", D,
                      " contiguous in its last dimension, got ", c->sizes(), " with strides ", c->strides());
    TORCH_CHECK_VALUE(c->scalar_type() == dtype, op, ": ", name, " must have q's dtype ", dtype, ", got ", c->scalar_type());
    same(*c, name);
    if (paged) {  // any page stride; each page's [page_size, Hkv, D] / [Hkv, page_size, D] dense
      TORCH_CHECK_VALUE(c->stride(2) == D && c->stride(1) == c->size(2) * D, op, ": ", name,
                        ": each page of a paged cache must be dense (any page stride), got strides ", c->strides());
    }
  }
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(), op,
                    ": k_cache and v_cache must have the same shape and strides");
  const int64_t Hkv = k_cache.size(head_dim);
  TORCH_CHECK_VALUE(Hkv >= 1 && Hq % Hkv == 0, op, ": the query heads Hq = ", Hq,
                    " must be a multiple of the KV heads Hkv = ", Hkv);
  P.stride_page = k_cache.stride(0);
  P.stride_slot = k_cache.stride(slot_dim);
  P.stride_head = k_cache.stride(head_dim);
  if (csr) {
    TORCH_CHECK_VALUE(!cache_seqlens.has_value(), op, ": cache_seqlens must be None with kv_indptr: the lengths come from "
                      "the CSR table (FlashInfer's kv length, which includes the Q_b new tokens)");
    TORCH_CHECK_VALUE(kv_indices.has_value() && kv_last_page_len.has_value(), op,
                      ": kv_indptr needs kv_indices and kv_last_page_len");
    P.kv_indptr = attention_index_vector(*kv_indptr, "kv_indptr", B + 1, device);
    P.kv_indices = attention_index_vector(*kv_indices, "kv_indices", -1, device);
    P.kv_last_page_len = attention_index_vector(*kv_last_page_len, "kv_last_page_len", B, device);
    P.num_indices = kv_indices->size(0);
  } else {
    TORCH_CHECK_VALUE(!kv_indices.has_value() && !kv_last_page_len.has_value(), op,
                      ": kv_indices and kv_last_page_len need kv_indptr");
    TORCH_CHECK_VALUE(cache_seqlens.has_value(), op, ": cache_seqlens is needed (unless the CSR table kv_indptr is given)");
    P.cache_seqlens = attention_index_vector(*cache_seqlens, "cache_seqlens", B, device);
  }
  TORCH_CHECK_VALUE(k_new.has_value() == v_new.has_value(), op, ": give both k_new and v_new, or neither");
  if (k_new.has_value()) {
    for (const auto* t : {&*k_new, &*v_new}) {
      const char* name = t == &*k_new ? "k_new" : "v_new";
      const bool shape_ok = flat ? t->dim() == 3 && t->size(0) == T && t->size(1) == Hkv && t->size(2) == D
                                 : t->dim() == 4 && t->size(0) == B && t->size(1) == Q && t->size(2) == Hkv && t->size(3) == D;
      TORCH_CHECK_VALUE(shape_ok && t->is_contiguous() && t->scalar_type() == dtype, op, ": ", name, " must be a contiguous ",
                        flat ? "[T, Hkv, D] = [" + std::to_string(T) + ", "
                             : "[B, Q, Hkv, D] = [" + std::to_string(B) + ", " + std::to_string(Q) + ", ",
                        Hkv, ", ", D, "] ", dtype, " tensor, got ", t->sizes(), " ", t->scalar_type());
      same(*t, name);
    }
    P.k_new = k_new->data_ptr();
    P.v_new = v_new->data_ptr();
  }
  P.page_size = 1;
  if (paged) {
    P.page_size = k_cache.size(slot_dim);
    P.num_pages = k_cache.size(0);
    TORCH_CHECK_VALUE(P.page_size >= 1, op, ": a paged k_cache needs page_size >= 1");
    P.page_shift = (P.page_size & (P.page_size - 1)) == 0 ? __builtin_ctzll(P.page_size) : -1;
    if (block_table.has_value()) {
      const at::Tensor& t = *block_table;
      TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == B && t.scalar_type() == at::kInt && t.is_contiguous(), op,
                        ": block_table must be a contiguous [B, max_pages] int32 tensor, got ", t.sizes(), " ",
                        t.scalar_type());
      same(t, "block_table");
      P.block_table = t.data_ptr<int32_t>();
      P.max_pages = t.size(1);
      TORCH_CHECK_VALUE(P.max_pages >= 1, op, ": block_table has no columns: the paged cache holds no positions");
      P.capacity = P.max_pages * P.page_size;
    } else {
      P.capacity = P.num_indices * P.page_size;  // a bound: no request lists more pages than kv_indices holds
    }
  } else {
    TORCH_CHECK_VALUE(k_cache.size(0) >= B, op, ": k_cache holds ", k_cache.size(0), " requests, q ", B);
    P.capacity = k_cache.size(slot_dim);
    TORCH_CHECK_VALUE(P.capacity >= 1, op, ": k_cache holds no positions (S_max = 0)");
  }
  if (tree_mask.has_value()) {
    const at::Tensor& m = *tree_mask;
    if (flat) {
      TORCH_CHECK_VALUE(m.dim() == 1 && m.scalar_type() == at::kBool && m.is_contiguous(), op,
                        ": with qo_indptr, tree_mask must be a flat contiguous bool tensor (request b's [Q_b, Q_b] "
                        "row-major at offset sum_{c<b} Q_c^2), got ", m.sizes(), " ", m.scalar_type());
    } else {
      const bool per_request = m.dim() == 3;
      TORCH_CHECK_VALUE((m.dim() == 2 || (per_request && m.size(0) == B)) && m.size(-1) == Q && m.size(-2) == Q &&
                            m.scalar_type() == at::kBool && m.is_contiguous(),
                        op, ": tree_mask must be a contiguous bool [Q, Q] or [B, Q, Q] tensor with Q = ", Q, ", got ",
                        m.sizes(), " ", m.scalar_type());
      P.mask_per_request = per_request;
    }
    same(m, "tree_mask");
    P.tree_mask = m.data_ptr<bool>();
    P.mask_numel = m.numel();
  }
  TORCH_CHECK_VALUE(out.sizes() == q.sizes() && out.scalar_type() == dtype && out.is_contiguous(), op,
                    ": out must be a contiguous ", dtype, " tensor of q's shape ", q.sizes(), ", got ", out.sizes(), " ",
                    out.scalar_type());
  same(out, "out");
  if (lse.has_value()) {
    TORCH_CHECK_VALUE(lse->sizes() == q.sizes().slice(0, q.dim() - 1) && lse->scalar_type() == at::kFloat &&
                          lse->is_contiguous(),
                      op, ": lse must be a contiguous float32 tensor of shape ", q.sizes().slice(0, q.dim() - 1), ", got ",
                      lse->sizes(), " ", lse->scalar_type());
    same(*lse, "lse");
    P.lse = lse->data_ptr<float>();
  }
  P.q = q.data_ptr();
  P.k_cache = k_cache.data_ptr();
  P.v_cache = v_cache.data_ptr();
  P.out = out.data_ptr();
  P.batch = B;
  P.num_queries = Q;
  P.total_queries = T;
  P.q_heads = Hq;
  P.kv_heads = Hkv;
  P.head_dim = D;
  P.window_left = static_cast<int32_t>(window_left);
  P.soft_cap = static_cast<float>(logits_soft_cap);
  P.scale = softmax_scale.has_value() ? static_cast<float>(*softmax_scale) : 1.0f / std::sqrt(static_cast<float>(D));
  P.error_flags = error_flags_pointer(op, error_flags, device);
  return P;
}

// The message for request b's AttentionError bits (CPU kernel: raised before anything is written).
inline std::string attention_error_message(int32_t bits, int64_t b) {
  return "verify_attention: request " + std::to_string(b) + ": " + describe_error_bits(bits, kAttentionErrorBits);
}

}  // namespace specdec
