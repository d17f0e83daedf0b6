// The argument checks and error bits of chain_speculative_sampling and chain_speculative_sampling_from_logits
// (cpu/chain_sampling.cpp, cuda/chain_sampling.cu).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

#include "checks/common.h"
#include "checks/sampling_rows.h"
#include "specdec/chain_sampling.h"

namespace specdec {

// Checks the arguments of both chain sampling ops and gathers them into the kernels' parameters. Padded form:
// draft_token_ids [B, K], num_draft_tokens [B], target rows [B, K+1, V] ([B, K, V] allowed with bonus_token_ids),
// draft rows [B, K, V or Vd], uniforms [B, K]. Flat form (cu_num_draft_tokens [B]): draft_token_ids [T], target rows
// [T + B, V] or [T, V] with bonus_token_ids, draft rows [T, V or Vd], uniforms [T], and num_draft_tokens [B] optional
// (a cap on each request's judged drafts). Outputs [B, K + 1] (K = max_draft_tokens in the flat form) and [B].
// verification: "token" or "block" (not with coupling="gumbel" or accepted_independently).
inline ChainSamplingParams make_chain_params(const at::Tensor& draft_token_ids, const at::Tensor& target,
                                             const std::optional<at::Tensor>& draft,
                                             const std::optional<at::Tensor>& num_draft_tokens,
                                             const at::Tensor& greedy_or_temperature, const at::Tensor& seed,
                                             const at::Tensor& offset, const at::Tensor& output_token_ids,
                                             const at::Tensor& num_accepted, const std::optional<at::Tensor>& error_flags,
                                             const std::optional<at::Tensor>& cu_num_draft_tokens,
                                             const std::optional<at::Tensor>& bonus_token_ids, const EngineLayoutArgs& E,
                                             const std::optional<at::Tensor>& accepted_independently, bool logits,
                                             c10::string_view verification = "token",
                                             const std::optional<at::Tensor>* row_lse = nullptr) {
  const char* op = logits ? "chain_speculative_sampling_from_logits" : "chain_speculative_sampling";
  TORCH_CHECK_VALUE(verification == "token" || verification == "block", op,
                    ": verification must be \"token\" or \"block\", got \"", std::string(verification), "\"");
  const bool block = verification == "block";
  TORCH_CHECK_VALUE(!block || E.coupling != "gumbel", op,
                    ": verification=\"block\" judges the drafts by their probabilities; coupling=\"gumbel\" takes none");
  TORCH_CHECK_VALUE(!block || !accepted_independently.has_value(), op,
                    ": accepted_independently (FlashInfer's count, token by token) is not defined with "
                    "verification=\"block\"");
  const bool flat = cu_num_draft_tokens.has_value();
  TORCH_CHECK_VALUE(draft_token_ids.scalar_type() == at::kInt || draft_token_ids.scalar_type() == at::kLong, op,
                    ": draft_token_ids must be int32 or int64, got ", draft_token_ids.scalar_type());
  TORCH_CHECK_VALUE(output_token_ids.dim() == 2, op, ": output_token_ids must be [B, K+1], got ", output_token_ids.sizes());
  int64_t B, K, T = 0;
  if (flat) {
    TORCH_CHECK_VALUE(draft_token_ids.dim() == 1, op, ": draft_token_ids must be [T] in the flat form, got ",
                      draft_token_ids.sizes());
    B = cu_num_draft_tokens->numel();
    K = output_token_ids.size(1) - 1;
    T = draft_token_ids.size(0);
    TORCH_CHECK_VALUE(K >= 0 && K <= kMaxDraftTokens, op, ": max_draft_tokens must be in [0, ", kMaxDraftTokens, "], got ", K);
  } else {
    TORCH_CHECK_VALUE(draft_token_ids.dim() == 2, op, ": draft_token_ids must be [B, K], got ", draft_token_ids.sizes());
    B = draft_token_ids.size(0);
    K = draft_token_ids.size(1);
    TORCH_CHECK_VALUE(K >= 0 && K <= kMaxDraftTokens, op, ": the number of draft tokens K must be in [0, ", kMaxDraftTokens,
                      "], got ", K);
    TORCH_CHECK_VALUE(num_draft_tokens.has_value(), op, ": num_draft_tokens is needed in the padded form");
  }
  const SamplingArgs A{op, logits, B, target.device()};
  ChainSamplingParams P{};
  const bool bonus = bonus_token_ids.has_value();
  if (flat) {
    check_sampling_rows(P, A, target, true, bonus ? T : T + B, bonus ? "T" : "T+B", draft, T, "T", greedy_or_temperature,
                        seed, offset, E, error_flags);
    A.vector_of(*cu_num_draft_tokens, "cu_num_draft_tokens", at::kInt);
    P.cu_num_draft_tokens = cu_num_draft_tokens->data_ptr<int32_t>();
    P.flat_positions = T;
    if (num_draft_tokens.has_value()) {  // a cap on the drafts each request judges, in [0, cu[b] - cu[b-1]]
      A.vector_of(*num_draft_tokens, "num_draft_tokens", at::kInt);
      P.num_draft_tokens = num_draft_tokens->data_ptr<int32_t>();
    }
  } else {
    // With the caller's bonus tokens the bonus row is never read: [B, K, V] will do.
    const int64_t rows = bonus && target.dim() == 3 && target.size(1) == K ? K : K + 1;
    check_sampling_rows(P, A, target, false, rows, rows == K ? "K" : "K+1", draft, K, "K", greedy_or_temperature, seed,
                        offset, E, error_flags);
    A.vector_of(*num_draft_tokens, "num_draft_tokens", at::kInt);
    P.num_draft_tokens = num_draft_tokens->data_ptr<int32_t>();
  }
  A.same_device(draft_token_ids, "draft_token_ids");
  TORCH_CHECK_VALUE(draft_token_ids.is_contiguous(), op, ": draft_token_ids must be contiguous");
  A.matrix_of(output_token_ids, "output_token_ids", K + 1, "K+1");
  A.vector_of(num_accepted, "num_accepted", at::kInt);
  if (bonus) {
    const at::Tensor& t = *bonus_token_ids;
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == B && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong) &&
                          t.is_contiguous(),
                      op, ": bonus_token_ids must be a contiguous [B] = [", B, "] int32 or int64 tensor, got ", t.sizes(), " ",
                      t.scalar_type());
    A.same_device(t, "bonus_token_ids");
    P.bonus_ids = t.data_ptr();
    P.bonus_ids_int64 = t.scalar_type() == at::kLong;
  }
  if (E.uniforms.has_value()) {
    P.uniforms = flat ? uniforms_pointer(A, *E.uniforms, {T}, "[T]") : uniforms_pointer(A, *E.uniforms, {B, K}, "[B, K]");
  }
  if (accepted_independently.has_value()) {
    A.vector_of(*accepted_independently, "accepted_independently", at::kInt);
    P.accepted_independently = accepted_independently->data_ptr<int32_t>();
  }
  P.draft_ids = draft_token_ids.data_ptr();
  P.draft_ids_int64 = draft_token_ids.scalar_type() == at::kLong;
  P.output_token_ids = output_token_ids.data_ptr<int32_t>();
  P.num_accepted = num_accepted.data_ptr<int32_t>();
  P.num_draft = K;
  P.block = block;
  if (row_lse != nullptr && row_lse->has_value()) {  // logits_normalizer: K = 0, one row per request
    TORCH_CHECK_VALUE(logits && K == 0 && !flat, op, ": row_lse takes the padded form with K = 0");
    A.vector_of(**row_lse, "row_lse", at::kFloat);
    P.row_lse = (*row_lse)->data_ptr<float>();
  }
  return P;
}

inline constexpr ErrorBit kSamplingErrorBits[] = {
    {kErrTargetNonFinite, "{target} holds NaN or inf (-inf is allowed in logits)"},
    {kErrDraftNonFinite, "{draft} holds NaN or inf (-inf is allowed in logits)"},
    {kErrDraftTokenId, "draft_token_ids holds ids outside [0, V) below num_draft_tokens"},
    {kErrNumDraftTokens, "num_draft_tokens holds values outside [0, K] (flat form: [0, cu[b] - cu[b-1]])"},
    {kErrTemperature, "temperature must be finite and >= 0"},
    {kErrTargetNoMass, "{target} has a row to sample from with no mass (every logit -inf, or every probability 0)"},
    {kErrUniform, "uniforms and final_uniforms must be in [0, 1)"},
    {kErrBonusTokenId, "bonus_token_ids holds ids outside [0, V)"},
    {kErrCuNumDraftTokens, "cu_num_draft_tokens must be non-decreasing, in [0, T], with steps of at most max_draft_tokens"},
    {kErrDraftToTarget, "draft_to_target holds an id outside [0, V) or an id twice"},
    {kErrRowFilter, "top_k must be >= 0, top_p in (0, 1] and min_p in [0, 1)"},
    {kErrTargetLse, "target_lse holds a row's normaliser more than 2^-14 + 2^-20 |lse| off logits_normalizer's"},
    {kErrDraftLse, "draft_lse holds a row's normaliser more than 2^-14 + 2^-20 |lse| off logits_normalizer's"},
};

// The message for error bits raised by the sampling kernels (SamplingError).
inline std::string sampling_error_message(int32_t bits, bool logits) {
  const char* op = logits ? "chain_speculative_sampling_from_logits" : "chain_speculative_sampling";
  return std::string(op) + ": invalid input: " +
         describe_error_bits(bits, kSamplingErrorBits, logits ? "target_logits" : "target_probs",
                             logits ? "draft_logits" : "draft_probs");
}

}  // namespace specdec
