// Chain speculative sampling on the GPU: the 1024 canonical lanes of one request (sampling_math.h) are the
// threads of a group of S blocks ("slices") of 1024 / S threads, S in {1, 2, 4, ..., 32}: thread t of the
// block of slice r is lane r * 1024 / S + t. In every tile of 8192 entries a lane owns the 8 contiguous
// entries at 8 * lane: one 16-byte load for fp16/bf16 (two for fp32), so each load instruction of a warp
// reads 512 contiguous bytes. A group of 32 lanes is a warp, and the pairwise tree over a group is the warp's
// butterfly; the tree over the 32 groups reads the warps' results, which the S blocks exchange through global
// memory (SliceExchange) and meet at a barrier of their own (arrive_and_wait). Every bit of the result depends
// on the lanes only, so S changes none: the split granularity is one group (a warp), so a request spreads
// over at most 32 blocks whatever its vocabulary.
//
// Why slices: a request's rows are read one after another, so with one block per request a batch of B
// uses B SMs. The launcher picks S by sampling_slices (chain_sampling.h): B = 1 reads each row with 32 SMs.
// A smaller block has the registers to keep more tiles of loads in flight per thread (kTilesInFlight), so the
// bytes in flight per request grow with S. The blocks of a request wait for each other, so the launch is
// cooperative (all blocks resident) when S > 1; each barrier costs a round trip through L2, so a reduction
// over the lanes takes one (double-buffered exchange) and a chunk of group totals one.
//
// Bytes: acceptance reads p(x) and q(x) (probabilities) or, with logits, one pass over the target and
// draft rows of each position up to the first rejection; the resampled token costs one more pass over the
// rejected rows. Rows after the first rejection are never read. Block verification (chain_block_verify) reads
// every row pair of a sampled request's block: rows 1..k-1 in full for their residual masses (total(), after the
// statistics pass from logits), then one more pass for the draw at row tau.
// Instructions per logit in the statistics pass: det_exp2 (13), the subtract and multiply that shift and
// scale it, the block sum, and an eighth of the block's max, rescale and check: about 20, against ~40 for an
// online softmax that rescales at every entry.
#pragma once
#include "specdec/chain_sampling.h"
#include "specdec/device.cuh"

namespace specdec {

static_assert(kGroup == kWarpSize && kGroups == kWarpSize, "a group is a warp, and the groups fill one warp");

// The target's and the draft's statistics, reduced together: one pass of barriers instead of two, and each
// half by the same tree as alone.
struct MaxSumPair {
  MaxSum p, q;
};
struct MaxSumPairCombine {
  float scale;
  SPECDEC_DEVICE MaxSumPair operator()(MaxSumPair a, MaxSumPair b) const {
    return MaxSumPair{maxsum_combine(a.p, b.p, scale), maxsum_combine(a.q, b.q, scale)};
  }
};

// The global memory through which the S blocks of a request group meet (S > 1), one per group of blocks. Each
// exchange is double-buffered by the parity of its use, so that a block may write the next values as soon as it
// has read the last ones: a later use of the same buffer comes after a barrier that every block reaches only after
// reading it. So every use has a sync_all between its writes and its reads, and the users of one buffer share one
// use counter (reduce_lanes and combine_blocks: lane_exchanges).
struct SliceExchange {
  uint4 lanes[2][kGroups];  // reduce_lanes: one value (<= 16 bytes) per group; combine_blocks: one per block
  float group_totals[2][kTileChunk * kGroups];
  float histogram[2][kMaxTiles];  // the row filters' histograms (histogram_crossing), accumulated by global atomics
};
// A launch's exchanges and barrier counters (one per request group, zeroed before the launch); null with S = 1.
struct SliceWorkspace {
  SliceExchange* exchange;
  unsigned* arrivals;
};

template <typename T, int kSlices>
struct SlicedSamplingEngine {
  static_assert(kSlices >= 1 && kSlices <= kMaxSamplingSlices && (kSlices & (kSlices - 1)) == 0);
  static constexpr int kThreads = kLanes / kSlices;
  static constexpr int kWarps = kThreads / kWarpSize;
  static_assert(kThreads >= kTileChunk, "row_totals sums a chunk's tiles with one thread each");
  // Tiles of loads in flight per thread: the registers a smaller block has (64 per thread at 1024 threads, 128 at
  // 512, 255 below), capped at 8 (a row of 65,536 entries in one round at S = 32).
  static constexpr int kTilesInFlight = kSlices < 8 ? kSlices : 8;

  const ChainSamplingParams P;  // a copy: a reference to the kernel parameter would put it in local memory
  unsigned rank;        // this block's slice of its request's lanes
  SliceExchange* exchange;  // the request group's (S > 1)
  unsigned* arrivals;   // the request group's barrier counter (S > 1)
  float* group_totals;  // [kTileChunk * kGroups]: the group totals of up to kTileChunk tiles at a time
  float* tile_totals;   // [kMaxTiles]
  float* lane_sums;     // [kGroup]
  MaxSumPair* ms_scratch;  // [kGroups]
  ArgMax* am_scratch;   // [kGroups]
  int32_t* int_scratch;  // [2]
  float* float_scratch;  // [2]
  float* gathered_pq;   // [2 * kMaxDraftTokens]: p(x_i), then q(x_i), of the request gather_drafts read
  int32_t errors;       // this thread's error bits, published once at the end
  int64_t gathered_request = -1;
  unsigned barriers = 0;  // the group barriers this block has passed (counted by thread 0)
  unsigned lane_exchanges = 0, total_exchanges = 0, histogram_exchanges = 0;  // uses of the exchange's buffers (their
                                                                              // parity picks one)
  float lo_p = kNegInf, lo_q = kNegInf;  // the thresholds of the target and draft rows being read (row_filter.h)

  // A barrier for everything the blocks of the request group share; with one block, the block barrier.
  SPECDEC_DEVICE void sync_all() {
    sync_threads();
    if constexpr (kSlices > 1) {
      if (threadIdx.x == 0) {
        ++barriers;
        arrive_and_wait(arrivals, barriers * kSlices);
      }
      sync_threads();
    }
  }

  SPECDEC_DEVICE const T* row_target(int64_t b, int64_t i) const {
    return static_cast<const T*>(P.target) + target_row_offset(P, b, i);
  }
  SPECDEC_DEVICE const T* row_draft(int64_t b, int64_t i) const {
    return static_cast<const T*>(P.draft) + draft_row_offset(P, b, i);
  }
  SPECDEC_DEVICE void flag(int32_t bits) { errors |= bits; }
  SPECDEC_DEVICE int32_t bad_bit(bool target) const { return target ? kErrTargetNonFinite : kErrDraftNonFinite; }
  SPECDEC_DEVICE float load(const T* row, int64_t v, bool target) {
    if (!target) v = draft_column(P, v);
    if (v < 0) return P.logits ? kNegInf : 0.0f;  // a target id the reduced draft vocabulary lacks: q = 0
    const float x = to_float(row[v]);
    if (invalid_entry(x, P.logits)) errors |= bad_bit(target);
    return filtered(x, target ? lo_p : lo_q);
  }
  // p(x_i) and q(x_i) (raw values; 0 for an invalid id or a column the draft lacks) of request b's positions 0..k-1,
  // loaded by one thread each, so that the acceptance tests wait for one round trip to memory.
  SPECDEC_DEVICE_NOINLINE void gather_drafts(int64_t b, int32_t k) {
    sync_threads();  // the previous request's values are no longer read
    for (int i = static_cast<int>(threadIdx.x); i < k; i += kThreads) {
      const int64_t x = draft_token(P, b, i);
      float p = 0.0f, q = 0.0f;
      if (draft_id_valid(P, x)) {
        p = to_float(row_target(b, i)[x]);
        const int64_t c = P.draft != nullptr ? draft_column(P, x) : -1;
        if (c >= 0) q = to_float(row_draft(b, i)[c]);
      }
      gathered_pq[i] = p;
      gathered_pq[kMaxDraftTokens + i] = q;
    }
    gathered_request = b;
    sync_threads();
  }
  // load(row, x, target) for draft position i of request b (row its target or draft row), from the gathered values.
  SPECDEC_DEVICE float gathered(int64_t b, int32_t i, int64_t x, bool target, const T* row) {
    if (gathered_request != b) return load(row, x, target);
    if (!target && draft_column(P, x) < 0) return P.logits ? kNegInf : 0.0f;  // as load: a column the draft lacks
    const float v = gathered_pq[(target ? 0 : kMaxDraftTokens) + i];
    if (invalid_entry(v, P.logits)) errors |= bad_bit(target);
    return filtered(v, target ? lo_p : lo_q);
  }
  SPECDEC_DEVICE int tiles() const { return static_cast<int>((P.vocab + kTile - 1) / kTile); }
  // Entry indices within a row fit in 32 bits (vocab <= kMaxVocab), which saves registers.
  SPECDEC_DEVICE int vocab() const { return static_cast<int>(P.vocab); }
  // Whether whole blocks of a row can be read with 16-byte loads.
  SPECDEC_DEVICE bool vector_row(const T* row) const {
    return row != nullptr && reinterpret_cast<uintptr_t>(row) % 16 == 0 && P.vocab % kLaneEntries == 0;
  }
  // A draft row with a reduced vocabulary is gathered entry by entry (load_draft_block).
  SPECDEC_DEVICE bool vector_draft_row(const T* row) const { return P.target_to_draft == nullptr && vector_row(row); }

  // This thread's canonical lane. With one block, threadIdx.x itself: a special register costs no register.
  SPECDEC_DEVICE unsigned lane() const { return kSlices == 1 ? threadIdx.x : rank * kThreads + threadIdx.x; }
  SPECDEC_DEVICE int block_start(int t, unsigned lane) const { return t * kTile + static_cast<int>(lane) * kLaneEntries; }

  // A lane's block as loaded: one 16-byte load for 16-bit types, two for fp32 (element by element when the
  // row is not aligned or does not end on a whole block). Kept packed until used, so that the loads in flight
  // hold 4 (16-bit) or 8 (fp32) registers per block.
  static constexpr int kPerVec = Vec16<T>::kSize;
  struct RawBlock {
    Vec16<T> h[kLaneEntries / kPerVec];
  };
  SPECDEC_DEVICE RawBlock load_block(const T* row, bool vec, int v0) const {
    RawBlock r;
    if (vec && v0 < vocab()) {
#pragma unroll
      for (int h = 0; h < kLaneEntries / kPerVec; ++h) r.h[h] = load_vec16(row + v0 + h * kPerVec);
    } else {
#pragma unroll
      for (int j = 0; j < kLaneEntries; ++j) r.h[j / kPerVec].v[j % kPerVec] = v0 + j < vocab() ? row[v0 + j] : T{};
    }
    return r;
  }
  // load_block for a draft row: with a reduced vocabulary, entry v is the draft's column target_to_draft[v], and a
  // target id without one reads as a masked logit or a zero probability (mass 0, valid).
  SPECDEC_DEVICE RawBlock load_draft_block(const T* row, bool vec, int v0) const {
    if (P.target_to_draft == nullptr) return load_block(row, vec, v0);
    const T absent = from_float<T>(P.logits ? kNegInf : 0.0f);
    RawBlock r;
#pragma unroll
    for (int j = 0; j < kLaneEntries; ++j) {
      const int64_t c = v0 + j < vocab() ? draft_column(P, v0 + j) : -1;
      r.h[j / kPerVec].v[j % kPerVec] = c >= 0 ? row[c] : absent;
    }
    return r;
  }
  // The block as floats. Past the vocabulary an entry reads as a masked logit (-inf) or a zero probability:
  // mass 0, and valid. Flags an invalid entry of the row: invalid_entry's rule for the whole block at once
  // (the NaN-propagating max of the logits, or of the probabilities' magnitudes, is below +inf), cheaper per
  // entry on this hot path.
  SPECDEC_DEVICE void to_floats(const RawBlock& r, int v0, bool target, float* x) {
    const float absent = P.logits ? kNegInf : 0.0f;
#pragma unroll
    for (int j = 0; j < kLaneEntries; ++j) x[j] = v0 + j < vocab() ? to_float(r.h[j / kPerVec].v[j % kPerVec]) : absent;
    float a[kLaneEntries];
#pragma unroll
    for (int j = 0; j < kLaneEntries; ++j) a[j] = P.logits || x[j] >= 0.0f ? x[j] : -x[j];
    if (!(block_max(a) < -kNegInf)) errors |= bad_bit(target);
    const float lo = target ? lo_p : lo_q;
#pragma unroll
    for (int j = 0; j < kLaneEntries; ++j) x[j] = filtered(x[j], lo);
  }

  // ----- Row filters (row_filter.h). Each block passes over its own lanes, and the blocks of a request group combine
  // what they found through the exchange, so every block finds the same thresholds and takes the same passes. The
  // passes read the raw row in its own order (a draft row over its own columns); group_totals is their scratch (free
  // until the row's statistics are computed).
  //
  // Top-k by radix select (three passes counting 11-, 11- and 10-bit digits of the ordered keys: exact counts, whatever
  // the order of the atomics); top-p from a bracket guessed by two levels of a histogram of the numerators by their
  // bits (10 each; float atomics, so the guess may vary from run to run, never the threshold, which S confirms; the
  // blocks of a request read one histogram, so they guess alike), then a few bisection steps inside it. tile_totals
  // (kMaxTiles floats) holds the histograms.

  // Calls f(x, lane) with this thread's lane's block x[8] of tile t (-inf past the row's n entries).
  template <typename F>
  SPECDEC_DEVICE void for_each_filter_block(const T* row, int n, int t, F&& f) const {
    const int lane = static_cast<int>(this->lane());
    const int v0 = t * kTile + lane * kLaneEntries;
    float x[kLaneEntries];
#pragma unroll
    for (int j = 0; j < kLaneEntries; ++j) x[j] = v0 + j < n ? to_float(row[v0 + j]) : kNegInf;
    f(x, lane);
  }
  // Combines the blocks' values of a request group (every thread passes its block's): op must be exact in any order
  // (max, min, sums of integers below 2^24). Every thread returns the result.
  template <typename Op>
  SPECDEC_DEVICE float combine_blocks(float value, Op op) {
    if constexpr (kSlices == 1) {
      return value;
    } else {
      uint4* slots = exchange->lanes[lane_exchanges++ % 2];
      if (threadIdx.x == 0) *reinterpret_cast<float*>(&slots[rank]) = value;
      sync_all();
      float r = load_coherent(reinterpret_cast<const float*>(&slots[0]));
      for (int s = 1; s < kSlices; ++s) r = op(r, load_coherent(reinterpret_cast<const float*>(&slots[s])));
      return r;
    }
  }
  // The group totals of tiles [first, end) (at most kTileChunk) in group_totals of every block of the request group:
  // write(out) stores this block's groups' totals at out[(t - first) * kGroups + g]; with S > 1 into the exchange,
  // which every block then copies whole.
  template <typename Write>
  SPECDEC_DEVICE void exchange_group_totals(int first, int end, Write&& write) {
    if constexpr (kSlices == 1) {
      write(group_totals);
      sync_threads();
    } else {
      float* totals = exchange->group_totals[total_exchanges++ % 2];
      write(totals);
      sync_all();
      for (int i = static_cast<int>(threadIdx.x); i < (end - first) * kGroups; i += kThreads) {
        group_totals[i] = load_coherent(&totals[i]);
      }
      sync_threads();
    }
  }
  struct FloatMax {
    SPECDEC_DEVICE float operator()(float a, float b) const { return b > a ? b : a; }
  };
  struct FloatMin {
    SPECDEC_DEVICE float operator()(float a, float b) const { return b < a ? b : a; }
  };
  SPECDEC_DEVICE static int tiles_of(int n) { return (n + kTile - 1) / kTile; }

  SPECDEC_DEVICE_NOINLINE float filter_max(const T* row, int n) {
    float m = kNegInf;
    for (int t = 0; t < tiles_of(n); ++t) {
      for_each_filter_block(row, n, t, [&](const float* x, int) {
#pragma unroll
        for (int j = 0; j < kLaneEntries; ++j) m = x[j] > m ? x[j] : m;  // NaN never wins
      });
    }
    return combine_blocks(block_reduce<kThreads>(m, FloatMax{}, group_totals), FloatMax{});
  }
  // How many entries are >= t (a float: exact, as counts stay below 2^24).
  SPECDEC_DEVICE_NOINLINE float filter_count(const T* row, int n, float t0) {
    float c = 0.0f;
    for (int t = 0; t < tiles_of(n); ++t) {
      for_each_filter_block(row, n, t, [&](const float* x, int lane) {
#pragma unroll
        for (int j = 0; j < kLaneEntries; ++j) c += t * kTile + lane * kLaneEntries + j < n && x[j] >= t0 ? 1.0f : 0.0f;
      });
    }
    return combine_blocks(block_reduce<kThreads>(c, FloatSum{}, group_totals), FloatSum{});
  }
  SPECDEC_DEVICE_NOINLINE float filter_min_at_gap(const T* row, int n, float m, float scale, float g) {
    float lo = m;
    for (int t = 0; t < tiles_of(n); ++t) {
      for_each_filter_block(row, n, t, [&](const float* x, int) {
#pragma unroll
        for (int j = 0; j < kLaneEntries; ++j) lo = scaled_gap(x[j], m, scale) >= g && x[j] < lo ? x[j] : lo;
      });
    }
    return combine_blocks(block_reduce<kThreads>(lo, FloatMin{}, group_totals), FloatMin{});
  }
  // S(t0) in the canonical order (the CPU kernel's mass_at_least_row): every thread returns it.
  SPECDEC_DEVICE_NOINLINE float filter_mass(const T* row, int n, float m, float scale, float t0) {
    float total = 0.0f;
    for (int first = 0; first < tiles_of(n); first += kTileChunk) {
      const int end = first + kTileChunk < tiles_of(n) ? first + kTileChunk : tiles_of(n);
      exchange_group_totals(first, end, [&](float* out) {
        for (int t = first; t < end; ++t) {
          for_each_filter_block(row, n, t, [&](const float* x, int lane) {
            float w[kLaneEntries];
#pragma unroll
            for (int j = 0; j < kLaneEntries; ++j) w[j] = x[j] >= t0 ? det_exp2(scaled_gap(x[j], m, scale)) : 0.0f;
            const float g = group_reduce<kGroup>(block_sum(w), FloatSum{});
            if (lane_id() == 0) out[(t - first) * kGroups + lane / kGroup] = g;
          });
        }
      });
      for (int t = first; t < end; ++t) {
        float tile_total = 0.0f;
        for (int g = 0; g < kGroups; ++g) tile_total = fadd(tile_total, group_totals[(t - first) * kGroups + g]);
        total = fadd(total, tile_total);
      }
      sync_threads();  // the next chunk's totals overwrite group_totals
    }
    return total;
  }

  // Counts (or masses) per bin of `bins` (a power of two <= kMaxTiles) into tile_totals: bin_of(x) for each entry
  // (-1: none), atomics in shared memory. With S > 1 each block then adds its nonzero bins into the exchange's
  // histogram (zeroed by the blocks in shares) with one global atomic each, and copies the sum back. Then one thread
  // walks the bins from the top: the bin where the running total reaches `want` (0 if none does), and the total above
  // it. Every thread returns both.
  template <typename BinOf>
  SPECDEC_DEVICE_NOINLINE int histogram_crossing(const T* row, int n, int bins, float want, BinOf&& bin_of, float* above) {
    float* hist = tile_totals;
    float* request_hist = kSlices == 1 ? nullptr : exchange->histogram[histogram_exchanges++ % 2];
    if constexpr (kSlices > 1) {
      for (int i = static_cast<int>(lane()); i < bins; i += kLanes) request_hist[i] = 0.0f;
    }
    for (int i = static_cast<int>(threadIdx.x); i < bins; i += kThreads) hist[i] = 0.0f;
    sync_threads();
    for (int t = 0; t < tiles_of(n); ++t) {
      for_each_filter_block(row, n, t, [&](const float* x, int lane) {
#pragma unroll
        for (int j = 0; j < kLaneEntries; ++j) {
          float weight = 0.0f;
          const int bin = t * kTile + lane * kLaneEntries + j < n ? bin_of(x[j], &weight) : -1;
          if (bin >= 0) atomic_add(&hist[bin], weight);
        }
      });
    }
    sync_all();  // with S > 1 also: every block has zeroed its share of request_hist
    if constexpr (kSlices > 1) {
      for (int i = static_cast<int>(threadIdx.x); i < bins; i += kThreads) {
        if (hist[i] != 0.0f) atomic_add(&request_hist[i], hist[i]);
      }
      sync_all();
      for (int i = static_cast<int>(threadIdx.x); i < bins; i += kThreads) hist[i] = load_coherent(&request_hist[i]);
      sync_threads();
    }
    if (threadIdx.x == 0) {
      float total = 0.0f;
      int bin = bins - 1;
      for (; bin > 0 && total + hist[bin] < want; --bin) total += hist[bin];
      int_scratch[0] = bin;
      float_scratch[0] = total;
    }
    sync_threads();
    const int bin = int_scratch[0];
    *above = float_scratch[0];
    sync_threads();
    return bin;
  }

  struct FilterRow {
    SlicedSamplingEngine& e;
    const T* row;
    int n;
    SPECDEC_DEVICE int64_t size() const { return n; }
    SPECDEC_DEVICE float max() { return e.filter_max(row, n); }
    // The k-th largest by radix select on the ordered keys, 11 + 11 + 10 bits, counts exact (floats below 2^24).
    SPECDEC_DEVICE float kth_largest(int32_t k, float) {
      float remaining = static_cast<float>(k), above;
      if (e.filter_count(row, n, kNegInf) < remaining) return kNegInf;  // fewer than k entries are numbers
      uint32_t prefix = 0, mask = 0;
      const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
      for (int level = 0; level < 3; ++level) {
        const int shift = shifts[level], bins = 1 << widths[level];
        const int digit = e.histogram_crossing(row, n, bins, remaining, [&](float x, float* weight) {
          const uint32_t key = ordered_key(x);
          *weight = 1.0f;
          return x == x && (key & mask) == prefix ? static_cast<int>((key >> shift) & static_cast<uint32_t>(bins - 1)) : -1;
        }, &above);
        remaining -= above;
        prefix |= static_cast<uint32_t>(digit) << shift;
        mask |= static_cast<uint32_t>(bins - 1) << shift;
      }
      return key_value(prefix);
    }
    SPECDEC_DEVICE float mass_at_least(float m, float scale, float t) { return e.filter_mass(row, n, m, scale, t); }
    // Two levels of 10 bits of the numerators' bits (w in (0, 1]: bits >> 20 <= 0x3f8), then the bracket of the values
    // in the crossing bin: [its smallest value, the float after its largest).
    SPECDEC_DEVICE void top_p_bracket(float m, float scale, float lo_k, float target, float* g_lo, float* g_hi) {
      float above1, above2;
      const auto numerator = [&](float x) { return x >= lo_k ? det_exp2(scaled_gap(x, m, scale)) : 0.0f; };
      const int b1 = e.histogram_crossing(row, n, 1024, target, [&](float x, float* weight) {
        *weight = numerator(x);
        return *weight > 0.0f ? static_cast<int>(float_as_bits(*weight) >> 20) : -1;
      }, &above1);
      if (b1 == 0) return;
      const int b2 = e.histogram_crossing(row, n, 1024, target - above1, [&](float x, float* weight) {
        *weight = numerator(x);
        const uint32_t bits = float_as_bits(*weight);
        return *weight > 0.0f && static_cast<int>(bits >> 20) == b1 ? static_cast<int>((bits >> 10) & 1023u) : -1;
      }, &above2);
      const uint32_t bin = (static_cast<uint32_t>(b1) << 10) | static_cast<uint32_t>(b2);
      float lo = kFloatMax, hi = -kFloatMax;
      for (int t = 0; t < tiles_of(n); ++t) {
        e.for_each_filter_block(row, n, t, [&](const float* x, int lane) {
#pragma unroll
          for (int j = 0; j < kLaneEntries; ++j) {
            const float w = numerator(x[j]);
            if (t * kTile + lane * kLaneEntries + j < n && w > 0.0f && (float_as_bits(w) >> 10) == bin) {
              lo = x[j] < lo ? x[j] : lo;
              hi = x[j] > hi ? x[j] : hi;
            }
          }
        });
      }
      lo = e.combine_blocks(block_reduce<kThreads>(lo, FloatMin{}, e.group_totals), FloatMin{});
      hi = e.combine_blocks(block_reduce<kThreads>(hi, FloatMax{}, e.group_totals), FloatMax{});
      if (lo <= hi) {
        *g_lo = lo;
        *g_hi = next_up(hi);
      }
    }
    SPECDEC_DEVICE float min_at_gap(float m, float scale, float g) { return e.filter_min_at_gap(row, n, m, scale, g); }
  };

  // The thresholds of the rows about to be read: a target row over its V entries, a draft row over its own columns.
  SPECDEC_DEVICE_NOINLINE void filter_rows(const T* row_p, const T* row_q, const RowFilter& f, float scale) {
    lo_p = lo_q = kNegInf;  // the passes below read raw rows
    if (row_p != nullptr) {
      FilterRow r{*this, row_p, vocab()};
      lo_p = row_threshold(r, f, scale);
    }
    if (row_q != nullptr) {
      FilterRow r{*this, row_q, P.target_to_draft != nullptr ? static_cast<int>(P.draft_vocab) : vocab()};
      lo_q = row_threshold(r, f, scale);
    }
  }

  // Combines the 1024 lane values by the pairwise tree: within each warp, then over the 32 groups (group g's result
  // in scratch[g] of the block, or in the request group's exchange). Every thread of the request group returns the
  // result; scratch may be reused as soon as it returns.
  template <typename V, typename Op>
  SPECDEC_DEVICE V reduce_lanes(V value, Op op, V* scratch) {
    const V g = group_reduce<kGroup>(value, op);
    if constexpr (kSlices == 1) {
      if (lane_id() == 0) scratch[threadIdx.x / kGroup] = g;
      sync_threads();
      const V r = group_reduce<kGroups>(scratch[lane_id()], op);
      sync_threads();
      return r;
    } else {
      static_assert(sizeof(V) <= sizeof(uint4), "an exchanged value fits one slot");
      uint4* slots = exchange->lanes[lane_exchanges++ % 2];
      if (lane_id() == 0) *reinterpret_cast<V*>(&slots[lane() / kGroup]) = g;
      sync_all();
      return group_reduce<kGroups>(load_coherent(reinterpret_cast<const V*>(&slots[lane_id()])), op);
    }
  }

  // The row loops load kTilesInFlight tiles, then use them in order. With 1024-thread blocks that is one:
  // two, or loading the next tile before using the current one, made ptxas spill two to three times as much
  // under their 64-register limit (sm_90a, nvcc 13.0); smaller blocks have 128 or 255 registers per thread.
  //
  // Calls f(p, q, t, v0) with this lane's raw blocks of tile t of the target row and (if row_q) the draft
  // row, v0 being the block's first entry, for every tile in order. Nothing is read past the vocabulary.
  // Tiles [first, end) only when given (end < 0: to the last).
  template <typename F>
  SPECDEC_DEVICE void for_each_tile(const T* row_p, bool vec_p, const T* row_q, bool vec_q, F&& f, int first = 0,
                                    int end = -1) const {
    const int tiles = end < 0 ? this->tiles() : end;
    for (int t0 = first; t0 < tiles; t0 += kTilesInFlight) {
      RawBlock p[kTilesInFlight], q[kTilesInFlight];
#pragma unroll
      for (int d = 0; d < kTilesInFlight; ++d) {
        const int v0 = block_start(t0 + d, lane());
        p[d] = row_p != nullptr ? load_block(row_p, vec_p, v0) : RawBlock{};
        q[d] = row_q != nullptr ? load_draft_block(row_q, vec_q, v0) : RawBlock{};
      }
#pragma unroll
      for (int d = 0; d < kTilesInFlight; ++d) {
        if (t0 + d >= tiles) break;  // uniform over the request group (f may reduce over the warp)
        f(p[d], q[d], t0 + d, block_start(t0 + d, lane()));
      }
    }
  }

  // The row operations are kept out of line: chain_sampling_request calls each from several places, and
  // inlining them all made one kernel body that ptxas could only fit in 64 registers with kilobytes of spills.
  SPECDEC_DEVICE_NOINLINE int32_t argmax(const T* row) {
    ArgMax best = argmax_identity();
    for_each_tile(row, vector_row(row), nullptr, false, [&](const RawBlock& p, const RawBlock&, int, int v0) {
      float x[kLaneEntries];
      to_floats(p, v0, true, x);
#pragma unroll
      for (int j = 0; j < kLaneEntries; ++j) {
        if (v0 + j < vocab()) best = argmax_combine(best, ArgMax{x[j], v0 + j});
      }
    });
    const ArgMax r = reduce_lanes(best, ArgMaxCombine{}, am_scratch);
    return row_has_mass(r.value, P.logits) && r.index < P.vocab ? r.index : -1;
  }

  // Gumbel coupling: the first index of the largest key log2 p + noise at `position` (gumbel_keys4), or -1 if the row
  // has no mass. The keys are relative to the row's max (argmax's pass); blocks out of its reach draw no noise.
  SPECDEC_DEVICE_NOINLINE int32_t gumbel_argmax(const T* row, float scale, uint64_t seed, uint64_t position) {
    const int32_t top = argmax(row);
    if (top < 0) return -1;
    const float m = to_float(row[top]);
    const float base = P.logits ? m : det_log2(m);
    ArgMax best = argmax_identity();
    for_each_tile(row, vector_row(row), nullptr, false, [&](const RawBlock& p, const RawBlock&, int, int v0) {
      float x[kLaneEntries], key[kLaneEntries];
      to_floats(p, v0, true, x);
#pragma unroll
      for (int j = 0; j < kLaneEntries; ++j) x[j] = gumbel_log2p(x[j], base, P.logits, scale);
      static_assert(kLaneEntries == 8, "two Philox blocks per lane block");
      gumbel_keys4(x, seed, position, v0, key);
      gumbel_keys4(x + 4, seed, position, v0 + 4, key + 4);
#pragma unroll
      for (int j = 0; j < kLaneEntries; ++j) best = argmax_combine(best, ArgMax{key[j], v0 + j});
    });
    const ArgMax r = reduce_lanes(best, ArgMaxCombine{}, am_scratch);
    return r.index < P.vocab ? r.index : -1;
  }

  SPECDEC_DEVICE_NOINLINE void softmax_stats(const T* row_p, const T* row_q, float scale, MaxSum* sp, MaxSum* sq) {
    const bool has_p = row_p != nullptr, has_q = row_q != nullptr;
    MaxSum lp = maxsum_identity(), lq = maxsum_identity();
    for_each_tile(row_p, vector_row(row_p), row_q, vector_draft_row(row_q), [&](const RawBlock& p, const RawBlock& q, int, int v0) {
      float x[kLaneEntries];
      if (has_p) {
        to_floats(p, v0, true, x);
        lp = maxsum_push_block(lp, x, block_max(x), scale);
      }
      if (has_q) {
        to_floats(q, v0, false, x);
        lq = maxsum_push_block(lq, x, block_max(x), scale);
      }
    });
    const MaxSumPair r = reduce_lanes(MaxSumPair{lp, lq}, MaxSumPairCombine{scale}, ms_scratch);
    *sp = has_p ? r.p : maxsum_identity();
    *sq = has_q ? r.q : maxsum_identity();
  }

  // The block sum of the masses of the block at v0 (0 past the vocabulary), from its raw target and draft
  // values; the masses themselves into m if given. Spec: MassSpec (chain) or TreeMass (tree_sampling.h).
  template <typename Spec>
  SPECDEC_DEVICE float block_mass(const RawBlock& rp, const RawBlock& rq, bool has_q, const Spec& spec, int v0,
                                  float* m = nullptr) {
    float xp[kLaneEntries], xq[kLaneEntries], mass[kLaneEntries];
    to_floats(rp, v0, true, xp);
    if (has_q) to_floats(rq, v0, false, xq);
#pragma unroll
    for (int j = 0; j < kLaneEntries; ++j) {
      mass[j] = entry_mass(spec, v0 + j, xp[j], has_q ? xq[j] : 0.0f, has_q);  // 0 past the vocabulary (to_floats)
      if (m != nullptr) m[j] = mass[j];
    }
    return block_sum(mass);
  }

  // Group totals of tiles [first, end) (at most kTileChunk; the pairwise tree over each group's lanes' block sums)
  // into out[(t - first) * kGroups + g]. Out of line, so that the hot loop gets the registers to itself.
  // This block's groups only.
  template <typename Spec>
  SPECDEC_DEVICE_NOINLINE void tile_group_totals(const T* row_p, const T* row_q, bool vec_p, bool vec_q, const Spec& spec,
                                                 int first, int end, float* out) {
    const bool has_q = row_q != nullptr;
    for_each_tile(
        row_p, vec_p, row_q, vec_q,
        [&](const RawBlock& p, const RawBlock& q, int t, int v0) {
          const float group_total = group_reduce<kGroup>(block_mass(p, q, has_q, spec, v0), FloatSum{});
          if (lane_id() == 0) out[(t - first) * kGroups + lane() / kGroup] = group_total;
        },
        first, end);
  }

  // Group totals of tiles [first, end) in the group_totals of every block of the request group: the blocks write
  // their groups' into the exchange, then each copies them all. From here on each block searches on its own, and all
  // find the same token.
  template <typename Spec>
  SPECDEC_DEVICE void chunk_group_totals(const T* row_p, const T* row_q, bool vec_p, bool vec_q, const Spec& spec, int first,
                                         int end) {
    exchange_group_totals(first, end, [&](float* out) {
      tile_group_totals(row_p, row_q, vec_p, vec_q, spec, first, end, out);
    });
  }

  // Pass 1 and the totals: tile_totals of every tile (its groups' totals in order), computed kTileChunk tiles at a
  // time, and the row's total, which every thread returns.
  template <typename Spec>
  SPECDEC_DEVICE float row_totals(const T* row_p, const T* row_q, bool vec_p, bool vec_q, const Spec& spec) {
    const int tiles = this->tiles();
    for (int first = 0; first < tiles; first += kTileChunk) {
      const int end = first + kTileChunk < tiles ? first + kTileChunk : tiles;
      chunk_group_totals(row_p, row_q, vec_p, vec_q, spec, first, end);
      if (static_cast<int>(threadIdx.x) < end - first) {  // one thread per tile
        float total = 0.0f;
        for (int g = 0; g < kGroups; ++g) total = fadd(total, group_totals[threadIdx.x * kGroups + g]);
        tile_totals[first + threadIdx.x] = total;
      }
      sync_threads();  // the next chunk's totals overwrite group_totals
    }
    float total = 0.0f;
    for (int t = 0; t < tiles; ++t) total = fadd(total, tile_totals[t]);
    return total;
  }

  // The row's total mass under spec, in the canonical order (every thread returns it).
  template <typename Spec>
  SPECDEC_DEVICE_NOINLINE float total(const T* row_p, const T* row_q, const Spec& spec) {
    const float r = row_totals(row_p, row_q, vector_row(row_p), vector_draft_row(row_q), spec);
    sync_threads();  // tile_totals is read by every thread before the next pass writes it
    return r;
  }

  template <typename Spec>
  SPECDEC_DEVICE_NOINLINE int32_t sample(const T* row_p, const T* row_q, const Spec& spec, float u) {
    const bool vec_p = vector_row(row_p), vec_q = vector_draft_row(row_q), has_q = row_q != nullptr;
    const int tiles = this->tiles();
    const float total = row_totals(row_p, row_q, vec_p, vec_q, spec);
    if (threadIdx.x == 0) {
      int32_t tile = -1;
      if (total > 0.0f && is_finite(total)) {
        const float threshold = fmul(u, total);
        float before_tile;
        tile = first_crossing(tile_totals, tiles, 0.0f, threshold, &before_tile);
        float_scratch[0] = before_tile;
        float_scratch[1] = threshold;
      }
      int_scratch[0] = tile;
    }
    sync_threads();
    const int32_t tile = int_scratch[0];
    sync_threads();  // int_scratch is written again below
    if (tile < 0) return -1;
    // The chosen tile's group totals again (the same sums as pass 1), then its group by one thread.
    chunk_group_totals(row_p, row_q, vec_p, vec_q, spec, tile, tile + 1);
    if (threadIdx.x == 0) {
      float before_group;
      const float threshold = float_scratch[1];
      const int g = first_crossing(group_totals, kGroups, float_scratch[0], threshold, &before_group);
      int_scratch[0] = tile * kGroups + g;
      float_scratch[0] = fadd(float_scratch[0], before_group);
    }
    sync_threads();
    const int32_t group = int_scratch[0];
    // The group's 32 block sums, by warp 0; then the lane and the entry, by one thread.
    const int t = group / kGroups, g = group % kGroups;
    if (threadIdx.x < kWarpSize) {
      const int v0 = block_start(t, static_cast<unsigned>(g * kGroup) + threadIdx.x);
      const RawBlock rp = load_block(row_p, vec_p, v0), rq = has_q ? load_draft_block(row_q, vec_q, v0) : RawBlock{};
      lane_sums[threadIdx.x] = block_mass(rp, rq, has_q, spec, v0);
    }
    sync_threads();
    if (threadIdx.x == 0) {
      const float base = float_scratch[0], threshold = float_scratch[1];
      float before_lane, before_entry;
      const int l = first_crossing(lane_sums, kGroup, base, threshold, &before_lane);
      const int v0 = block_start(t, static_cast<unsigned>(g * kGroup + l));
      const RawBlock rp = load_block(row_p, vec_p, v0), rq = has_q ? load_draft_block(row_q, vec_q, v0) : RawBlock{};
      float m[kLaneEntries];
      block_mass(rp, rq, has_q, spec, v0, m);
      const int j = first_crossing(m, kLaneEntries, fadd(base, before_lane), threshold, &before_entry);
      int_scratch[1] = v0 + j;
    }
    sync_threads();
    const int32_t token = int_scratch[1];
    sync_threads();
    return token;
  }

  SPECDEC_DEVICE void write(int64_t b, int32_t accepted, int32_t token, int32_t independent) {
    if (rank != 0) return;  // every block of the request group knows the outcome; one writes it
    for (int64_t j = threadIdx.x; j <= P.num_draft; j += kThreads) {
      P.output_token_ids[b * (P.num_draft + 1) + j] = output_id(P, b, j, accepted, token);
    }
    if (threadIdx.x == 0) {
      P.num_accepted[b] = accepted;
      if (P.accepted_independently != nullptr) P.accepted_independently[b] = independent;
    }
  }
  SPECDEC_DEVICE void write_row_lse(int64_t b, float lse) {
    if (rank == 0 && threadIdx.x == 0) P.row_lse[b] = lse;
  }
};

// A grid of request groups of kSlices blocks, each of kLanes / kSlices threads; group g handles requests g,
// g + groups, ... (blocks g * kSlices .. + kSlices - 1; with kSlices > 1 the launch is cooperative).
template <typename T, int kSlices>
__global__ void __launch_bounds__(kLanes / kSlices, 1) chain_sampling_kernel(const ChainSamplingParams params,
                                                                             const SliceWorkspace workspace) {
  using Engine = SlicedSamplingEngine<T, kSlices>;
  const ChainSamplingParams P = params;
  SPECDEC_SHARED(float, group_totals, kTileChunk * kGroups);
  SPECDEC_SHARED(float, tile_totals, kMaxTiles);
  SPECDEC_SHARED(float, lane_sums, kGroup);
  SPECDEC_SHARED(MaxSumPair, ms_scratch, kGroups);
  SPECDEC_SHARED(ArgMax, am_scratch, kGroups);
  SPECDEC_SHARED(int32_t, int_scratch, 2);
  SPECDEC_SHARED(float, float_scratch, 2);
  SPECDEC_SHARED(float, gathered_pq, 2 * kMaxDraftTokens);
  const unsigned group = blockIdx.x / kSlices;
  if (kSlices > 1 && (gridDim.x % kSlices != 0 || workspace.arrivals == nullptr)) {
    invariant_failed("chain_sampling_kernel: a grid of whole request groups, with their workspace");
  }
  Engine engine{P, blockIdx.x % kSlices, kSlices > 1 ? workspace.exchange + group : nullptr,
                kSlices > 1 ? workspace.arrivals + group : nullptr, group_totals, tile_totals, lane_sums, ms_scratch,
                am_scratch, int_scratch, float_scratch, gathered_pq, 0};
  const int64_t groups = gridDim.x / kSlices;
  for (int64_t b = group; b < P.batch; b += groups) chain_sampling_request(engine, P, b);
  if (engine.errors != 0 && P.error_flags != nullptr) atomic_or(P.error_flags, engine.errors);
}

}  // namespace specdec
