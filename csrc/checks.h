// Argument checks shared by the CPU, CUDA and emulated implementations of each op. The Python wrappers
// in specdec_ext/ops.py check the same things first with friendlier messages; these keep direct
// torch.ops calls from reading or writing out of bounds.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace specdec {

inline void check_philox_args(const at::Tensor& seed, const at::Tensor& offset, int64_t n, int64_t stream) {
  TORCH_CHECK_VALUE(seed.dim() == 1 && seed.scalar_type() == at::kLong, "philox_uniform: seed must be a 1-D int64 tensor, got ",
                    seed.sizes(), " ", seed.scalar_type());
  TORCH_CHECK_VALUE(offset.dim() == 1 && offset.scalar_type() == at::kLong,
                    "philox_uniform: offset must be a 1-D int64 tensor, got ", offset.sizes(), " ", offset.scalar_type());
  TORCH_CHECK_VALUE(seed.size(0) == offset.size(0), "philox_uniform: seed and offset must have the same length, got ",
                    seed.size(0), " and ", offset.size(0));
  TORCH_CHECK_VALUE(seed.device() == offset.device(), "philox_uniform: seed and offset must be on the same device, got ",
                    seed.device(), " and ", offset.device());
  TORCH_CHECK_VALUE(n >= 0 && n <= (int64_t{1} << 34), "philox_uniform: n must be in [0, 2^34], got ", n);
  TORCH_CHECK_VALUE(stream >= 0 && stream <= 0xffffffffLL, "philox_uniform: stream must be in [0, 2^32), got ", stream);
}

}  // namespace specdec

#include "specdec/chain_sampling.h"

namespace specdec {

// Checks the arguments of both chain sampling ops and gathers them into the kernels' parameters.
// `probs_or_logits` names the input kind in messages ("probs" / "logits").
inline ChainSamplingParams make_chain_params(const at::Tensor& draft_token_ids, const at::Tensor& target,
                                             const std::optional<at::Tensor>& draft, const at::Tensor& num_draft_tokens,
                                             const at::Tensor& greedy_or_temperature, const at::Tensor& seed,
                                             const at::Tensor& offset, const at::Tensor& output_token_ids,
                                             const at::Tensor& num_accepted, const std::optional<at::Tensor>& error_flags,
                                             bool logits) {
  const char* op = logits ? "chain_speculative_sampling_from_logits" : "chain_speculative_sampling";
  const char* tname = logits ? "target_logits" : "target_probs";
  const char* dname = logits ? "draft_logits" : "draft_probs";
  TORCH_CHECK_VALUE(draft_token_ids.dim() == 2, op, ": draft_token_ids must be [B, K], got ", draft_token_ids.sizes());
  TORCH_CHECK_VALUE(draft_token_ids.scalar_type() == at::kInt || draft_token_ids.scalar_type() == at::kLong, op,
                    ": draft_token_ids must be int32 or int64, got ", draft_token_ids.scalar_type());
  const int64_t B = draft_token_ids.size(0), K = draft_token_ids.size(1);
  TORCH_CHECK_VALUE(K >= 1 && K <= kMaxDraftTokens, op, ": the number of draft tokens K must be in [1, ", kMaxDraftTokens,
                    "], got ", K);
  TORCH_CHECK_VALUE(target.dim() == 3 && target.size(0) == B && target.size(1) == K + 1, op, ": ", tname,
                    " must be [B, K+1, V] = [", B, ", ", K + 1, ", V], got ", target.sizes());
  const auto dtype = target.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op, ": ", tname,
                    " must be float32, float16 or bfloat16, got ", dtype);
  const int64_t V = target.size(2);
  TORCH_CHECK_VALUE(V >= 1 && V <= kMaxVocab, op, ": the vocabulary size V must be in [1, ", kMaxVocab, "], got ", V);
  TORCH_CHECK_VALUE(target.stride(2) == 1, op, ": ", tname, " must be contiguous in its last (vocabulary) dimension");
  const auto device = target.device();
  auto same_device = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but ", tname, " is on ", device);
  };
  auto vector_of = [&](const at::Tensor& t, const char* name, at::ScalarType type) {
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == B && t.scalar_type() == type && t.is_contiguous(), op, ": ", name,
                      " must be a contiguous [B] = [", B, "] ", type, " tensor, got ", t.sizes(), " ", t.scalar_type());
    same_device(t, name);
  };
  same_device(draft_token_ids, "draft_token_ids");
  TORCH_CHECK_VALUE(draft_token_ids.is_contiguous(), op, ": draft_token_ids must be contiguous");
  ChainSamplingParams P{};
  if (draft.has_value()) {
    const at::Tensor& d = *draft;
    TORCH_CHECK_VALUE(d.dim() == 3 && d.size(0) == B && d.size(1) == K && d.size(2) == V, op, ": ", dname,
                      " must be [B, K, V] = [", B, ", ", K, ", ", V, "], got ", d.sizes());
    TORCH_CHECK_VALUE(d.scalar_type() == dtype, op, ": ", dname, " must have the dtype of ", tname, " (", dtype, "), got ",
                      d.scalar_type());
    TORCH_CHECK_VALUE(d.stride(2) == 1, op, ": ", dname, " must be contiguous in its last (vocabulary) dimension");
    same_device(d, dname);
    P.draft = d.data_ptr();
    P.draft_stride_b = d.stride(0);
    P.draft_stride_k = d.stride(1);
  }
  vector_of(num_draft_tokens, "num_draft_tokens", at::kInt);
  vector_of(greedy_or_temperature, logits ? "temperature" : "greedy", logits ? at::kFloat : at::kBool);
  vector_of(seed, "seed", at::kLong);
  vector_of(offset, "offset", at::kLong);
  TORCH_CHECK_VALUE(output_token_ids.dim() == 2 && output_token_ids.size(0) == B && output_token_ids.size(1) == K + 1 &&
                        output_token_ids.scalar_type() == at::kInt && output_token_ids.is_contiguous(),
                    op, ": output_token_ids must be a contiguous [B, K+1] int32 tensor, got ", output_token_ids.sizes(),
                    " ", output_token_ids.scalar_type());
  same_device(output_token_ids, "output_token_ids");
  vector_of(num_accepted, "num_accepted", at::kInt);
  if (error_flags.has_value()) {
    TORCH_CHECK_VALUE(error_flags->numel() == 1 && error_flags->scalar_type() == at::kInt, op,
                      ": error_flags must be a one-element int32 tensor");
    same_device(*error_flags, "error_flags");
    P.error_flags = error_flags->data_ptr<int32_t>();
  }
  P.draft_ids = draft_token_ids.data_ptr();
  P.draft_ids_int64 = draft_token_ids.scalar_type() == at::kLong;
  P.target = target.data_ptr();
  P.target_stride_b = target.stride(0);
  P.target_stride_k = target.stride(1);
  P.num_draft_tokens = num_draft_tokens.data_ptr<int32_t>();
  if (logits) {
    P.temperature = greedy_or_temperature.data_ptr<float>();
  } else {
    P.greedy = greedy_or_temperature.data_ptr<bool>();
  }
  P.seed = seed.data_ptr<int64_t>();
  P.offset = offset.data_ptr<int64_t>();
  P.output_token_ids = output_token_ids.data_ptr<int32_t>();
  P.num_accepted = num_accepted.data_ptr<int32_t>();
  P.batch = B;
  P.num_draft = K;
  P.vocab = V;
  P.logits = logits;
  return P;
}

// The message for error bits raised by the sampling kernels (SamplingError).
inline std::string sampling_error_message(int32_t bits, bool logits) {
  const char* op = logits ? "chain_speculative_sampling_from_logits" : "chain_speculative_sampling";
  std::string m = std::string(op) + ": invalid input:";
  if (bits & kErrTargetNonFinite) m += logits ? " target_logits holds NaN or +inf;" : " target_probs holds NaN or inf;";
  if (bits & kErrDraftNonFinite) m += logits ? " draft_logits holds NaN or +inf;" : " draft_probs holds NaN or inf;";
  if (bits & kErrDraftTokenId) m += " draft_token_ids holds ids outside [0, V);";
  if (bits & kErrNumDraftTokens) m += " num_draft_tokens holds values outside [0, K];";
  if (bits & kErrTemperature) m += " temperature must be finite and >= 0;";
  m.pop_back();
  return m;
}

}  // namespace specdec
