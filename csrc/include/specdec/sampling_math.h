// The arithmetic of chain speculative sampling, shared by the CPU kernel, the CUDA kernel and the emulator,
// written so that every backend computes the same bits (RNG contract, docs/design.md §3.1).
//
// Why bit-exact: acceptance of a draft token from logits compares u * q(x) with p(x), where p and q are
// softmax values whose normaliser is a sum over the vocabulary. CPU and CUDA agree on every decision only
// if they compute that sum, and exp, identically. So:
//   * exp is `det_exp2` below (base 2; a logit's distance to its row's max is scaled by log2(e) / temperature,
//     subtracted first, then scaled, so that the max's term is exactly 1 at any temperature and logit size;
//     temperatures below kMinTemperature are greedy and never scaled): rounding to an integer
//     and a degree-5 polynomial using only IEEE add, multiply and fused multiply-add, each correctly
//     rounded on every backend (no library exp, no contraction: device code uses the _rn intrinsics, host
//     code is compiled with -ffp-contract=off). 13 instructions, ~2 ulp.
//   * every reduction over a row follows one canonical order. The row is cut into tiles of kTile = 8192
//     entries; lane l (of kLanes = 1024) owns the block of kLaneEntries = 8 contiguous entries
//     t * 8192 + 8 l .. + 7 of every tile t, i.e. one 16-byte load of 16-bit values, and folds its blocks
//     in increasing t. A group is 32 consecutive lanes.
//       - softmax statistics: a lane keeps a running (max, sum); a block moves the max once, rescales the
//         sum once, and adds the pairwise sum of its 8 exps (maxsum_push_block). The 1024 lane states are
//         combined by the balanced pairwise tree over the lanes in order.
//       - sampling masses: a group's total in a tile is the pairwise tree over its 32 lanes' block sums
//         (each the pairwise sum of the block's 8 masses); a tile's total is its groups' totals summed in
//         order, and the row's total R the tiles' totals summed in order.
//     The CUDA kernel gets exactly this with one lane per thread (the tree over a group is the warp's
//     butterfly); the CPU kernel with lane arrays and SIMD loops.
//   * sampling by inverse CDF in index order: the entry v = t * 8192 + 8 l + j is found level by level, tile
//     t, group of l, lane l, entry j. Each level picks, by `first_crossing` (chain_sampling.h), the first
//     position whose cumulative mass, summed left to right from the level's base, exceeds u * R: tiles by
//     their totals (base 0), the tile's groups by their totals, the group's lanes by their block sums, the
//     block's 8 masses.
// With that, CPU, CUDA and the emulator return the same tokens, resampled ones included. The order depends on
// the lanes only, not on how they are spread over threads or blocks (the CUDA kernel splits them over a
// cluster of 1, 2 or 4 blocks).
#pragma once
#include <stdint.h>

#include "philox.h"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#include <cstring>
#endif

namespace specdec {

constexpr int kLanes = 1024;                  // canonical lanes
constexpr int kLaneEntries = 8;               // contiguous entries of a lane in each tile
constexpr int kTile = kLanes * kLaneEntries;  // 8192 entries
constexpr int kGroup = 32;                    // lanes per group
constexpr int kGroups = kLanes / kGroup;
constexpr int64_t kMaxVocab = int64_t{1} << 24;  // entry indices and cumulative masses stay exact in float32
constexpr int kMaxTiles = static_cast<int>(kMaxVocab / kTile);
// Group totals are kept for kTileChunk tiles at a time (shared memory on CUDA): a row's pass folds them into
// tile totals chunk by chunk, and sampling recomputes the chosen tile's.
constexpr int kTileChunk = 32;
constexpr float kLog2e = 1.44269502e+00f;  // log2(e), rounded to float
constexpr float kLn2 = 6.93147182e-01f;    // ln(2), rounded to float
constexpr int kMaxDraftTokens = 128;  // per request (vLLM's limit)
// Temperatures t < kMinTemperature (0 included) make a request greedy (argmax acceptance, no randomness), in
// every backend and the reference (vLLM's _SAMPLING_EPS), bit for bit as temperature 0. Below it,
// softmax(logits / t) leaves less than e^-20 of its mass off the argmax unless another logit is within 20 t
// (2e-4) of the max; and it keeps 1 / t finite (t <= 2^-128 has no float32 inverse). Exported to Python as
// LIMITS["min_temperature"].
constexpr float kMinTemperature = 1e-5f;

// RNG streams of a request (seed[b], offset[b]): acceptance of draft position i uses uniform i of
// kStreamAccept; the round's one resampled or bonus token uses uniform 0 of kStreamResample.
constexpr uint32_t kStreamAccept = 0;
constexpr uint32_t kStreamResample = 1;
// Gumbel coupling (coupling="gumbel"): the noise of token v at a request's absolute position n is uniform v of
// kStreamGumbel at offset n, so a position's noise is the same whether its row is verified, drawn as a bonus, or
// drawn by plain decoding or a drafter.
constexpr uint32_t kStreamGumbel = 2;

// Error bits reported by the kernels (CPU raises on them; CUDA records them for set_strict(True)). Their
// messages are in checks/chain_sampling.h and checks/tree_sampling.h (kSamplingErrorBits, kTreeSamplingErrorBits),
// which the Python layer reads from the extension.
enum SamplingError : int32_t {
  kErrTargetNonFinite = 1,
  kErrDraftNonFinite = 2,
  kErrDraftTokenId = 4,
  kErrNumDraftTokens = 8,
  kErrTemperature = 16,
  kErrTargetNoMass = 32,  // a target row the round samples from has no positive mass: the token is -1
  // 64, 128, 256: the tree op's (tree_sampling.h)
  kErrUniform = 512,             // a caller's uniform (uniforms, final_uniforms) outside [0, 1)
  kErrBonusTokenId = 1024,       // bonus_token_ids outside [0, V)
  kErrCuNumDraftTokens = 2048,   // cu_num_draft_tokens not an inclusive cumsum in [0, T] with steps <= max_draft_tokens
  kErrDraftToTarget = 4096,      // draft_to_target holds an id outside [0, V) or one id twice
  kErrRowFilter = 8192,          // top_k < 0, top_p outside (0, 1] or min_p outside [0, 1) (row_filter.h)
  kErrTargetLse = 16384,         // checked (strict mode): a target_lse row off its row's normaliser (lse_matches)
  kErrDraftLse = 32768,          // likewise draft_lse
};

// ----- correctly rounded primitives, never contracted ----------------------------------------------
#if defined(__CUDA_ARCH__)
SPECDEC_HD float fadd(float a, float b) { return __fadd_rn(a, b); }
SPECDEC_HD float fmul(float a, float b) { return __fmul_rn(a, b); }
SPECDEC_HD float ffma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
SPECDEC_HD float fdiv(float a, float b) { return __fdiv_rn(a, b); }
SPECDEC_HD float bits_as_float(uint32_t u) { return __uint_as_float(u); }
SPECDEC_HD uint32_t float_as_bits(float f) { return __float_as_uint(f); }
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
SPECDEC_HD bool is_finite(float x) { return x - x == 0.0f; }
#endif
constexpr float kNegInf = -__builtin_huge_valf();
constexpr float kFloatMax = 3.40282347e+38f;

// 2^d for d <= 64, the same bits on every backend; relative error ~2 ulp (a minimax polynomial on
// [-1/2, 1/2]). Returns 0 for d <= -124 (2^d below 2^-124 is dropped: softmax terms are relative to the
// row's max, so such a term is below 1e-37 of the sum) and for NaN and -inf.
SPECDEC_HD float det_exp2(float d) {
  const float kMagic = 12582912.0f;  // 1.5 * 2^23: t's low mantissa bits hold round(d)
  const float t = fadd(d, kMagic);
  const float r = fadd(d, -fadd(t, -kMagic));  // d - round(d), exact, in [-1/2, 1/2]
  float p = 1.326472731e-03f;
  p = ffma(p, r, 9.671512991e-03f);
  p = ffma(p, r, 5.550733581e-02f);
  p = ffma(p, r, 2.402224243e-01f);
  p = ffma(p, r, 6.931470037e-01f);
  p = ffma(p, r, 1.0f);
  // p is in [0.7, 1.42]; adding round(d) to its exponent field stays normal for round(d) >= -124.
  // float_as_bits(t) << 23 == round(d) << 23 (mod 2^32): the bits of 1.5 * 2^23 shift out.
  // Zeroed by a mask rather than a select: a select lets the compiler move the arithmetic under a branch,
  // and then CPU loops do not vectorise.
  const uint32_t keep = 0u - static_cast<uint32_t>(d > -124.0f);
  return bits_as_float((float_as_bits(p) + (float_as_bits(t) << 23)) & keep);
}

// log2(x) for finite normal x > 0, the same bits on every backend: x = 2^e * m with m in [sqrt(1/2), sqrt(2)],
// log2(m) = 2 atanh(s) / ln 2 with s = (m - 1) / (m + 1), |s| <= 0.172, by its series to s^9 (truncation below 1e-9
// of the result), in correctly rounded operations only; selects, no branches, so that CPU loops vectorise. Within
// 4 ulp (tests/cpp/test_sampling_math.cpp).
SPECDEC_HD float det_log2_normal(float x) {
  const uint32_t bits = float_as_bits(x);
  const float m1 = bits_as_float((bits & 0x7fffffu) | 0x3f800000u);  // [1, 2)
  const bool high = m1 > 1.41421354f;
  const float m = high ? fmul(m1, 0.5f) : m1;  // exact
  const int32_t e = static_cast<int32_t>(bits >> 23) - 127 + static_cast<int32_t>(high);
  const float s = fdiv(fadd(m, -1.0f), fadd(m, 1.0f));  // m - 1 is exact (Sterbenz)
  const float s2 = fmul(s, s);
  float p = 1.11111111e-01f;  // 1/9
  p = ffma(p, s2, 1.42857143e-01f);
  p = ffma(p, s2, 2.00000003e-01f);
  p = ffma(p, s2, 3.33333343e-01f);
  p = ffma(p, s2, 1.0f);
  return fadd(static_cast<float>(e), fmul(fmul(s, p), 2.88539004f));  // 2 / ln 2
}
// det_log2_normal for any finite x > 0 (subnormals scaled into the normal range exactly); -inf for x <= 0.
SPECDEC_HD float det_log2(float x) {
  if (!(x > 0.0f)) return kNegInf;
  if (x < 1.17549435e-38f) return fadd(det_log2_normal(fmul(x, 16777216.0f)), -24.0f);
  return det_log2_normal(x);
}

// The base-2 Gumbel noise of a uniform u in (0, 1): -log2(-log2 u), which is -log2(-ln u) up to the constant
// log2(ln 2) (argmax(log2 p + noise) is then the Gumbel-max sample of p). For the uniforms of philox.h
// (u in [2^-24, 1 - 2^-24]) it lies in [-4.59, 23.5].
SPECDEC_HD float gumbel_noise2(float u) { return -det_log2_normal(-det_log2_normal(u)); }
// A token whose key (log2 p + noise) is kGumbelReach below the row's best log2 p can never win: its noise is at
// most 23.5 above, the best's at least -4.59, so keys are computed only within reach of the row's max.
constexpr float kGumbelReach = 32.0f;
// An input value the kernels reject: logits may be -inf (a masked token) but not NaN or +inf; probabilities
// must be finite. Written without branches, so that CPU loops vectorise.
SPECDEC_HD bool invalid_entry(float x, bool logits) {
  return !(x >= (logits ? kNegInf : -kFloatMax)) | !(x <= kFloatMax);  // NaN fails both comparisons
}

// max(a, b) that returns NaN if either is NaN (a NaN input must not hide behind a max).
SPECDEC_HD float max_propagate_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a ? a : (a > b ? a : b);  // b when b is NaN; written so that CPU loops vectorise
#endif
}

// The pairwise tree over a lane's block: ((x0 op x1) op (x2 op x3)) op ((x4 op x5) op (x6 op x7)).
SPECDEC_HD float block_sum(const float* x) {
  return fadd(fadd(fadd(x[0], x[1]), fadd(x[2], x[3])), fadd(fadd(x[4], x[5]), fadd(x[6], x[7])));
}
SPECDEC_HD float block_max(const float* x) {
  const float a = max_propagate_nan(max_propagate_nan(x[0], x[1]), max_propagate_nan(x[2], x[3]));
  const float b = max_propagate_nan(max_propagate_nan(x[4], x[5]), max_propagate_nan(x[6], x[7]));
  return max_propagate_nan(a, b);
}

// Running softmax statistics of a row of raw logits x at `scale` = log2(e) / temperature > 0 (base 2): their
// max m (a raw logit, not scaled) and the sum of 2^((x - m) * scale). Every exponent is a logit's distance to
// the max, subtracted first and then scaled (scaled_gap), so it is <= 0 and the max's own term is exactly
// 2^0 = 1: the sum is >= 1 for any finite logits at any scale. (Scaling first and subtracting the scaled max,
// fl(x_max * scale), leaves the max's term 2^(x_max * scale - fl(x_max * scale)), whose exponent is up to half
// an ulp of the scaled max: beyond 2^31, i.e. |logit| / temperature above ~1.5e9, that is out of det_exp2's
// range and the row lost its max, "no mass".)
struct MaxSum {
  float m;
  float s;
};
SPECDEC_HD MaxSum maxsum_identity() { return MaxSum{kNegInf, 0.0f}; }
// (x - m) * scale, the base-2 exponent of x's softmax term relative to m: <= 0 for x <= m, NaN (a term of 0)
// for x = m = -inf, -inf for x = -inf or a distance that overflows.
SPECDEC_HD float scaled_gap(float x, float m, float scale) { return fmul(fadd(x, -m), scale); }
// Folds one block of raw logits x[0..7] into a lane's state; x_max = block_max(x). The block's terms are
// summed as block_sum does. -inf (a masked token, or an entry past the vocabulary) adds 0; NaN adds 0 and does
// not move the max (callers detect it through x_max).
SPECDEC_HD MaxSum maxsum_push_block(MaxSum a, const float* x, float x_max, float scale) {
  const float m = x_max > a.m ? x_max : a.m;
  const float n = -m;  // spelled out, not a loop, so that a CPU loop over lanes around it vectorises
  const float e0 = det_exp2(fmul(fadd(x[0], n), scale)), e1 = det_exp2(fmul(fadd(x[1], n), scale));
  const float e2 = det_exp2(fmul(fadd(x[2], n), scale)), e3 = det_exp2(fmul(fadd(x[3], n), scale));
  const float e4 = det_exp2(fmul(fadd(x[4], n), scale)), e5 = det_exp2(fmul(fadd(x[5], n), scale));
  const float e6 = det_exp2(fmul(fadd(x[6], n), scale)), e7 = det_exp2(fmul(fadd(x[7], n), scale));
  const float block = fadd(fadd(fadd(e0, e1), fadd(e2, e3)), fadd(fadd(e4, e5), fadd(e6, e7)));  // block_sum's order
  static_assert(kLaneEntries == 8, "blocks of 8");
  return MaxSum{m, fadd(fmul(a.s, det_exp2(scaled_gap(a.m, m, scale))), block)};
}
// Commutative bit for bit: combine(a, b) == combine(b, a). `scale` is the one the states were pushed with.
SPECDEC_HD MaxSum maxsum_combine(MaxSum a, MaxSum b, float scale) {
  const float m = a.m > b.m ? a.m : b.m;
  if (!(m > kNegInf)) return maxsum_identity();
  return MaxSum{m, fadd(fmul(a.s, det_exp2(scaled_gap(a.m, m, scale))), fmul(b.s, det_exp2(scaled_gap(b.m, m, scale))))};
}

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

// Whether a row whose largest value is `row_max` can be sampled at all: some logit above -inf, or some
// probability above 0. A row without mass has no defined token (kErrTargetNoMass).
SPECDEC_HD bool row_has_mass(float row_max, bool logits) { return row_max > (logits ? kNegInf : 0.0f); }

struct FloatSum {
  SPECDEC_HD float operator()(float a, float b) const { return fadd(a, b); }
};

// How the probabilities of a row of logits are computed from its raw logits x at `scale` = log2(e) / temperature:
//   p(x) = 2^(((x - m) * scale) - c) * inv_z        (softmax_prob)
// From the row's own statistics (norm_of_stats): m its max, c = 0, inv_z = 1 / sum, so that the max's term is exactly
// inv_z at any temperature and logit size. From a caller's normaliser lse = ln sum_v exp(x_v / temperature)
// (norm_of_lse): m = 0, c = lse * log2(e), inv_z = 1; every probability then carries the normaliser's float32
// rounding, a relative error of about |lse| * 2^-24 (lse_matches bounds what strict mode accepts).
struct SoftmaxNorm {
  float m = 0.0f;
  float c = 0.0f;
  float inv_z = 1.0f;
};
SPECDEC_HD SoftmaxNorm norm_of_stats(MaxSum s) { return SoftmaxNorm{s.m, 0.0f, fdiv(1.0f, s.s)}; }
SPECDEC_HD SoftmaxNorm norm_of_lse(float lse) { return SoftmaxNorm{0.0f, fmul(lse, kLog2e), 1.0f}; }
// The natural-log normaliser of a row from its statistics: ln sum_v exp(x_v / temperature) = (m * scale + log2 sum)
// * ln 2; -inf for a row without mass, +-inf when |m| / temperature overflows float32. What logits_normalizer returns.
SPECDEC_HD float lse_of_stats(MaxSum s, float scale) {
  return fmul(fadd(fmul(s.m, scale), det_log2(s.s)), kLn2);
}
// Whether a caller's normaliser `given` matches the row's own `exact` (lse_of_stats) within 2^-14 + 2^-20 |exact|:
// a normaliser that close scales every probability of its row by a factor within exp(+-(2^-14 + 2^-20 |exact|)); it
// covers a float32 log-sum-exp computed any reasonable way (torch.logsumexp, an LM head's epilogue). A row whose own
// normaliser is not finite (no mass: -inf; |logit| / temperature past float32: +inf) matches no value, nor does NaN.
SPECDEC_HD bool lse_matches(float given, float exact) {
  if (!is_finite(exact)) return false;
  const float diff = fadd(given, -exact);
  const float tolerance = ffma(exact >= 0.0f ? exact : -exact, 9.53674316e-07f, 6.10351562e-05f);
  return diff <= tolerance && -diff <= tolerance;
}

// What one sampling pass draws from: the mass of entry v is
//   logits == false: max(0, fmul(p_v, p_scale) - q_v), with q_v = [v == point] when q is absent, or p_v alone
//                    (p_only, unscaled);
//   logits == true : p_v = softmax_prob(l_v, scale, norm_p), likewise q from the draft logits with norm_q.
// Masses are clamped to >= 0 and NaN counts as 0. p_scale is block verification's weight c_j (chain_sampling.h);
// token verification leaves it 1, and fmul(p, 1) == p, so its masses are unchanged bit for bit.
struct MassSpec {
  bool logits;
  bool p_only;
  int32_t point;  // the draft token when q is a point mass (no draft row), else -1
  float scale;
  SoftmaxNorm norm_p, norm_q;
  float p_scale = 1.0f;
};

// Softmax probability of one raw logit given its row's normaliser at `scale`. With c = 0 (a row's own statistics)
// the subtraction of c is exact: the bits are those of 2^((x - m) * scale) * inv_z.
SPECDEC_HD float softmax_prob(float logit, float scale, const SoftmaxNorm& n) {
  return fmul(det_exp2(fadd(scaled_gap(logit, n.m, scale), -n.c)), n.inv_z);
}

// Mass of entry v from the raw row values pv (target) and qv (draft; ignored without a draft row).
SPECDEC_HD float entry_mass(const MassSpec& s, int32_t v, float pv, float qv, bool has_q) {
  float p = s.logits ? softmax_prob(pv, s.scale, s.norm_p) : pv;
  if (s.p_only) return p > 0.0f ? p : 0.0f;
  float q = has_q ? (s.logits ? softmax_prob(qv, s.scale, s.norm_q) : qv) : (v == s.point ? 1.0f : 0.0f);
  const float r = fadd(fmul(p, s.p_scale), -q);
  return r > 0.0f ? r : 0.0f;
}

// log2 of an entry's probability relative to its row's largest (raw value x; `base` the row's max logit, or log2 of
// its max probability): 0 for the max, -inf for no mass.
SPECDEC_HD float gumbel_log2p(float x, float base, bool logits, float scale) {
  return logits ? scaled_gap(x, base, scale) : (x > 0.0f ? fadd(det_log2(x), -base) : kNegInf);
}
// The Gumbel key of an entry from its gumbel_log2p value and its Philox word: log2 p + noise, or -inf out of reach (or
// NaN). A row's sample is the first index of its largest key (argmax_combine).
SPECDEC_HD float gumbel_key(float lp, uint32_t word) {
  return lp >= -kGumbelReach ? fadd(lp, gumbel_noise2(uniform_from_bits(word))) : kNegInf;
}
// The Gumbel keys log2 p + noise of the 4 entries v0 .. v0 + 3 (v0 % 4 == 0, one Philox block) at a request's
// position (gumbel_key), from their gumbel_log2p values. The block is drawn only if one of them is in reach.
SPECDEC_HD void gumbel_keys4(const float* lp, uint64_t seed, uint64_t position, int64_t v0, float* key) {
  const bool any = lp[0] >= -kGumbelReach || lp[1] >= -kGumbelReach || lp[2] >= -kGumbelReach || lp[3] >= -kGumbelReach;
  if (!any) {
    key[0] = key[1] = key[2] = key[3] = kNegInf;
    return;
  }
  const Philox4 r = philox_block(seed, position, kStreamGumbel, static_cast<uint32_t>(v0 >> 2));
  for (int j = 0; j < 4; ++j) key[j] = gumbel_key(lp[j], r.x[j]);
}

}  // namespace specdec
