// verify_attention (docs/design.md §3.2, §3.4): parameters shared by the backends. Query i of request b sits at
// position length_b + i and sees cache positions [0, length_b) and the new token j (at position length_b + j)
// where mask[i][j]; the default mask is causal (j <= i). With window_left >= 0 it also sees only keys at
// positions >= length_b + i - window_left (FlashInfer's sliding window).
//
// Layouts (every backend addresses the cache through attention_cache_row):
//   q / out: padded [B, Q, Hq, D] (request b owns rows b*Q .. b*Q + Q) or flat [T, Hq, D] with qo_indptr
//            (request b owns rows qo_indptr[b] .. qo_indptr[b+1], possibly none); k_new / v_new likewise.
//   cache:   contiguous [B, S, H, D] (NHD) / [B, H, S, D] (HND), or paged [pages, page_size, H, D] /
//            [pages, H, page_size, D] with any page stride, through block_table [B, max_pages] or FlashInfer's
//            CSR table (kv_indptr [B+1], kv_indices [nnz], kv_last_page_len [B]). In the CSR form the table
//            lists the request's whole KV, new tokens included: length_b = kv_len_b - Q_b, where
//            kv_len_b = (pages_b - 1) * page_size + kv_last_page_len[b] (0 without pages).
#pragma once
#include <stdint.h>

#include "sampling_math.h"

namespace specdec {

constexpr int kMaxVerifyQueries = 128;  // new tokens per request (Q_b)
constexpr int kMaxHeadDim = 256;

struct AttentionParams {
  const void* q;              // [B, Q, Hq, D] or [T, Hq, D]
  void* k_cache;              // see the layouts above
  void* v_cache;
  const int32_t* cache_seqlens;  // [B], or nullptr in the CSR form
  const void* k_new;          // [B, Q, Hkv, D] / [T, Hkv, D], or nullptr (new tokens already in the cache)
  const void* v_new;
  const int32_t* block_table; // [B, max_pages] or nullptr
  const int32_t* qo_indptr;   // [B+1] or nullptr (padded q)
  const int32_t* kv_indptr;   // [B+1] or nullptr (no CSR table)
  const int32_t* kv_indices;  // [num_indices]
  const int32_t* kv_last_page_len;  // [B]
  const bool* tree_mask;      // [Q, Q], [B, Q, Q], flat (qo_indptr: request b's [Q_b, Q_b] at sum_{c<b} Q_c^2), or nullptr
  bool mask_per_request;
  int64_t mask_numel;
  void* out;                  // like q, dtype of q
  float* lse;                 // [B, Q, Hq] / [T, Hq], or nullptr when not asked for
  // num_queries: Q of the padded form; with qo_indptr, the most rows a request can own (min(T, kMaxVerifyQueries)),
  // which sizes the grid. total_queries: the rows of q (B * Q, or T).
  int64_t batch, num_queries, total_queries, q_heads, kv_heads, head_dim;
  // Element strides of the cache: page (request b of a contiguous cache), slot (position in the page, or in
  // the request), head. The last dimension is contiguous.
  int64_t stride_page, stride_slot, stride_head;
  int64_t page_size, num_pages, max_pages, num_indices, capacity;  // capacity: positions of a contiguous / block-table request
  int32_t page_shift;         // log2(page_size) when it is a power of two (the usual case), else -1
  int32_t window_left;        // -1: no sliding window
  float scale;
  float soft_cap;             // 0: off; else scores s -> soft_cap * tanh(s / soft_cap) (scaled scores)
  // A request's keys are cut at the multiples of its split size C (attention_split_size): keys [s * C, (s + 1) * C)
  // are one work item (CPU) or block (CUDA); a request with several splits gets normalised partial outputs and
  // their lse, merged in split order. C is split_keys when > 0 (the CPU's fixed size, or a test's), else a function
  // of the request's cached length alone, so that its output bits depend neither on the other requests of the batch
  // nor on its number of new tokens. num_splits: the grid's (CUDA), the most any request can have.
  int64_t num_splits, split_keys, row_tiles;
  float* partial_out;         // [num_splits, total_queries, Hq, D]
  float* partial_lse;         // [num_splits, total_queries, Hq]
  int32_t* error_flags;       // [1] or nullptr: AttentionError bits of invalid requests
};

enum AttentionError : int32_t {
  kAttentionBadLength = 1,     // cache_seqlens[b] < 0 or the block runs past the cache (CSR: fewer keys than Q_b)
  kAttentionBadPage = 2,       // block_table / kv_indices points outside the paged cache
  kAttentionBadQoIndptr = 4,   // qo_indptr decreasing, negative, past T, or Q_b > kMaxVerifyQueries
  kAttentionBadKvIndptr = 8,   // kv_indptr decreasing, negative or past kv_indices; kv_last_page_len out of range
  kAttentionBadMask = 16,      // the flat tree_mask is shorter than sum Q_b^2
  kAttentionPageAlias = 32,    // a page the new tokens go to appears twice among the pages the request touches
};

constexpr int64_t kAttnSplitAlign = 64;  // split boundaries fall on whole key tiles of every backend

// One request's view of the parameters, read once per block / work item. An invalid request has `errors` set
// and no keys; with kAttentionBadQoIndptr it has no rows either (its rows are unknown, so nothing is written).
struct AttentionRequest {
  int64_t q_begin;      // first row of q / out / k_new
  int64_t queries;      // Q_b
  int64_t length;       // tokens in the cache before the block
  int64_t key_begin;    // keys [key_begin, key_end) are attended: the sliding window's start, split-aligned
  int64_t key_end;      // length + Q_b, or 0 when invalid
  int64_t pages_begin;  // CSR: the request's first entry of kv_indices
  int64_t mask_offset, mask_stride;
  int32_t errors;
};

// Reads and checks request b's entries only (qo_indptr[b..b+1], kv_indptr[b..b+1], ...; the flat mask's
// offset sums the Q_c^2 of the requests before it), so that every read of q, k_new, out and the cache is in bounds.
SPECDEC_HD AttentionRequest attention_request(const AttentionParams& P, int64_t b) {
  AttentionRequest R{};
  if (P.qo_indptr != nullptr) {
    const int64_t a = P.qo_indptr[b], e = P.qo_indptr[b + 1];
    if (a >= 0 && a <= e && e <= P.total_queries && e - a <= kMaxVerifyQueries) {
      R.q_begin = a;
      R.queries = e - a;
    } else {
      R.errors |= kAttentionBadQoIndptr;
    }
  } else {
    R.q_begin = b * P.num_queries;
    R.queries = P.num_queries;
  }
  int64_t capacity = P.capacity;
  if (P.kv_indptr != nullptr) {
    const int64_t p0 = P.kv_indptr[b], p1 = P.kv_indptr[b + 1], last = P.kv_last_page_len[b];
    const int64_t pages = p1 - p0;
    if (p0 >= 0 && p0 <= p1 && p1 <= P.num_indices &&
        (pages == 0 ? last == 0 : last >= 1 && last <= P.page_size)) {
      R.pages_begin = p0;
      capacity = pages * P.page_size;
      R.length = (pages == 0 ? 0 : (pages - 1) * P.page_size + last) - R.queries;
    } else {
      R.errors |= kAttentionBadKvIndptr;
    }
  } else {
    R.length = P.cache_seqlens[b];
  }
  if (!(R.errors & kAttentionBadKvIndptr) && (R.length < 0 || R.length > capacity - R.queries)) {
    R.errors |= kAttentionBadLength;
  }
  R.mask_stride = P.num_queries;
  if (P.tree_mask != nullptr && P.qo_indptr != nullptr) {
    int64_t offset = 0;
    for (int64_t c = 0; c < b; ++c) {
      const int64_t n = int64_t{P.qo_indptr[c + 1]} - P.qo_indptr[c];
      offset += n * n;
    }
    R.mask_offset = offset;
    R.mask_stride = R.queries;
    if (offset < 0 || offset > P.mask_numel - R.queries * R.queries) R.errors |= kAttentionBadMask;
  } else if (P.mask_per_request) {
    R.mask_offset = b * P.num_queries * P.num_queries;
  }
  if (R.errors == 0) {
    R.key_end = R.length + R.queries;
    // Keys before every row's window are skipped, from a split-aligned start so that tiles stay whole.
    const int64_t first = P.window_left >= 0 ? R.length - P.window_left : 0;
    R.key_begin = first > 0 ? first / kAttnSplitAlign * kAttnSplitAlign : 0;
  }
  return R;
}

// Element offset of head 0 of the row (b, pos) in the cache, or -1 if its page is outside the cache. pos must
// be within the request's capacity (attention_request checked it).
// The page request b lists at `index` of its table (paged layouts only).
SPECDEC_HD int64_t attention_page(const AttentionParams& P, const AttentionRequest& R, int64_t b, int64_t index) {
  return P.kv_indices != nullptr ? P.kv_indices[R.pages_begin + index] : P.block_table[b * P.max_pages + index];
}

SPECDEC_HD int64_t attention_cache_row(const AttentionParams& P, const AttentionRequest& R, int64_t b, int64_t pos) {
  if (P.block_table == nullptr && P.kv_indices == nullptr) return b * P.stride_page + pos * P.stride_slot;
  // A shift and a mask rather than a 64-bit division: the kernels address every row through here.
  const int64_t index = P.page_shift >= 0 ? pos >> P.page_shift : pos / P.page_size;
  const int64_t slot = P.page_shift >= 0 ? pos & (P.page_size - 1) : pos % P.page_size;
  const int64_t page = attention_page(P, R, b, index);
  if (page < 0 || page >= P.num_pages) return -1;
  return page * P.stride_page + slot * P.stride_slot;
}

// The table indices of the pages request b touches, [first, last]: those of its keys [key_begin, key_end).
SPECDEC_HD void attention_touched_pages(const AttentionParams& P, const AttentionRequest& R, int64_t* first,
                                        int64_t* last) {
  *first = R.key_begin / P.page_size;
  *last = R.key_end > R.key_begin ? (R.key_end - 1) / P.page_size : *first - 1;
}

// Whether the page at table index j (one the request touches) is also listed at another index i that the new tokens
// [length, length + Q_b) are written to: the appends and the reads of that page would then race, and backends that
// read the new keys from k_new (CUDA) or from the cache after appending (CPU) would disagree. A caller's error,
// refused on the CPU and in strict mode (paged layouts with k_new). Costs O(pages written) table reads.
SPECDEC_HD bool attention_page_aliases_written(const AttentionParams& P, const AttentionRequest& R, int64_t b,
                                               int64_t j) {
  const int64_t page = attention_page(P, R, b, j);
  const int64_t w0 = R.length / P.page_size, w1 = (R.length + R.queries - 1) / P.page_size;
  for (int64_t i = w0; i <= w1; ++i) {
    if (i != j && attention_page(P, R, b, i) == page) return true;
  }
  return false;
}

// The split size of the CUDA kernel for a request with `length` cached tokens: kAttnMinSplitKeys keys, doubled until
// the request's keys with the most new tokens a call can add (length + kMaxVerifyQueries) fill at most
// kAttnMaxSplits splits. Short requests get many small splits (so that a small batch still fills the SMs), long ones
// at most 32 (which bounds the merge's traffic and workspace). A function of the cached length only: a row's splits,
// hence its bits, are the same whatever the batch and however many new tokens its request verifies; between calls at
// different lengths they change only where the size doubles (past lengths 8064, 16256, 32640, ...).
constexpr int64_t kAttnMinSplitKeys = 256;
constexpr int64_t kAttnMaxSplits = 32;
SPECDEC_HD int64_t attention_length_split_keys(int64_t length) {
  int64_t keys = kAttnMinSplitKeys;
  while ((length + kMaxVerifyQueries + keys - 1) / keys > kAttnMaxSplits) keys *= 2;
  return keys;
}
// Request R's split size C: P.split_keys when set, else attention_length_split_keys of its cached length.
SPECDEC_HD int64_t attention_split_size(const AttentionParams& P, const AttentionRequest& R) {
  return P.split_keys > 0 ? P.split_keys : attention_length_split_keys(R.length);
}

// Request b's KV splits: the multiples of C its keys [key_begin, key_end) straddle, at least one (an invalid
// request's NaN output is written by its first split).
SPECDEC_HD int64_t attention_request_splits(const AttentionParams& P, const AttentionRequest& R) {
  const int64_t c = attention_split_size(P, R);
  return R.key_end > R.key_begin ? (R.key_end - 1) / c - R.key_begin / c + 1 : 1;
}

// Keys [*begin, *end) of split `split` of request b: its keys within [(first + split) * C, (first + split + 1) * C),
// first = key_begin / C. Every split below the count is non-empty, and a split's keys sit at absolute positions, so
// that a row sees the same splits whichever new tokens follow it.
SPECDEC_HD void attention_split_keys(const AttentionParams& P, const AttentionRequest& R, int64_t split, int64_t* begin,
                                     int64_t* end) {
  const int64_t c = attention_split_size(P, R), k0 = (R.key_begin / c + split) * c;
  *begin = k0 > R.key_begin ? k0 : R.key_begin;
  *end = k0 + c < R.key_end ? k0 + c : R.key_end;
}

// Whether query i of the request sees the key at position pos (pos < key_end): the mask for the new tokens,
// the sliding window for every key. tree_sees(j): whether the tree mask lets query i see new token j (read from
// tree_mask, or from a copy of its row a kernel keeps).
template <typename TreeSees>
SPECDEC_HD bool attention_visible_with(const AttentionParams& P, const AttentionRequest& R, int64_t i, int64_t pos,
                                       TreeSees&& tree_sees) {
  if (P.window_left >= 0 && pos < R.length + i - P.window_left) return false;
  if (pos < R.length) return true;
  const int64_t j = pos - R.length;
  if (P.tree_mask == nullptr) return j <= i;
  return tree_sees(j);
}
SPECDEC_HD bool attention_visible(const AttentionParams& P, const AttentionRequest& R, int64_t i, int64_t pos) {
  return attention_visible_with(P, R, i, pos, [&](int64_t j) { return P.tree_mask[R.mask_offset + i * R.mask_stride + j]; });
}

// Whether any query of the request can be masked at keys [p0, p1): the block's new tokens or the window.
SPECDEC_HD bool attention_tile_masked(const AttentionParams& P, const AttentionRequest& R, int64_t p0, int64_t p1) {
  return p1 > R.length || (P.window_left >= 0 && p0 < R.length + R.queries - 1 - P.window_left);
}

// The soft cap of a scaled score (Gemma 2, FlashInfer's logits_soft_cap): cap * tanh(s / cap).
SPECDEC_HD float attention_soft_cap(float score, float cap) { return cap * tanhf(score / cap); }

}  // namespace specdec
