// The tree speculative sampling ops' launchers (probabilities and logits).
#include "checks/tree_sampling.h"
#include "cuda/sampling_launch.cuh"
#include "kernels/tree_sampling.cuh"

namespace specdec {
namespace {

using sampling_launch::launch_sampling;
using sampling_launch::Opt;

template <typename T>
struct TreeKernel {
  template <int C>
  struct Of {
    static constexpr auto kernel = tree_sampling_kernel<T, C>;
  };
};

template <bool kLogits>
void tree_sampling_launch(const at::Tensor& parents, const at::Tensor& candidate_token_ids, const Opt& num_nodes,
                          const at::Tensor& target, const Opt& draft, const at::Tensor& greedy_or_temperature,
                          const at::Tensor& seed, const at::Tensor& offset, const at::Tensor& output_token_ids,
                          const at::Tensor& accepted_nodes, const at::Tensor& num_accepted, const Opt& error_flags,
                          const Opt& uniforms, const Opt& final_uniforms, const Opt& target_to_draft,
                          const Opt& cu_num_draft_tokens, c10::string_view coupling, const Opt& top_k = std::nullopt,
                          const Opt& top_p = std::nullopt, const Opt& min_p = std::nullopt,
                          const Opt& target_lse = std::nullopt, const Opt& draft_lse = std::nullopt,
                          bool check_lse = false) {
  const TreeSamplingParams TP = make_tree_params(
      parents, candidate_token_ids, num_nodes, target, draft, greedy_or_temperature, seed, offset, output_token_ids,
      accepted_nodes, num_accepted, error_flags, cu_num_draft_tokens,
      EngineLayoutArgs{uniforms, final_uniforms, target_to_draft, coupling, &top_k, &top_p, &min_p, &target_lse,
                       &draft_lse, check_lse},
      kLogits);
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

// The registered signature: the probability op takes no logits processing.
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
  m.impl("tree_speculative_sampling", &tree_sampling_probs);
  m.impl("tree_speculative_sampling_from_logits", &tree_sampling_launch<true>);
}

}  // namespace specdec
