// Chain speculative sampling on the CPU: requests in parallel (at::parallel_for), each row scanned with
// lane arrays laid out as the canonical order of sampling_math.h (lane = v mod 1024), so the loops over a
// chunk run over contiguous lanes and vectorise, and every sum comes out bit for bit as on the GPU.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#include "checks.h"
#include "cpu/simd.h"

namespace specdec {
namespace {

// The loops over a chunk are compiled for several instruction sets (SPECDEC_CPU_CLONES). Every variant
// computes the same bits: the arithmetic is the correctly rounded operations of sampling_math.h, never
// contracted (-ffp-contract=off), and std::fma is exact with or without FMA units.

// Converts n values to float; returns whether any is invalid (probabilities: not finite; logits: NaN, +inf).
template <typename T>
SPECDEC_CPU_CLONES bool convert_chunk(const T* src, int n, float* out, bool logits) {
  const float lowest_valid = logits ? kNegInf : -__FLT_MAX__;  // logits may be -inf, probabilities not
  int bad = 0;
  for (int l = 0; l < n; ++l) {
    const float x = static_cast<float>(src[l]);
    out[l] = x;
    bad |= static_cast<int>(!(x >= lowest_valid) | !(x <= __FLT_MAX__));  // also true for NaN
  }
  return bad != 0;
}

// Folds one chunk of logits, scaled by inv_temp, into the lanes' (max, sum) state.
SPECDEC_CPU_CLONES void push_chunk(const float* logit, int n, float inv_temp, float* m, float* s) {
  for (int l = 0; l < n; ++l) {
    const MaxSum r = maxsum_push(MaxSum{m[l], s[l]}, fmul(logit[l], inv_temp));
    m[l] = r.m;
    s[l] = r.s;
  }
}

// Masses of entries base .. base + n (entry_mass), zero up to kChunk. The mode flags are made constants
// so that each mode's loop vectorises.
template <bool kLogits, bool kPOnly, bool kHasQ>
SPECDEC_HD void chunk_masses_for(MassSpec spec, int64_t base, int n, const float* pv, const float* qv, float* out) {
  spec.logits = kLogits;
  spec.p_only = kPOnly;
  for (int l = 0; l < n; ++l) out[l] = entry_mass(spec, base + l, pv[l], kHasQ ? qv[l] : 0.0f, kHasQ);
}

SPECDEC_CPU_CLONES void chunk_masses(const MassSpec spec, int64_t base, int n, const float* pv, const float* qv, bool has_q,
                                     float* out) {
  if (spec.p_only) {
    spec.logits ? chunk_masses_for<true, true, false>(spec, base, n, pv, qv, out)
                : chunk_masses_for<false, true, false>(spec, base, n, pv, qv, out);
  } else if (has_q) {
    spec.logits ? chunk_masses_for<true, false, true>(spec, base, n, pv, qv, out)
                : chunk_masses_for<false, false, true>(spec, base, n, pv, qv, out);
  } else {
    spec.logits ? chunk_masses_for<true, false, false>(spec, base, n, pv, qv, out)
                : chunk_masses_for<false, false, false>(spec, base, n, pv, qv, out);
  }
  for (int l = n; l < kChunk; ++l) out[l] = 0.0f;
}

// The 32 group totals of a chunk's masses: the pairwise tree, one level at a time (adjacent pairs).
SPECDEC_CPU_CLONES void group_totals_of_chunk(const float* mass, float* totals) {
  float a[kChunk / 2], b[kChunk / 4];
  for (int i = 0; i < kChunk / 2; ++i) a[i] = fadd(mass[2 * i], mass[2 * i + 1]);
  for (int i = 0; i < kChunk / 4; ++i) b[i] = fadd(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < kChunk / 8; ++i) a[i] = fadd(b[2 * i], b[2 * i + 1]);
  for (int i = 0; i < kChunk / 16; ++i) b[i] = fadd(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < kChunk / 32; ++i) totals[i] = fadd(b[2 * i], b[2 * i + 1]);
}

SPECDEC_CPU_CLONES void argmax_chunk(const float* x, int n, int32_t base, float* best, int32_t* index) {
  for (int l = 0; l < n; ++l) {
    const bool take = x[l] > best[l] || (x[l] == best[l] && index[l] == INT32_MAX);
    best[l] = take ? x[l] : best[l];
    index[l] = take ? base + l : index[l];
  }
}

template <typename T>
struct CpuSamplingEngine {
  const ChainSamplingParams& P;
  int32_t errors = 0;
  // Per-request scratch, reused across rows.
  std::vector<float> lane_a, lane_b, lane_c, lane_d, mass;
  std::vector<int32_t> lane_i;
  std::vector<float> group_totals, carry;

  explicit CpuSamplingEngine(const ChainSamplingParams& p)
      : P(p), lane_a(kChunk), lane_b(kChunk), lane_c(kChunk), lane_d(kChunk), mass(kChunk), lane_i(kChunk),
        group_totals(kMaxChunks * kGroups), carry(kMaxChunks + 1) {}

  const T* row_target(int64_t b, int64_t i) const {
    return static_cast<const T*>(P.target) + b * P.target_stride_b + i * P.target_stride_k;
  }
  const T* row_draft(int64_t b, int64_t i) const {
    return static_cast<const T*>(P.draft) + b * P.draft_stride_b + i * P.draft_stride_k;
  }
  void flag(int32_t bits) { errors |= bits; }
  float load(const T* row, int64_t v, bool target) {
    float x;
    if (convert_chunk(row + v, 1, &x, P.logits)) errors |= target ? kErrTargetNonFinite : kErrDraftNonFinite;
    return x;
  }
  int64_t chunks() const { return (P.vocab + kChunk - 1) / kChunk; }
  int valid(int64_t c) const { return static_cast<int>(std::min<int64_t>(kChunk, P.vocab - c * kChunk)); }

  // Converts one chunk of a row to float and checks it.
  void load_chunk(const T* row, int64_t c, float* out, bool target) {
    if (convert_chunk(row + c * kChunk, valid(c), out, P.logits)) errors |= target ? kErrTargetNonFinite : kErrDraftNonFinite;
  }

  int32_t argmax(const T* row) {
    float* best = lane_a.data();
    int32_t* index = lane_i.data();
    float* x = lane_c.data();
    for (int l = 0; l < kChunk; ++l) {
      best[l] = kNegInf;
      index[l] = INT32_MAX;
    }
    for (int64_t c = 0; c < chunks(); ++c) {
      load_chunk(row, c, x, true);
      argmax_chunk(x, valid(c), static_cast<int32_t>(c * kChunk), best, index);
    }
    ArgMax r = argmax_identity();
    for (int l = 0; l < kChunk; ++l) r = argmax_combine(r, ArgMax{best[l], index[l]});
    return r.index < P.vocab ? r.index : 0;
  }

  // The canonical combination of lane states: pairwise tree within each group, then groups in order.
  static MaxSum reduce_lanes(const float* m, const float* s) {
    MaxSum group[kGroups];
    for (int g = 0; g < kGroups; ++g) {
      MaxSum t[kGroup];
      for (int l = 0; l < kGroup; ++l) t[l] = MaxSum{m[g * kGroup + l], s[g * kGroup + l]};
      for (int width = 1; width < kGroup; width *= 2) {
        for (int l = 0; l < kGroup; l += 2 * width) t[l] = maxsum_combine(t[l], t[l + width]);
      }
      group[g] = t[0];
    }
    MaxSum r = group[0];
    for (int g = 1; g < kGroups; ++g) r = maxsum_combine(r, group[g]);
    return r;
  }

  void softmax_stats(const T* row_p, const T* row_q, float inv_temp, MaxSum* sp, MaxSum* sq) {
    float *mp = lane_a.data(), *spp = lane_b.data(), *mq = lane_c.data(), *sqq = lane_d.data(), *x = mass.data();
    for (int l = 0; l < kChunk; ++l) {
      mp[l] = mq[l] = kNegInf;
      spp[l] = sqq[l] = 0.0f;
    }
    for (int64_t c = 0; c < chunks(); ++c) {
      const int n = valid(c);
      load_chunk(row_p, c, x, true);
      push_chunk(x, n, inv_temp, mp, spp);
      if (row_q != nullptr) {
        load_chunk(row_q, c, x, false);
        push_chunk(x, n, inv_temp, mq, sqq);
      }
    }
    *sp = reduce_lanes(mp, spp);
    *sq = row_q != nullptr ? reduce_lanes(mq, sqq) : maxsum_identity();
  }

  // Masses of chunk c (zero past the vocabulary).
  void chunk_mass(const T* row_p, const T* row_q, const MassSpec& spec, int64_t c) {
    const int n = valid(c);
    float *pv = lane_a.data(), *qv = lane_b.data(), *m = mass.data();
    load_chunk(row_p, c, pv, true);
    if (row_q != nullptr) load_chunk(row_q, c, qv, false);
    chunk_masses(spec, c * kChunk, n, pv, qv, row_q != nullptr, m);
  }

  int32_t sample(const T* row_p, const T* row_q, const MassSpec& spec, float u) {
    const int64_t C = chunks();
    float* m = mass.data();
    for (int64_t c = 0; c < C; ++c) {
      chunk_mass(row_p, row_q, spec, c);
      group_totals_of_chunk(m, &group_totals[c * kGroups]);
    }
    carry[0] = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      float t = 0.0f;
      for (int g = 0; g < kGroups; ++g) t = fadd(t, group_totals[c * kGroups + g]);
      carry[c + 1] = fadd(carry[c], t);
    }
    const float total = carry[C];
    if (!(total > 0.0f) || !is_finite(total)) return -1;
    const float threshold = fmul(u, total);
    int64_t c = 0;
    while (c < C - 1 && !(carry[c + 1] > threshold)) ++c;
    const float base = carry[c];
    float prefix;
    const int g = find_group(&group_totals[c * kGroups], base, threshold, &prefix);
    chunk_mass(row_p, row_q, spec, c);
    float x[kGroup];
    for (int l = 0; l < kGroup; ++l) x[l] = m[g * kGroup + l];
    group_inclusive_scan(x);
    int l = 0;
    while (l < kGroup - 1 && !(fadd(base, fadd(prefix, x[l])) > threshold)) ++l;
    return static_cast<int32_t>(c * kChunk + g * kGroup + l);
  }

  void write(int64_t b, int32_t accepted, int32_t token) {
    for (int64_t j = 0; j <= P.num_draft; ++j) P.output_token_ids[b * (P.num_draft + 1) + j] = output_id(P, b, j, accepted, token);
    P.num_accepted[b] = accepted;
  }
};

// Requests are taken from a shared counter: their cost varies by an order of magnitude with the number of
// accepted drafts (logits rows are read up to the first rejection), so a static split would leave threads idle.
template <typename T>
int32_t run(const ChainSamplingParams& P) {
  std::atomic<int32_t> errors{0};
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(P.batch, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    CpuSamplingEngine<T> engine(P);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t b = next.fetch_add(1); b < P.batch; b = next.fetch_add(1)) chain_sampling_request(engine, P, b);
    }
    errors.fetch_or(engine.errors);
  });
  return errors.load();
}

void chain_sampling_cpu(const at::Tensor& draft_token_ids, const at::Tensor& target, const std::optional<at::Tensor>& draft,
                        const at::Tensor& num_draft_tokens, const at::Tensor& greedy_or_temperature, const at::Tensor& seed,
                        const at::Tensor& offset, const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                        const std::optional<at::Tensor>& error_flags, bool logits) {
  const ChainSamplingParams P = make_chain_params(draft_token_ids, target, draft, num_draft_tokens, greedy_or_temperature,
                                                  seed, offset, output_token_ids, num_accepted, error_flags, logits);
  int32_t errors = 0;
  switch (target.scalar_type()) {
    case at::kFloat: errors = run<float>(P); break;
    case at::kHalf: errors = run<c10::Half>(P); break;
    default: errors = run<c10::BFloat16>(P);
  }
  if (errors != 0) {
    if (P.error_flags != nullptr) *P.error_flags |= errors;
    TORCH_CHECK_VALUE(false, sampling_error_message(errors, logits));
  }
}

void chain_sampling_probs_cpu(const at::Tensor& draft_token_ids, const at::Tensor& target_probs,
                              const std::optional<at::Tensor>& draft_probs, const at::Tensor& num_draft_tokens,
                              const at::Tensor& greedy, const at::Tensor& seed, const at::Tensor& offset,
                              const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                              const std::optional<at::Tensor>& error_flags) {
  chain_sampling_cpu(draft_token_ids, target_probs, draft_probs, num_draft_tokens, greedy, seed, offset, output_token_ids,
                     num_accepted, error_flags, false);
}

void chain_sampling_logits_cpu(const at::Tensor& draft_token_ids, const at::Tensor& target_logits,
                               const std::optional<at::Tensor>& draft_logits, const at::Tensor& num_draft_tokens,
                               const at::Tensor& temperature, const at::Tensor& seed, const at::Tensor& offset,
                               const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                               const std::optional<at::Tensor>& error_flags) {
  chain_sampling_cpu(draft_token_ids, target_logits, draft_logits, num_draft_tokens, temperature, seed, offset,
                     output_token_ids, num_accepted, error_flags, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("chain_speculative_sampling", &chain_sampling_probs_cpu);
  m.impl("chain_speculative_sampling_from_logits", &chain_sampling_logits_cpu);
}

}  // namespace specdec
