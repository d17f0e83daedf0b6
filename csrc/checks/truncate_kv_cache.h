// The argument checks and error bits of truncate_kv_cache (cpu/truncate_kv_cache.cpp, cuda/truncate_kv_cache.cu).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <tuple>

#include "checks/common.h"
#include "specdec/kv_cache.h"

namespace specdec {

inline TruncateParams make_truncate_params(const at::Tensor& cache_seqlens, const at::Tensor& num_kept,
                                           const std::optional<at::Tensor>& kept_indices, at::TensorList k_caches,
                                           at::TensorList v_caches, const std::optional<at::Tensor>& block_table,
                                           std::optional<int64_t> block_len, bool clear,
                                           const std::optional<at::Tensor>& error_flags,
                                           const std::optional<at::Tensor>& kv_indptr,
                                           const std::optional<at::Tensor>& kv_indices, c10::string_view kv_layout) {
  const char* op = "truncate_kv_cache";
  const bool hnd = kv_layout_is_hnd(op, kv_layout);
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.scalar_type() == at::kInt && cache_seqlens.is_contiguous(), op,
                    ": cache_seqlens must be a contiguous [B] int32 tensor, got ", cache_seqlens.sizes(), " ",
                    cache_seqlens.scalar_type());
  const int64_t B = cache_seqlens.size(0);
  const auto device = cache_seqlens.device();
  auto same_device = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but cache_seqlens is on ", device);
  };
  TORCH_CHECK_VALUE(num_kept.dim() == 1 && num_kept.size(0) == B && num_kept.scalar_type() == at::kInt &&
                        num_kept.is_contiguous(),
                    op, ": num_kept must be a contiguous [B] = [", B, "] int32 tensor, got ", num_kept.sizes(), " ",
                    num_kept.scalar_type());
  same_device(num_kept, "num_kept");
  TORCH_CHECK_VALUE(!block_len.has_value() || (*block_len >= 1 && *block_len <= kMaxBlockLen), op,
                    ": block_len must be in [1, ", kMaxBlockLen, "], got ", block_len.value_or(0));
  TORCH_CHECK_VALUE(block_len.has_value() || (!kept_indices.has_value() && !clear), op,
                    ": block_len is needed with kept_indices or clear");
  TruncateParams P{};
  P.cache_seqlens = cache_seqlens.data_ptr<int32_t>();
  P.num_kept = num_kept.data_ptr<int32_t>();
  P.batch = B;
  P.block_len = block_len.value_or(0);  // 0: lengths only, no block given
  P.clear = clear;
  P.capacity = INT64_MAX / 2;
  P.page_size = 1;
  if (kept_indices.has_value()) {
    const at::Tensor& t = *kept_indices;
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == B && t.size(1) == P.block_len && t.scalar_type() == at::kInt &&
                          t.is_contiguous(),
                      op, ": kept_indices must be a contiguous [B, block_len] = [", B, ", ", P.block_len,
                      "] int32 tensor, got ", t.sizes(), " ", t.scalar_type());
    same_device(t, "kept_indices");
    P.kept_indices = t.data_ptr<int32_t>();
  }
  TORCH_CHECK_VALUE(k_caches.size() == v_caches.size(), op, ": k_caches and v_caches must list the same number of layers, got ",
                    k_caches.size(), " and ", v_caches.size());
  TORCH_CHECK_VALUE(!k_caches.empty() || (!kept_indices.has_value() && !clear), op,
                    ": k_caches and v_caches are needed with kept_indices or clear");
  TORCH_CHECK_VALUE(static_cast<int64_t>(k_caches.size()) <= kMaxCacheLayers, op, ": at most ", kMaxCacheLayers,
                    " layers, got ", k_caches.size());
  P.layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK_VALUE(!(block_table.has_value() && kv_indptr.has_value()), op,
                    ": give block_table or the CSR table (kv_indptr, kv_indices), not both");
  TORCH_CHECK_VALUE(kv_indptr.has_value() == kv_indices.has_value(), op, ": kv_indptr and kv_indices go together");
  const bool paged = block_table.has_value() || kv_indptr.has_value();
  if (block_table.has_value()) {
    const at::Tensor& t = *block_table;
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == B && t.scalar_type() == at::kInt && t.is_contiguous(), op,
                      ": block_table must be a contiguous [B, max_pages] int32 tensor, got ", t.sizes(), " ",
                      t.scalar_type());
    same_device(t, "block_table");
    P.block_table = t.data_ptr<int32_t>();
    P.max_pages = t.size(1);
  }
  if (kv_indptr.has_value()) {
    for (const auto& [t, name, n] : {std::tuple{&*kv_indptr, "kv_indptr", B + 1}, std::tuple{&*kv_indices, "kv_indices", int64_t{-1}}}) {
      TORCH_CHECK_VALUE(t->dim() == 1 && (n < 0 || t->size(0) == n) && t->scalar_type() == at::kInt && t->is_contiguous(),
                        op, ": ", name, " must be a contiguous 1-D int32 tensor", n >= 0 ? " of B+1 entries" : "", ", got ",
                        t->sizes(), " ", t->scalar_type());
      same_device(*t, name);
    }
    P.kv_indptr = kv_indptr->data_ptr<int32_t>();
    P.kv_indices = kv_indices->data_ptr<int32_t>();
    P.num_indices = kv_indices->size(0);
  }
  // The cache dims: [page or request, slot, head, D] (NHD) or [page or request, head, slot, D] (HND).
  const int slot_dim = hnd ? 2 : 1, head_dim = hnd ? 1 : 2;
  for (int64_t l = 0; l < P.layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& c = kv == 0 ? k_caches[l] : v_caches[l];
      const char* name = kv == 0 ? "k_caches" : "v_caches";
      const at::Tensor& first = k_caches[0];
      TORCH_CHECK_VALUE(c.dim() == 4, op, ": ", name, "[", l, "] must be ",
                        hnd ? "[B, Hkv, S_max, D] or [num_pages, Hkv, page_size, D]"
                            : "[B, S_max, Hkv, D] or [num_pages, page_size, Hkv, D]",
                        " (kv_layout \"", std::string(kv_layout), "\"), got ", c.sizes());
      TORCH_CHECK_VALUE(c.sizes() == first.sizes() && c.strides() == first.strides() && c.scalar_type() == first.scalar_type(),
                        op, ": every layer of k_caches and v_caches must have the shape, strides and dtype of k_caches[0]");
      same_device(c, name);
      const int64_t elem = c.element_size();
      if (hnd) {
        TORCH_CHECK_VALUE(c.stride(3) == 1 && (c.size(3) * elem) % 4 == 0, op, ": ", name, "[", l,
                          "]: each head's D values must be contiguous and a multiple of 4 bytes");
      } else {
        TORCH_CHECK_VALUE(c.stride(3) == 1 && c.stride(2) == c.size(3) && (c.size(2) * c.size(3) * elem) % 4 == 0, op, ": ",
                          name, "[", l, "]: each token's [Hkv, D] values must be contiguous and a multiple of 4 bytes");
      }
      if (paged) {  // any page stride; each page dense
        TORCH_CHECK_VALUE(c.stride(2) == c.size(3) && c.stride(1) == c.size(2) * c.size(3), op, ": ", name, "[", l,
                          "]: each page of a paged cache must be dense (any page stride), got strides ", c.strides());
      } else {
        TORCH_CHECK_VALUE(c.size(0) >= B, op, ": ", name, "[", l, "] holds ", c.size(0), " requests, cache_seqlens ", B);
      }
      TORCH_CHECK_VALUE((c.stride(0) * elem) % 4 == 0 && (c.stride(1) * elem) % 4 == 0 && (c.stride(2) * elem) % 4 == 0,
                        op, ": ", name, " strides must be multiples of 4 bytes");
      (kv == 0 ? P.k : P.v)[l] = c.data_ptr();
    }
  }
  if (P.layers > 0) {
    const at::Tensor& c = k_caches[0];
    const int64_t elem = c.element_size();
    const int64_t H = c.size(head_dim), D = c.size(3);
    P.stride_page = c.stride(0) * elem / 4;
    P.stride_slot = c.stride(slot_dim) * elem / 4;
    if (!hnd) {  // a token's [Hkv, D] is one run
      P.segments = 1;
      P.segment_words = H * D * elem / 4;
    } else {
      P.segments = H;
      P.segment_words = D * elem / 4;
      P.stride_segment = c.stride(head_dim) * elem / 4;
    }
    if (paged) {
      P.page_size = c.size(slot_dim);
      P.num_pages = c.size(0);
      TORCH_CHECK_VALUE(P.page_size >= 1, op, ": a paged cache needs page_size >= 1");
      if (block_table.has_value()) P.capacity = P.max_pages * P.page_size;  // CSR: per request
    } else {
      P.capacity = c.size(slot_dim);
    }
  } else if (paged) {
    P.page_size = 1;  // lengths only: the table is not read
    P.block_table = nullptr;
    P.kv_indptr = nullptr;
    P.kv_indices = nullptr;
  }
  P.error_flags = error_flags_pointer(op, error_flags, device);
  return P;
}

inline constexpr ErrorBit kTruncateErrorBits[] = {
    {kErrNumKept, "num_kept must be in [0, block_len] (>= 0 without block_len)"},
    {kErrKeptIndices, "kept_indices must increase within [0, block_len) for the first num_kept entries"},
    {kErrBlockRange,
     "the slots it touches run outside the cache or past 2^31 - 1 ([cache_seqlens, cache_seqlens + block_len) with "
     "kept_indices or clear, else [cache_seqlens, cache_seqlens + num_kept))"},
    {kErrPageIndex, "block_table points outside the paged cache for the slots it touches (kv_indices with the CSR table)"},
    {kErrKvIndptr, "kv_indptr must start at >= 0, not decrease and end <= len(kv_indices)"},
    {kErrPageAlias, "block_table (kv_indices with the CSR table) lists a page of the block twice within one request"},
};

inline std::string truncate_error_message(int32_t bits, int64_t b) {
  return "truncate_kv_cache: request " + std::to_string(b) + ": " + describe_error_bits(bits, kTruncateErrorBits);
}

}  // namespace specdec
