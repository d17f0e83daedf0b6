// Tree speculative sampling on the CPU (tree_speculative_sampling, tree_speculative_sampling_from_logits, their flat
// form): requests in parallel (at::parallel_for), each running tree_sampling_request (specdec/tree_sampling.h) on the
// CPU sampling engine (cpu/sampling_engine.h) with the request's nodes and levels.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "checks/tree_sampling.h"
#include "cpu/sampling_engine.h"
#include "specdec/tree_sampling.h"

namespace specdec {
namespace {

// The engine's block sums of one tile (cpu/sampling_engine.h) for a tree's residual: the loop over its levels is per
// entry.
template <bool kLogits>
SPECDEC_HD void tree_tile_block_sums_for(TreeMass spec, int64_t t, const float* pt, const float* qt, float* sums) {
  spec.logits = kLogits;
  for (int l = 0; l < kLanes; ++l) {
    const int32_t v0 = static_cast<int32_t>(t * kTile + l * kLaneEntries);
    const float* p = pt + l * kLaneEntries;
    const float* q = spec.has_q ? qt + l * kLaneEntries : p;
    const auto m = [&](int j) __attribute__((always_inline)) { return entry_mass(spec, v0 + j, p[j], q[j], spec.has_q); };
    sums[l] = fadd(fadd(fadd(m(0), m(1)), fadd(m(2), m(3))), fadd(fadd(m(4), m(5)), fadd(m(6), m(7))));
  }
}

}  // namespace

// In namespace specdec, not the unnamed one: the engine's total() finds this overload for a TreeMass by
// argument-dependent lookup.
static SPECDEC_CPU_CLONES void tile_block_sums(const TreeMass spec, int64_t t, const float* pt, const float* qt, bool,
                                               float* sums) {
  spec.logits ? tree_tile_block_sums_for<true>(spec, t, pt, qt, sums) : tree_tile_block_sums_for<false>(spec, t, pt, qt, sums);
}

namespace {

// The tree flow's engine: the chain engine's row operations plus the request's nodes and levels.
template <typename T>
struct CpuTreeEngine : CpuSamplingEngine<T> {
  const TreeSamplingParams& TP;
  int64_t b = 0;
  bool node_valid[kMaxTreeNodes];
  int32_t removed[kMaxTreeNodes];
  float inv_q[kMaxTreeNodes], inv_s[kMaxTreeNodes];

  explicit CpuTreeEngine(const TreeSamplingParams& tp) : CpuSamplingEngine<T>(tp.rows), TP(tp) {}

  int32_t parent(int32_t c) const { return tree_parent(TP, b, c); }
  int64_t token(int32_t c) const { return tree_token(TP, b, c); }
  bool valid(int32_t c) const { return node_valid[c]; }
  void load_tree(int64_t request, int32_t n) {
    b = request;
    for (int32_t c = 1; c < n; ++c) {
      const int32_t bits = tree_node_errors([&](int32_t i) { return parent(i); }, [&](int32_t i) { return token(i); }, c,
                                            TP.rows.vocab);
      node_valid[c] = bits == 0;
      this->flag(bits);
    }
  }
  TreeLevels levels() { return TreeLevels{removed, inv_q, inv_s}; }
  void set_level(int32_t i, int32_t x, float q, float s) {
    removed[i] = x;
    inv_q[i] = q;
    inv_s[i] = s;
  }
  void write_tree(int64_t request, int32_t node, int32_t depth, int32_t token) {
    write_tree_outputs(TP, request, node, depth, token);
  }
};

// The controls and nodes of every request, before anything is sampled or written (so that whether an input
// raises does not depend on where a round ends).
int32_t check_tree_controls(const TreeSamplingParams& T) {
  int32_t errors = 0;
  for (int64_t b = 0; b < T.rows.batch; ++b) {
    errors |= check_tree_request(T, b);
    const int32_t n = tree_num_nodes(T, b);
    for (int32_t c = 1; c < n; ++c) {
      errors |= tree_node_errors([&](int32_t i) { return tree_parent(T, b, i); },
                                 [&](int32_t i) { return tree_token(T, b, i); }, c, T.rows.vocab);
    }
  }
  return errors;
}

void tree_sampling_cpu(const at::Tensor& parents, const at::Tensor& candidate_token_ids, const Opt& num_nodes,
                       const at::Tensor& target, const Opt& draft, const at::Tensor& greedy_or_temperature,
                       const at::Tensor& seed, const at::Tensor& offset, const at::Tensor& output_token_ids,
                       const at::Tensor& accepted_nodes, const at::Tensor& num_accepted, const Opt& error_flags,
                       const Opt& cu_num_draft_tokens, const EngineLayoutArgs& E, bool logits) {
  const TreeSamplingParams TP = make_tree_params(parents, candidate_token_ids, num_nodes, target, draft, greedy_or_temperature,
                                                 seed, offset, output_token_ids, accepted_nodes, num_accepted, error_flags,
                                                 cu_num_draft_tokens, E, logits);
  int32_t errors = check_tree_controls(TP);
  if (errors == 0) {
    const char* op = tree_sampling_op_name(logits);
    dispatch_float_types<float, c10::Half, c10::BFloat16>(target.scalar_type(), op, [&](auto tag) {
      using Engine = CpuTreeEngine<typename decltype(tag)::type>;
      errors = run_requests<Engine>(TP, TP.rows.batch, [&](Engine& e, int64_t b) { tree_sampling_request(e, TP, b); });
    });
  }
  if (errors != 0) {
    if (TP.rows.error_flags != nullptr) *TP.rows.error_flags |= errors;
    TORCH_CHECK_VALUE(false, tree_sampling_error_message(errors, logits));
  }
}

void tree_sampling_op_cpu(const at::Tensor& parents, const at::Tensor& candidate_token_ids, const Opt& num_nodes,
                          const at::Tensor& target, const Opt& draft, const at::Tensor& greedy,
                          const at::Tensor& seed, const at::Tensor& offset, const at::Tensor& output_token_ids,
                          const at::Tensor& accepted_nodes, const at::Tensor& num_accepted, const Opt& error_flags,
                          const Opt& uniforms, const Opt& final_uniforms, const Opt& target_to_draft,
                          const Opt& cu_num_draft_tokens, c10::string_view coupling) {
  tree_sampling_cpu(parents, candidate_token_ids, num_nodes, target, draft, greedy, seed, offset,
                    output_token_ids, accepted_nodes, num_accepted, error_flags,
                    cu_num_draft_tokens, EngineLayoutArgs{uniforms, final_uniforms, target_to_draft, coupling}, false);
}

void tree_sampling_from_logits_op_cpu(const at::Tensor& parents, const at::Tensor& candidate_token_ids,
                                      const Opt& num_nodes, const at::Tensor& target, const Opt& draft,
                                      const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& offset,
                                      const at::Tensor& output_token_ids, const at::Tensor& accepted_nodes,
                                      const at::Tensor& num_accepted, const Opt& error_flags, const Opt& uniforms,
                                      const Opt& final_uniforms, const Opt& target_to_draft,
                                      const Opt& cu_num_draft_tokens, c10::string_view coupling, const Opt& top_k,
                                      const Opt& top_p, const Opt& min_p, const Opt& target_lse,
                                      const Opt& draft_lse, bool check_lse) {
  tree_sampling_cpu(parents, candidate_token_ids, num_nodes, target, draft, temperature, seed, offset, output_token_ids,
                    accepted_nodes, num_accepted, error_flags, cu_num_draft_tokens,
                    EngineLayoutArgs{uniforms, final_uniforms, target_to_draft, coupling, &top_k, &top_p, &min_p,
                                     &target_lse, &draft_lse, check_lse},
                    true);
}
}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("tree_speculative_sampling", &tree_sampling_op_cpu);
  m.impl("tree_speculative_sampling_from_logits", &tree_sampling_from_logits_op_cpu);
}

}  // namespace specdec
