// Chain speculative sampling on the CPU (chain_speculative_sampling, chain_speculative_sampling_from_logits, their
// flat form, and gumbel_sample, which is the from-logits op with coupling="gumbel"): requests in parallel
// (at::parallel_for), each running chain_sampling_request (specdec/chain_sampling.h) on the CPU sampling engine
// (cpu/sampling_engine.h).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "checks/chain_sampling.h"
#include "cpu/sampling_engine.h"

namespace specdec {
namespace {

void chain_sampling_cpu(const at::Tensor& draft_token_ids, const at::Tensor& target, const Opt& draft,
                        const Opt& num_draft_tokens, const at::Tensor& greedy_or_temperature, const at::Tensor& seed,
                        const at::Tensor& offset, const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                        const Opt& error_flags, const Opt& cu_num_draft_tokens, const Opt& bonus_token_ids,
                        const EngineLayoutArgs& E, const Opt& accepted_independently, bool logits,
                        c10::string_view verification, const Opt* row_lse = nullptr) {
  const ChainSamplingParams P =
      make_chain_params(draft_token_ids, target, draft, num_draft_tokens, greedy_or_temperature, seed, offset,
                        output_token_ids, num_accepted, error_flags, cu_num_draft_tokens, bonus_token_ids, E,
                        accepted_independently, logits, verification, row_lse);
  // Counts, ids and temperatures of every request first: they raise before anything is sampled or written.
  int32_t errors = 0;
  for (int64_t b = 0; b < P.batch; ++b) errors |= check_request_controls(P, b);
  if (errors == 0) {
    const char* op = logits ? "chain_speculative_sampling_from_logits" : "chain_speculative_sampling";
    dispatch_float_types<float, c10::Half, c10::BFloat16>(target.scalar_type(), op, [&](auto tag) {
      using Engine = CpuSamplingEngine<typename decltype(tag)::type>;
      errors = run_requests<Engine>(P, P.batch, [&](Engine& e, int64_t b) { chain_sampling_request(e, P, b); });
    });
  }
  if (errors != 0) {
    if (P.error_flags != nullptr) *P.error_flags |= errors;
    TORCH_CHECK_VALUE(false, sampling_error_message(errors, logits));
  }
}

void chain_sampling_op_cpu(const at::Tensor& draft_token_ids, const at::Tensor& target, const Opt& draft,
                           const Opt& num_draft_tokens, const at::Tensor& greedy, const at::Tensor& seed,
                           const at::Tensor& offset, const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                           const Opt& error_flags, const Opt& cu_num_draft_tokens, const Opt& bonus_token_ids,
                           const Opt& uniforms, const Opt& final_uniforms, const Opt& target_to_draft,
                           const Opt& accepted_independently, c10::string_view coupling,
                           c10::string_view verification) {
  chain_sampling_cpu(draft_token_ids, target, draft, num_draft_tokens, greedy, seed, offset, output_token_ids,
                     num_accepted, error_flags, cu_num_draft_tokens, bonus_token_ids,
                     EngineLayoutArgs{uniforms, final_uniforms, target_to_draft, coupling}, accepted_independently, false,
                     verification);
}

void chain_sampling_from_logits_op_cpu(const at::Tensor& draft_token_ids, const at::Tensor& target, const Opt& draft,
                                       const Opt& num_draft_tokens, const at::Tensor& temperature,
                                       const at::Tensor& seed, const at::Tensor& offset,
                                       const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                                       const Opt& error_flags, const Opt& cu_num_draft_tokens,
                                       const Opt& bonus_token_ids, const Opt& uniforms, const Opt& final_uniforms,
                                       const Opt& target_to_draft, const Opt& accepted_independently,
                                       c10::string_view coupling, const Opt& top_k, const Opt& top_p,
                                       const Opt& min_p, c10::string_view verification, const Opt& target_lse,
                                       const Opt& draft_lse, bool check_lse, const Opt& row_lse) {
  chain_sampling_cpu(draft_token_ids, target, draft, num_draft_tokens, temperature, seed, offset, output_token_ids,
                     num_accepted, error_flags, cu_num_draft_tokens, bonus_token_ids,
                     EngineLayoutArgs{uniforms, final_uniforms, target_to_draft, coupling, &top_k, &top_p, &min_p,
                                      &target_lse, &draft_lse, check_lse},
                     accepted_independently, true, verification, &row_lse);
}
}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("chain_speculative_sampling", &chain_sampling_op_cpu);
  m.impl("chain_speculative_sampling_from_logits", &chain_sampling_from_logits_op_cpu);
}

}  // namespace specdec
