// KV-cache truncation after verification (docs/design.md §3.3, §3.4): the parameters shared by the CPU kernel and
// the CUDA kernel. A cache row is one token's Hkv x D values of one layer: one run of words (NHD), or Hkv runs
// of D values head_stride apart (HND). Rows are addressed contiguously ([B, S_max, H, D] / [B, H, S_max, D]:
// request b, position s), through a block table ([num_pages, page_size, H, D] / [num_pages, H, page_size, D]
// and block_table[b, s / page_size]) or through FlashInfer's CSR table (kv_indices[kv_indptr[b] + s / page_size]);
// pages may have any stride.
#pragma once
#include <stdint.h>

#include "attention.h"
#include "sampling_math.h"

namespace specdec {

constexpr int kMaxCacheLayers = 128;  // layer pointers travel in the kernel parameters: no copy, graph-safe
constexpr int kMaxBlockLen = kMaxVerifyQueries;  // the block verify_attention wrote

enum TruncateError : int32_t {
  kErrNumKept = 1,       // num_kept[b] outside [0, block_len]
  kErrKeptIndices = 2,   // kept_indices not increasing in [0, block_len)
  kErrBlockRange = 4,    // the slots touched run outside the cache, a negative length, or a length past 2^31 - 1
  kErrPageIndex = 8,     // a page of the slots touched outside [0, num_pages)
  kErrKvIndptr = 16,     // kv_indptr[b..b+1] decreasing, negative or past kv_indices
  kErrPageAlias = 32,    // a page of the slots touched listed twice: moves within the request would race
};

struct TruncateParams {
  int32_t* cache_seqlens;         // [B], advanced by num_kept (a separate launch on CUDA)
  const int32_t* num_kept;        // [B]
  const int32_t* kept_indices;    // [B, block_len] or nullptr (chain: keep the first num_kept)
  const int32_t* block_table;     // [B, max_pages] or nullptr (contiguous or CSR)
  const int32_t* kv_indptr;       // [B+1] or nullptr: the CSR page table
  const int32_t* kv_indices;      // [num_indices]
  void* k[kMaxCacheLayers];
  void* v[kMaxCacheLayers];
  int32_t* error_flags;           // [1] or nullptr
  int64_t batch, layers, block_len;  // block_len 0: not given (lengths only)
  int64_t segments, segment_words;  // a row is `segments` runs of segment_words 4-byte words (1 run for NHD)
  int64_t stride_page, stride_slot, stride_segment;  // words between pages (requests) / positions / runs
  int64_t capacity;               // positions a request can hold (S_max, or max_pages * page_size; CSR: per request)
  int64_t page_size, num_pages, max_pages, num_indices;
  bool clear;
};

// Request b's first entry of kv_indices and its pages (CSR), or -1 if kv_indptr[b..b+1] is inconsistent.
SPECDEC_HD int64_t truncate_csr_pages(const TruncateParams& P, int64_t b, int64_t* first) {
  const int64_t p0 = P.kv_indptr[b], p1 = P.kv_indptr[b + 1];
  *first = p0;
  return p0 >= 0 && p0 <= p1 && p1 <= P.num_indices ? p1 - p0 : -1;
}

// Word offset of the first run of row (b, pos), or -1 if the page table points outside the cache. pos is within
// the request's capacity (check_truncate_request).
// The page request b lists at `index` of its table (paged layouts only).
SPECDEC_HD int64_t table_page(const TruncateParams& P, int64_t b, int64_t index) {
  return P.kv_indptr != nullptr ? P.kv_indices[P.kv_indptr[b] + index] : P.block_table[b * P.max_pages + index];
}

SPECDEC_HD int64_t cache_row(const TruncateParams& P, int64_t b, int64_t pos) {
  if (P.block_table == nullptr && P.kv_indptr == nullptr) return b * P.stride_page + pos * P.stride_slot;
  const int64_t page = table_page(P, b, pos / P.page_size);
  if (page < 0 || page >= P.num_pages) return -1;
  return page * P.stride_page + pos % P.page_size * P.stride_slot;
}

// Checks request b; returns its error bits (0 = valid). Reads only request b's entries. The slots it
// touches are the block [base, base + block_len) when rows move or are cleared, else the kept tokens
// [base, base + num_kept): a lengths-only truncation near the end of the cache is valid. block_len 0 means
// none was given (lengths only): num_kept is then bounded by the cache alone.
SPECDEC_HD int32_t check_truncate_request(const TruncateParams& P, int64_t b) {
  const int64_t base = P.cache_seqlens[b], n = P.num_kept[b];
  if (n < 0 || (P.block_len > 0 && n > P.block_len)) return kErrNumKept;
  int64_t capacity = P.capacity;
  if (P.kv_indptr != nullptr) {
    int64_t first;
    const int64_t pages = truncate_csr_pages(P, b, &first);
    if (pages < 0) return kErrKvIndptr;
    capacity = pages * P.page_size;
  }
  const bool moves = P.kept_indices != nullptr || P.clear;
  const int64_t end = base + (moves ? P.block_len : n);
  if (base < 0 || end > capacity || base + n > INT32_MAX) return kErrBlockRange;
  if (P.kept_indices != nullptr) {
    int32_t previous = -1;
    for (int32_t j = 0; j < n; ++j) {
      const int32_t idx = P.kept_indices[b * P.block_len + j];
      if (idx <= previous || idx >= P.block_len) return kErrKeptIndices;
      previous = idx;
    }
  }
  if (P.block_table != nullptr || P.kv_indptr != nullptr) {
    for (int64_t pos = base; pos < end; pos += P.page_size - (pos % P.page_size)) {
      if (cache_row(P, b, pos) < 0) return kErrPageIndex;
    }
    // The pages touched are distinct (at most block_len of them, so the pairwise scan stays small): a page listed
    // twice would make a move's source and destination one row on some backends and two on others.
    if (end > base) {
      const int64_t first = base / P.page_size, last = (end - 1) / P.page_size;
      for (int64_t i = first + 1; i <= last; ++i) {
        for (int64_t j = first; j < i; ++j) {
          if (table_page(P, b, i) == table_page(P, b, j)) return kErrPageAlias;
        }
      }
    }
  }
  return 0;
}

// Copies row `from` to row `to` (word offsets from cache_row), run by run; `lane` of `lanes` threads.
SPECDEC_HD void copy_cache_row(const TruncateParams& P, uint32_t* cache, int64_t to, int64_t from, int64_t lane,
                               int64_t lanes) {
  for (int64_t w = lane; w < P.segments * P.segment_words; w += lanes) {
    const int64_t at = w / P.segment_words * P.stride_segment + w % P.segment_words;
    cache[to + at] = cache[from + at];
  }
}

// Zeroes row `to`; `lane` of `lanes` threads.
SPECDEC_HD void clear_cache_row(const TruncateParams& P, uint32_t* cache, int64_t to, int64_t lane, int64_t lanes) {
  for (int64_t w = lane; w < P.segments * P.segment_words; w += lanes) {
    cache[to + w / P.segment_words * P.stride_segment + w % P.segment_words] = 0u;
  }
}

}  // namespace specdec
