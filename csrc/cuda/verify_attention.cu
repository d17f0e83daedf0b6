#include "checks.h"
#include "cuda/launcher.h"
#include "kernels/verify_attention.cuh"

namespace specdec {
namespace {

// Keys per KV split: kAttnSplitKeys, doubled while a cache of this capacity would need more than
// kAttnMaxSplits splits (which bounds the merge workspace to kAttnMaxSplits partial outputs per row).
constexpr int64_t kAttnSplitKeys = 4 * kAttnKeys;
constexpr int64_t kAttnMaxSplits = 32;

template <typename T, int D>
void launch_verify_attention(AttentionParams& P, const at::Tensor& q, Stream stream) {
  const int64_t rows = P.batch * P.num_queries * P.q_heads;
  at::Tensor workspace;
  if (P.num_splits > 1) {
    workspace = at::empty({P.num_splits * rows * (D + 1)}, q.options().dtype(at::kFloat));
    P.partial_out = workspace.data_ptr<float>();
    P.partial_lse = P.partial_out + P.num_splits * rows * D;
  }
  launch_kernel("verify_attention_kernel", verify_attention_kernel<T, D>,
                dim3(static_cast<unsigned>(P.num_splits), static_cast<unsigned>(P.kv_heads * P.row_tiles),
                     static_cast<unsigned>(P.batch)),
                dim3(kAttnThreads), attention_smem_bytes<D>(), stream, P);
  if (P.num_splits > 1) {
    launch_kernel("merge_attention_splits_kernel", merge_attention_splits_kernel<T>, dim3(ceil_div(rows, kAttnMergeWarps)),
                  dim3(kAttnMergeWarps * kWarpSize), 0, stream, P);
  }
}

template <typename T>
void dispatch_head_dim(AttentionParams& P, const at::Tensor& q, Stream stream) {
  if (P.head_dim == 64) {
    launch_verify_attention<T, 64>(P, q, stream);
  } else {
    launch_verify_attention<T, 128>(P, q, stream);
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

std::tuple<at::Tensor, at::Tensor> verify_attention_launch(const at::Tensor& q, const at::Tensor& k_cache,
                                                           const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                                           const std::optional<at::Tensor>& k_new,
                                                           const std::optional<at::Tensor>& v_new,
                                                           const std::optional<at::Tensor>& block_table,
                                                           const std::optional<at::Tensor>& tree_mask,
                                                           std::optional<double> softmax_scale, bool return_lse,
                                                           const std::optional<at::Tensor>& error_flags) {
  const char* op = "verify_attention";
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = empty_lse(q, return_lse);
  AttentionParams P = make_attention_params(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, tree_mask,
                                            softmax_scale, error_flags, out, lse, return_lse);
  TORCH_CHECK_VALUE(q.device().type() == kLauncherDevice, op, ": tensors must be on ", kLauncherDevice);
  TORCH_CHECK_VALUE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, op,
                    ": the tensor-core kernel takes float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK_VALUE(P.head_dim == 64 || P.head_dim == 128, op, ": the tensor-core kernel takes head dim 64 or 128, got ",
                    P.head_dim);
  // cp.async moves 16-byte chunks: every cache row and new-token row must start on a 16-byte boundary.
  TORCH_CHECK_VALUE(aligned(P.k_cache, 16) && aligned(P.v_cache, 16) && P.cache_stride_b % 8 == 0 &&
                        P.cache_stride_s % 8 == 0,
                    op, ": k_cache and v_cache rows must be 16-byte aligned");
  TORCH_CHECK_VALUE(P.k_new == nullptr || (aligned(P.k_new, 16) && aligned(P.v_new, 16)), op,
                    ": k_new and v_new must be 16-byte aligned");
  TORCH_CHECK_VALUE(aligned(P.q, 4), op, ": q must be 4-byte aligned");
  TORCH_CHECK_VALUE(P.batch <= 65535, op, ": at most 65535 requests per call, got ", P.batch);
  if (P.batch == 0) return {out, lse};

  const LauncherGuard guard(q);
  // Blocks: (request, KV head, row tile of 64 query rows) x KV splits. A request uses the splits that its own
  // keys fill (attention_request_splits): its output bits depend on its length and the cache's capacity, never
  // on the batch. The split size comes from the capacity, so nothing is read back from the device.
  const int64_t rows_per_head = P.num_queries * (P.q_heads / P.kv_heads);
  P.row_tiles = (rows_per_head + kAttnRows - 1) / kAttnRows;
  P.split_keys = kAttnSplitKeys;
  while ((P.capacity + P.split_keys - 1) / P.split_keys > kAttnMaxSplits) P.split_keys *= 2;
  P.num_splits = (P.capacity + P.split_keys - 1) / P.split_keys;
  TORCH_CHECK_VALUE(P.kv_heads * P.row_tiles <= 65535, op, ": too many KV heads x query rows");

  const Stream stream = current_stream(q);
  dispatch_float_types<void, half_t, bf16_t>(q.scalar_type(), op, [&](auto tag) {
    dispatch_head_dim<typename decltype(tag)::type>(P, q, stream);
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(SPECDEC_LIB, SPECDEC_LAUNCHER_KEY, m) { m.impl("verify_attention", &verify_attention_launch); }

}  // namespace specdec
