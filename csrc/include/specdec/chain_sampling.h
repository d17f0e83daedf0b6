// Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the per-request decision flow,
// shared by the CPU kernel and the CUDA kernel. Each backend supplies an Engine with the row operations
// (argmax, softmax statistics, sampling by inverse CDF), computed in the canonical order of
// sampling_math.h, so that every backend takes the same decisions and emits the same tokens.
//
// Row i of request b is read only while the round is still going at position i: the flow stops at the
// first rejection, and the rows after it are never touched.
#pragma once
#include "sampling_math.h"

#if defined(__CUDACC__)
#define SPECDEC_FLOW __host__ __device__ __forceinline__
#else
#define SPECDEC_FLOW inline
#endif

namespace specdec {

struct ChainSamplingParams {
  const void* draft_ids;        // [B, K] int32 or int64
  bool draft_ids_int64;
  const void* target;           // [B, K+1, V] probabilities or logits (T)
  const void* draft;            // [B, K, V] or nullptr: point proposals
  int64_t target_stride_b, target_stride_k;  // in elements; the vocabulary dimension is contiguous
  int64_t draft_stride_b, draft_stride_k;
  const int32_t* num_draft_tokens;  // [B]
  const bool* greedy;           // [B] (probabilities); nullptr with logits
  const float* temperature;     // [B] (logits); nullptr with probabilities
  const int64_t* seed;          // [B]
  const int64_t* offset;        // [B]
  int32_t* output_token_ids;    // [B, K+1]
  int32_t* num_accepted;        // [B]
  int32_t* error_flags;         // [1] or nullptr
  int64_t batch, num_draft, vocab;  // B, K, V
  bool logits;
};

SPECDEC_HD int64_t draft_token(const ChainSamplingParams& P, int64_t b, int64_t i) {
  return P.draft_ids_int64 ? static_cast<const int64_t*>(P.draft_ids)[b * P.num_draft + i]
                           : static_cast<const int32_t*>(P.draft_ids)[b * P.num_draft + i];
}

// Position j of a request's output row: the accepted drafts, the last token, then -1.
SPECDEC_HD int32_t output_id(const ChainSamplingParams& P, int64_t b, int64_t j, int32_t accepted, int32_t token) {
  if (j < accepted) return static_cast<int32_t>(draft_token(P, b, j));
  return j == accepted ? token : -1;
}

// The CUDA kernel's blocks per request (a thread block cluster on sm_90; the launcher's rule, kept here so
// that it is tested without a GPU): the largest C in {4, 2} with batch * C <= sms and all `batch` clusters
// resident at once, clusters_at_once(C) (a cluster must fit in one GPC, so fewer than sms / C may; 0 without
// clusters), else 1. More SMs per request while the batch leaves SMs idle, never a second wave.
constexpr int kMaxSamplingClusterBlocks = 4;
template <typename ClustersAtOnce>
int sampling_cluster_blocks(int64_t batch, int sms, ClustersAtOnce&& clusters_at_once) {
  for (int c = kMaxSamplingClusterBlocks; c > 1; c /= 2) {
    if (batch * c <= sms && batch <= clusters_at_once(c)) return c;
  }
  return 1;
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

// The inputs of request b other than its rows: the draft count, every draft id it covers, the temperature.
// Checked in full before any row is read, so that whether an input is reported does not depend on where
// the round happens to end. Returns SamplingError bits.
SPECDEC_HD int32_t check_request_controls(const ChainSamplingParams& P, int64_t b) {
  int32_t bits = 0;
  int64_t k = P.num_draft_tokens[b];
  if (k < 0 || k > P.num_draft) {
    bits |= kErrNumDraftTokens;
    k = k < 0 ? 0 : P.num_draft;
  }
  for (int64_t i = 0; i < k; ++i) {
    const int64_t x = draft_token(P, b, i);
    if (x < 0 || x >= P.vocab) bits |= kErrDraftTokenId;
  }
  if (P.logits) {
    const float t = P.temperature[b];
    if (!(t >= 0.0f) || !is_finite(t)) bits |= kErrTemperature;
  }
  return bits;
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

// The flow for one request. Engine supplies:
//   row_target(b, i), row_draft(b, i) -> const T*; load(row, v, is_target) -> float (raw value, checked);
//   argmax(row) -> int32, or -1 if the row has no mass (row_has_mass); softmax_stats(row_p, row_q, scale,
//   MaxSum*, MaxSum*) (base-2 statistics of the logits at scale, maxsum_push_block);
//   sample(row_p, row_q, MassSpec, u) -> int32 or -1 if the mass is zero or not finite;
//   flag(bits); write(b, accepted, token).
// Invalid controls are flagged up front and then given defined meanings (a count is clamped to [0, K], an id
// outside [0, V) is rejected, a bad temperature is greedy, as is one below kMinTemperature). A target row the round must draw its last token
// from, but which has no mass, yields the token -1 (and kErrTargetNoMass).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with a device engine (CUDA) or a host one (CPU)
#endif
template <typename Engine>
SPECDEC_FLOW void chain_sampling_request(Engine& e, const ChainSamplingParams& P, int64_t b) {
  const int64_t K = P.num_draft, V = P.vocab;
  e.flag(check_request_controls(P, b));
  int32_t k = P.num_draft_tokens[b];
  k = k < 0 ? 0 : k > K ? static_cast<int32_t>(K) : k;
  float scale;  // log2(e) / temperature: softmax in base 2
  const bool greedy = request_greedy(P, b, &scale);
  const uint64_t seed = static_cast<uint64_t>(P.seed[b]), offset = static_cast<uint64_t>(P.offset[b]);
  const bool has_q = P.draft != nullptr;

  int32_t accepted = 0, token = -1;
  bool rejected = false;
  for (int32_t i = 0; i < k; ++i) {
    int64_t x = draft_token(P, b, i);
    if (x < 0 || x >= V) x = -1;  // rejected: an id that is not in the vocabulary has no probability
    const auto* row_p = e.row_target(b, i);
    const auto* row_q = has_q ? e.row_draft(b, i) : nullptr;
    if (greedy) {
      const int32_t best = e.argmax(row_p);
      if (best >= 0 && x == best) {
        ++accepted;
        continue;
      }
      token = best;
      rejected = true;
      break;
    }
    MassSpec spec{P.logits, false, has_q ? -1 : static_cast<int32_t>(x), scale, 0.0f, 1.0f, 0.0f, 1.0f};
    float p = 0.0f, q = has_q ? 0.0f : 1.0f;
    if (P.logits) {
      MaxSum sp, sq;
      e.softmax_stats(row_p, row_q, scale, &sp, &sq);
      spec.m_p = sp.m;
      spec.inv_z_p = fdiv(1.0f, sp.s);
      spec.m_q = sq.m;
      spec.inv_z_q = fdiv(1.0f, sq.s);
      if (x >= 0) {
        p = softmax_prob(e.load(row_p, x, true), scale, spec.m_p, spec.inv_z_p);
        if (has_q) q = softmax_prob(e.load(row_q, x, false), scale, spec.m_q, spec.inv_z_q);
      }
    } else if (x >= 0) {
      p = e.load(row_p, x, true);
      if (has_q) q = e.load(row_q, x, false);
    }
    // Accept with probability min(1, p/q): u < p/q, as u * q < p so that q == 0 always rejects.
    const float u = philox_uniform_at(seed, offset, kStreamAccept, static_cast<uint64_t>(i));
    if (x >= 0 && q > 0.0f && fmul(u, q) < p) {
      ++accepted;
      continue;
    }
    const float u_resample = philox_uniform_at(seed, offset, kStreamResample, 0);
    token = e.sample(row_p, row_q, spec, u_resample);
    if (token < 0) {  // max(0, p - q) sums to 0 (p == q): sample p itself
      spec.p_only = true;
      token = e.sample(row_p, nullptr, spec, u_resample);
    }
    rejected = true;
    break;
  }
  if (!rejected) {  // every draft accepted: the bonus token from p_k
    const auto* row_p = e.row_target(b, k);
    if (greedy) {
      token = e.argmax(row_p);
    } else {
      MassSpec spec{P.logits, true, -1, scale, 0.0f, 1.0f, 0.0f, 1.0f};
      if (P.logits) {
        MaxSum sp, sq;
        e.softmax_stats(row_p, nullptr, scale, &sp, &sq);
        spec.m_p = sp.m;
        spec.inv_z_p = fdiv(1.0f, sp.s);
      }
      token = e.sample(row_p, nullptr, spec, philox_uniform_at(seed, offset, kStreamResample, 0));
    }
  }
  if (token < 0) e.flag(kErrTargetNoMass);  // the row of the last token has no mass: -1 is emitted
  e.write(b, accepted, token);
}

}  // namespace specdec
