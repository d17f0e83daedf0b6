// KV-cache truncation after verification (DESIGN.md §3.3): the parameters shared by the CPU kernel and the
// CUDA kernel. A cache row is one token's Hkv x D values of one layer, contiguous; rows are addressed
// either contiguously ([B, S_max, Hkv, D]: request b, position s) or through a page table
// ([num_pages, page_size, Hkv, D] and block_table[b, s / page_size]).
#pragma once
#include <stdint.h>

#include "sampling_math.h"

namespace specdec {

constexpr int kMaxCacheLayers = 128;  // layer pointers travel in the kernel parameters: no copy, graph-safe
constexpr int kMaxBlockLen = 64;

enum TruncateError : int32_t {
  kErrNumKept = 1,       // num_kept[b] outside [0, block_len]
  kErrKeptIndices = 2,   // kept_indices not increasing in [0, block_len)
  kErrBlockRange = 4,    // the slots touched run outside the cache, a negative length, or a length past 2^31 - 1
  kErrPageIndex = 8,     // a page of the slots touched outside [0, num_pages)
};

struct TruncateParams {
  int32_t* cache_seqlens;         // [B], advanced by num_kept (a separate launch on CUDA)
  const int32_t* num_kept;        // [B]
  const int32_t* kept_indices;    // [B, block_len] or nullptr (chain: keep the first num_kept)
  const int32_t* block_table;     // [B, max_pages] or nullptr (contiguous)
  void* k[kMaxCacheLayers];
  void* v[kMaxCacheLayers];
  int32_t* error_flags;           // [1] or nullptr
  int64_t batch, layers, block_len;  // block_len 0: not given (lengths only)
  int64_t row_words;              // 4-byte words per row
  int64_t stride_b, stride_s;     // contiguous: words between requests / positions
  int64_t capacity;               // positions a request can hold (S_max, or max_pages * page_size)
  int64_t page_size, num_pages, max_pages;
  bool clear;
};

// Word offset of row (b, pos), or -1 if the page table points outside the cache.
SPECDEC_HD int64_t cache_row(const TruncateParams& P, int64_t b, int64_t pos) {
  if (P.block_table == nullptr) return b * P.stride_b + pos * P.stride_s;
  const int64_t page = P.block_table[b * P.max_pages + pos / P.page_size];
  if (page < 0 || page >= P.num_pages) return -1;
  return (page * P.page_size + pos % P.page_size) * P.row_words;
}

// Checks request b; returns its error bits (0 = valid). Reads only request b's entries. The slots it
// touches are the block [base, base + block_len) when rows move or are cleared, else the kept tokens
// [base, base + num_kept): a lengths-only truncation near the end of the cache is valid. block_len 0 means
// none was given (lengths only): num_kept is then bounded by the cache alone.
SPECDEC_HD int32_t check_truncate_request(const TruncateParams& P, int64_t b) {
  const int64_t base = P.cache_seqlens[b], n = P.num_kept[b];
  if (n < 0 || (P.block_len > 0 && n > P.block_len)) return kErrNumKept;
  const bool moves = P.kept_indices != nullptr || P.clear;
  const int64_t end = base + (moves ? P.block_len : n);
  if (base < 0 || end > P.capacity || base + n > INT32_MAX) return kErrBlockRange;
  if (P.kept_indices != nullptr) {
    int32_t previous = -1;
    for (int32_t j = 0; j < n; ++j) {
      const int32_t idx = P.kept_indices[b * P.block_len + j];
      if (idx <= previous || idx >= P.block_len) return kErrKeptIndices;
      previous = idx;
    }
  }
  if (P.block_table != nullptr) {
    for (int64_t pos = base; pos < end; pos += P.page_size - (pos % P.page_size)) {
      if (cache_row(P, b, pos) < 0) return kErrPageIndex;
    }
  }
  return 0;
}

}  // namespace specdec
