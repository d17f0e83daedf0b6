#include <atomic>

#include "checks.h"
#include "cuda/launcher.h"
#include "kernels/chain_sampling.cuh"
#include "kernels/tree_sampling.cuh"

namespace specdec {
namespace {

// How many clusters of C blocks of `Kernel` (chain_sampling_kernel<T, C> or tree_sampling_kernel<T, C>) run at
// once on the tensor's device (0 without clusters), cached per device: it does not change, and the launch path
// must stay cheap.
template <auto kKernel, int C>
int sampling_clusters_at_once(const at::Tensor& t) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices];  // one per instantiation: 0 unknown, else clusters + 1
  const int device = std::max<int>(0, t.device().index());
  if (device < kCachedDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached - 1;
  }
  const int clusters = max_active_clusters(kKernel, dim3(kLanes / C), C, 0);
  if (device < kCachedDevices) cache[device].store(clusters + 1, std::memory_order_relaxed);
  return clusters;
}

// One cluster per request (blocks per cluster by sampling_cluster_blocks); a grid-stride loop covers batches
// beyond the grid limit. Kernel<C> is the kernel for clusters of C blocks.
template <template <int> class Kernel, typename Params>
void launch_sampling(const char* name, const Params& params, int64_t batch, const at::Tensor& target, Stream stream) {
  const int c = sampling_cluster_blocks(batch, multiprocessor_count(target), [&](int blocks) {
    return blocks == 4 ? sampling_clusters_at_once<Kernel<4>::kernel, 4>(target)
                       : sampling_clusters_at_once<Kernel<2>::kernel, 2>(target);
  });
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(batch, 1 << 28) * c));
  const auto launch = [&](auto kernel, unsigned blocks) {
    launch_cluster_kernel(name, kernel, grid, dim3(kLanes / blocks), blocks, 0, stream, params);
  };
  switch (c) {
    case 4:
      launch(Kernel<4>::kernel, 4);
      break;
    case 2:
      launch(Kernel<2>::kernel, 2);
      break;
    default:
      launch(Kernel<1>::kernel, 1);
  }
}

template <typename T>
struct ChainKernel {
  template <int C>
  struct Of {
    static constexpr auto kernel = chain_sampling_kernel<T, C>;
  };
};
template <typename T>
struct TreeKernel {
  template <int C>
  struct Of {
    static constexpr auto kernel = tree_sampling_kernel<T, C>;
  };
};

using Opt = std::optional<at::Tensor>;

template <bool kLogits>
void chain_sampling_launch(const at::Tensor& draft_token_ids, const at::Tensor& target, const Opt& draft,
                           const Opt& num_draft_tokens, const at::Tensor& greedy_or_temperature, const at::Tensor& seed,
                           const at::Tensor& offset, const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                           const Opt& error_flags, const Opt& cu_num_draft_tokens, const Opt& bonus_token_ids,
                           const Opt& uniforms, const Opt& final_uniforms, const Opt& target_to_draft,
                           const Opt& accepted_independently, c10::string_view coupling, const Opt& top_k = std::nullopt,
                           const Opt& top_p = std::nullopt, const Opt& min_p = std::nullopt) {
  const ChainSamplingParams P =
      make_chain_params(draft_token_ids, target, draft, num_draft_tokens, greedy_or_temperature, seed, offset,
                        output_token_ids, num_accepted, error_flags, cu_num_draft_tokens, bonus_token_ids,
                        EngineLayoutArgs{uniforms, final_uniforms, target_to_draft, coupling, &top_k, &top_p, &min_p},
                        accepted_independently, kLogits);
  TORCH_CHECK_VALUE(target.device().type() == kLauncherDevice, "chain sampling: tensors must be on ", kLauncherDevice);
  if (P.batch == 0) return;
  const LauncherGuard guard(target);
  const Stream stream = current_stream(target);
  const char* op = kLogits ? "chain_speculative_sampling_from_logits" : "chain_speculative_sampling";
  dispatch_float_types<float, half_t, bf16_t>(target.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_sampling<ChainKernel<T>::template Of>(std::is_same_v<T, float> ? "chain_sampling_kernel<float>"
                                                 : std::is_same_v<T, half_t> ? "chain_sampling_kernel<half>"
                                                                             : "chain_sampling_kernel<bf16>",
                                                 P, P.batch, target, stream);
  });
}

template <bool kLogits>
void tree_sampling_launch(const at::Tensor& parents, const at::Tensor& candidate_token_ids, const Opt& num_nodes,
                          const at::Tensor& target, const Opt& draft, const at::Tensor& greedy_or_temperature,
                          const at::Tensor& seed, const at::Tensor& offset, const at::Tensor& output_token_ids,
                          const at::Tensor& accepted_nodes, const at::Tensor& num_accepted, const Opt& error_flags,
                          const Opt& uniforms, const Opt& final_uniforms, const Opt& target_to_draft,
                          const Opt& cu_num_draft_tokens, c10::string_view coupling, const Opt& top_k = std::nullopt,
                          const Opt& top_p = std::nullopt, const Opt& min_p = std::nullopt) {
  const TreeSamplingParams TP = make_tree_params(
      parents, candidate_token_ids, num_nodes, target, draft, greedy_or_temperature, seed, offset, output_token_ids,
      accepted_nodes, num_accepted, error_flags, cu_num_draft_tokens,
      EngineLayoutArgs{uniforms, final_uniforms, target_to_draft, coupling, &top_k, &top_p, &min_p}, kLogits);
  TORCH_CHECK_VALUE(target.device().type() == kLauncherDevice, "tree sampling: tensors must be on ", kLauncherDevice);
  if (TP.rows.batch == 0) return;
  const LauncherGuard guard(target);
  const Stream stream = current_stream(target);
  dispatch_float_types<float, half_t, bf16_t>(target.scalar_type(), tree_sampling_op_name(kLogits), [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_sampling<TreeKernel<T>::template Of>(std::is_same_v<T, float> ? "tree_sampling_kernel<float>"
                                                : std::is_same_v<T, half_t> ? "tree_sampling_kernel<half>"
                                                                            : "tree_sampling_kernel<bf16>",
                                                TP, TP.rows.batch, target, stream);
  });
}

// The registered signatures: the probability ops take no logits processing.
void chain_sampling_probs(const at::Tensor& draft_token_ids, const at::Tensor& target, const Opt& draft,
                          const Opt& num_draft_tokens, const at::Tensor& greedy, const at::Tensor& seed,
                          const at::Tensor& offset, const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                          const Opt& error_flags, const Opt& cu_num_draft_tokens, const Opt& bonus_token_ids,
                          const Opt& uniforms, const Opt& final_uniforms, const Opt& target_to_draft,
                          const Opt& accepted_independently, c10::string_view coupling) {
  chain_sampling_launch<false>(draft_token_ids, target, draft, num_draft_tokens, greedy, seed, offset, output_token_ids,
                               num_accepted, error_flags, cu_num_draft_tokens, bonus_token_ids, uniforms, final_uniforms,
                               target_to_draft, accepted_independently, coupling);
}
void tree_sampling_probs(const at::Tensor& parents, const at::Tensor& candidate_token_ids, const Opt& num_nodes,
                         const at::Tensor& target, const Opt& draft, const at::Tensor& greedy, const at::Tensor& seed,
                         const at::Tensor& offset, const at::Tensor& output_token_ids, const at::Tensor& accepted_nodes,
                         const at::Tensor& num_accepted, const Opt& error_flags, const Opt& uniforms,
                         const Opt& final_uniforms, const Opt& target_to_draft, const Opt& cu_num_draft_tokens,
                         c10::string_view coupling) {
  tree_sampling_launch<false>(parents, candidate_token_ids, num_nodes, target, draft, greedy, seed, offset,
                              output_token_ids, accepted_nodes, num_accepted, error_flags, uniforms, final_uniforms,
                              target_to_draft, cu_num_draft_tokens, coupling);
}

}  // namespace

TORCH_LIBRARY_IMPL(SPECDEC_LIB, SPECDEC_LAUNCHER_KEY, m) {
  m.impl("chain_speculative_sampling", &chain_sampling_probs);
  m.impl("chain_speculative_sampling_from_logits", &chain_sampling_launch<true>);
  m.impl("tree_speculative_sampling", &tree_sampling_probs);
  m.impl("tree_speculative_sampling_from_logits", &tree_sampling_launch<true>);
}

}  // namespace specdec
