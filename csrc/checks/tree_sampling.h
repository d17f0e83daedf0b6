// The argument checks and error bits of tree_speculative_sampling and tree_speculative_sampling_from_logits
// (cpu/tree_sampling.cpp, cuda/tree_sampling.cu).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

#include "checks/common.h"
#include "checks/sampling_rows.h"
#include "specdec/tree_sampling.h"

namespace specdec {

inline const char* tree_sampling_op_name(bool logits) {
  return logits ? "tree_speculative_sampling_from_logits" : "tree_speculative_sampling";
}

// Checks the arguments of both tree sampling ops and gathers them into the kernels' parameters.
inline TreeSamplingParams make_tree_params(const at::Tensor& parents, const at::Tensor& candidate_token_ids,
                                           const std::optional<at::Tensor>& num_nodes, const at::Tensor& target,
                                           const std::optional<at::Tensor>& draft, const at::Tensor& greedy_or_temperature,
                                           const at::Tensor& seed, const at::Tensor& offset,
                                           const at::Tensor& output_token_ids, const at::Tensor& accepted_nodes,
                                           const at::Tensor& num_accepted, const std::optional<at::Tensor>& error_flags,
                                           const std::optional<at::Tensor>& cu_num_draft_tokens, const EngineLayoutArgs& E,
                                           bool logits) {
  const char* op = tree_sampling_op_name(logits);
  const bool flat = cu_num_draft_tokens.has_value();
  // Padded: parents [B, N]. Flat: parents [T + B] (request b's k_b + 1 nodes, its root first, from cu[b-1] + b) and
  // N = max_draft_tokens + 1, the outputs' width.
  TORCH_CHECK_VALUE(parents.dim() == (flat ? 1 : 2), op, ": parents must be ", flat ? "[T + B] in the flat form" : "[B, N]",
                    ", got ", parents.sizes());
  TORCH_CHECK_VALUE(output_token_ids.dim() == 2, op, ": output_token_ids must be [B, N], got ", output_token_ids.sizes());
  const int64_t B = flat ? cu_num_draft_tokens->numel() : parents.size(0);
  const int64_t N = flat ? output_token_ids.size(1) : parents.size(1), R = parents.size(0);
  TORCH_CHECK_VALUE(N >= 1 && N <= kMaxTreeNodes, op, ": the number of tree nodes N must be in [1, ", kMaxTreeNodes,
                    "], got ", N);
  TORCH_CHECK_VALUE(!flat || R >= B, op, ": the flat form's parents must have T + B >= B = ", B, " entries, got ", R);
  const SamplingArgs A{op, logits, B, target.device()};
  TreeSamplingParams T{};
  T.rows.draft_rows_per_node = true;
  check_sampling_rows(T.rows, A, target, flat, flat ? R : N, flat ? "T+B" : "N", draft, flat ? R : N, flat ? "T+B" : "N",
                      greedy_or_temperature, seed, offset, E, error_flags);
  if (E.uniforms.has_value()) {
    T.rows.uniforms = flat ? uniforms_pointer(A, *E.uniforms, {R}, "[T + B]") : uniforms_pointer(A, *E.uniforms, {B, N}, "[B, N]");
  }
  TORCH_CHECK_VALUE(parents.scalar_type() == at::kInt && parents.is_contiguous(), op,
                    ": parents must be a contiguous int32 tensor, got ", parents.scalar_type());
  A.same_device(parents, "parents");
  TORCH_CHECK_VALUE(candidate_token_ids.sizes() == parents.sizes() &&
                        (candidate_token_ids.scalar_type() == at::kInt || candidate_token_ids.scalar_type() == at::kLong) &&
                        candidate_token_ids.is_contiguous(),
                    op, ": candidate_token_ids must be a contiguous int32 or int64 tensor shaped like parents ",
                    parents.sizes(), ", got ", candidate_token_ids.sizes(), " ", candidate_token_ids.scalar_type());
  A.same_device(candidate_token_ids, "candidate_token_ids");
  if (flat) {
    A.vector_of(*cu_num_draft_tokens, "cu_num_draft_tokens", at::kInt);
    T.rows.cu_num_draft_tokens = cu_num_draft_tokens->data_ptr<int32_t>();
    T.rows.flat_positions = R - B;
    T.rows.num_draft = N - 1;
  } else {
    TORCH_CHECK_VALUE(num_nodes.has_value(), op, ": num_nodes is needed in the padded form");
    A.vector_of(*num_nodes, "num_nodes", at::kInt);
    T.num_nodes = num_nodes->data_ptr<int32_t>();
    T.rows.num_draft = N;
  }
  A.matrix_of(output_token_ids, "output_token_ids", N, "N");
  A.matrix_of(accepted_nodes, "accepted_nodes", N, "N");
  A.vector_of(num_accepted, "num_accepted", at::kInt);
  T.parents = parents.data_ptr<int32_t>();
  T.token_ids = candidate_token_ids.data_ptr();
  T.token_ids_int64 = candidate_token_ids.scalar_type() == at::kLong;
  T.output_token_ids = output_token_ids.data_ptr<int32_t>();
  T.accepted_nodes = accepted_nodes.data_ptr<int32_t>();
  T.num_accepted = num_accepted.data_ptr<int32_t>();
  T.nodes = N;
  return T;
}

inline constexpr ErrorBit kTreeSamplingErrorBits[] = {
    {kErrTargetNonFinite, "{target} holds NaN or inf (-inf is allowed in logits)"},
    {kErrDraftNonFinite, "{draft} holds NaN or inf (-inf is allowed in logits)"},
    {kErrDraftTokenId, "candidate_token_ids holds ids outside [0, V) below num_nodes"},
    {kErrTemperature, "temperature must be finite and >= 0"},
    {kErrTargetNoMass, "{target} has a row to sample from with no mass (every logit -inf, or every probability 0)"},
    {kErrTreeParent, "parents is not a tree: the root's parent must be -1 and every other node's an earlier node "
                     "(a parent out of range, after its child, or a cycle)"},
    {kErrNumNodes, "num_nodes holds values outside [1, N]"},
    {kErrDuplicateSibling, "candidate_token_ids repeats a token among the children of one node"},
    {kErrUniform, "uniforms and final_uniforms must be in [0, 1)"},
    {kErrCuNumDraftTokens, "cu_num_draft_tokens must be non-decreasing, in [0, T], with steps of at most max_draft_tokens"},
    {kErrDraftToTarget, "draft_to_target holds an id outside [0, V) or an id twice"},
    {kErrRowFilter, "top_k must be >= 0, top_p in (0, 1] and min_p in [0, 1)"},
    {kErrTargetLse, "target_lse holds a row's normaliser more than 2^-14 + 2^-20 |lse| off logits_normalizer's"},
    {kErrDraftLse, "draft_lse holds a row's normaliser more than 2^-14 + 2^-20 |lse| off logits_normalizer's"},
};

inline std::string tree_sampling_error_message(int32_t bits, bool logits) {
  return std::string(tree_sampling_op_name(logits)) + ": invalid input: " +
         describe_error_bits(bits, kTreeSamplingErrorBits, logits ? "target_logits" : "target_probs",
                             logits ? "draft_logits" : "draft_probs");
}

}  // namespace specdec
