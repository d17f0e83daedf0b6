// Argument checks shared by the CPU, CUDA and emulated implementations of each op. The Python wrappers
// in specdec_ext/ops.py check the same things first with friendlier messages; these keep direct
// torch.ops calls from reading or writing out of bounds.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <utility>

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

// The kernels' device-side error word: a one-element int32 tensor on `device`, or none.
inline int32_t* error_flags_pointer(const char* op, const std::optional<at::Tensor>& error_flags, const at::Device& device) {
  if (!error_flags.has_value()) return nullptr;
  TORCH_CHECK_VALUE(error_flags->numel() == 1 && error_flags->scalar_type() == at::kInt, op,
                    ": error_flags must be a one-element int32 tensor");
  TORCH_CHECK_VALUE(error_flags->device() == device, op, ": error_flags is on ", error_flags->device(), ", expected ", device);
  return error_flags->data_ptr<int32_t>();
}

constexpr int64_t kMaxSkinnyRows = 16;  // skinny_linear's row limit (decode and verify steps)

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with the backend's element type for `dtype`: Float for float32, Half for float16,
// BFloat16 for bfloat16, `void` where the kernel does not take that dtype. Every other dtype throws naming
// the op, so that a dtype added to the Python checks is never reinterpreted as one of these.
template <typename Float, typename Half, typename BFloat16, typename F>
void dispatch_float_types(at::ScalarType dtype, const char* op, F&& f) {
  if (dtype == at::kFloat) {
    if constexpr (!std::is_void_v<Float>) return f(TypeTag<Float>{});
  } else if (dtype == at::kHalf) {
    if constexpr (!std::is_void_v<Half>) return f(TypeTag<Half>{});
  } else if (dtype == at::kBFloat16) {
    if constexpr (!std::is_void_v<BFloat16>) return f(TypeTag<BFloat16>{});
  }
  TORCH_CHECK_VALUE(false, op, ": no kernel for dtype ", dtype);
}

// What an error bit of a kernel's device-side error word means: the one table per op, used by the C++
// messages and exported to Python (specdec_ext._C.constants()). "{target}" and "{draft}" stand for the
// names of the op's inputs (target_probs or target_logits, ...).
struct ErrorBit {
  int32_t bit;
  const char* message;
};

// Joins the messages of the bits set in `bits`, with the input names filled in.
template <size_t N>
std::string describe_error_bits(int32_t bits, const ErrorBit (&table)[N], const std::string& target = "",
                                const std::string& draft = "") {
  std::string joined;
  for (const ErrorBit& e : table) {
    if (!(bits & e.bit)) continue;
    std::string m = e.message;
    for (const auto& [key, value] : {std::pair<std::string, std::string>{"{target}", target}, {"{draft}", draft}}) {
      for (size_t at = m.find(key); at != std::string::npos; at = m.find(key)) m.replace(at, key.size(), value);
    }
    joined += (joined.empty() ? "" : "; ") + m;
  }
  return joined;
}

}  // namespace specdec

#include "specdec/chain_sampling.h"

namespace specdec {

// The checks the chain and tree sampling ops share: target rows [B, R, V] (R = rows), draft rows [B, R_d, V]
// (R_d = draft_rows) when given, the [B] controls (greedy or temperature), seed and offset, the error word;
// gathered into P. `rows_name` / `draft_rows_name` spell R and R_d in messages ("K+1", "N"); `op`'s input
// names are target_/draft_ + probs or logits.
struct SamplingArgs {
  const char* op;
  bool logits;
  int64_t batch;
  const at::Device device;
  const char* tname() const { return logits ? "target_logits" : "target_probs"; }
  const char* dname() const { return logits ? "draft_logits" : "draft_probs"; }
  void same_device(const at::Tensor& t, const char* name) const {
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but ", tname(), " is on ", device);
  }
  void vector_of(const at::Tensor& t, const char* name, at::ScalarType type) const {
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == batch && t.scalar_type() == type && t.is_contiguous(), op, ": ", name,
                      " must be a contiguous [B] = [", batch, "] ", type, " tensor, got ", t.sizes(), " ", t.scalar_type(),
                      t.is_contiguous() ? "" : " (not contiguous)");
    same_device(t, name);
  }
  // A contiguous [B, n] int32 tensor (outputs, parents).
  void matrix_of(const at::Tensor& t, const char* name, int64_t n, const char* n_name) const {
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == batch && t.size(1) == n && t.scalar_type() == at::kInt && t.is_contiguous(),
                      op, ": ", name, " must be a contiguous [B, ", n_name, "] = [", batch, ", ", n, "] int32 tensor, got ",
                      t.sizes(), " ", t.scalar_type(), t.is_contiguous() ? "" : " (not contiguous)");
    same_device(t, name);
  }
};

// The engine-layout inputs both sampling ops take (docs/design.md §3.4); absent ones are nullopt.
struct EngineLayoutArgs {
  const std::optional<at::Tensor>& uniforms;
  const std::optional<at::Tensor>& final_uniforms;
  const std::optional<at::Tensor>& target_to_draft;
  c10::string_view coupling;  // "rejection" or "gumbel"
  // The from-logits ops' per-request logits processing (row_filter.h): [B] int32, float32, float32, or absent.
  const std::optional<at::Tensor>* top_k = nullptr;
  const std::optional<at::Tensor>* top_p = nullptr;
  const std::optional<at::Tensor>* min_p = nullptr;
};

// Target rows: [B, rows, V] (padded) or [rows, V] (flat); draft rows likewise with draft_rows rows and V columns, or Vd
// columns with target_to_draft [V] (the draft column of each target id, -1 for none). Also the [B] controls
// (greedy or temperature), seed and offset, final_uniforms [B], the error word; gathered into P. `rows_name` /
// `draft_rows_name` spell the row counts in messages ("K+1", "N", "T+B"); `op`'s input names are target_/draft_ +
// probs or logits.
inline void check_sampling_rows(ChainSamplingParams& P, const SamplingArgs& A, const at::Tensor& target, bool flat,
                                int64_t rows, const char* rows_name, const std::optional<at::Tensor>& draft,
                                int64_t draft_rows, const char* draft_rows_name, const at::Tensor& greedy_or_temperature,
                                const at::Tensor& seed, const at::Tensor& offset, const EngineLayoutArgs& E,
                                const std::optional<at::Tensor>& error_flags) {
  const char *op = A.op, *tname = A.tname(), *dname = A.dname();
  const int64_t B = A.batch;
  if (flat) {
    TORCH_CHECK_VALUE(target.dim() == 2 && target.size(0) == rows, op, ": ", tname, " must be [", rows_name, ", V] = [", rows,
                      ", V] in the flat form, got ", target.sizes());
  } else {
    TORCH_CHECK_VALUE(target.dim() == 3 && target.size(0) == B && target.size(1) == rows, op, ": ", tname, " must be [B, ",
                      rows_name, ", V] = [", B, ", ", rows, ", V], got ", target.sizes());
  }
  const auto dtype = target.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op, ": ", tname,
                    " must be float32, float16 or bfloat16, got ", dtype);
  const int64_t V = target.size(-1);
  TORCH_CHECK_VALUE(V >= 1 && V <= kMaxVocab, op, ": the vocabulary size V must be in [1, ", kMaxVocab, "], got ", V);
  TORCH_CHECK_VALUE(target.stride(-1) == 1, op, ": ", tname, " must be contiguous in its last (vocabulary) dimension");
  int64_t Vd = V;
  if (E.target_to_draft.has_value()) {
    const at::Tensor& m = *E.target_to_draft;
    TORCH_CHECK_VALUE(m.dim() == 1 && m.size(0) == V && m.scalar_type() == at::kInt && m.is_contiguous(), op,
                      ": target_to_draft must be a contiguous [V] = [", V, "] int32 tensor, got ", m.sizes(), " ",
                      m.scalar_type());
    TORCH_CHECK_VALUE(draft.has_value(), op, ": a draft vocabulary map needs ", dname);
    A.same_device(m, "target_to_draft");
    Vd = draft->size(-1);
    TORCH_CHECK_VALUE(Vd >= 1 && Vd <= kMaxVocab, op, ": the draft vocabulary size Vd must be in [1, ", kMaxVocab, "], got ",
                      Vd);
    P.target_to_draft = m.data_ptr<int32_t>();
  }
  if (draft.has_value()) {
    const at::Tensor& d = *draft;
    if (flat) {
      TORCH_CHECK_VALUE(d.dim() == 2 && d.size(0) == draft_rows && d.size(1) == Vd, op, ": ", dname, " must be [",
                        draft_rows_name, ", ", E.target_to_draft ? "Vd" : "V", "] = [", draft_rows, ", ", Vd,
                        "] in the flat form, got ", d.sizes());
    } else {
      TORCH_CHECK_VALUE(d.dim() == 3 && d.size(0) == B && d.size(1) == draft_rows && d.size(2) == Vd, op, ": ", dname,
                        " must be [B, ", draft_rows_name, ", ", E.target_to_draft ? "Vd" : "V", "] = [", B, ", ",
                        draft_rows, ", ", Vd, "], got ", d.sizes());
    }
    TORCH_CHECK_VALUE(d.scalar_type() == dtype, op, ": ", dname, " must have the dtype of ", tname, " (", dtype, "), got ",
                      d.scalar_type());
    TORCH_CHECK_VALUE(d.stride(-1) == 1, op, ": ", dname, " must be contiguous in its last (vocabulary) dimension");
    A.same_device(d, dname);
    P.draft = d.data_ptr();
    P.draft_stride_b = flat ? 0 : d.stride(0);
    P.draft_stride_k = d.stride(-2);
  }
  if (E.target_to_draft.has_value() && A.device.is_cpu()) {
    // Host-side here: the kernels then trust the columns (on CUDA they treat one outside [0, Vd) as absent).
    const int32_t* m = E.target_to_draft->data_ptr<int32_t>();
    for (int64_t v = 0; v < V; ++v) {
      TORCH_CHECK_VALUE(m[v] >= -1 && m[v] < Vd, op, ": target_to_draft[", v, "] = ", m[v], " is outside [-1, Vd = ", Vd, ")");
    }
  }
  P.draft_vocab = Vd;
  TORCH_CHECK_VALUE(E.coupling == "rejection" || E.coupling == "gumbel", op, ": coupling must be \"rejection\" or ",
                    "\"gumbel\", got \"", std::string(E.coupling), "\"");
  P.gumbel = E.coupling == "gumbel";
  if (P.gumbel) {  // the Gumbel-max token of each row decides alone: nothing else would be read
    TORCH_CHECK_VALUE(!draft.has_value(), op, ": coupling=\"gumbel\" reads no draft rows; pass ", dname, "=None");
    TORCH_CHECK_VALUE(!E.uniforms.has_value() && !E.final_uniforms.has_value(), op,
                      ": coupling=\"gumbel\" draws its own noise per position; uniforms and final_uniforms must be None");
  }
  const auto row_filter = [&](const std::optional<at::Tensor>* t, const char* name, at::ScalarType type) -> const void* {
    if (t == nullptr || !t->has_value()) return nullptr;
    A.vector_of(**t, name, type);
    return (*t)->data_ptr();
  };
  P.top_k = static_cast<const int32_t*>(row_filter(E.top_k, "top_k", at::kInt));
  P.top_p = static_cast<const float*>(row_filter(E.top_p, "top_p", at::kFloat));
  P.min_p = static_cast<const float*>(row_filter(E.min_p, "min_p", at::kFloat));
  A.vector_of(greedy_or_temperature, A.logits ? "temperature" : "greedy", A.logits ? at::kFloat : at::kBool);
  A.vector_of(seed, "seed", at::kLong);
  A.vector_of(offset, "offset", at::kLong);
  if (E.final_uniforms.has_value()) {
    A.vector_of(*E.final_uniforms, "final_uniforms", at::kFloat);
    P.final_uniforms = E.final_uniforms->data_ptr<float>();
  }
  P.error_flags = error_flags_pointer(op, error_flags, A.device);
  P.target = target.data_ptr();
  P.target_stride_b = flat ? 0 : target.stride(0);
  P.target_stride_k = target.stride(-2);
  if (A.logits) {
    P.temperature = greedy_or_temperature.data_ptr<float>();
  } else {
    P.greedy = greedy_or_temperature.data_ptr<bool>();
  }
  P.seed = seed.data_ptr<int64_t>();
  P.offset = offset.data_ptr<int64_t>();
  P.batch = B;
  P.vocab = V;
  P.logits = A.logits;
}

// A contiguous float32 tensor of `shape` (the caller's uniforms).
inline const float* uniforms_pointer(const SamplingArgs& A, const at::Tensor& u, at::IntArrayRef shape, const char* shape_name) {
  TORCH_CHECK_VALUE(u.sizes() == shape && u.scalar_type() == at::kFloat && u.is_contiguous(), A.op,
                    ": uniforms must be a contiguous ", shape_name, " = ", shape, " float32 tensor, got ", u.sizes(), " ",
                    u.scalar_type());
  A.same_device(u, "uniforms");
  return u.data_ptr<float>();
}

// Checks the arguments of both chain sampling ops and gathers them into the kernels' parameters. Padded form:
// draft_token_ids [B, K], num_draft_tokens [B], target rows [B, K+1, V] ([B, K, V] allowed with bonus_token_ids),
// draft rows [B, K, V or Vd], uniforms [B, K]. Flat form (cu_num_draft_tokens [B]): draft_token_ids [T], target rows
// [T + B, V] or [T, V] with bonus_token_ids, draft rows [T, V or Vd], uniforms [T]. Outputs [B, K + 1] (K =
// max_draft_tokens in the flat form) and [B].
inline ChainSamplingParams make_chain_params(const at::Tensor& draft_token_ids, const at::Tensor& target,
                                             const std::optional<at::Tensor>& draft,
                                             const std::optional<at::Tensor>& num_draft_tokens,
                                             const at::Tensor& greedy_or_temperature, const at::Tensor& seed,
                                             const at::Tensor& offset, const at::Tensor& output_token_ids,
                                             const at::Tensor& num_accepted, const std::optional<at::Tensor>& error_flags,
                                             const std::optional<at::Tensor>& cu_num_draft_tokens,
                                             const std::optional<at::Tensor>& bonus_token_ids, const EngineLayoutArgs& E,
                                             const std::optional<at::Tensor>& accepted_independently, bool logits) {
  const char* op = logits ? "chain_speculative_sampling_from_logits" : "chain_speculative_sampling";
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
  return P;
}

inline constexpr ErrorBit kSamplingErrorBits[] = {
    {kErrTargetNonFinite, "{target} holds NaN or inf (-inf is allowed in logits)"},
    {kErrDraftNonFinite, "{draft} holds NaN or inf (-inf is allowed in logits)"},
    {kErrDraftTokenId, "draft_token_ids holds ids outside [0, V) below num_draft_tokens"},
    {kErrNumDraftTokens, "num_draft_tokens holds values outside [0, K]"},
    {kErrTemperature, "temperature must be finite and >= 0"},
    {kErrTargetNoMass, "{target} has a row to sample from with no mass (every logit -inf, or every probability 0)"},
    {kErrUniform, "uniforms and final_uniforms must be in [0, 1)"},
    {kErrBonusTokenId, "bonus_token_ids holds ids outside [0, V)"},
    {kErrCuNumDraftTokens, "cu_num_draft_tokens must be non-decreasing, in [0, T], with steps of at most max_draft_tokens"},
    {kErrDraftToTarget, "draft_to_target holds an id outside [0, V) or an id twice"},
    {kErrRowFilter, "top_k must be >= 0, top_p in (0, 1] and min_p in [0, 1)"},
};

// The message for error bits raised by the sampling kernels (SamplingError).
inline std::string sampling_error_message(int32_t bits, bool logits) {
  const char* op = logits ? "chain_speculative_sampling_from_logits" : "chain_speculative_sampling";
  return std::string(op) + ": invalid input: " +
         describe_error_bits(bits, kSamplingErrorBits, logits ? "target_logits" : "target_probs",
                             logits ? "draft_logits" : "draft_probs");
}

}  // namespace specdec

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
};

inline std::string tree_sampling_error_message(int32_t bits, bool logits) {
  return std::string(tree_sampling_op_name(logits)) + ": invalid input: " +
         describe_error_bits(bits, kTreeSamplingErrorBits, logits ? "target_logits" : "target_probs",
                             logits ? "draft_logits" : "draft_probs");
}

}  // namespace specdec

#include "specdec/kv_cache.h"

namespace specdec {

// Whether kv_layout names HND (true) or NHD (false); anything else is a ValueError naming kv_layout.
inline bool kv_layout_is_hnd(const char* op, c10::string_view kv_layout) {
  TORCH_CHECK_VALUE(kv_layout == "NHD" || kv_layout == "HND", op, ": kv_layout must be \"NHD\" or \"HND\", got \"",
                    std::string(kv_layout), "\"");
  return kv_layout == "HND";
}

inline TruncateParams make_truncate_params(const at::Tensor& cache_seqlens, const at::Tensor& num_kept,
                                           const std::optional<at::Tensor>& kept_indices, at::TensorList k_caches,
                                           at::TensorList v_caches, const std::optional<at::Tensor>& block_table,
                                           std::optional<int64_t> block_len, bool clear,
                                           const std::optional<at::Tensor>& error_flags,
                                           const std::optional<at::Tensor>& kv_indptr,
                                           const std::optional<at::Tensor>& kv_indices, c10::string_view kv_layout) {
  const char* op = "truncate_kv_cache";
  const bool hnd = kv_layout_is_hnd(op, kv_layout);
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.scalar_type() == at::kInt && cache_seqlens.is_contiguous(), op,
                    ": cache_seqlens must be a contiguous [B] int32 tensor, got ", cache_seqlens.sizes(), " ",
                    cache_seqlens.scalar_type());
  const int64_t B = cache_seqlens.size(0);
  const auto device = cache_seqlens.device();
  auto same_device = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but cache_seqlens is on ", device);
  };
  TORCH_CHECK_VALUE(num_kept.dim() == 1 && num_kept.size(0) == B && num_kept.scalar_type() == at::kInt &&
                        num_kept.is_contiguous(),
                    op, ": num_kept must be a contiguous [B] = [", B, "] int32 tensor, got ", num_kept.sizes(), " ",
                    num_kept.scalar_type());
  same_device(num_kept, "num_kept");
  TORCH_CHECK_VALUE(!block_len.has_value() || (*block_len >= 1 && *block_len <= kMaxBlockLen), op,
                    ": block_len must be in [1, ", kMaxBlockLen, "], got ", block_len.value_or(0));
  TORCH_CHECK_VALUE(block_len.has_value() || (!kept_indices.has_value() && !clear), op,
                    ": block_len is needed with kept_indices or clear");
  TruncateParams P{};
  P.cache_seqlens = cache_seqlens.data_ptr<int32_t>();
  P.num_kept = num_kept.data_ptr<int32_t>();
  P.batch = B;
  P.block_len = block_len.value_or(0);  // 0: lengths only, no block given
  P.clear = clear;
  P.capacity = INT64_MAX / 2;
  P.page_size = 1;
  if (kept_indices.has_value()) {
    const at::Tensor& t = *kept_indices;
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == B && t.size(1) == P.block_len && t.scalar_type() == at::kInt &&
                          t.is_contiguous(),
                      op, ": kept_indices must be a contiguous [B, block_len] = [", B, ", ", P.block_len,
                      "] int32 tensor, got ", t.sizes(), " ", t.scalar_type());
    same_device(t, "kept_indices");
    P.kept_indices = t.data_ptr<int32_t>();
  }
  TORCH_CHECK_VALUE(k_caches.size() == v_caches.size(), op, ": k_caches and v_caches must list the same number of layers, got ",
                    k_caches.size(), " and ", v_caches.size());
  TORCH_CHECK_VALUE(!k_caches.empty() || (!kept_indices.has_value() && !clear), op,
                    ": k_caches and v_caches are needed with kept_indices or clear");
  TORCH_CHECK_VALUE(static_cast<int64_t>(k_caches.size()) <= kMaxCacheLayers, op, ": at most ", kMaxCacheLayers,
                    " layers, got ", k_caches.size());
  P.layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK_VALUE(!(block_table.has_value() && kv_indptr.has_value()), op,
                    ": give block_table or the CSR table (kv_indptr, kv_indices), not both");
  TORCH_CHECK_VALUE(kv_indptr.has_value() == kv_indices.has_value(), op, ": kv_indptr and kv_indices go together");
  const bool paged = block_table.has_value() || kv_indptr.has_value();
  if (block_table.has_value()) {
    const at::Tensor& t = *block_table;
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == B && t.scalar_type() == at::kInt && t.is_contiguous(), op,
                      ": block_table must be a contiguous [B, max_pages] int32 tensor, got ", t.sizes(), " ",
                      t.scalar_type());
    same_device(t, "block_table");
    P.block_table = t.data_ptr<int32_t>();
    P.max_pages = t.size(1);
  }
  if (kv_indptr.has_value()) {
    for (const auto& [t, name, n] : {std::tuple{&*kv_indptr, "kv_indptr", B + 1}, std::tuple{&*kv_indices, "kv_indices", int64_t{-1}}}) {
      TORCH_CHECK_VALUE(t->dim() == 1 && (n < 0 || t->size(0) == n) && t->scalar_type() == at::kInt && t->is_contiguous(),
                        op, ": ", name, " must be a contiguous 1-D int32 tensor", n >= 0 ? " of B+1 entries" : "", ", got ",
                        t->sizes(), " ", t->scalar_type());
      same_device(*t, name);
    }
    P.kv_indptr = kv_indptr->data_ptr<int32_t>();
    P.kv_indices = kv_indices->data_ptr<int32_t>();
    P.num_indices = kv_indices->size(0);
  }
  // The cache dims: [page or request, slot, head, D] (NHD) or [page or request, head, slot, D] (HND).
  const int slot_dim = hnd ? 2 : 1, head_dim = hnd ? 1 : 2;
  for (int64_t l = 0; l < P.layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& c = kv == 0 ? k_caches[l] : v_caches[l];
      const char* name = kv == 0 ? "k_caches" : "v_caches";
      const at::Tensor& first = k_caches[0];
      TORCH_CHECK_VALUE(c.dim() == 4, op, ": ", name, "[", l, "] must be ",
                        hnd ? "[B, Hkv, S_max, D] or [num_pages, Hkv, page_size, D]"
                            : "[B, S_max, Hkv, D] or [num_pages, page_size, Hkv, D]",
                        " (kv_layout \"", std::string(kv_layout), "\"), got ", c.sizes());
      TORCH_CHECK_VALUE(c.sizes() == first.sizes() && c.strides() == first.strides() && c.scalar_type() == first.scalar_type(),
                        op, ": every layer of k_caches and v_caches must have the shape, strides and dtype of k_caches[0]");
      same_device(c, name);
      const int64_t elem = c.element_size();
      if (hnd) {
        TORCH_CHECK_VALUE(c.stride(3) == 1 && (c.size(3) * elem) % 4 == 0, op, ": ", name, "[", l,
                          "]: each head's D values must be contiguous and a multiple of 4 bytes");
      } else {
        TORCH_CHECK_VALUE(c.stride(3) == 1 && c.stride(2) == c.size(3) && (c.size(2) * c.size(3) * elem) % 4 == 0, op, ": ",
                          name, "[", l, "]: each token's [Hkv, D] values must be contiguous and a multiple of 4 bytes");
      }
      if (paged) {  // any page stride; each page dense
        TORCH_CHECK_VALUE(c.stride(2) == c.size(3) && c.stride(1) == c.size(2) * c.size(3), op, ": ", name, "[", l,
                          "]: each page of a paged cache must be dense (any page stride), got strides ", c.strides());
      } else {
        TORCH_CHECK_VALUE(c.size(0) >= B, op, ": ", name, "[", l, "] holds ", c.size(0), " requests, cache_seqlens ", B);
      }
      TORCH_CHECK_VALUE((c.stride(0) * elem) % 4 == 0 && (c.stride(1) * elem) % 4 == 0 && (c.stride(2) * elem) % 4 == 0,
                        op, ": ", name, " strides must be multiples of 4 bytes");
      (kv == 0 ? P.k : P.v)[l] = c.data_ptr();
    }
  }
  if (P.layers > 0) {
    const at::Tensor& c = k_caches[0];
    const int64_t elem = c.element_size();
    const int64_t H = c.size(head_dim), D = c.size(3);
    P.stride_page = c.stride(0) * elem / 4;
    P.stride_slot = c.stride(slot_dim) * elem / 4;
    if (!hnd) {  // a token's [Hkv, D] is one run
      P.segments = 1;
      P.segment_words = H * D * elem / 4;
    } else {
      P.segments = H;
      P.segment_words = D * elem / 4;
      P.stride_segment = c.stride(head_dim) * elem / 4;
    }
    if (paged) {
      P.page_size = c.size(slot_dim);
      P.num_pages = c.size(0);
      TORCH_CHECK_VALUE(P.page_size >= 1, op, ": a paged cache needs page_size >= 1");
      if (block_table.has_value()) P.capacity = P.max_pages * P.page_size;  // CSR: per request
    } else {
      P.capacity = c.size(slot_dim);
    }
  } else if (paged) {
    P.page_size = 1;  // lengths only: the table is not read
    P.block_table = nullptr;
    P.kv_indptr = nullptr;
    P.kv_indices = nullptr;
  }
  P.error_flags = error_flags_pointer(op, error_flags, device);
  return P;
}

inline constexpr ErrorBit kTruncateErrorBits[] = {
    {kErrNumKept, "num_kept must be in [0, block_len] (>= 0 without block_len)"},
    {kErrKeptIndices, "kept_indices must increase within [0, block_len) for the first num_kept entries"},
    {kErrBlockRange,
     "the slots it touches run outside the cache or past 2^31 - 1 ([cache_seqlens, cache_seqlens + block_len) with "
     "kept_indices or clear, else [cache_seqlens, cache_seqlens + num_kept))"},
    {kErrPageIndex, "block_table points outside the paged cache for the slots it touches (kv_indices with the CSR table)"},
    {kErrKvIndptr, "kv_indptr must start at >= 0, not decrease and end <= len(kv_indices)"},
    {kErrPageAlias, "block_table (kv_indices with the CSR table) lists a page of the block twice within one request"},
};

inline std::string truncate_error_message(int32_t bits, int64_t b) {
  return "truncate_kv_cache: request " + std::to_string(b) + ": " + describe_error_bits(bits, kTruncateErrorBits);
}

}  // namespace specdec

#include "specdec/attention.h"

namespace specdec {

inline constexpr ErrorBit kAttentionErrorBits[] = {
    {kAttentionBadLength,
     "the block [cache_seqlens[b], cache_seqlens[b] + Q_b) runs outside the cache (or cache_seqlens[b] < 0; with the "
     "CSR table: its kv length holds fewer than Q_b tokens)"},
    {kAttentionBadPage, "block_table points outside the paged cache (kv_indices with the CSR table)"},
    {kAttentionBadQoIndptr, "qo_indptr must be non-decreasing from >= 0 to <= T, with at most 128 rows per request"},
    {kAttentionBadKvIndptr,
     "kv_indptr must be non-decreasing from >= 0 to <= len(kv_indices), and kv_last_page_len in [1, page_size] "
     "(0 for a request without pages)"},
    {kAttentionBadMask, "the flat tree_mask is shorter than sum Q_b^2"},
    {kAttentionPageAlias,
     "block_table (kv_indices with the CSR table) lists a page the new tokens go to twice within one request"},
};

// A 1-D contiguous int32 tensor of n entries (n < 0: any length) on `device`, or a ValueError naming it.
inline const int32_t* attention_index_vector(const at::Tensor& t, const char* name, int64_t n, const at::Device& device) {
  TORCH_CHECK_VALUE(t.dim() == 1 && (n < 0 || t.size(0) == n) && t.scalar_type() == at::kInt && t.is_contiguous(),
                    "verify_attention: ", name, " must be a contiguous 1-D int32 tensor",
                    n >= 0 ? " of " + std::to_string(n) + " entries" : std::string(), ", got ", t.sizes(), " ",
                    t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == device, "verify_attention: ", name, " is on ", t.device(), " but q is on ", device);
  return t.data_ptr<int32_t>();
}

// Checks verify_attention's arguments and gathers them into the kernels' parameters (layouts: specdec/attention.h).
// `out` is written, like q; `lse`, when given, is q's shape without D, float32.
inline AttentionParams make_attention_params(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& k_new,
    const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& tree_mask, std::optional<double> softmax_scale, const at::Tensor& out,
    const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& error_flags,
    const std::optional<at::Tensor>& qo_indptr, const std::optional<at::Tensor>& kv_indptr,
    const std::optional<at::Tensor>& kv_indices, const std::optional<at::Tensor>& kv_last_page_len,
    c10::string_view kv_layout, int64_t window_left, double logits_soft_cap) {
  const char* op = "verify_attention";
  const bool flat = qo_indptr.has_value(), csr = kv_indptr.has_value(), hnd = kv_layout_is_hnd(op, kv_layout);
  const auto device = q.device();
  auto same = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but q is on ", device);
  };
  AttentionParams P{};
  int64_t B, Q, T;
  if (flat) {
    TORCH_CHECK_VALUE(q.dim() == 3 && q.is_contiguous(), op, ": with qo_indptr, q must be a contiguous [T, Hq, D] tensor, got ",
                      q.sizes());
    TORCH_CHECK_VALUE(qo_indptr->dim() == 1 && qo_indptr->size(0) >= 1, op, ": qo_indptr must be [B+1], got ",
                      qo_indptr->sizes());
    B = qo_indptr->size(0) - 1;
    P.qo_indptr = attention_index_vector(*qo_indptr, "qo_indptr", B + 1, device);
    T = q.size(0);
    Q = std::min<int64_t>(T, kMaxVerifyQueries);  // the most rows one request can own
  } else {
    TORCH_CHECK_VALUE(q.dim() == 4 && q.is_contiguous(), op, ": q must be a contiguous [B, Q, Hq, D] tensor, got ", q.sizes());
    B = q.size(0);
    Q = q.size(1);
    T = B * Q;
    TORCH_CHECK_VALUE(Q >= 1 && Q <= kMaxVerifyQueries, op, ": the number of new tokens Q must be in [1, ",
                      kMaxVerifyQueries, "], got ", Q);
  }
  const int64_t Hq = q.size(-2), D = q.size(-1);
  const auto dtype = q.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, op,
                    ": q must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK_VALUE(D >= 1 && D <= kMaxHeadDim, op, ": head dim D must be in [1, ", kMaxHeadDim, "], got ", D);
  TORCH_CHECK_VALUE(Hq >= 1, op, ": q must have at least one head, got Hq = ", Hq);
  TORCH_CHECK_VALUE(!softmax_scale.has_value() ||
                        (std::isfinite(static_cast<float>(*softmax_scale)) && static_cast<float>(*softmax_scale) > 0), op,
                    ": softmax_scale must be finite and > 0, got ", softmax_scale.value_or(0.0));
  TORCH_CHECK_VALUE(window_left >= -1 && window_left <= INT32_MAX, op, ": window_left must be -1 (off) or in [0, 2^31), got ",
                    window_left);
  TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(logits_soft_cap)) && logits_soft_cap >= 0, op,
                    ": logits_soft_cap must be finite and >= 0 (0: off), got ", logits_soft_cap);
  const bool paged = block_table.has_value() || csr;
  TORCH_CHECK_VALUE(!(block_table.has_value() && csr), op, ": give block_table or the CSR table (kv_indptr, kv_indices, "
                    "kv_last_page_len), not both");
  // The cache dims: [page or request, slot, head, D] (NHD) or [page or request, head, slot, D] (HND).
  const int slot_dim = hnd ? 2 : 1, head_dim = hnd ? 1 : 2;
  for (const auto* c : {&k_cache, &v_cache}) {
    const char* name = c == &k_cache ? "k_cache" : "v_cache";
    TORCH_CHECK_VALUE(c->dim() == 4 && c->size(3) == D && c->stride(3) == 1, op, ": ", name, " must be ",
                      hnd ? "[B, Hkv, S_max, D] or [num_pages, Hkv, page_size, D]"
                          : "[B, S_max, Hkv, D] or [num_pages, page_size, Hkv, D]",
                      " (kv_layout \"", std::string(kv_layout), "\") with D = ", D,
                      " contiguous in its last dimension, got ", c->sizes(), " with strides ", c->strides());
    TORCH_CHECK_VALUE(c->scalar_type() == dtype, op, ": ", name, " must have q's dtype ", dtype, ", got ", c->scalar_type());
    same(*c, name);
    if (paged) {  // any page stride; each page's [page_size, Hkv, D] / [Hkv, page_size, D] dense
      TORCH_CHECK_VALUE(c->stride(2) == D && c->stride(1) == c->size(2) * D, op, ": ", name,
                        ": each page of a paged cache must be dense (any page stride), got strides ", c->strides());
    }
  }
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(), op,
                    ": k_cache and v_cache must have the same shape and strides");
  const int64_t Hkv = k_cache.size(head_dim);
  TORCH_CHECK_VALUE(Hkv >= 1 && Hq % Hkv == 0, op, ": the query heads Hq = ", Hq,
                    " must be a multiple of the KV heads Hkv = ", Hkv);
  P.stride_page = k_cache.stride(0);
  P.stride_slot = k_cache.stride(slot_dim);
  P.stride_head = k_cache.stride(head_dim);
  if (csr) {
    TORCH_CHECK_VALUE(!cache_seqlens.has_value(), op, ": cache_seqlens must be None with kv_indptr: the lengths come from "
                      "the CSR table (FlashInfer's kv length, which includes the Q_b new tokens)");
    TORCH_CHECK_VALUE(kv_indices.has_value() && kv_last_page_len.has_value(), op,
                      ": kv_indptr needs kv_indices and kv_last_page_len");
    P.kv_indptr = attention_index_vector(*kv_indptr, "kv_indptr", B + 1, device);
    P.kv_indices = attention_index_vector(*kv_indices, "kv_indices", -1, device);
    P.kv_last_page_len = attention_index_vector(*kv_last_page_len, "kv_last_page_len", B, device);
    P.num_indices = kv_indices->size(0);
  } else {
    TORCH_CHECK_VALUE(!kv_indices.has_value() && !kv_last_page_len.has_value(), op,
                      ": kv_indices and kv_last_page_len need kv_indptr");
    TORCH_CHECK_VALUE(cache_seqlens.has_value(), op, ": cache_seqlens is needed (unless the CSR table kv_indptr is given)");
    P.cache_seqlens = attention_index_vector(*cache_seqlens, "cache_seqlens", B, device);
  }
  TORCH_CHECK_VALUE(k_new.has_value() == v_new.has_value(), op, ": give both k_new and v_new, or neither");
  if (k_new.has_value()) {
    for (const auto* t : {&*k_new, &*v_new}) {
      const char* name = t == &*k_new ? "k_new" : "v_new";
      const bool shape_ok = flat ? t->dim() == 3 && t->size(0) == T && t->size(1) == Hkv && t->size(2) == D
                                 : t->dim() == 4 && t->size(0) == B && t->size(1) == Q && t->size(2) == Hkv && t->size(3) == D;
      TORCH_CHECK_VALUE(shape_ok && t->is_contiguous() && t->scalar_type() == dtype, op, ": ", name, " must be a contiguous ",
                        flat ? "[T, Hkv, D] = [" + std::to_string(T) + ", "
                             : "[B, Q, Hkv, D] = [" + std::to_string(B) + ", " + std::to_string(Q) + ", ",
                        Hkv, ", ", D, "] ", dtype, " tensor, got ", t->sizes(), " ", t->scalar_type());
      same(*t, name);
    }
    P.k_new = k_new->data_ptr();
    P.v_new = v_new->data_ptr();
  }
  P.page_size = 1;
  if (paged) {
    P.page_size = k_cache.size(slot_dim);
    P.num_pages = k_cache.size(0);
    TORCH_CHECK_VALUE(P.page_size >= 1, op, ": a paged k_cache needs page_size >= 1");
    P.page_shift = (P.page_size & (P.page_size - 1)) == 0 ? __builtin_ctzll(P.page_size) : -1;
    if (block_table.has_value()) {
      const at::Tensor& t = *block_table;
      TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == B && t.scalar_type() == at::kInt && t.is_contiguous(), op,
                        ": block_table must be a contiguous [B, max_pages] int32 tensor, got ", t.sizes(), " ",
                        t.scalar_type());
      same(t, "block_table");
      P.block_table = t.data_ptr<int32_t>();
      P.max_pages = t.size(1);
      TORCH_CHECK_VALUE(P.max_pages >= 1, op, ": block_table has no columns: the paged cache holds no positions");
      P.capacity = P.max_pages * P.page_size;
    } else {
      P.capacity = P.num_indices * P.page_size;  // a bound: no request lists more pages than kv_indices holds
    }
  } else {
    TORCH_CHECK_VALUE(k_cache.size(0) >= B, op, ": k_cache holds ", k_cache.size(0), " requests, q ", B);
    P.capacity = k_cache.size(slot_dim);
    TORCH_CHECK_VALUE(P.capacity >= 1, op, ": k_cache holds no positions (S_max = 0)");
  }
  if (tree_mask.has_value()) {
    const at::Tensor& m = *tree_mask;
    if (flat) {
      TORCH_CHECK_VALUE(m.dim() == 1 && m.scalar_type() == at::kBool && m.is_contiguous(), op,
                        ": with qo_indptr, tree_mask must be a flat contiguous bool tensor (request b's [Q_b, Q_b] "
                        "row-major at offset sum_{c<b} Q_c^2), got ", m.sizes(), " ", m.scalar_type());
    } else {
      const bool per_request = m.dim() == 3;
      TORCH_CHECK_VALUE((m.dim() == 2 || (per_request && m.size(0) == B)) && m.size(-1) == Q && m.size(-2) == Q &&
                            m.scalar_type() == at::kBool && m.is_contiguous(),
                        op, ": tree_mask must be a contiguous bool [Q, Q] or [B, Q, Q] tensor with Q = ", Q, ", got ",
                        m.sizes(), " ", m.scalar_type());
      P.mask_per_request = per_request;
    }
    same(m, "tree_mask");
    P.tree_mask = m.data_ptr<bool>();
    P.mask_numel = m.numel();
  }
  TORCH_CHECK_VALUE(out.sizes() == q.sizes() && out.scalar_type() == dtype && out.is_contiguous(), op,
                    ": out must be a contiguous ", dtype, " tensor of q's shape ", q.sizes(), ", got ", out.sizes(), " ",
                    out.scalar_type());
  same(out, "out");
  if (lse.has_value()) {
    TORCH_CHECK_VALUE(lse->sizes() == q.sizes().slice(0, q.dim() - 1) && lse->scalar_type() == at::kFloat &&
                          lse->is_contiguous(),
                      op, ": lse must be a contiguous float32 tensor of shape ", q.sizes().slice(0, q.dim() - 1), ", got ",
                      lse->sizes(), " ", lse->scalar_type());
    same(*lse, "lse");
    P.lse = lse->data_ptr<float>();
  }
  P.q = q.data_ptr();
  P.k_cache = k_cache.data_ptr();
  P.v_cache = v_cache.data_ptr();
  P.out = out.data_ptr();
  P.batch = B;
  P.num_queries = Q;
  P.total_queries = T;
  P.q_heads = Hq;
  P.kv_heads = Hkv;
  P.head_dim = D;
  P.window_left = static_cast<int32_t>(window_left);
  P.soft_cap = static_cast<float>(logits_soft_cap);
  P.scale = softmax_scale.has_value() ? static_cast<float>(*softmax_scale) : 1.0f / std::sqrt(static_cast<float>(D));
  P.error_flags = error_flags_pointer(op, error_flags, device);
  return P;
}

// The message for request b's AttentionError bits (CPU kernel: raised before anything is written).
inline std::string attention_error_message(int32_t bits, int64_t b) {
  return "verify_attention: request " + std::to_string(b) + ": " + describe_error_bits(bits, kAttentionErrorBits);
}

}  // namespace specdec
