// Logits processing inside the from-logits sampling ops: per-request top-k, top-p and min-p, applied to every target
// row and every draft row of the request alike, after temperature, in transformers' order (top-k, then top-p over
// what top-k kept, then min-p). Each control leaves an upper set of the row's values, so the processed row is the
// row with every logit below one threshold `lo` set to -inf; the kernels apply it as they read (load, to_floats),
// and every other operation (statistics, acceptance, residual draws, Gumbel keys) is unchanged.
//
// The threshold of a row of n raw logits x (a draft row over its own n = Vd columns, in its own order), with m its
// largest value (NaN ignored), scale = log2(e) / temperature and w(x) = det_exp2(scaled_gap(x, m, scale)) (the
// softmax numerator relative to the max, the max's being exactly 1):
//   top_k (0 or >= n: off): lo_k = the k-th largest value, counted with multiplicity (torch.topk's values[k - 1]);
//     every entry equal to it is kept, so ties at the threshold all stay (transformers' TopKLogitsWarper).
//   top_p (1: off): S(t) = the sum of w(x) over the entries with x >= max(t, lo_k), added in the canonical order of
//     sampling_math.h's masses (lane blocks, groups, tiles); lo_p = the largest t with S(t) >= fl(top_p * S(lo_k)),
//     i.e. the smallest set of the largest values whose mass reaches top_p of top-k's mass, every entry tied with its
//     smallest value included. The set is exact for that sum: S is monotone in t (float addition is monotone), so lo_p
//     is unique, and every backend finds the same one whatever search it uses (a guess checked by S, then bisection
//     on the float order), since every backend computes S bit for bit.
//   min_p (0: off): lo_m = the smallest value with scaled_gap(x, m, scale) >= det_log2(min_p): p(x) >= min_p * p(max).
//   lo = max(lo_k, lo_p, lo_m); the max is always kept. Greedy rows are never processed (the argmax is kept anyway).
// vLLM applies min-p before top-k/top-p; transformers and SGLang after, as here. The two differ only when a request
// sets both min_p and top_p.
#pragma once
#include "sampling_math.h"

#if defined(__CUDACC__)
#define SPECDEC_FLOW __host__ __device__ __forceinline__
#else
#define SPECDEC_FLOW inline
#endif

namespace specdec {

struct RowFilter {
  int32_t top_k;
  float top_p;
  float min_p;
};

// Whether a request's controls are valid: top_k >= 0, top_p in (0, 1], min_p in [0, 1). Invalid ones are flagged
// (kErrRowFilter) and the request is sampled unprocessed.
SPECDEC_HD bool row_filter_valid(const RowFilter& f) {
  return f.top_k >= 0 && f.top_p > 0.0f && f.top_p <= 1.0f && f.min_p >= 0.0f && f.min_p < 1.0f;
}
// Whether a row of n entries is left as it is.
SPECDEC_HD bool row_filter_off(const RowFilter& f, int64_t n) {
  return (f.top_k <= 0 || f.top_k >= n) && !(f.top_p < 1.0f) && !(f.min_p > 0.0f);
}

// The float order as unsigned integers: a < b (floats, NaN aside) iff key(a) < key(b); -0 sorts just below +0.
SPECDEC_HD uint32_t ordered_key(float x) {
  const uint32_t u = float_as_bits(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
SPECDEC_HD float key_value(uint32_t k) { return bits_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }
// The smallest float above x (x not NaN, below +inf): "x' >= next_up(x)" is "x' > x", zeros of both signs included.
SPECDEC_HD float next_up(float x) { return x == 0.0f ? bits_as_float(1u) : key_value(ordered_key(x) + 1u); }
SPECDEC_HD float quiet_nan() { return bits_as_float(0x7fc00000u); }

// The largest float t in [lo, hi) with pred(t), given pred(lo), !pred(hi) and pred true below any t where it holds:
// bisection on the float order, at most 32 evaluations.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with device (CUDA) or host (CPU) callables
#endif
template <typename Pred>
SPECDEC_FLOW float last_true(Pred&& pred, float lo, float hi) {
  uint32_t a = ordered_key(lo), b = ordered_key(hi);
  while (b - a > 1u) {
    const uint32_t mid = a + (b - a) / 2u;
    if (pred(key_value(mid))) {
      a = mid;
    } else {
      b = mid;
    }
  }
  return key_value(a);
}

// Top-p's threshold: the largest t in [lo, hi) with S(t) >= target, where S(lo) >= target > S(hi). A backend's guess of
// a bracket [g_lo, g_hi) around it (NaN: none) is checked first: when g_hi is the next float above g_lo and the
// threshold is g_lo, two evaluations of S say so; a narrow bracket leaves few bisection steps.
template <typename Mass>
SPECDEC_FLOW float top_p_threshold(Mass&& S, float lo, float hi, float target, float g_lo, float g_hi) {
  if (g_lo > lo && g_lo < hi) {
    if (S(g_lo) >= target) {
      lo = g_lo;
    } else {
      hi = g_lo;
    }
  }
  if (g_hi > lo && g_hi < hi) {
    if (S(g_hi) < target) {
      hi = g_hi;
    } else {
      lo = g_hi;
    }
  }
  return last_true([&](float t) { return S(t) >= target; }, lo, hi);
}

// A row's threshold lo (above). Row supplies, over the row's n entries: size(); max() (NaN ignored; -inf if none);
// kth_largest(k, m) for 0 < k < n (-inf if fewer than k entries are not NaN); mass_at_least(m, scale, t) = S(t) for
// t >= lo_k, in the canonical order; top_p_bracket(m, scale, lo_k, target, &g_lo, &g_hi), any guess of a bracket [g_lo,
// g_hi) around top-p's threshold or NaN; min_at_gap(m, scale, g),
// the smallest x with scaled_gap(x, m, scale) >= g (g <= 0). Returns -inf when nothing is removed.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with device (CUDA) or host (CPU) callables
#endif
template <typename Row>
SPECDEC_FLOW float row_threshold(Row& row, const RowFilter& f, float scale) {
  if (row_filter_off(f, row.size())) return kNegInf;
  const float m = row.max();
  if (!(m > kNegInf) || !is_finite(m)) return kNegInf;  // no mass: the flow reports it
  const float lo_k = f.top_k > 0 && f.top_k < row.size() ? row.kth_largest(f.top_k, m) : kNegInf;
  float lo = lo_k;
  if (f.top_p < 1.0f) {
    const auto S = [&](float t) { return row.mass_at_least(m, scale, t > lo_k ? t : lo_k); };
    const float target = fmul(f.top_p, S(lo_k));  // > 0: the max's own term is 1
    float g_lo = quiet_nan(), g_hi = quiet_nan();
    row.top_p_bracket(m, scale, lo_k, target, &g_lo, &g_hi);
    const float lo_p = top_p_threshold(S, lo_k, next_up(m), target, g_lo, g_hi);
    lo = lo_p > lo ? lo_p : lo;
  }
  if (f.min_p > 0.0f) {
    const float lo_m = row.min_at_gap(m, scale, det_log2(f.min_p));
    lo = lo_m > lo ? lo_m : lo;
  }
  return lo;
}

// A raw logit as the processed row holds it: -inf below the row's threshold (NaN stays NaN, for the checks).
SPECDEC_HD float filtered(float x, float lo) { return x < lo ? kNegInf : x; }

}  // namespace specdec
