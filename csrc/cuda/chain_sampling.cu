// The chain speculative sampling ops' launchers (probabilities and logits).
#include "checks/chain_sampling.h"
#include "cuda/sampling_launch.cuh"
#include "kernels/chain_sampling.cuh"

namespace specdec {
namespace {

using sampling_launch::launch_sampling;
using sampling_launch::Opt;

template <typename T>
struct ChainKernel {
  template <int C>
  struct Of {
    static constexpr auto kernel = chain_sampling_kernel<T, C>;
  };
};

template <bool kLogits>
void chain_sampling_launch(const at::Tensor& draft_token_ids, const at::Tensor& target, const Opt& draft,
                           const Opt& num_draft_tokens, const at::Tensor& greedy_or_temperature, const at::Tensor& seed,
                           const at::Tensor& offset, const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                           const Opt& error_flags, const Opt& cu_num_draft_tokens, const Opt& bonus_token_ids,
                           const Opt& uniforms, const Opt& final_uniforms, const Opt& target_to_draft,
                           const Opt& accepted_independently, c10::string_view coupling, const Opt& top_k,
                           const Opt& top_p, const Opt& min_p, c10::string_view verification,
                           const Opt& target_lse, const Opt& draft_lse, bool check_lse, const Opt& row_lse) {
  const ChainSamplingParams P =
      make_chain_params(draft_token_ids, target, draft, num_draft_tokens, greedy_or_temperature, seed, offset,
                        output_token_ids, num_accepted, error_flags, cu_num_draft_tokens, bonus_token_ids,
                        EngineLayoutArgs{uniforms, final_uniforms, target_to_draft, coupling, &top_k, &top_p, &min_p,
                                         &target_lse, &draft_lse, check_lse},
                        accepted_independently, kLogits, verification, &row_lse);
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

// The registered signature: the probability op takes no logits processing.
void chain_sampling_probs(const at::Tensor& draft_token_ids, const at::Tensor& target, const Opt& draft,
                          const Opt& num_draft_tokens, const at::Tensor& greedy, const at::Tensor& seed,
                          const at::Tensor& offset, const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                          const Opt& error_flags, const Opt& cu_num_draft_tokens, const Opt& bonus_token_ids,
                          const Opt& uniforms, const Opt& final_uniforms, const Opt& target_to_draft,
                          const Opt& accepted_independently, c10::string_view coupling,
                          c10::string_view verification) {
  chain_sampling_launch<false>(draft_token_ids, target, draft, num_draft_tokens, greedy, seed, offset, output_token_ids,
                               num_accepted, error_flags, cu_num_draft_tokens, bonus_token_ids, uniforms, final_uniforms,
                               target_to_draft, accepted_independently, coupling, std::nullopt, std::nullopt,
                               std::nullopt, verification, std::nullopt, std::nullopt, false, std::nullopt);
}

}  // namespace

TORCH_LIBRARY_IMPL(SPECDEC_LIB, SPECDEC_LAUNCHER_KEY, m) {
  m.impl("chain_speculative_sampling", &chain_sampling_probs);
  m.impl("chain_speculative_sampling_from_logits", &chain_sampling_launch<true>);
}

}  // namespace specdec
