#include "checks/verify_attention.h"
#include "cuda/launcher.h"
#include "kernels/verify_attention.cuh"

namespace specdec {
namespace {

// SPECDEC_ATTENTION_SPLIT_KEYS=C (a multiple of 64) forces every request's split size to C, for tests of the split
// plans; unset, the size follows each request's cached length (attention_length_split_keys).
int64_t forced_split_keys() {
  return launch_override(
      "SPECDEC_ATTENTION_SPLIT_KEYS",
      [](long long keys) { return keys >= kAttnSplitAlign && keys % kAttnSplitAlign == 0 && keys <= (1LL << 30); },
      "a positive multiple of 64");
}
static_assert(kAttnSplitAlign == 64, "the override's message names the split alignment");

template <typename T, int D>
void launch_verify_attention(AttentionParams& P, const at::Tensor& q, Stream stream) {
  const int64_t rows = P.total_queries * P.q_heads;
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
    // Launched while the attention kernel's last blocks run; it waits for their partial outputs on the device.
    launch_dependent_kernel("merge_attention_splits_kernel", merge_attention_splits_kernel<T>,
                  dim3(ceil_div(P.num_queries * P.q_heads, kAttnMergeWarps), static_cast<unsigned>(P.batch)),
                  dim3(kAttnMergeWarps * kWarpSize), 0, stream, P);
  }
}

template <typename T>
void dispatch_head_dim(AttentionParams& P, const at::Tensor& q, Stream stream) {
  switch (P.head_dim) {
    case 16: launch_verify_attention<T, 16>(P, q, stream); break;
    case 32: launch_verify_attention<T, 32>(P, q, stream); break;
    case 64: launch_verify_attention<T, 64>(P, q, stream); break;
    case 128: launch_verify_attention<T, 128>(P, q, stream); break;
    default: launch_verify_attention<T, 256>(P, q, stream);
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

void verify_attention_launch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& k_new,
                             const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
                             const std::optional<at::Tensor>& tree_mask, std::optional<double> softmax_scale,
                             const at::Tensor& out, const std::optional<at::Tensor>& lse,
                             const std::optional<at::Tensor>& error_flags, const std::optional<at::Tensor>& qo_indptr,
                             const std::optional<at::Tensor>& kv_indptr, const std::optional<at::Tensor>& kv_indices,
                             const std::optional<at::Tensor>& kv_last_page_len, c10::string_view kv_layout,
                             int64_t window_left, double logits_soft_cap) {
  const char* op = "verify_attention";
  AttentionParams P = make_attention_params(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, tree_mask,
                                            softmax_scale, out, lse, error_flags, qo_indptr, kv_indptr, kv_indices,
                                            kv_last_page_len, kv_layout, window_left, logits_soft_cap);
  TORCH_CHECK_VALUE(q.device().type() == kLauncherDevice, op, ": tensors must be on ", kLauncherDevice);
  TORCH_CHECK_VALUE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, op,
                    ": the tensor-core kernel takes float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK_VALUE(P.head_dim == 16 || P.head_dim == 32 || P.head_dim == 64 || P.head_dim == 128 ||
                        P.head_dim == 256,
                    op, ": the tensor-core kernel takes head dim 16, 32, 64, 128 or 256, got ", P.head_dim);
  // cp.async moves 16-byte chunks: every cache row and new-token row must start on a 16-byte boundary.
  TORCH_CHECK_VALUE(aligned(P.k_cache, 16) && aligned(P.v_cache, 16) && P.stride_page % 8 == 0 &&
                        P.stride_slot % 8 == 0 && P.stride_head % 8 == 0,
                    op, ": k_cache and v_cache rows must be 16-byte aligned (pointers and strides)");
  TORCH_CHECK_VALUE(P.k_new == nullptr || (aligned(P.k_new, 16) && aligned(P.v_new, 16)), op,
                    ": k_new and v_new must be 16-byte aligned");
  // Q fragments are read in 4-byte pairs, or in 16-byte chunks when staged in shared memory (head dim 256).
  TORCH_CHECK_VALUE(aligned(P.q, P.head_dim > 128 ? 16 : 4) && aligned(P.out, 16), op,
                    ": q must be ", P.head_dim > 128 ? 16 : 4, "-byte aligned and out 16-byte aligned");
  TORCH_CHECK_VALUE(P.batch <= 65535, op, ": at most 65535 requests per call, got ", P.batch);
  if (P.batch == 0 || P.total_queries == 0) return;

  const LauncherGuard guard(q);
  // Blocks: (request, KV head, row tile of 64 query rows) x KV splits. A request uses the splits its own keys
  // straddle (attention_request_splits, sized by its cached length): its output bits depend on its own keys only,
  // never on the other requests, nor on how many new tokens it has. The grid holds the most splits a request of
  // this capacity (S_max, max_pages x page_size, or len(kv_indices) x page_size with the CSR table) can have, so
  // nothing is read back from the device; the blocks past a request's own splits return at once.
  const int64_t rows_per_head = P.num_queries * (P.q_heads / P.kv_heads);
  P.row_tiles = (rows_per_head + kAttnRows - 1) / kAttnRows;
  P.split_keys = forced_split_keys();
  const int64_t smallest = P.split_keys > 0 ? P.split_keys : kAttnMinSplitKeys;
  // A request's splits: ceil(key_end / C) at most, C >= smallest; and at most kAttnMaxSplits unforced.
  P.num_splits = std::max<int64_t>(1, (P.capacity + smallest - 1) / smallest);
  if (P.split_keys == 0) P.num_splits = std::min(P.num_splits, kAttnMaxSplits);
  TORCH_CHECK_VALUE(P.num_splits <= 65535, op, ": SPECDEC_ATTENTION_SPLIT_KEYS leaves too many splits for the cache");
  TORCH_CHECK_VALUE(P.kv_heads * P.row_tiles <= 65535, op, ": too many KV heads x query rows");

  const Stream stream = current_stream(q);
  dispatch_float_types<void, half_t, bf16_t>(q.scalar_type(), op, [&](auto tag) {
    dispatch_head_dim<typename decltype(tag)::type>(P, q, stream);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(SPECDEC_LIB, SPECDEC_LAUNCHER_KEY, m) { m.impl("verify_attention", &verify_attention_launch); }

}  // namespace specdec
