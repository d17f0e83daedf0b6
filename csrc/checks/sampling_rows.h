// The argument checks the chain and tree sampling ops share (checks/chain_sampling.h, checks/tree_sampling.h).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

#include "checks/common.h"
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
  // The from-logits ops' caller normalisers (ChainSamplingParams::target_lse): float32, the rows' shape less V.
  const std::optional<at::Tensor>* target_lse = nullptr;
  const std::optional<at::Tensor>* draft_lse = nullptr;
  bool check_lse = false;
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
  const auto normalizer = [&](const std::optional<at::Tensor>* t, const char* name, const at::Tensor& rows,
                              const char* rows_name) -> const float* {
    if (t == nullptr || !t->has_value()) return nullptr;
    const at::Tensor& n = **t;
    const auto shape = rows.sizes().slice(0, rows.dim() - 1);
    TORCH_CHECK_VALUE(n.sizes() == shape && n.scalar_type() == at::kFloat && n.is_contiguous(), op, ": ", name,
                      " must be a contiguous float32 tensor of ", rows_name, "'s shape less its last dimension, ", shape,
                      ", got ", n.sizes(), " ", n.scalar_type(), n.is_contiguous() ? "" : " (not contiguous)");
    A.same_device(n, name);
    return n.data_ptr<float>();
  };
  P.target_lse = normalizer(E.target_lse, "target_lse", target, tname);
  if (E.draft_lse != nullptr && E.draft_lse->has_value()) {
    TORCH_CHECK_VALUE(draft.has_value(), op, ": draft_lse normalises ", dname, ", which is None");
    // A reduced draft row is normalised over its mapped columns in target-id order, which a normaliser of the draft
    // rows themselves does not reproduce.
    TORCH_CHECK_VALUE(!E.target_to_draft.has_value(), op, ": draft_lse is not taken with a draft vocabulary map "
                      "(draft_to_target); pass target_lse alone");
    P.draft_lse = normalizer(E.draft_lse, "draft_lse", *draft, dname);
  }
  P.check_lse = E.check_lse;
  P.target_rows = flat ? 0 : target.size(1);
  P.draft_rows = flat || !draft.has_value() ? 0 : draft->size(1);
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

}  // namespace specdec
