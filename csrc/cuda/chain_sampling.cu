#include "checks.h"
#include "cuda/launcher.h"
#include "kernels/chain_sampling.cuh"

namespace specdec {
namespace {

void chain_sampling_launch(const at::Tensor& draft_token_ids, const at::Tensor& target, const std::optional<at::Tensor>& draft,
                           const at::Tensor& num_draft_tokens, const at::Tensor& greedy_or_temperature, const at::Tensor& seed,
                           const at::Tensor& offset, const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                           const std::optional<at::Tensor>& error_flags, bool logits) {
  const ChainSamplingParams P = make_chain_params(draft_token_ids, target, draft, num_draft_tokens, greedy_or_temperature,
                                                  seed, offset, output_token_ids, num_accepted, error_flags, logits);
  TORCH_CHECK_VALUE(target.device().type() == kLauncherDevice, "chain sampling: tensors must be on ", kLauncherDevice);
  if (P.batch == 0) return;
  const LauncherGuard guard(target);
  // One block per request; a grid-stride loop covers batches beyond the grid limit.
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(P.batch, 1 << 30)));
  const Stream stream = current_stream(target);
  switch (target.scalar_type()) {
    case at::kFloat:
      launch_kernel("chain_sampling_kernel<float>", chain_sampling_kernel<float>, grid, dim3(kSamplingThreads), 0, stream, P);
      break;
    case at::kHalf:
      launch_kernel("chain_sampling_kernel<half>", chain_sampling_kernel<half_t>, grid, dim3(kSamplingThreads), 0, stream, P);
      break;
    default:
      launch_kernel("chain_sampling_kernel<bf16>", chain_sampling_kernel<bf16_t>, grid, dim3(kSamplingThreads), 0, stream, P);
  }
}

void chain_sampling_probs(const at::Tensor& draft_token_ids, const at::Tensor& target_probs,
                          const std::optional<at::Tensor>& draft_probs, const at::Tensor& num_draft_tokens,
                          const at::Tensor& greedy, const at::Tensor& seed, const at::Tensor& offset,
                          const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                          const std::optional<at::Tensor>& error_flags) {
  chain_sampling_launch(draft_token_ids, target_probs, draft_probs, num_draft_tokens, greedy, seed, offset, output_token_ids,
                        num_accepted, error_flags, false);
}

void chain_sampling_logits(const at::Tensor& draft_token_ids, const at::Tensor& target_logits,
                           const std::optional<at::Tensor>& draft_logits, const at::Tensor& num_draft_tokens,
                           const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& offset,
                           const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                           const std::optional<at::Tensor>& error_flags) {
  chain_sampling_launch(draft_token_ids, target_logits, draft_logits, num_draft_tokens, temperature, seed, offset,
                        output_token_ids, num_accepted, error_flags, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(SPECDEC_LIB, SPECDEC_LAUNCHER_KEY, m) {
  m.impl("chain_speculative_sampling", &chain_sampling_probs);
  m.impl("chain_speculative_sampling_from_logits", &chain_sampling_logits);
}

}  // namespace specdec
