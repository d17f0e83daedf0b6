#include <atomic>

#include "checks.h"
#include "cuda/launcher.h"
#include "kernels/chain_sampling.cuh"

namespace specdec {
namespace {

// How many clusters of chain_sampling_kernel<T, C> run at once on the tensor's device (0 without clusters),
// cached per device: it does not change, and the launch path must stay cheap.
template <typename T, int C>
int sampling_clusters_at_once(const at::Tensor& t) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices];  // 0: unknown, else clusters + 1
  const int device = std::max<int>(0, t.device().index());
  if (device < kCachedDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached - 1;
  }
  const int clusters = max_active_clusters(chain_sampling_kernel<T, C>, dim3(kLanes / C), C, 0);
  if (device < kCachedDevices) cache[device].store(clusters + 1, std::memory_order_relaxed);
  return clusters;
}

template <typename T>
void launch_for_type(const char* name, const ChainSamplingParams& P, const at::Tensor& target, Stream stream) {
  const int c = sampling_cluster_blocks(P.batch, multiprocessor_count(target), [&](int blocks) {
    return blocks == 4 ? sampling_clusters_at_once<T, 4>(target) : sampling_clusters_at_once<T, 2>(target);
  });
  // One cluster per request; a grid-stride loop covers batches beyond the grid limit.
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(P.batch, 1 << 28) * c));
  const auto launch = [&](auto kernel, unsigned blocks) {
    launch_cluster_kernel(name, kernel, grid, dim3(kLanes / blocks), blocks, 0, stream, P);
  };
  switch (c) {
    case 4:
      launch(chain_sampling_kernel<T, 4>, 4);
      break;
    case 2:
      launch(chain_sampling_kernel<T, 2>, 2);
      break;
    default:
      launch(chain_sampling_kernel<T, 1>, 1);
  }
}

void chain_sampling_launch(const at::Tensor& draft_token_ids, const at::Tensor& target, const std::optional<at::Tensor>& draft,
                           const at::Tensor& num_draft_tokens, const at::Tensor& greedy_or_temperature, const at::Tensor& seed,
                           const at::Tensor& offset, const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                           const std::optional<at::Tensor>& error_flags, bool logits) {
  const ChainSamplingParams P = make_chain_params(draft_token_ids, target, draft, num_draft_tokens, greedy_or_temperature,
                                                  seed, offset, output_token_ids, num_accepted, error_flags, logits);
  TORCH_CHECK_VALUE(target.device().type() == kLauncherDevice, "chain sampling: tensors must be on ", kLauncherDevice);
  if (P.batch == 0) return;
  const LauncherGuard guard(target);
  const Stream stream = current_stream(target);
  const char* op = logits ? "chain_speculative_sampling_from_logits" : "chain_speculative_sampling";
  dispatch_float_types<float, half_t, bf16_t>(target.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_for_type<T>(std::is_same_v<T, float> ? "chain_sampling_kernel<float>"
                       : std::is_same_v<T, half_t> ? "chain_sampling_kernel<half>" : "chain_sampling_kernel<bf16>",
                       P, target, stream);
  });
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
