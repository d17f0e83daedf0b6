// Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the per-request decision flow,
// shared by the CPU kernel and the CUDA kernel. Each backend supplies an Engine with the row operations
// (argmax, softmax statistics, sampling by inverse CDF), computed in the canonical order of
// sampling_math.h, so that every backend takes the same decisions and emits the same tokens.
//
// Row i of request b is read only while the round is still going at position i: the flow stops at the
// first rejection, and the rows after it are never touched. With top_k / top_p / min_p (row_filter.h) each row of a
// sampled request is processed as the flow reaches it (filter_rows): its threshold found, then applied by every read.
// Block verification (P.block; Sun et al. 2024, chain_block_verify below) judges a sampled request's drafts jointly
// and reads every row pair of its block; greedy requests are verified token by token in either mode.
#pragma once
#include "row_filter.h"
#include "sampling_math.h"

namespace specdec {

struct ChainSamplingParams {
  const void* draft_ids;        // [B, K] (padded) or [T] (flat) int32 or int64
  bool draft_ids_int64;
  const void* target;           // [B, K+1, V] (padded) or [T + B, V] / [T, V] with bonus_ids (flat); probabilities or logits
  const void* draft;            // [B, K, Vd] or [T, Vd], or nullptr: point proposals
  int64_t target_stride_b, target_stride_k;  // in elements (flat: stride_b 0, stride_k the row stride); the
  int64_t draft_stride_b, draft_stride_k;    // vocabulary dimension is contiguous
  int64_t target_rows, draft_rows;           // padded form: the rows per request (target.size(1), draft.size(1))
  // [B]: the drafts request b judges. Padded form: required, in [0, K]. Flat form: nullptr (every draft its
  // layout holds), or a cap in [0, cu[b] - cu[b-1]]: request b judges its first num_draft_tokens[b] drafts, and its
  // all-accepted token comes from its target row num_draft_tokens[b]; the drafts past the cap are never read.
  const int32_t* num_draft_tokens;
  // Engine layouts (docs/design.md §3.4). Flat form: request b owns draft positions [cu[b-1], cu[b]) (cu[-1] = 0)
  // of draft_ids, the draft rows and uniforms, and target rows from cu[b-1] + b (its bonus row last) or, with
  // bonus_ids, from cu[b-1]. num_draft is then max_draft_tokens, the outputs' width less one.
  const int32_t* cu_num_draft_tokens;  // [B] inclusive cumulative sum, or nullptr (padded form)
  int64_t flat_positions;       // T: the flat form's draft positions (draft_ids' length)
  const void* bonus_ids;        // [B] int32/int64 or nullptr: the token emitted when every draft is accepted
  bool bonus_ids_int64;
  const float* uniforms;        // acceptance draws at the request's draft positions (tree: [B, N] by node), or nullptr (Philox)
  const float* final_uniforms;  // [B]: the resampled / bonus token's draw, or nullptr (Philox)
  const int32_t* target_to_draft;  // [V]: the draft column of each target id (-1: none), or nullptr (draft rows have V columns)
  int64_t draft_vocab;          // Vd: the draft rows' columns
  int32_t* accepted_independently;  // [B] or nullptr: drafts accepted when each is judged on its own (FlashInfer's count)
  bool draft_rows_per_node;     // trees: flat draft rows are [T + B, Vd], one per node like the target's
  // coupling="gumbel": a sampled row's token is its Gumbel-max sample (sampling_math.h, gumbel_keys4) with the noise of
  // the request's position offset[b] + the row's depth; a draft is accepted when it equals it. No draft row or
  // uniform is read. The emitted tokens are then the ones plain decoding with the same noise draws.
  bool gumbel;
  // verification="block" (Sun et al. 2024, arXiv 2403.10444): a sampled request's drafts are judged jointly
  // (chain_block_verify); never with gumbel or accepted_independently (refused by the checks).
  bool block;
  // Logits processing (row_filter.h), per request, or nullptr (off): applied to target and draft rows alike.
  const int32_t* top_k;         // [B], 0: off
  const float* top_p;           // [B], 1: off
  const float* min_p;           // [B], 0: off
  const bool* greedy;           // [B] (probabilities); nullptr with logits
  const float* temperature;     // [B] (logits); nullptr with probabilities
  // Caller normalisers (logits): ln sum_v exp(x_v / temperature) over each processed row (after top_k / top_p /
  // min_p), [rows] in the rows' order (target_row_number, draft_row_number), or nullptr. A finite value replaces the
  // row's statistics pass (norm_of_lse); a non-finite one is ignored (the row's statistics are computed). With
  // check_lse (strict mode) the statistics are computed anyway and a value off them (lse_matches) is flagged.
  const float* target_lse;
  const float* draft_lse;
  bool check_lse;
  // logits_normalizer: with row_lse [B], each request's target row 0 is not sampled; its normaliser (lse_of_stats of
  // the processed row; +inf for a greedy request) is written to row_lse[b], and nothing else is.
  float* row_lse;
  const int64_t* seed;          // [B]
  const int64_t* offset;        // [B]
  int32_t* output_token_ids;    // [B, K+1]
  int32_t* num_accepted;        // [B]
  int32_t* error_flags;         // [1] or nullptr
  int64_t batch, num_draft, vocab;  // B, K, V
  bool logits;
};

// Request b's first draft position: its index into draft_ids, the draft rows and uniforms.
SPECDEC_HD int64_t draft_start(const ChainSamplingParams& P, int64_t b) {
  if (P.cu_num_draft_tokens == nullptr) return b * P.num_draft;
  return b > 0 ? P.cu_num_draft_tokens[b - 1] : 0;
}

// The draft positions request b's layout holds: K (padded form), or cu[b] - cu[b-1] (flat form).
SPECDEC_HD int64_t layout_num_drafts(const ChainSamplingParams& P, int64_t b) {
  if (P.cu_num_draft_tokens == nullptr) return P.num_draft;
  return static_cast<int64_t>(P.cu_num_draft_tokens[b]) - draft_start(P, b);
}

// Request b's draft count as given (not clamped): num_draft_tokens[b] (padded form, or the flat form's cap), else
// cu[b] - cu[b-1].
SPECDEC_HD int64_t given_num_drafts(const ChainSamplingParams& P, int64_t b) {
  if (P.num_draft_tokens != nullptr) return P.num_draft_tokens[b];
  return layout_num_drafts(P, b);
}

// Whether request b's rows can be found: always in the padded form (a bad count is clamped); in the flat form its
// positions [cu[b-1], cu[b]) must lie in [0, T] and number at most max_draft_tokens. An inconsistent request is
// never read: it emits no token.
SPECDEC_HD bool request_rows_valid(const ChainSamplingParams& P, int64_t b) {
  if (P.cu_num_draft_tokens == nullptr) return true;
  const int64_t start = draft_start(P, b), end = P.cu_num_draft_tokens[b];
  return start >= 0 && start <= end && end <= P.flat_positions && end - start <= P.num_draft;
}

// Element offsets of request b's target row i (0 <= i <= k_b) and draft row i.
SPECDEC_HD int64_t target_row_offset(const ChainSamplingParams& P, int64_t b, int64_t i) {
  if (P.cu_num_draft_tokens == nullptr) return b * P.target_stride_b + i * P.target_stride_k;
  return (draft_start(P, b) + (P.bonus_ids != nullptr ? 0 : b) + i) * P.target_stride_k;
}
SPECDEC_HD int64_t draft_row_offset(const ChainSamplingParams& P, int64_t b, int64_t i) {
  if (P.cu_num_draft_tokens == nullptr) return b * P.draft_stride_b + i * P.draft_stride_k;
  return (draft_start(P, b) + (P.draft_rows_per_node ? b : 0) + i) * P.draft_stride_k;
}

// The row numbers of request b's target row i and draft row i among all the target (draft) rows: b * R + i in the
// padded form, the row itself in the flat one (where the caller's normalisers are found).
SPECDEC_HD int64_t target_row_number(const ChainSamplingParams& P, int64_t b, int64_t i) {
  if (P.cu_num_draft_tokens == nullptr) return b * P.target_rows + i;
  return draft_start(P, b) + (P.bonus_ids != nullptr ? 0 : b) + i;
}
SPECDEC_HD int64_t draft_row_number(const ChainSamplingParams& P, int64_t b, int64_t i) {
  if (P.cu_num_draft_tokens == nullptr) return b * P.draft_rows + i;
  return draft_start(P, b) + (P.draft_rows_per_node ? b : 0) + i;
}

SPECDEC_HD int64_t draft_token(const ChainSamplingParams& P, int64_t b, int64_t i) {
  const int64_t at = draft_start(P, b) + i;
  return P.draft_ids_int64 ? static_cast<const int64_t*>(P.draft_ids)[at] : static_cast<const int32_t*>(P.draft_ids)[at];
}

SPECDEC_HD int64_t bonus_token(const ChainSamplingParams& P, int64_t b) {
  return P.bonus_ids_int64 ? static_cast<const int64_t*>(P.bonus_ids)[b] : static_cast<const int32_t*>(P.bonus_ids)[b];
}

// Whether a caller's uniform is usable: in [0, 1) (0 accepts every draft with p > 0; NaN is not).
SPECDEC_HD bool uniform_valid(float u) { return u >= 0.0f && u < 1.0f; }

// The acceptance draw of draft position i of request b: the caller's uniform, or uniform i of Philox stream 0.
SPECDEC_HD float accept_uniform(const ChainSamplingParams& P, int64_t b, int64_t i, uint64_t seed, uint64_t offset) {
  if (P.uniforms != nullptr) return P.uniforms[draft_start(P, b) + i];
  return philox_uniform_at(seed, offset, kStreamAccept, static_cast<uint64_t>(i));
}

// The draw of the round's resampled or bonus token: the caller's final uniform, or uniform 0 of Philox stream 1.
SPECDEC_HD float final_uniform(const ChainSamplingParams& P, int64_t b, uint64_t seed, uint64_t offset) {
  if (P.final_uniforms != nullptr) return P.final_uniforms[b];
  return philox_uniform_at(seed, offset, kStreamResample, 0);
}

// The draft column holding target id v (v itself without a map), or -1 if the draft has no such column.
SPECDEC_HD int64_t draft_column(const ChainSamplingParams& P, int64_t v) {
  if (P.target_to_draft == nullptr) return v;
  const int32_t c = P.target_to_draft[v];
  return c >= 0 && c < P.draft_vocab ? c : -1;
}

// Position j of a request's output row: the accepted drafts, the last token, then -1.
SPECDEC_HD int32_t output_id(const ChainSamplingParams& P, int64_t b, int64_t j, int32_t accepted, int32_t token) {
  if (j < accepted) return static_cast<int32_t>(draft_token(P, b, j));
  return j == accepted ? token : -1;
}

// The CUDA kernel's blocks per request, its "slices" (the launcher's rule, kept here so that it is tested without a
// GPU): the request's 1024 canonical lanes split into S blocks of whole groups (warps), S in {1, 2, 4, ..., 32}. The
// largest S with batch * S <= sms whose group of S blocks the device can hold at once (resident_blocks(S) >= S, the
// blocks of S threads it holds; 0 without cooperative launches), else 1: more SMs per request while the batch leaves
// SMs idle, never a second wave. The split changes no bit (sampling_math.h).
constexpr int kMaxSamplingSlices = kGroups;
template <typename ResidentBlocks>
int sampling_slices(int64_t batch, int sms, ResidentBlocks&& resident_blocks) {
  for (int s = kMaxSamplingSlices; s > 1; s /= 2) {
    if (batch * s <= sms && resident_blocks(s) >= s) return s;
  }
  return 1;
}
// The request groups a launch of S slices runs at once (the grid is groups * S blocks; a grid-stride loop covers the
// rest of the batch): every request when the device holds them (S > 1 is a cooperative launch, so at most
// resident / S groups), and at most 2^28 groups of one block.
inline int64_t sampling_groups(int64_t batch, int slices, int64_t resident) {
  const int64_t fit = slices > 1 ? resident / slices : int64_t{1} << 28;
  return batch < fit ? batch : fit;
}

// One level of the inverse CDF: the first i whose cumulative mass fadd(base, c_i), c_i the left-to-right
// sum parts[0] + ... + parts[i], exceeds `threshold`; or, should rounding let none, the last i with a
// positive part (n - 1 if none is). *before = c_{i-1} (0 for i = 0). Parts are masses, >= 0. A pick by crossing always has a
// positive part, since the level's base never exceeds the threshold.
SPECDEC_HD int first_crossing(const float* parts, int n, float base, float threshold, float* before) {
  float c = 0.0f, fallback_before = 0.0f;
  int fallback = n - 1;
  for (int i = 0; i < n; ++i) {
    const float next = fadd(c, parts[i]);
    if (fadd(base, next) > threshold) {
      *before = c;
      return i;
    }
    if (parts[i] > 0.0f) {
      fallback = i;
      fallback_before = c;
    }
    c = next;
  }
  *before = fallback_before;
  return fallback;
}

// Whether the op processes rows (top_k, top_p or min_p given).
SPECDEC_HD bool row_filters_given(const ChainSamplingParams& P) {
  return P.top_k != nullptr || P.top_p != nullptr || P.min_p != nullptr;
}
SPECDEC_HD RowFilter given_row_filter(const ChainSamplingParams& P, int64_t b) {
  return RowFilter{P.top_k != nullptr ? P.top_k[b] : 0, P.top_p != nullptr ? P.top_p[b] : 1.0f,
                   P.min_p != nullptr ? P.min_p[b] : 0.0f};
}
SPECDEC_HD int32_t check_row_filter(const ChainSamplingParams& P, int64_t b) {
  return row_filters_given(P) && !row_filter_valid(given_row_filter(P, b)) ? kErrRowFilter : 0;
}
// What request b's rows are processed with: its controls, or none for greedy requests and invalid controls.
SPECDEC_HD RowFilter request_row_filter(const ChainSamplingParams& P, int64_t b, bool greedy) {
  const RowFilter f = given_row_filter(P, b);
  return greedy || !row_filter_valid(f) ? RowFilter{0, 1.0f, 0.0f} : f;
}

// Sets the engine's thresholds for the rows about to be read (row_q may be null), when the op processes rows.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with a device engine (CUDA) or a host one (CPU)
#endif
template <typename Engine, typename Row>
SPECDEC_FLOW void filter_rows(Engine& e, const ChainSamplingParams& P, int64_t b, bool greedy, const Row* row_p,
                              const Row* row_q, float scale) {
  if (row_filters_given(P)) e.filter_rows(row_p, row_q, request_row_filter(P, b, greedy), scale);
}

// The inputs of request b other than its rows: the draft count, every draft id it covers, the temperature.
// Checked in full before any row is read, so that whether an input is reported does not depend on where
// the round happens to end. Returns SamplingError bits.
SPECDEC_HD int32_t check_request_controls(const ChainSamplingParams& P, int64_t b) {
  int32_t bits = 0;
  if (!request_rows_valid(P, b)) return kErrCuNumDraftTokens;
  int64_t k = given_num_drafts(P, b);
  const int64_t limit = layout_num_drafts(P, b);
  if (k < 0 || k > limit) {
    bits |= kErrNumDraftTokens;
    k = k < 0 ? 0 : limit;
  }
  for (int64_t i = 0; i < k; ++i) {
    const int64_t x = draft_token(P, b, i);
    if (x < 0 || x >= P.vocab) bits |= kErrDraftTokenId;
    if (P.uniforms != nullptr && !uniform_valid(P.uniforms[draft_start(P, b) + i])) bits |= kErrUniform;
  }
  if (P.final_uniforms != nullptr && !uniform_valid(P.final_uniforms[b])) bits |= kErrUniform;
  if (P.bonus_ids != nullptr) {
    const int64_t x = bonus_token(P, b);
    if (x < 0 || x >= P.vocab) bits |= kErrBonusTokenId;
  }
  if (P.logits) {
    const float t = P.temperature[b];
    if (!(t >= 0.0f) || !is_finite(t)) bits |= kErrTemperature;
  }
  return bits | check_row_filter(P, b);
}

// Request b's sampling mode: whether it is greedy (greedy[b], or a temperature below kMinTemperature, 0
// included, or invalid), and the softmax scale log2(e) / temperature of its logits (base 2).
SPECDEC_HD bool request_greedy(const ChainSamplingParams& P, int64_t b, float* scale) {
  *scale = kLog2e;
  if (!P.logits) return P.greedy[b];
  const float t = P.temperature[b];
  const bool greedy = !(t >= kMinTemperature) || !is_finite(t);
  if (!greedy) *scale = fmul(fdiv(1.0f, t), kLog2e);
  return greedy;
}

// Request b's draft count as judged: given_num_drafts clamped to [0, layout_num_drafts] (flagged by
// check_request_controls when it was outside).
SPECDEC_HD int32_t request_num_drafts(const ChainSamplingParams& P, int64_t b) {
  const int64_t given = given_num_drafts(P, b), limit = layout_num_drafts(P, b);
  return static_cast<int32_t>(given < 0 ? 0 : given > limit ? limit : given);
}

// Whether draft id x is in the vocabulary (an id outside it has no probability: token verification rejects it, and it
// ends a block).
SPECDEC_HD bool draft_id_valid(const ChainSamplingParams& P, int64_t x) { return x >= 0 && x < P.vocab; }

// The softmax normalisers of request b's target row i (row_p) and, given row_q, its draft row i, whose thresholds
// filter_rows has set: the caller's (target_lse, draft_lse) where given and finite, else the rows' statistics, one pass
// over the rows that need them. With check_lse the statistics are computed for every row and a caller's value off
// them is flagged (kErrTargetLse, kErrDraftLse; it is still used: the flag is the report).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with a device engine (CUDA) or a host one (CPU)
#endif
template <typename Engine, typename Row>
SPECDEC_FLOW void logits_norms(Engine& e, const ChainSamplingParams& P, int64_t b, int32_t i, const Row* row_p,
                               const Row* row_q, float scale, SoftmaxNorm* norm_p, SoftmaxNorm* norm_q) {
  const float lse_p = P.target_lse != nullptr ? P.target_lse[target_row_number(P, b, i)] : kNegInf;
  const float lse_q = P.draft_lse != nullptr && row_q != nullptr ? P.draft_lse[draft_row_number(P, b, i)] : kNegInf;
  const bool given_p = is_finite(lse_p), given_q = is_finite(lse_q);
  const bool stats_p = !given_p || P.check_lse, stats_q = row_q != nullptr && (!given_q || P.check_lse);
  if (stats_p || stats_q) {
    MaxSum sp, sq;
    e.softmax_stats(stats_p ? row_p : nullptr, stats_q ? row_q : nullptr, scale, &sp, &sq);
    if (stats_p) *norm_p = norm_of_stats(sp);
    if (stats_q) *norm_q = norm_of_stats(sq);
    if (given_p && stats_p && !lse_matches(lse_p, lse_of_stats(sp, scale))) e.flag(kErrTargetLse);
    if (given_q && stats_q && !lse_matches(lse_q, lse_of_stats(sq, scale))) e.flag(kErrDraftLse);
  }
  if (given_p) *norm_p = norm_of_lse(lse_p);
  if (given_q) *norm_q = norm_of_lse(lse_q);
}

// The statistics of a sampled request's row pair (row_p, row_q; row_q null for point proposals), whose thresholds
// filter_rows has set, into *spec (point: x when q is a point mass), and the target's and the draft's probability of
// token x there into *p, *q (x = -1: p = 0, and q = 0, or 1 for a point mass). The rows are draft position i's of
// request b: probabilities at x are the engine's gathered values (gather_drafts).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with a device engine (CUDA) or a host one (CPU)
#endif
template <typename Engine, typename Row>
SPECDEC_FLOW void chain_row_probs(Engine& e, const ChainSamplingParams& P, int64_t b, int32_t i, int64_t x,
                                  const Row* row_p, const Row* row_q, float scale, MassSpec* spec, float* p_out,
                                  float* q_out) {
  const bool has_q = row_q != nullptr;
  *spec = MassSpec{P.logits, false, has_q ? -1 : static_cast<int32_t>(x), scale, {}, {}};
  float p = 0.0f, q = has_q ? 0.0f : 1.0f;
  if (P.logits) {
    logits_norms(e, P, b, i, row_p, row_q, scale, &spec->norm_p, &spec->norm_q);
    if (x >= 0) {
      p = softmax_prob(e.load(row_p, x, true), scale, spec->norm_p);
      if (has_q) q = softmax_prob(e.load(row_q, x, false), scale, spec->norm_q);
    }
  } else if (x >= 0) {
    p = e.gathered(b, i, x, true, row_p);
    if (has_q) q = e.gathered(b, i, x, false, row_q);
  }
  *p_out = p;
  *q_out = q;
}

// Whether draft position i of request b (0 <= i < its count) is accepted when judged on its own. Sampled rows fill
// *spec with the rows' statistics (for the residual draw), greedy ones *best with the target's argmax.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with a device engine (CUDA) or a host one (CPU)
#endif
template <typename Engine>
SPECDEC_FLOW bool chain_draft_accepted(Engine& e, const ChainSamplingParams& P, int64_t b, int32_t i, bool greedy,
                                       float scale, uint64_t seed, uint64_t offset, MassSpec* spec, int32_t* best) {
  const bool has_q = P.draft != nullptr;
  int64_t x = draft_token(P, b, i);
  if (!draft_id_valid(P, x)) x = -1;  // rejected: an id that is not in the vocabulary has no probability
  const auto* row_p = e.row_target(b, i);
  const auto* row_q = has_q ? e.row_draft(b, i) : nullptr;
  filter_rows(e, P, b, greedy, row_p, row_q, scale);
  if (greedy || P.gumbel) {
    *best = greedy ? e.argmax(row_p) : e.gumbel_argmax(row_p, scale, seed, offset + static_cast<uint64_t>(i));
    return *best >= 0 && x == *best;
  }
  float p, q;
  chain_row_probs(e, P, b, i, x, row_p, row_q, scale, spec, &p, &q);
  // Accept with probability min(1, p/q): u < p/q, as u * q < p so that q == 0 always rejects.
  const float u = accept_uniform(P, b, i, seed, offset);
  return x >= 0 && q > 0.0f && fmul(u, q) < p;
}

// The token drawn from request b's target row i alone (the all-accepted row, or the row where a block of i drafts
// ends before an invalid id): its argmax (greedy), its Gumbel-max token, or a draw from p_i by inverse CDF at the final
// uniform. -1 if the row has no mass.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with a device engine (CUDA) or a host one (CPU)
#endif
template <typename Engine>
SPECDEC_FLOW int32_t draw_from_target_row(Engine& e, const ChainSamplingParams& P, int64_t b, int32_t i, bool greedy,
                                          float scale, uint64_t seed, uint64_t offset) {
  const auto* row_p = e.row_target(b, i);
  filter_rows(e, P, b, greedy, row_p, static_cast<decltype(row_p)>(nullptr), scale);
  if (greedy) return e.argmax(row_p);
  if (P.gumbel) return e.gumbel_argmax(row_p, scale, seed, offset + static_cast<uint64_t>(i));
  MassSpec spec{P.logits, true, -1, scale, {}, {}};
  if (P.logits) logits_norms(e, P, b, i, row_p, static_cast<decltype(row_p)>(nullptr), scale, &spec.norm_p, &spec.norm_q);
  return e.sample(row_p, nullptr, spec, final_uniform(P, b, seed, offset));
}

// Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", arXiv 2403.10444; vLLM's
// rejection_sample_method="block") of sampled request b's k drafts x_1..x_k. Row i (0 <= i < k) judges x_{i+1}; P_i,
// Q_i are its processed target and draft laws as token verification computes them (Q_i the point mass at x_{i+1}
// without draft rows). The block ends early at an id outside [0, V): n drafts precede it (n = k if none).
//   c_0 = 1; c_j = min(1, c_{j-1} P_{j-1}(x_j) / Q_{j-1}(x_j)) in float32 as clamp01(fdiv(fmul(c_{j-1}, p), q)), and
//     0 when q == 0 (clamp01(r): 1 for r >= 1, r for 0 < r < 1, else 0, NaN included).
//   R_j = sum_v max(fmul(P_j(v), c_j) - Q_j(v), 0) over row j (1 <= j < n), the engines' canonical total() with
//     MassSpec::p_scale = c_j; h_j = fdiv(R_j, fadd(R_j, fadd(1, -c_j))), or 1 when that denominator is not > 0;
//     h_n = c_n.
//   tau = the largest j in 1..n with u_j < h_j (u_j = accept_uniform of draft position j - 1), 0 if none.
// Writes *accepted = tau and, when tau < k, *token: tau < n draws from norm(max(c_tau P_tau - Q_tau, 0)) at row tau
// by the inverse CDF at the final uniform (from P_tau if that has no mass: token verification's fallback; tau = 0 is
// token verification's residual at row 0); tau = n < k draws from P_n (draw_from_target_row). tau = k is left to the
// caller's all-accepted path (bonus_ids, or a draw from row k), *token -1.
// Rows read: the target and draft rows 0..n-1 (row 0's statistics and its p, q at x_1; rows 1..n-1 in full for R_j),
// then row tau again for the draw. Lossless for any draft law Q: every emitted sequence has the target's law.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with a device engine (CUDA) or a host one (CPU)
#endif
template <typename Engine>
SPECDEC_FLOW void chain_block_verify(Engine& e, const ChainSamplingParams& P, int64_t b, int32_t k, float scale,
                                     uint64_t seed, uint64_t offset, int32_t* accepted, int32_t* token) {
  const bool has_q = P.draft != nullptr;
  int32_t n = 0;
  while (n < k && draft_id_valid(P, draft_token(P, b, n))) ++n;
  float c = 1.0f;          // c_i, the weight of the prefix x_1..x_i (i the row being read)
  int32_t tau = 0;
  MassSpec tau_spec{};     // row tau's statistics, p_scale = c_tau
  for (int32_t i = 0; i < n; ++i) {
    const auto* row_p = e.row_target(b, i);
    const auto* row_q = has_q ? e.row_draft(b, i) : nullptr;
    filter_rows(e, P, b, false, row_p, row_q, scale);
    MassSpec spec;
    float p, q;
    chain_row_probs(e, P, b, i, draft_token(P, b, i), row_p, row_q, scale, &spec, &p, &q);
    spec.p_scale = c;
    if (i == 0) {
      tau_spec = spec;
    } else {  // h_i from the residual mass of row i at weight c_i
      const float residual = e.total(row_p, row_q, spec);
      const float denominator = fadd(residual, fadd(1.0f, -c));
      const float h = denominator > 0.0f ? fdiv(residual, denominator) : 1.0f;
      if (accept_uniform(P, b, i - 1, seed, offset) < h) {
        tau = i;
        tau_spec = spec;
      }
    }
    const float r = q > 0.0f ? fdiv(fmul(c, p), q) : 0.0f;
    c = r >= 1.0f ? 1.0f : r > 0.0f ? r : 0.0f;
  }
  if (n > 0 && accept_uniform(P, b, n - 1, seed, offset) < c) tau = n;  // h_n = c_n
  *accepted = tau;
  *token = -1;
  if (tau == k) return;
  if (tau == n) {
    *token = draw_from_target_row(e, P, b, n, false, scale, seed, offset);
    return;
  }
  const auto* row_p = e.row_target(b, tau);
  const auto* row_q = has_q ? e.row_draft(b, tau) : nullptr;
  filter_rows(e, P, b, false, row_p, row_q, scale);  // row tau's thresholds again (the statistics are kept)
  const float u_resample = final_uniform(P, b, seed, offset);
  *token = e.sample(row_p, row_q, tau_spec, u_resample);
  if (*token < 0) {  // max(0, c P - Q) sums to 0: sample P itself
    tau_spec.p_only = true;
    *token = e.sample(row_p, nullptr, tau_spec, u_resample);
  }
}

// The flow for one request. Engine supplies:
//   row_target(b, i), row_draft(b, i) -> const T*; load(row, v, is_target) -> float (raw value, checked; a draft
//   row is read at draft_column(v), absent columns reading as probability 0); gather_drafts(b, k) (may fetch
//   p(x_i) and q(x_i) of positions 0..k-1 ahead) and gathered(b, i, x, is_target, row) -> load(row, x, is_target); argmax(row) -> int32, or -1 if the
//   row has no mass (row_has_mass); softmax_stats(row_p, row_q, scale, MaxSum*, MaxSum*) (base-2 statistics of
//   the logits at scale, maxsum_push_block; either row may be null, its statistics then not computed); sample(row_p, row_q, MassSpec, u) -> int32 or -1 if the mass is
//   zero or not finite; gumbel_argmax(row, scale, seed, position) -> int32, the first index of the largest
//   gumbel_keys4 key, or -1 if the row has no mass; flag(bits); write(b, accepted, token); write_row_lse(b, lse).
// Invalid controls are flagged up front and then given defined meanings (a count is clamped to [0, K], an id
// outside [0, V) is rejected, a bad temperature is greedy, as is one below kMinTemperature; a flat request whose
// positions are inconsistent emits nothing). A target row the round must draw its last token from, but which has
// no mass, yields the token -1 (and kErrTargetNoMass).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with a device engine (CUDA) or a host one (CPU)
#endif
template <typename Engine>
SPECDEC_FLOW void chain_sampling_request(Engine& e, const ChainSamplingParams& P, int64_t b) {
  e.flag(check_request_controls(P, b));
  if (!request_rows_valid(P, b)) {
    e.write(b, 0, -1, 0);
    return;
  }
  const int32_t k = request_num_drafts(P, b);
  float scale;  // log2(e) / temperature: softmax in base 2
  const bool greedy = request_greedy(P, b, &scale);
  const uint64_t seed = static_cast<uint64_t>(P.seed[b]), offset = static_cast<uint64_t>(P.offset[b]);
  if (P.row_lse != nullptr) {  // logits_normalizer: target row 0's normaliser, nothing sampled
    float lse = -kNegInf;
    if (!greedy) {
      const auto* row_p = e.row_target(b, 0);
      filter_rows(e, P, b, false, row_p, static_cast<decltype(row_p)>(nullptr), scale);
      MaxSum sp, sq;
      e.softmax_stats(row_p, static_cast<decltype(row_p)>(nullptr), scale, &sp, &sq);
      lse = lse_of_stats(sp, scale);
    }
    e.write_row_lse(b, lse);
    return;
  }

  int32_t accepted = 0, token = -1;
  // From probabilities, the acceptance tests need p(x_i) and q(x_i) alone: gathered for every position at once, so that
  // the tests wait for one round trip to memory, not one each (values past the first rejection are used only by
  // accepted_independently).
  if (!P.logits && !greedy && !P.gumbel) e.gather_drafts(b, k);
  if (P.block && !greedy && !P.gumbel) {  // a sampled request under block verification
    chain_block_verify(e, P, b, k, scale, seed, offset, &accepted, &token);
  } else {  // token by token, up to the first rejection
    while (accepted < k) {
      MassSpec spec{};
      int32_t best = -1;
      if (chain_draft_accepted(e, P, b, accepted, greedy, scale, seed, offset, &spec, &best)) {
        ++accepted;
        continue;
      }
      if (greedy || P.gumbel) {
        token = best;
        break;
      }
      const auto* row_p = e.row_target(b, accepted);
      const auto* row_q = P.draft != nullptr ? e.row_draft(b, accepted) : nullptr;
      const float u_resample = final_uniform(P, b, seed, offset);
      token = e.sample(row_p, row_q, spec, u_resample);
      if (token < 0) {  // max(0, p - q) sums to 0 (p == q): sample p itself
        spec.p_only = true;
        token = e.sample(row_p, nullptr, spec, u_resample);
      }
      break;
    }
  }
  if (accepted == k) {  // every draft accepted: the caller's bonus token, or one drawn from p_k
    if (P.bonus_ids != nullptr) {
      const int64_t x = bonus_token(P, b);
      token = x >= 0 && x < P.vocab ? static_cast<int32_t>(x) : -1;
    } else {
      token = draw_from_target_row(e, P, b, k, greedy, scale, seed, offset);
      if (token < 0) e.flag(kErrTargetNoMass);  // the row of the last token has no mass: -1 is emitted
    }
  } else if (token < 0) {
    e.flag(kErrTargetNoMass);
  }
  // FlashInfer's count: the drafts after the first rejection judged on their own (their rows are read only here).
  int32_t independent = accepted;
  if (P.accepted_independently != nullptr) {
    for (int32_t i = accepted + 1; i < k; ++i) {
      MassSpec spec{};
      int32_t best = -1;
      if (chain_draft_accepted(e, P, b, i, greedy, scale, seed, offset, &spec, &best)) ++independent;
    }
  }
  e.write(b, accepted, token, independent);
}

}  // namespace specdec
