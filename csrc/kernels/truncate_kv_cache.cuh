// truncate_kv_cache: one block per (request, layer) moves the kept rows of the verified block to its front
// (tree compaction) and zeroes the discarded slots (clear). Bytes: n kept rows read and written, plus the
// cleared rows written, per layer, K and V; nothing else of the cache is touched.
//
// Kept indices increase, so row j's source kept[j] >= j is never a destination of an earlier row; rows are
// moved in order with a barrier between them, so a row is read before any later move overwrites it.
#pragma once
#include "specdec/device.cuh"
#include "specdec/kv_cache.h"

namespace specdec {

constexpr int kTruncateThreads = 256;

__global__ void __launch_bounds__(kTruncateThreads) truncate_kv_cache_kernel(const TruncateParams params) {
  const TruncateParams P = params;
  const int64_t b = blockIdx.x, layer = blockIdx.y;
  if (check_truncate_request(P, b) != 0) return;  // a defined outcome: this request's cache is left untouched
  const int32_t base = P.cache_seqlens[b], n = P.num_kept[b];
  for (int kv = 0; kv < 2; ++kv) {
    uint32_t* cache = static_cast<uint32_t*>(kv == 0 ? P.k[layer] : P.v[layer]);
    if (P.kept_indices != nullptr) {
      for (int32_t j = 0; j < n; ++j) {
        const int32_t src = P.kept_indices[b * P.block_len + j];
        if (src != j) {  // uniform across the block
          copy_cache_row(P, cache, cache_row(P, b, base + j), cache_row(P, b, base + src), threadIdx.x, kTruncateThreads);
        }
        sync_threads();
      }
    }
    if (P.clear) {
      for (int64_t j = n; j < P.block_len; ++j) {
        clear_cache_row(P, cache, cache_row(P, b, base + j), threadIdx.x, kTruncateThreads);
      }
    }
  }
}

// Runs after the moves (its own launch: every block of a request reads the old length first), and on its own
// for a lengths-only truncation; it records the error bits of every rejected request.
__global__ void __launch_bounds__(kTruncateThreads) advance_seqlens_kernel(const TruncateParams params) {
  const TruncateParams P = params;
  const int64_t b = int64_t{blockIdx.x} * kTruncateThreads + threadIdx.x;
  if (b >= P.batch) return;
  const int32_t errors = check_truncate_request(P, b);
  if (errors == 0) {
    P.cache_seqlens[b] += P.num_kept[b];
  } else if (P.error_flags != nullptr) {
    atomic_or(P.error_flags, errors);
  }
}

}  // namespace specdec
