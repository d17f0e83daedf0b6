// Chain speculative sampling on the GPU: one block of 1024 threads per request. Thread t owns canonical
// lane t of every chunk (sampling_math.h), so a group of 32 lanes is a warp and the pairwise tree over a
// group is the warp's butterfly; the within-group scan of the sampling step is the warp's Hillis-Steele
// scan. 1024 threads (not fewer threads with several lanes each) keep 32 warps per SM in flight.
//
// Bytes: acceptance reads p(x) and q(x) (probabilities) or, with logits, one pass over the target and
// draft rows of each position up to the first rejection; the resampled token costs one more pass over the
// rejected rows and one chunk. Rows after the first rejection are never read.
#pragma once
#include "specdec/chain_sampling.h"
#include "specdec/device.cuh"

namespace specdec {

constexpr int kSamplingThreads = kChunk;
static_assert(kGroup == kWarpSize, "a canonical group is one warp");

template <typename T>
struct BlockSamplingEngine {
  const ChainSamplingParams P;  // a copy: a reference to the kernel parameter would put it in local memory
  float* group_totals;  // [kMaxChunks * kGroups]
  float* carry;         // [kMaxChunks + 1]
  MaxSum* ms_scratch;   // [2 * kGroups]
  ArgMax* am_scratch;   // [kGroups]
  int32_t* int_scratch; // [2]
  float* scan_scratch;   // [1]
  int32_t errors;       // this thread's error bits, published once at the end

  SPECDEC_DEVICE const T* row_target(int64_t b, int64_t i) const {
    return static_cast<const T*>(P.target) + b * P.target_stride_b + i * P.target_stride_k;
  }
  SPECDEC_DEVICE const T* row_draft(int64_t b, int64_t i) const {
    return static_cast<const T*>(P.draft) + b * P.draft_stride_b + i * P.draft_stride_k;
  }
  SPECDEC_DEVICE void flag(int32_t bits) { errors |= bits; }
  // Probabilities must be finite; logits may be -inf (masked), never NaN or +inf.
  SPECDEC_DEVICE void check(float x, bool target) {
    const bool bad = P.logits ? (is_nan(x) || x == -kNegInf) : !is_finite(x);
    if (bad) errors |= target ? kErrTargetNonFinite : kErrDraftNonFinite;
  }
  SPECDEC_DEVICE float load(const T* row, int64_t v, bool target) {
    const float x = to_float(row[v]);
    check(x, target);
    return x;
  }
  SPECDEC_DEVICE int64_t lane_entry(int64_t chunk) const { return chunk * kChunk + threadIdx.x; }
  SPECDEC_DEVICE int64_t chunks() const { return (P.vocab + kChunk - 1) / kChunk; }
  // This thread's entry of chunk c (0 past the vocabulary, neither read nor checked).
  SPECDEC_DEVICE float load_lane(const T* row, int64_t c, bool target) {
    const int64_t v = lane_entry(c);
    if (v >= P.vocab) return 0.0f;
    return load(row, v, target);
  }

  // Combines the lanes: the pairwise tree over each group (warp butterfly), then the 32 groups in order.
  // Every thread returns the result.
  template <typename V, typename Op>
  SPECDEC_DEVICE V reduce_lanes(V lane, Op op, V* scratch) {
    const V v = group_reduce<kGroup>(lane, op);
    if (lane_id() == 0) scratch[threadIdx.x / kGroup] = v;
    sync_threads();
    V r = scratch[0];
    for (int g = 1; g < kGroups; ++g) r = op(r, scratch[g]);
    sync_threads();
    return r;
  }

  // Rows are streamed kUnroll chunks at a time: all loads of a batch are issued before any is used, which
  // keeps enough bytes in flight per block. Each lane still folds its entries in increasing order.
  static constexpr int kUnroll = 8;

  SPECDEC_DEVICE int32_t argmax(const T* row) {
    ArgMax lane = argmax_identity();
    for (int64_t c0 = 0; c0 < chunks(); c0 += kUnroll) {
      float x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) x[u] = c0 + u < chunks() ? load_lane(row, c0 + u, true) : 0.0f;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = lane_entry(c0 + u);
        if (c0 + u < chunks() && v < P.vocab) lane = argmax_combine(lane, ArgMax{x[u], static_cast<int32_t>(v)});
      }
    }
    const ArgMax best = reduce_lanes(lane, ArgMaxCombine{}, am_scratch);
    return best.index < P.vocab ? best.index : 0;
  }

  SPECDEC_DEVICE void softmax_stats(const T* row_p, const T* row_q, float inv_temp, MaxSum* sp, MaxSum* sq) {
    MaxSum lp = maxsum_identity(), lq = maxsum_identity();
    for (int64_t c0 = 0; c0 < chunks(); c0 += kUnroll) {
      float xp[kUnroll], xq[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        xp[u] = c0 + u < chunks() ? load_lane(row_p, c0 + u, true) : 0.0f;
        xq[u] = c0 + u < chunks() && row_q != nullptr ? load_lane(row_q, c0 + u, false) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (c0 + u < chunks() && lane_entry(c0 + u) < P.vocab) {
          lp = maxsum_push(lp, fmul(xp[u], inv_temp));
          if (row_q != nullptr) lq = maxsum_push(lq, fmul(xq[u], inv_temp));
        }
      }
    }
    *sp = reduce_lanes(lp, MaxSumCombine{}, ms_scratch);
    *sq = row_q != nullptr ? reduce_lanes(lq, MaxSumCombine{}, ms_scratch + kGroups) : maxsum_identity();
  }

  SPECDEC_DEVICE float mass(const T* row_p, const T* row_q, const MassSpec& spec, int64_t v) {
    if (v >= P.vocab) return 0.0f;
    const float pv = load(row_p, v, true);
    const float qv = row_q != nullptr ? load(row_q, v, false) : 0.0f;
    return entry_mass(spec, v, pv, qv, row_q != nullptr);
  }

  SPECDEC_DEVICE int32_t sample(const T* row_p, const T* row_q, const MassSpec& spec, float u) {
    const int64_t chunks = this->chunks();
    const unsigned group = threadIdx.x / kGroup;
    // Pass 1: every group's total mass, per chunk.
    for (int64_t c0 = 0; c0 < chunks; c0 += kUnroll) {
      float xp[kUnroll], xq[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        xp[u] = c0 + u < chunks ? load_lane(row_p, c0 + u, true) : 0.0f;
        xq[u] = c0 + u < chunks && row_q != nullptr ? load_lane(row_q, c0 + u, false) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (c0 + u >= chunks) break;  // uniform across the block
        const int64_t v = lane_entry(c0 + u);
        const float m = v < P.vocab ? entry_mass(spec, v, xp[u], xq[u], row_q != nullptr) : 0.0f;
        const float total = group_reduce<kGroup>(m, FloatSum{});
        if (lane_id() == 0) group_totals[(c0 + u) * kGroups + group] = total;
      }
    }
    sync_threads();
    // Chunk totals (groups in order), then the carries (chunks in order).
    for (int64_t c = threadIdx.x; c < chunks; c += kSamplingThreads) {
      float t = 0.0f;
      for (int g = 0; g < kGroups; ++g) t = fadd(t, group_totals[c * kGroups + g]);
      carry[c + 1] = t;
    }
    sync_threads();
    if (threadIdx.x == 0) {
      carry[0] = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) carry[c + 1] = fadd(carry[c], carry[c + 1]);
    }
    sync_threads();
    const float total = carry[chunks];
    if (!(total > 0.0f) || !is_finite(total)) {
      sync_threads();
      return -1;
    }
    const float threshold = fmul(u, total);
    // The first chunk whose carry passes the threshold; then, by one thread, the group and the lane.
    int64_t first = chunks;
    for (int64_t c = threadIdx.x; c < chunks; c += kSamplingThreads) {
      if (carry[c + 1] > threshold && c < first) first = c;
    }
    SPECDEC_SHARED(int32_t, chunk_min, kSamplingThreads / kWarpSize);
    const int64_t c = block_reduce<kSamplingThreads>(static_cast<int32_t>(first), Min{}, chunk_min);
    // The group, by one thread (groups in order), then the lane, by one warp: its Hillis-Steele scan is the
    // canonical within-group scan.
    if (threadIdx.x == 0) int_scratch[1] = find_group(&group_totals[c * kGroups], carry[c], threshold, &scan_scratch[0]);
    sync_threads();
    if (threadIdx.x < kWarpSize) {
      const int g = int_scratch[1];
      const float base = carry[c], prefix = scan_scratch[0];
      const int64_t v = c * kChunk + g * kGroup + threadIdx.x;
      const float inclusive = warp_inclusive_scan(mass(row_p, row_q, spec, v), FloatSum{});
      const unsigned above = ballot(kFullMask, fadd(base, fadd(prefix, inclusive)) > threshold);
      const int l = above != 0 ? lowest_set_bit(above) : kGroup - 1;
      if (threadIdx.x == 0) int_scratch[0] = static_cast<int32_t>(c * kChunk + g * kGroup + l);
    }
    sync_threads();
    const int32_t token = int_scratch[0];
    sync_threads();
    return token;
  }

  SPECDEC_DEVICE void write(int64_t b, int32_t accepted, int32_t token) {
    for (int64_t j = threadIdx.x; j <= P.num_draft; j += kSamplingThreads) {
      P.output_token_ids[b * (P.num_draft + 1) + j] = output_id(P, b, j, accepted, token);
    }
    if (threadIdx.x == 0) P.num_accepted[b] = accepted;
  }
};

template <typename T>
__global__ void __launch_bounds__(kSamplingThreads) chain_sampling_kernel(const ChainSamplingParams params) {
  const ChainSamplingParams P = params;
  SPECDEC_SHARED(float, group_totals, kMaxChunks * kGroups);
  SPECDEC_SHARED(float, carry, kMaxChunks + 1);
  SPECDEC_SHARED(MaxSum, ms_scratch, 2 * kGroups);
  SPECDEC_SHARED(ArgMax, am_scratch, kGroups);
  SPECDEC_SHARED(int32_t, int_scratch, 2);
  SPECDEC_SHARED(float, scan_scratch, 1);
  BlockSamplingEngine<T> engine{P, group_totals, carry, ms_scratch, am_scratch, int_scratch, scan_scratch, 0};
  for (int64_t b = blockIdx.x; b < P.batch; b += gridDim.x) chain_sampling_request(engine, P, b);
  if (engine.errors != 0 && P.error_flags != nullptr) atomic_or(P.error_flags, engine.errors);
}

}  // namespace specdec
