#include "checks/truncate_kv_cache.h"
#include "cuda/launcher.h"
#include "kernels/truncate_kv_cache.cuh"

namespace specdec {
namespace {

void truncate_kv_cache_launch(const at::Tensor& cache_seqlens, const at::Tensor& num_kept,
                              const std::optional<at::Tensor>& kept_indices, at::TensorList k_caches, at::TensorList v_caches,
                              const std::optional<at::Tensor>& block_table, std::optional<int64_t> block_len, bool clear,
                              const std::optional<at::Tensor>& error_flags, const std::optional<at::Tensor>& kv_indptr,
                              const std::optional<at::Tensor>& kv_indices, c10::string_view kv_layout) {
  const TruncateParams P = make_truncate_params(cache_seqlens, num_kept, kept_indices, k_caches, v_caches, block_table,
                                                block_len, clear, error_flags, kv_indptr, kv_indices, kv_layout);
  TORCH_CHECK_VALUE(cache_seqlens.device().type() == kLauncherDevice, "truncate_kv_cache: tensors must be on ", kLauncherDevice);
  if (P.batch == 0) return;
  const LauncherGuard guard(cache_seqlens);
  const Stream stream = current_stream(cache_seqlens);
  if (P.layers > 0 && (P.kept_indices != nullptr || P.clear)) {
    launch_kernel("truncate_kv_cache_kernel", truncate_kv_cache_kernel, dim3(static_cast<unsigned>(P.batch), static_cast<unsigned>(P.layers)),
                  dim3(kTruncateThreads), 0, stream, P);
  }
  launch_kernel("advance_seqlens_kernel", advance_seqlens_kernel, dim3(ceil_div(P.batch, kTruncateThreads)),
                dim3(kTruncateThreads), 0, stream, P);
}

}  // namespace

TORCH_LIBRARY_IMPL(SPECDEC_LIB, SPECDEC_LAUNCHER_KEY, m) { m.impl("truncate_kv_cache", &truncate_kv_cache_launch); }

}  // namespace specdec
