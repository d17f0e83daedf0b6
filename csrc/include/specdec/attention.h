// verify_attention (DESIGN.md §3.2): parameters shared by the backends. Query i of request b sees cache
// positions [0, cache_seqlens[b]) and the new token j (at position cache_seqlens[b] + j) where
// mask[i][j]; the default mask is causal (j <= i).
#pragma once
#include <stdint.h>

#include "sampling_math.h"

namespace specdec {

constexpr int kMaxVerifyQueries = 64;
constexpr int kMaxHeadDim = 256;

struct AttentionParams {
  const void* q;              // [B, Q, Hq, D]
  void* k_cache;              // contiguous [B, S_max, Hkv, D] or paged [num_pages, page_size, Hkv, D]
  void* v_cache;
  const int32_t* cache_seqlens;
  const void* k_new;          // [B, Q, Hkv, D] or nullptr (new tokens already in the cache)
  const void* v_new;
  const int32_t* block_table; // [B, max_pages] or nullptr
  const bool* tree_mask;      // [Q, Q] or [B, Q, Q] or nullptr (causal)
  bool mask_per_request;
  void* out;                  // [B, Q, Hq, D], dtype of q
  float* lse;                 // [B, Q, Hq], or nullptr when not asked for
  int64_t batch, num_queries, q_heads, kv_heads, head_dim;
  int64_t cache_stride_b, cache_stride_s;  // elements (contiguous layout)
  int64_t page_size, num_pages, max_pages, capacity;
  int32_t page_shift;         // log2(page_size) when it is a power of two (the usual case), else -1
  float scale;
  // Keys [split * split_keys, (split + 1) * split_keys) of a request are one work item (CPU) or block (CUDA);
  // a request with several splits gets normalised partial outputs and their lse, merged in split order.
  // The split count of a request depends on its own length only (attention_request_splits), so its output
  // bits do not depend on the other requests of the batch. num_splits: the grid's (CUDA), the most any
  // request can have.
  int64_t num_splits, split_keys, row_tiles;
  float* partial_out;         // [num_splits, B, Q, Hq, D]
  float* partial_lse;         // [num_splits, B, Q, Hq]
  int32_t* error_flags;       // [1] or nullptr: AttentionError bits of invalid requests
};

enum AttentionError : int32_t {
  kAttentionBadLength = 1,  // cache_seqlens[b] < 0 or the block runs past the cache
  kAttentionBadPage = 2,    // block_table points outside the paged cache
};

// Element offset of the row (b, position) in the cache, or -1 if its page is outside the cache.
SPECDEC_HD int64_t attention_cache_row(const AttentionParams& P, int64_t b, int64_t pos) {
  if (P.block_table == nullptr) return b * P.cache_stride_b + pos * P.cache_stride_s;
  // A shift and a mask rather than a 64-bit division: the kernels address every row through here.
  const int64_t index = P.page_shift >= 0 ? pos >> P.page_shift : pos / P.page_size;
  const int64_t slot = P.page_shift >= 0 ? pos & (P.page_size - 1) : pos % P.page_size;
  const int64_t page = P.block_table[b * P.max_pages + index];
  if (page < 0 || page >= P.num_pages) return -1;
  return (page * P.page_size + slot) * P.kv_heads * P.head_dim;
}

// The keys request b attends to, cache_seqlens[b] + Q, or 0 if its block does not fit its cache.
SPECDEC_HD int64_t attention_request_keys(const AttentionParams& P, int64_t b) {
  const int64_t length = P.cache_seqlens[b];
  return length >= 0 && length <= P.capacity - P.num_queries ? length + P.num_queries : 0;
}

// Request b's KV splits: one per split_keys keys, at least one (an invalid request's NaN output is written by
// its first split).
SPECDEC_HD int64_t attention_request_splits(const AttentionParams& P, int64_t b) {
  const int64_t keys = attention_request_keys(P, b);
  return keys > P.split_keys ? (keys + P.split_keys - 1) / P.split_keys : 1;
}

constexpr int64_t kAttnSplitAlign = 64;  // split boundaries fall on whole key tiles of every backend

// Keys [*begin, *end) of split `split` of request b: the request's keys cut into attention_request_splits
// near-equal runs (whole tiles of kAttnSplitAlign keys, at most split_keys, a multiple of it, each), so that
// no split is a sliver; every split below the count is non-empty. A function of the request's length only.
SPECDEC_HD void attention_split_keys(const AttentionParams& P, int64_t b, int64_t split, int64_t* begin, int64_t* end) {
  const int64_t keys = attention_request_keys(P, b), splits = attention_request_splits(P, b);
  const int64_t even = (keys + splits - 1) / splits;
  const int64_t per = (even + kAttnSplitAlign - 1) / kAttnSplitAlign * kAttnSplitAlign;
  const int64_t k0 = split * per;
  *begin = k0 < keys ? k0 : keys;
  *end = k0 + per < keys ? k0 + per : keys;
}

SPECDEC_HD bool attention_visible(const AttentionParams& P, int64_t b, int64_t i, int64_t j) {
  if (P.tree_mask == nullptr) return j <= i;
  const int64_t Q = P.num_queries;
  return P.tree_mask[(P.mask_per_request ? b * Q * Q : 0) + i * Q + j];
}

}  // namespace specdec
