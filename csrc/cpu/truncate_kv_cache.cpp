// truncate_kv_cache on the CPU: every request is checked first (an invalid one raises before anything is
// written), then (request, layer) pairs move and clear rows in parallel, then the lengths advance.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "checks/truncate_kv_cache.h"

namespace specdec {
namespace {

void truncate_kv_cache_cpu(const at::Tensor& cache_seqlens, const at::Tensor& num_kept,
                           const std::optional<at::Tensor>& kept_indices, at::TensorList k_caches, at::TensorList v_caches,
                           const std::optional<at::Tensor>& block_table, std::optional<int64_t> block_len, bool clear,
                           const std::optional<at::Tensor>& error_flags, const std::optional<at::Tensor>& kv_indptr,
                           const std::optional<at::Tensor>& kv_indices, c10::string_view kv_layout) {
  const TruncateParams P = make_truncate_params(cache_seqlens, num_kept, kept_indices, k_caches, v_caches, block_table,
                                                block_len, clear, error_flags, kv_indptr, kv_indices, kv_layout);
  for (int64_t b = 0; b < P.batch; ++b) {
    const int32_t bits = check_truncate_request(P, b);
    if (bits != 0) {
      if (P.error_flags != nullptr) *P.error_flags |= bits;
      TORCH_CHECK_VALUE(false, truncate_error_message(bits, b));
    }
  }
  if (P.layers > 0 && (P.kept_indices != nullptr || P.clear)) {
    at::parallel_for(0, P.batch * P.layers, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / P.layers, layer = t % P.layers;
        const int32_t base = P.cache_seqlens[b], n = P.num_kept[b];
        for (int kv = 0; kv < 2; ++kv) {
          uint32_t* cache = static_cast<uint32_t*>(kv == 0 ? P.k[layer] : P.v[layer]);
          const size_t run_bytes = static_cast<size_t>(P.segment_words) * 4;
          for (int32_t j = 0; P.kept_indices != nullptr && j < n; ++j) {
            const int32_t src = P.kept_indices[b * P.block_len + j];
            if (src == j) continue;
            const int64_t to = cache_row(P, b, base + j), from = cache_row(P, b, base + src);
            for (int64_t r = 0; r < P.segments; ++r) {
              std::memcpy(cache + to + r * P.stride_segment, cache + from + r * P.stride_segment, run_bytes);
            }
          }
          for (int64_t j = n; P.clear && j < P.block_len; ++j) {
            const int64_t to = cache_row(P, b, base + j);
            for (int64_t r = 0; r < P.segments; ++r) std::memset(cache + to + r * P.stride_segment, 0, run_bytes);
          }
        }
      }
    });
  }
  for (int64_t b = 0; b < P.batch; ++b) P.cache_seqlens[b] += P.num_kept[b];
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("truncate_kv_cache", &truncate_kv_cache_cpu); }

}  // namespace specdec
