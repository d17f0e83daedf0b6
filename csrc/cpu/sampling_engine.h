// The CPU engine of the chain and tree sampling flows (cpu/chain_sampling.cpp, cpu/tree_sampling.cpp): each row
// scanned tile by tile with lane arrays in the canonical order of sampling_math.h. The loops over the 1024 lanes
// vectorise (GCC loads the 8-entry blocks interleaved), and every sum comes out bit for bit as on the GPU.
//
// Everything here has internal linkage (an unnamed namespace): each kernel file compiles its own copy, so that its
// instruction-set clones (SPECDEC_CPU_CLONES) and inlining are those of one translation unit.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "cpu/simd.h"
#include "specdec/chain_sampling.h"

namespace specdec {
namespace {

// The loops over a chunk are compiled for several instruction sets (SPECDEC_CPU_CLONES). Every variant
// computes the same bits: the arithmetic is the correctly rounded operations of sampling_math.h, never
// contracted (-ffp-contract=off), and std::fma is exact with or without FMA units.

// Converts tile t of a row to float, `absent` past the vocabulary: lane l's block is x[8 l .. 8 l + 7].
// Returns whether any entry is invalid (probabilities: not finite; logits: NaN, +inf).
template <typename T>
SPECDEC_CPU_CLONES bool convert_tile(const T* row, int64_t vocab, int64_t t, float absent, bool logits, float* x) {
  const T* src = row + t * kTile;
  const int n = static_cast<int>(std::min<int64_t>(kTile, vocab - t * kTile));
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    const float v = static_cast<float>(src[i]);
    x[i] = v;
    bad |= static_cast<int>(invalid_entry(v, logits));
  }
  for (int i = n; i < kTile; ++i) x[i] = absent;
  return bad != 0;
}

// convert_tile for a draft row with a reduced vocabulary: entry v is the draft's column target_to_draft[v], and
// `absent` where the draft has no such column (or past the vocabulary).
template <typename T>
bool gather_tile(const T* row, const ChainSamplingParams& P, int64_t t, float absent, float* x) {
  const int n = static_cast<int>(std::min<int64_t>(kTile, P.vocab - t * kTile));
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t c = draft_column(P, t * kTile + i);
    const float v = c >= 0 ? static_cast<float>(row[c]) : absent;
    x[i] = v;
    bad |= static_cast<int>(c >= 0 && invalid_entry(v, P.logits));
  }
  for (int i = n; i < kTile; ++i) x[i] = absent;
  return bad != 0;
}

// Folds one tile of logits into the lanes' (max, sum) states (maxsum_push_block). The loop over lanes
// vectorises with interleaved loads of the 8-entry blocks.
SPECDEC_CPU_CLONES void push_tile(const float* x, float scale, float* m, float* s) {
  for (int l = 0; l < kLanes; ++l) {
    const float* block = x + l * kLaneEntries;
    const MaxSum r = maxsum_push_block(MaxSum{m[l], s[l]}, block, block_max(block), scale);
    m[l] = r.m;
    s[l] = r.s;
  }
}

// Each lane's block sum of one tile of masses, into sums[l]. The masses are entry_mass of entries
// t * kTile + l * kLaneEntries + j; past the vocabulary the tile holds -inf logits or zero probabilities, whose
// mass is 0. The mode flags are made constants so that each mode's loop vectorises.
template <bool kLogits, bool kPOnly, bool kHasQ>
SPECDEC_HD void tile_block_sums_for(MassSpec spec, int64_t t, const float* pt, const float* qt, float* sums) {
  spec.logits = kLogits;
  spec.p_only = kPOnly;
  for (int l = 0; l < kLanes; ++l) {
    const int32_t v0 = static_cast<int32_t>(t * kTile + l * kLaneEntries);
    const float* p = pt + l * kLaneEntries;
    const float* q = kHasQ ? qt + l * kLaneEntries : nullptr;
    const auto m = [&](int j) __attribute__((always_inline)) {
      return entry_mass(spec, v0 + j, p[j], kHasQ ? q[j] : 0.0f, kHasQ);
    };
    // block_sum spelled out over the 8 masses (no local array, no inner loop), so that the loop vectorises.
    sums[l] = fadd(fadd(fadd(m(0), m(1)), fadd(m(2), m(3))), fadd(fadd(m(4), m(5)), fadd(m(6), m(7))));
  }
}

SPECDEC_CPU_CLONES void tile_block_sums(const MassSpec spec, int64_t t, const float* pt, const float* qt, bool has_q,
                                        float* sums) {
  if (spec.p_only) {
    spec.logits ? tile_block_sums_for<true, true, false>(spec, t, pt, qt, sums)
                : tile_block_sums_for<false, true, false>(spec, t, pt, qt, sums);
  } else if (has_q) {
    spec.logits ? tile_block_sums_for<true, false, true>(spec, t, pt, qt, sums)
                : tile_block_sums_for<false, false, true>(spec, t, pt, qt, sums);
  } else {
    spec.logits ? tile_block_sums_for<true, false, false>(spec, t, pt, qt, sums)
                : tile_block_sums_for<false, false, false>(spec, t, pt, qt, sums);
  }
}

// The 32 group totals of the lanes' values: the pairwise tree, one level at a time (adjacent pairs).
SPECDEC_CPU_CLONES void group_totals_of_lanes(const float* lane, float* totals) {
  float a[kLanes / 2], b[kLanes / 4];
  for (int i = 0; i < kLanes / 2; ++i) a[i] = fadd(lane[2 * i], lane[2 * i + 1]);
  for (int i = 0; i < kLanes / 4; ++i) b[i] = fadd(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < kLanes / 8; ++i) a[i] = fadd(b[2 * i], b[2 * i + 1]);
  for (int i = 0; i < kLanes / 16; ++i) b[i] = fadd(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < kLanes / 32; ++i) totals[i] = fadd(b[2 * i], b[2 * i + 1]);
}

// Greedy rows: the first index of the row's maximum (NaN never wins; it is reported by the caller's check),
// or -1 if the row has no mass.
template <typename T>
SPECDEC_CPU_CLONES int32_t argmax_row(const T* row, int64_t vocab, bool logits, bool* bad) {
  float best = kNegInf;
  int64_t index = 0;
  int invalid = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float x = static_cast<float>(row[v]);
    invalid |= static_cast<int>(invalid_entry(x, logits));
    if (x > best) {
      best = x;
      index = v;
    }
  }
  *bad = invalid != 0;
  return row_has_mass(best, logits) ? static_cast<int32_t>(index) : -1;
}

// Gumbel coupling: the first index of the largest key log2 p + noise at `position` (gumbel_key: the same bits as the
// CUDA kernel's); `base` is the row's max logit or log2 of its max probability, `lo` the row's threshold. Chunks of 64 entries with none
// in reach of the max draw no noise; the others run each step as its own loop over the chunk, which vectorises
// (Philox's 32 x 32-bit products as 64-bit lanes, the logarithms with selects).
template <typename T>
SPECDEC_CPU_CLONES int32_t gumbel_argmax_row(const T* row, int64_t vocab, bool logits, float scale, float base, float lo,
                                             uint64_t seed, uint64_t position) {
  constexpr int kChunk = 64;
  float lp[kChunk], key[kChunk];
  uint32_t words[kChunk];
  ArgMax best = argmax_identity();
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, vocab - c0));
    int in_reach = 0;
    for (int i = 0; i < kChunk; ++i) {
      lp[i] = i < n ? gumbel_log2p(filtered(static_cast<float>(row[c0 + i]), lo), base, logits, scale) : kNegInf;
      in_reach |= static_cast<int>(lp[i] >= -kGumbelReach);
    }
    if (!in_reach) continue;
    const uint32_t block0 = static_cast<uint32_t>(c0 >> 2);
    for (int j = 0; j < kChunk / 4; ++j) {
      const Philox4 r = philox_block(seed, position, kStreamGumbel, block0 + static_cast<uint32_t>(j));
      words[4 * j] = r.x[0];
      words[4 * j + 1] = r.x[1];
      words[4 * j + 2] = r.x[2];
      words[4 * j + 3] = r.x[3];
    }
    for (int i = 0; i < kChunk; ++i) key[i] = gumbel_key(lp[i], words[i]);
    for (int i = 0; i < n; ++i) {
      if (key[i] > best.value) best = ArgMax{key[i], static_cast<int32_t>(c0 + i)};
    }
  }
  return best.index < vocab ? best.index : -1;
}

// ----- Row filters (row_filter.h) ------------------------------------------------------------------------------
// A row to process, as floats x [n] padded with -inf to whole tiles, and its numerators w(x) (0 in the padding).

// Converts a raw row (n entries in its own order) to floats; returns whether an entry is invalid.
template <typename T>
SPECDEC_CPU_CLONES bool convert_row(const T* row, int64_t n, int64_t padded, float* x) {
  int bad = 0;
  for (int64_t v = 0; v < n; ++v) {
    x[v] = static_cast<float>(row[v]);
    bad |= static_cast<int>(invalid_entry(x[v], true));
  }
  for (int64_t v = n; v < padded; ++v) x[v] = kNegInf;
  return bad != 0;
}

SPECDEC_CPU_CLONES float row_max(const float* x, int64_t n) {
  float m = kNegInf;
  for (int64_t v = 0; v < n; ++v) m = x[v] > m ? x[v] : m;  // NaN never wins
  return m;
}

// w(x) = det_exp2(scaled_gap(x, m, scale)) for x >= lo, else 0 (NaN: 0).
SPECDEC_CPU_CLONES void row_numerators(const float* x, int64_t n, float m, float scale, float lo, float* w) {
  for (int64_t v = 0; v < n; ++v) {
    const float e = det_exp2(scaled_gap(x[v], m, scale));
    w[v] = x[v] >= lo ? e : 0.0f;
  }
}

// S(t): the sum of w over the entries with x >= t, in the canonical order of the sampling masses (lane blocks, the
// pairwise tree over each group's lanes, groups in order, tiles in order), the sum the CUDA kernel computes.
SPECDEC_CPU_CLONES float mass_at_least_row(const float* x, const float* w, int64_t tiles, float t) {
  float sums[kLanes], groups[kGroups];
  float total = 0.0f;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const float* xt = x + tile * kTile;
    const float* wt = w + tile * kTile;
    for (int l = 0; l < kLanes; ++l) {
      const float* xb = xt + l * kLaneEntries;
      const float* wb = wt + l * kLaneEntries;
      const auto m = [&](int j) __attribute__((always_inline)) { return xb[j] >= t ? wb[j] : 0.0f; };
      sums[l] = fadd(fadd(fadd(m(0), m(1)), fadd(m(2), m(3))), fadd(fadd(m(4), m(5)), fadd(m(6), m(7))));
    }
    group_totals_of_lanes(sums, groups);
    float tile_total = 0.0f;
    for (int g = 0; g < kGroups; ++g) tile_total = fadd(tile_total, groups[g]);
    total = fadd(total, tile_total);
  }
  return total;
}

// The CPU's row for row_threshold: a materialised row, its numerators computed once (at the first S), and searches
// that use the whole row at once: a histogram by value, then a selection inside one bucket.
struct CpuFilterRow {
  const float* x;
  float* w;
  int64_t n, tiles;
  std::vector<uint32_t>& keys;
  std::vector<std::pair<float, float>>& pairs;
  bool have_w = false;

  int64_t size() const { return n; }
  float max() const { return row_max(x, n); }

  // The k-th largest value: counts per bucket of the 11 high bits of the ordered key, then nth_element inside the
  // bucket that holds it.
  float kth_largest(int32_t k, float) {
    constexpr int kBuckets = 2048;
    int64_t count[kBuckets] = {};
    for (int64_t v = 0; v < n; ++v) {
      if (x[v] == x[v]) ++count[ordered_key(x[v]) >> 21];
    }
    int64_t above = 0;
    int bucket = kBuckets - 1;
    for (; bucket >= 0 && above + count[bucket] < k; --bucket) above += count[bucket];
    if (bucket < 0) return kNegInf;  // fewer than k entries are numbers
    keys.clear();
    for (int64_t v = 0; v < n; ++v) {
      if (x[v] == x[v] && static_cast<int>(ordered_key(x[v]) >> 21) == bucket) keys.push_back(ordered_key(x[v]));
    }
    const int64_t rank = k - above - 1;  // from the top of the bucket
    std::nth_element(keys.begin(), keys.begin() + rank, keys.end(), std::greater<uint32_t>());
    return key_value(keys[rank]);
  }

  float mass_at_least(float m, float scale, float t) {
    if (!have_w) {  // the first S is S(lo_k): the numerators of the entries top-k keeps
      row_numerators(x, n, m, scale, t, w);
      std::fill(w + n, w + tiles * kTile, 0.0f);
      have_w = true;
    }
    return mass_at_least_row(x, w, tiles, t);
  }

  // Where the sum of w over the largest values reaches target, in double precision: the mass per bucket of w's
  // exponent and 3 high mantissa bits (a factor 2^(1/8) per bucket), then the crossing bucket's entries in order. The
  // bracket is [that value, the next float).
  void top_p_bracket(float, float, float, float target, float* g_lo, float* g_hi) {
    constexpr int kBuckets = 1024;  // w in (0, 1]: its bits >> 20 are at most 0x3f8
    double mass[kBuckets] = {};
    for (int64_t v = 0; v < n; ++v) mass[float_as_bits(w[v]) >> 20] += w[v];
    double above = 0.0;
    int bucket = kBuckets - 1;
    for (; bucket > 0 && above + mass[bucket] < target; --bucket) above += mass[bucket];
    if (bucket <= 0) return;
    pairs.clear();
    for (int64_t v = 0; v < n; ++v) {
      if (static_cast<int>(float_as_bits(w[v]) >> 20) == bucket) pairs.emplace_back(x[v], w[v]);
    }
    std::sort(pairs.begin(), pairs.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& [value, mass_v] : pairs) {
      above += mass_v;
      if (above >= target) {
        *g_lo = value;
        *g_hi = next_up(value);
        return;
      }
    }
  }

  float min_at_gap(float m, float scale, float g) const {
    float lo = m;
    for (int64_t v = 0; v < n; ++v) {
      if (scaled_gap(x[v], m, scale) >= g && x[v] < lo) lo = x[v];
    }
    return lo;
  }
};

// The row operations of the sampling flows (specdec/chain_sampling.h), for rows of element type T. A tree's residual
// comes in as a TreeMass: its tile_block_sums is in cpu/tree_sampling.cpp, found by argument-dependent lookup.
template <typename T>
struct CpuSamplingEngine {
  const ChainSamplingParams& P;
  int32_t errors = 0;
  // Per-request scratch, reused across rows: tiles as floats, lane states, totals.
  std::vector<float> tile_p, tile_q, lane_a, lane_b, lane_c, lane_d;
  std::vector<float> group_totals, tile_totals;  // [tiles * kGroups], [tiles]
  // Row filters: the thresholds of the target and draft rows being read (-inf: none), and the scratch to find them.
  float lo_p = kNegInf, lo_q = kNegInf;
  std::vector<float> filter_x, filter_w;
  std::vector<uint32_t> filter_keys;
  std::vector<std::pair<float, float>> filter_pairs;

  explicit CpuSamplingEngine(const ChainSamplingParams& p)
      : P(p), tile_p(kTile), tile_q(kTile), lane_a(kLanes), lane_b(kLanes), lane_c(kLanes), lane_d(kLanes),
        group_totals(tiles() * kGroups), tile_totals(tiles()) {}

  const T* row_target(int64_t b, int64_t i) const { return static_cast<const T*>(P.target) + target_row_offset(P, b, i); }
  const T* row_draft(int64_t b, int64_t i) const { return static_cast<const T*>(P.draft) + draft_row_offset(P, b, i); }
  void flag(int32_t bits) { errors |= bits; }
  int32_t bad_bit(bool target) const { return target ? kErrTargetNonFinite : kErrDraftNonFinite; }
  float load(const T* row, int64_t v, bool target) {
    if (!target) v = draft_column(P, v);
    if (v < 0) return P.logits ? kNegInf : 0.0f;  // a target id the reduced draft vocabulary lacks: q = 0
    const float x = static_cast<float>(row[v]);
    if (invalid_entry(x, P.logits)) errors |= bad_bit(target);
    return filtered(x, target ? lo_p : lo_q);
  }
  // The CPU reads p(x_i) and q(x_i) where the flow asks for them (a cached row entry costs nothing to wait for).
  void gather_drafts(int64_t, int32_t) {}
  float gathered(int64_t, int32_t, int64_t x, bool target, const T* row) { return load(row, x, target); }
  int64_t tiles() const { return (P.vocab + kTile - 1) / kTile; }
  void load_tile(const T* row, int64_t t, float absent, bool target, float* x) {
    const bool bad = !target && P.target_to_draft != nullptr ? gather_tile(row, P, t, absent, x)
                                                             : convert_tile(row, P.vocab, t, absent, P.logits, x);
    if (bad) errors |= bad_bit(target);
    const float lo = target ? lo_p : lo_q;
    if (lo > kNegInf) {
      for (int i = 0; i < kTile; ++i) x[i] = filtered(x[i], lo);
    }
  }

  // The thresholds of the rows about to be read (row_filter.h): a target row over its V entries, a draft row over
  // its own columns (Vd with a reduced vocabulary), so that a drafter sampling its own row finds the same one.
  void filter_rows(const T* row_p, const T* row_q, const RowFilter& f, float scale) {
    lo_p = row_p != nullptr ? row_threshold_of(row_p, P.vocab, true, f, scale) : kNegInf;
    lo_q = row_q != nullptr ? row_threshold_of(row_q, P.target_to_draft != nullptr ? P.draft_vocab : P.vocab, false, f, scale)
                            : kNegInf;
  }
  float row_threshold_of(const T* row, int64_t n, bool target, const RowFilter& f, float scale) {
    if (row_filter_off(f, n)) return kNegInf;
    const int64_t tiles = (n + kTile - 1) / kTile;
    filter_x.resize(tiles * kTile);
    filter_w.resize(tiles * kTile);
    if (convert_row(row, n, tiles * kTile, filter_x.data())) errors |= bad_bit(target);
    CpuFilterRow r{filter_x.data(), filter_w.data(), n, tiles, filter_keys, filter_pairs};
    return row_threshold(r, f, scale);
  }

  int32_t argmax(const T* row) {
    bool bad = false;
    const int32_t index = argmax_row(row, P.vocab, P.logits, &bad);
    if (bad) errors |= kErrTargetNonFinite;
    return index;
  }

  int32_t gumbel_argmax(const T* row, float scale, uint64_t seed, uint64_t position) {
    const int32_t top = argmax(row);
    if (top < 0) return -1;
    const float m = static_cast<float>(row[top]);
    return gumbel_argmax_row(row, P.vocab, P.logits, scale, P.logits ? m : det_log2(m), lo_p, seed, position);
  }

  // The pairwise tree over the lane states, one level at a time (adjacent pairs).
  static MaxSum reduce_lanes(float* m, float* s, float scale) {
    for (int width = 1; width < kLanes; width *= 2) {
      for (int l = 0; l < kLanes; l += 2 * width) {
        const MaxSum r = maxsum_combine(MaxSum{m[l], s[l]}, MaxSum{m[l + width], s[l + width]}, scale);
        m[l] = r.m;
        s[l] = r.s;
      }
    }
    return MaxSum{m[0], s[0]};
  }

  void softmax_stats(const T* row_p, const T* row_q, float scale, MaxSum* sp, MaxSum* sq) {
    float *mp = lane_a.data(), *spp = lane_b.data(), *mq = lane_c.data(), *sqq = lane_d.data();
    for (int l = 0; l < kLanes; ++l) {
      mp[l] = mq[l] = kNegInf;
      spp[l] = sqq[l] = 0.0f;
    }
    for (int64_t t = 0; t < tiles(); ++t) {
      if (row_p != nullptr) {
        load_tile(row_p, t, kNegInf, true, tile_p.data());
        push_tile(tile_p.data(), scale, mp, spp);
      }
      if (row_q != nullptr) {
        load_tile(row_q, t, kNegInf, false, tile_q.data());
        push_tile(tile_q.data(), scale, mq, sqq);
      }
    }
    *sp = row_p != nullptr ? reduce_lanes(mp, spp, scale) : maxsum_identity();
    *sq = row_q != nullptr ? reduce_lanes(mq, sqq, scale) : maxsum_identity();
  }

  // The masses of one lane's block in tile t (0 past the vocabulary).
  template <typename Spec>
  void block_masses(const T* row_p, const T* row_q, const Spec& spec, int64_t t, int lane, float* m) {
    for (int j = 0; j < kLaneEntries; ++j) {
      const int32_t v = static_cast<int32_t>(t * kTile + lane * kLaneEntries + j);
      m[j] = v < P.vocab ? entry_mass(spec, v, load(row_p, v, true), row_q != nullptr ? load(row_q, v, false) : 0.0f,
                                      row_q != nullptr)
                         : 0.0f;
    }
  }

  // The row's total mass in the canonical order; the group and tile totals stay in group_totals, tile_totals.
  template <typename Spec>
  float total(const T* row_p, const T* row_q, const Spec& spec) {
    const float absent = P.logits ? kNegInf : 0.0f;
    const int tiles = static_cast<int>(this->tiles());
    float* sums = lane_a.data();
    for (int t = 0; t < tiles; ++t) {
      load_tile(row_p, t, absent, true, tile_p.data());
      if (row_q != nullptr) load_tile(row_q, t, absent, false, tile_q.data());
      tile_block_sums(spec, t, tile_p.data(), tile_q.data(), row_q != nullptr, sums);
      group_totals_of_lanes(sums, &group_totals[t * kGroups]);
      tile_totals[t] = 0.0f;
      for (int g = 0; g < kGroups; ++g) tile_totals[t] = fadd(tile_totals[t], group_totals[t * kGroups + g]);
    }
    float total = 0.0f;
    for (int t = 0; t < tiles; ++t) total = fadd(total, tile_totals[t]);
    return total;
  }

  // Inverse CDF in index order, the cumulative mass built level by level: tiles, groups, lanes, entries.
  template <typename Spec>
  int32_t sample(const T* row_p, const T* row_q, const Spec& spec, float u) {
    const int tiles = static_cast<int>(this->tiles());
    const float total = this->total(row_p, row_q, spec);
    if (!(total > 0.0f) || !is_finite(total)) return -1;
    const float threshold = fmul(u, total);
    float before_tile, before_group, before_lane, before_entry;
    const int t = first_crossing(tile_totals.data(), tiles, 0.0f, threshold, &before_tile);
    const int g = first_crossing(&group_totals[t * kGroups], kGroups, before_tile, threshold, &before_group);
    const float base = fadd(before_tile, before_group);
    float lane_sums[kGroup], m[kLaneEntries];
    for (int l = 0; l < kGroup; ++l) {
      block_masses(row_p, row_q, spec, t, g * kGroup + l, m);
      lane_sums[l] = block_sum(m);
    }
    const int l = first_crossing(lane_sums, kGroup, base, threshold, &before_lane);
    block_masses(row_p, row_q, spec, t, g * kGroup + l, m);
    const int j = first_crossing(m, kLaneEntries, fadd(base, before_lane), threshold, &before_entry);
    return t * kTile + (g * kGroup + l) * kLaneEntries + j;
  }

  void write(int64_t b, int32_t accepted, int32_t token, int32_t independent) {
    for (int64_t j = 0; j <= P.num_draft; ++j) P.output_token_ids[b * (P.num_draft + 1) + j] = output_id(P, b, j, accepted, token);
    P.num_accepted[b] = accepted;
    if (P.accepted_independently != nullptr) P.accepted_independently[b] = independent;
  }
  void write_row_lse(int64_t b, float lse) { P.row_lse[b] = lse; }
};

// Runs request(engine, b) for every request b, each thread on its own Engine(params); returns the error bits of
// all. Requests are taken from a shared counter: their cost varies by an order of magnitude with the number of
// accepted drafts (logits rows are read up to the first rejection), so a static split would leave threads idle.
template <typename Engine, typename Params, typename Request>
int32_t run_requests(const Params& params, int64_t batch, Request request) {
  std::atomic<int32_t> errors{0};
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(batch, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Engine engine(params);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t b = next.fetch_add(1); b < batch; b = next.fetch_add(1)) request(engine, b);
    }
    errors.fetch_or(engine.errors);
  });
  return errors.load();
}

using Opt = std::optional<at::Tensor>;  // the ops' optional tensor arguments

}  // namespace
}  // namespace specdec
