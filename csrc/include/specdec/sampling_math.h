// The arithmetic of chain speculative sampling, shared by the CPU kernel, the CUDA kernel and the emulator,
// written so that every backend computes the same bits (RNG contract, DESIGN.md §3.1).
//
// Why bit-exact: acceptance of a draft token from logits compares u * q(x) with p(x), where p and q are
// softmax values whose normaliser is a sum over the vocabulary. CPU and CUDA agree on every decision only
// if they compute that sum, and exp, identically. So:
//   * exp is `det_exp` below: Cody-Waite reduction and a degree-7 polynomial using only IEEE multiply, add
//     and fused multiply-add, each correctly rounded on every backend (no library expf, no contraction:
//     device code uses the _rn intrinsics, host code is compiled with -ffp-contract=off);
//   * every reduction over a row follows one canonical order. The row is cut into chunks of kChunk = 1024
//     entries; lane = v mod 1024; group = 32 consecutive lanes. A lane folds its entries in increasing v;
//     lanes are combined by the balanced pairwise tree over each group, then groups sequentially 0..31.
//     The CUDA kernel gets exactly this with 1024 threads, one lane each (the tree over a group is the
//     warp's butterfly); the CPU kernel gets it with lane arrays and SIMD loops.
//   * sampling by inverse CDF over the canonical order: chunk c, group g, lane l has the cumulative mass
//     carry[c] + (prefix[c][g] + inclusive_scan_g[l]) where the group scan is Hillis-Steele, prefix is the
//     sequential sum of earlier groups' totals and carry the sequential sum of earlier chunks' totals.
//     The sampled entry is the first whose cumulative mass exceeds u * R, R = carry[number of chunks].
// With that, CPU, CUDA and the emulator return the same tokens, resampled ones included.
#pragma once
#include <stdint.h>

#include "philox.h"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#include <cstring>
#endif

namespace specdec {

constexpr int kChunk = 1024;        // vocabulary entries per chunk (= canonical lanes)
constexpr int kGroup = 32;          // lanes per group
constexpr int kGroups = kChunk / kGroup;
constexpr int64_t kMaxVocab = 262144;
constexpr int kMaxChunks = static_cast<int>(kMaxVocab / kChunk);
constexpr int kMaxDraftTokens = 16;

// RNG streams of a request (seed[b], offset[b]): acceptance of draft position i uses uniform i of
// kStreamAccept; the round's one resampled or bonus token uses uniform 0 of kStreamResample.
constexpr uint32_t kStreamAccept = 0;
constexpr uint32_t kStreamResample = 1;

// Error bits reported by the kernels (CPU raises on them; CUDA records them for set_strict(True)).
enum SamplingError : int32_t {
  kErrTargetNonFinite = 1,
  kErrDraftNonFinite = 2,
  kErrDraftTokenId = 4,
  kErrNumDraftTokens = 8,
  kErrTemperature = 16,
};

// ----- correctly rounded primitives, never contracted ----------------------------------------------
#if defined(__CUDA_ARCH__)
SPECDEC_HD float fadd(float a, float b) { return __fadd_rn(a, b); }
SPECDEC_HD float fmul(float a, float b) { return __fmul_rn(a, b); }
SPECDEC_HD float ffma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
SPECDEC_HD float fdiv(float a, float b) { return __fdiv_rn(a, b); }
SPECDEC_HD float bits_as_float(uint32_t u) { return __uint_as_float(u); }
SPECDEC_HD uint32_t float_as_bits(float f) { return __float_as_uint(f); }
SPECDEC_HD bool is_nan(float x) { return isnan(x); }
SPECDEC_HD bool is_finite(float x) { return isfinite(x); }
#else
SPECDEC_HD float fadd(float a, float b) { return a + b; }
SPECDEC_HD float fmul(float a, float b) { return a * b; }
SPECDEC_HD float ffma(float a, float b, float c) { return std::fma(a, b, c); }
SPECDEC_HD float fdiv(float a, float b) { return a / b; }
SPECDEC_HD float bits_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
SPECDEC_HD uint32_t float_as_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
SPECDEC_HD bool is_nan(float x) { return x != x; }
SPECDEC_HD bool is_finite(float x) { return x - x == 0.0f; }
#endif
constexpr float kNegInf = -__builtin_huge_valf();

// exp(x), the same bits on every backend; relative error ~2 ulp. Returns 0 below -87.3 (where exp(x) is
// subnormal) and for NaN, which callers detect separately. Branch-free, so that CPU loops vectorise.
SPECDEC_HD float det_exp(float x0) {
  float x = x0 > -87.3f ? x0 : -87.3f;  // NaN -> -87.3; the result is replaced by 0 below
  x = x < 88.0f ? x : 88.0f;
  const float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float k = fadd(fadd(fmul(x, 1.44269504f), kMagic), -kMagic);
  float r = ffma(k, -0.693145752f, x);  // ln 2, high part (exact product)
  r = ffma(k, -1.42860677e-06f, r);     // ln 2, low part
  float p = 1.98412698e-4f;
  p = ffma(p, r, 1.38888889e-3f);
  p = ffma(p, r, 8.33333333e-3f);
  p = ffma(p, r, 4.16666667e-2f);
  p = ffma(p, r, 1.66666667e-1f);
  p = ffma(p, r, 0.5f);
  p = ffma(p, r, 1.0f);
  p = ffma(p, r, 1.0f);
  const int ki = static_cast<int>(k);  // in [-126, 127]
  const float e = fmul(p, bits_as_float(static_cast<uint32_t>(ki + 127) << 23));
  return x0 > -87.3f ? e : 0.0f;
}

// Running softmax statistics of a set of scaled logits: max m and sum of exp(x - m).
struct MaxSum {
  float m;
  float s;
};
SPECDEC_HD MaxSum maxsum_identity() { return MaxSum{kNegInf, 0.0f}; }
// Folds one scaled logit in. -inf (a masked token) and NaN leave the state unchanged. Written with selects
// and one exp, so that neither a warp nor a SIMD loop evaluates both cases.
SPECDEC_HD MaxSum maxsum_push(MaxSum a, float x) {
  const bool up = x > a.m;
  const float e = det_exp(up ? fadd(a.m, -x) : fadd(x, -a.m));
  const float s_up = fadd(fmul(a.s, e), 1.0f);
  const float s_same = fadd(a.s, e);
  return MaxSum{up ? x : a.m, up ? s_up : (x > kNegInf ? s_same : a.s)};
}
// Commutative bit for bit: combine(a, b) == combine(b, a).
SPECDEC_HD MaxSum maxsum_combine(MaxSum a, MaxSum b) {
  const float m = a.m > b.m ? a.m : b.m;
  if (!(m > kNegInf)) return maxsum_identity();
  return MaxSum{m, fadd(fmul(a.s, det_exp(fadd(a.m, -m))), fmul(b.s, det_exp(fadd(b.m, -m))))};
}
struct MaxSumCombine {
  SPECDEC_HD MaxSum operator()(MaxSum a, MaxSum b) const { return maxsum_combine(a, b); }
};

// Argmax with ties to the lowest index; NaN never wins.
struct ArgMax {
  float value;
  int32_t index;
};
SPECDEC_HD ArgMax argmax_identity() { return ArgMax{kNegInf, INT32_MAX}; }
SPECDEC_HD ArgMax argmax_combine(ArgMax a, ArgMax b) {
  if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
  return a;
}
struct ArgMaxCombine {
  SPECDEC_HD ArgMax operator()(ArgMax a, ArgMax b) const { return argmax_combine(a, b); }
};

struct FloatSum {
  SPECDEC_HD float operator()(float a, float b) const { return fadd(a, b); }
};

// What one sampling pass draws from: the mass of entry v is
//   logits == false: max(0, p_v - q_v), with q_v = [v == point] when q is absent, or p_v alone (p_only);
//   logits == true : p_v = exp(l_v * inv_temp - m_p) * inv_z_p, likewise q from the draft logits.
// Masses are clamped to >= 0 and NaN counts as 0.
struct MassSpec {
  bool logits;
  bool p_only;
  int64_t point;  // the draft token when q is a point mass (no draft row), else -1
  float inv_temp, m_p, inv_z_p, m_q, inv_z_q;
};

// Softmax probability of one logit given its row's statistics.
SPECDEC_HD float softmax_prob(float logit, float inv_temp, float m, float inv_z) {
  return fmul(det_exp(fadd(fmul(logit, inv_temp), -m)), inv_z);
}

// Mass of entry v from the raw row values pv (target) and qv (draft; ignored without a draft row).
SPECDEC_HD float entry_mass(const MassSpec& s, int64_t v, float pv, float qv, bool has_q) {
  float p = s.logits ? softmax_prob(pv, s.inv_temp, s.m_p, s.inv_z_p) : pv;
  if (s.p_only) return p > 0.0f ? p : 0.0f;
  float q = has_q ? (s.logits ? softmax_prob(qv, s.inv_temp, s.m_q, s.inv_z_q) : qv) : (v == s.point ? 1.0f : 0.0f);
  const float r = fadd(p, -q);
  return r > 0.0f ? r : 0.0f;
}

// Hillis-Steele inclusive scan of one group's 32 masses, in place: the canonical within-group order.
SPECDEC_HD void group_inclusive_scan(float* x) {
  for (int off = 1; off < kGroup; off *= 2) {
    for (int l = kGroup - 1; l >= off; --l) x[l] = fadd(x[l - off], x[l]);
  }
}

}  // namespace specdec
