// verify_attention on the CPU: work items are (request, KV head, KV split). Each item streams its share of
// the request's keys in tiles, reads every K and V row once for all Q x (Hq/Hkv) query rows of the KV head,
// and keeps a running max, sum and output per query row (fp32); splits are merged by their log-sum-exp.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu/cpu_ops.h"
#include "checks/verify_attention.h"
#include "cpu/simd.h"
#include "specdec/sampling_math.h"

namespace specdec {
namespace {


// A vector of W floats, for the micro-kernels' accumulators; loads and stores through it are unaligned and
// may alias float.
template <int W>
struct FloatVec {
  typedef float type __attribute__((vector_size(4 * W), aligned(4), may_alias));
};
template <int W>
using f32v = typename FloatVec<W>::type;
template <int W>
SPECDEC_HD f32v<W>& vec_at(float* p) {
  return *reinterpret_cast<f32v<W>*>(p);
}
template <int W>
SPECDEC_HD const f32v<W>& vec_at(const float* p) {
  return *reinterpret_cast<const f32v<W>*>(p);
}

// Floats per vector register of the running CPU, which is also the instruction set of the
// SPECDEC_CPU_CLONES clones that run: their micro-kernels use vectors of this width, the widest that the
// compiler keeps in registers (wider generic vectors go through memory).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
inline int vector_floats() {
  return __builtin_cpu_supports("x86-64-v4") ? 16 : __builtin_cpu_supports("x86-64-v3") ? 8 : 4;
}
#else
inline int vector_floats() { return 4; }
#endif

constexpr int kKeyTile = 32;       // keys per tile: the tile's rows and scores stay in L1
constexpr int kRowBlock = 16;      // query rows are padded to a multiple of this (one AVX-512 vector)
constexpr int kScoreAccs = 8;      // vector accumulators of the score micro-kernel
constexpr int kPvRows = 4;         // rows per P.V micro-kernel
constexpr int kPrefetchTiles = 1;  // K and V rows are requested this many tiles ahead
// Keys per work item, at most: a request's splits depend on its own length only (batch invariance); small
// enough that one long request keeps every thread busy, large enough that merging costs little (an item's
// partial output is R x D floats against 2 x 512 x D cache values read).
constexpr int64_t kSplitKeys = 512;
static_assert(kSplitKeys % kAttnSplitAlign == 0 && kAttnSplitAlign % kKeyTile == 0, "splits hold whole key tiles");

// Points keys[t] and values[t] at the tile's n cache rows as float: the cache itself for fp32, rows
// converted into buf (2 x kKeyTile x d) otherwise. Keys past n repeat the last row (their scores are masked).
template <typename T>
SPECDEC_CPU_CLONES void tile_rows(const T* k, const T* v, const int64_t* rows, int64_t n, int64_t d, float* buf,
                                  const float** keys, const float** values) {
  for (int64_t t = 0; t < n; ++t) {
    if constexpr (std::is_same_v<T, float>) {
      keys[t] = k + rows[t];
      values[t] = v + rows[t];
    } else {
      float* kf = buf + t * d;
      float* vf = buf + (kKeyTile + t) * d;
      for (int64_t e = 0; e < d; ++e) kf[e] = static_cast<float>(k[rows[t] + e]);
      for (int64_t e = 0; e < d; ++e) vf[e] = static_cast<float>(v[rows[t] + e]);
      keys[t] = kf;
      values[t] = vf;
    }
  }
  for (int64_t t = n; t < kKeyTile; ++t) keys[t] = keys[n - 1];
}

// scores[t][r] = q_r . k_t for the tile's kKeyTile keys, from the transposed queries qt[e][r] (rows padded
// to rows_padded, a multiple of kRowBlock, with zeros): vectors of rows per key, a few keys at a time, so that
// kScoreAccs independent accumulators hide the latency of the multiply-adds and no horizontal sums occur.
template <int W>
SPECDEC_HD void tile_scores_w(const float* qt, int64_t rows_padded, const float* const* keys, int64_t d,
                                  float* scores) {
  constexpr int kVecs = kRowBlock / W, kKeys = kScoreAccs / kVecs;
  for (int64_t r0 = 0; r0 < rows_padded; r0 += kRowBlock) {
    for (int t0 = 0; t0 < kKeyTile; t0 += kKeys) {
      f32v<W> acc[kKeys][kVecs] = {};
      for (int64_t e = 0; e < d; ++e) {
        f32v<W> q[kVecs];
#pragma GCC unroll 4
        for (int c = 0; c < kVecs; ++c) q[c] = vec_at<W>(&qt[e * rows_padded + r0 + c * W]);
#pragma GCC unroll 8
        for (int j = 0; j < kKeys; ++j) {
          const float k = keys[t0 + j][e];
#pragma GCC unroll 4
          for (int c = 0; c < kVecs; ++c) acc[j][c] += q[c] * k;
        }
      }
#pragma GCC unroll 8
      for (int j = 0; j < kKeys; ++j) {
#pragma GCC unroll 4
        for (int c = 0; c < kVecs; ++c) vec_at<W>(&scores[(t0 + j) * rows_padded + r0 + c * W]) = acc[j][c];
      }
    }
  }
}

SPECDEC_CPU_CLONES SPECDEC_FUSED_MADD void tile_scores(const float* qt, int64_t rows_padded, const float* const* keys,
                                                       int64_t d, float* scores) {
  switch (vector_floats()) {
    case 16: tile_scores_w<16>(qt, rows_padded, keys, d, scores); break;
    case 8: tile_scores_w<8>(qt, rows_padded, keys, d, scores); break;
    default: tile_scores_w<4>(qt, rows_padded, keys, d, scores);
  }
}

// Folds a tile's scores into each row's running max m and sum l, and turns them into probabilities relative
// to the new max; alpha[r] = exp(old max - new max) rescales the row's output. Masked scores are -inf and
// get probability 0 (a row with no visible key so far keeps m = -inf, l = 0, and gets alpha = 0). Rows are
// in vector lanes; exp is det_exp2 (sampling_math.h) of the score times log2(e), which vectorises.
SPECDEC_CPU_CLONES void tile_softmax(float* scores, int64_t rows_padded, float* m, float* l, float* alpha) {
  for (int64_t r0 = 0; r0 < rows_padded; r0 += kRowBlock) {
    float mx[kRowBlock], sum[kRowBlock] = {};
    for (int r = 0; r < kRowBlock; ++r) mx[r] = m[r0 + r];
    for (int t = 0; t < kKeyTile; ++t) {
      const float* s = &scores[t * rows_padded + r0];
      for (int r = 0; r < kRowBlock; ++r) mx[r] = s[r] > mx[r] ? s[r] : mx[r];
    }
    for (int t = 0; t < kKeyTile; ++t) {
      float* s = &scores[t * rows_padded + r0];
      for (int r = 0; r < kRowBlock; ++r) {
        s[r] = det_exp2(fmul(s[r] - mx[r], kLog2e));
        sum[r] += s[r];
      }
    }
    for (int r = 0; r < kRowBlock; ++r) {
      alpha[r0 + r] = det_exp2(fmul(m[r0 + r] - mx[r], kLog2e));
      l[r0 + r] = l[r0 + r] * alpha[r0 + r] + sum[r];
      m[r0 + r] = mx[r];
    }
  }
}

// out[r][d0, d0 + W kVecs) = alpha[r] out[r][...] + sum_t probs[t][r] values[t][...] for kRows rows from r0:
// the outputs stay in registers across the tile's keys.
template <int W, int kRows, int kVecs>
SPECDEC_HD void pv_block(const float* probs, int64_t rows_padded, const float* const* values, int64_t n,
                             const float* alpha, int64_t r0, int64_t d0, int64_t d, float* out) {
  f32v<W> acc[kRows][kVecs];
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i) {
#pragma GCC unroll 4
    for (int c = 0; c < kVecs; ++c) acc[i][c] = vec_at<W>(&out[(r0 + i) * d + d0 + c * W]) * alpha[r0 + i];
  }
  for (int64_t t = 0; t < n; ++t) {
    f32v<W> v[kVecs];
#pragma GCC unroll 4
    for (int c = 0; c < kVecs; ++c) v[c] = vec_at<W>(values[t] + d0 + c * W);
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i) {
      const float p = probs[t * rows_padded + r0 + i];
#pragma GCC unroll 4
      for (int c = 0; c < kVecs; ++c) acc[i][c] += p * v[c];
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i) {
#pragma GCC unroll 4
    for (int c = 0; c < kVecs; ++c) vec_at<W>(&out[(r0 + i) * d + d0 + c * W]) = acc[i][c];
  }
}

template <int W, int kVecs>
SPECDEC_HD void pv_columns(const float* probs, int64_t rows_padded, const float* const* values, int64_t n,
                               const float* alpha, int64_t rows, int64_t d0, int64_t d, float* out) {
  int64_t r0 = 0;
  for (; r0 + kPvRows <= rows; r0 += kPvRows) {
    pv_block<W, kPvRows, kVecs>(probs, rows_padded, values, n, alpha, r0, d0, d, out);
  }
  for (; r0 < rows; ++r0) pv_block<W, 1, kVecs>(probs, rows_padded, values, n, alpha, r0, d0, d, out);
}

// Adds a tile's probabilities times its n value rows to the rows' outputs out[r][d], rescaled by alpha:
// columns in blocks of kVecs vectors (kPvRows x kVecs accumulators: half the vector registers), then single
// vectors, then one at a time.
template <int W>
SPECDEC_HD void tile_accumulate_w(const float* probs, int64_t rows_padded, const float* const* values, int64_t n,
                                      const float* alpha, int64_t rows, int64_t d, float* out) {
  constexpr int kVecs = W == 16 ? 4 : 2;
  int64_t d0 = 0;
  for (; d0 + W * kVecs <= d; d0 += W * kVecs) {
    pv_columns<W, kVecs>(probs, rows_padded, values, n, alpha, rows, d0, d, out);
  }
  for (; d0 + W <= d; d0 += W) pv_columns<W, 1>(probs, rows_padded, values, n, alpha, rows, d0, d, out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = d0; c < d; ++c) {
      float x = out[r * d + c] * alpha[r];
      for (int64_t t = 0; t < n; ++t) x += probs[t * rows_padded + r] * values[t][c];
      out[r * d + c] = x;
    }
  }
}

SPECDEC_CPU_CLONES SPECDEC_FUSED_MADD void tile_accumulate(const float* probs, int64_t rows_padded,
                                                           const float* const* values, int64_t n, const float* alpha,
                                                           int64_t rows, int64_t d, float* out) {
  switch (vector_floats()) {
    case 16: tile_accumulate_w<16>(probs, rows_padded, values, n, alpha, rows, d, out); break;
    case 8: tile_accumulate_w<8>(probs, rows_padded, values, n, alpha, rows, d, out); break;
    default: tile_accumulate_w<4>(probs, rows_padded, values, n, alpha, rows, d, out);
  }
}

// Asks for the K and V rows of keys [t0, t1) in L2. Each key's D values are one short run, far from the next
// key's, too short for the hardware prefetchers to follow.
template <typename T>
void prefetch_keys(const AttentionParams& P, const AttentionRequest& R, int64_t b, int64_t kvh, const T* k, const T* v,
                   int64_t t0, int64_t t1) {
  const int64_t D = P.head_dim;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = attention_cache_row(P, R, b, t) + kvh * P.stride_head;
    for (int64_t e = 0; e < D; e += 64 / sizeof(T)) {
      __builtin_prefetch(k + row + e, 0, 2);
      __builtin_prefetch(v + row + e, 0, 2);
    }
  }
}

// Per-thread buffers, sized for the largest item.
struct Workspace {
  std::vector<float> qt;      // [D][rows_padded] scaled queries, transposed, padding rows 0
  std::vector<float> tile;    // [2][kKeyTile][D] the tile's K and V rows as float (16-bit caches)
  std::vector<float> scores;  // [kKeyTile][rows_padded] scores, then probabilities
  std::vector<float> alpha;   // [rows_padded]
  // Tree requests: the new keys' scores for every row [Q][rows_padded], their value rows as float [Q][D] (16-bit
  // caches), and each query's visible new keys in block order [Q][Q] with their counts [Q].
  std::vector<float> new_scores, new_values;
  std::vector<int64_t> visible, visible_count;
};

// A tree request's rows see their visible new keys (ancestors and themselves, in block order) at positions
// length, length + 1, ...: where plain decoding of the row's path puts them. Tiles are of those positions, so a
// row's keys fall in the tiles, in the order, of the one-row steps that decode its path, and its bits are theirs
// (a key's score is the same chain of multiply-adds wherever it is computed; masked keys add exact zeros). The new
// keys' scores are computed once for all rows; a tile holding new keys gives each row its own, and accumulates
// the values row by row.
template <typename T>
int64_t prepare_tree(const AttentionParams& P, const AttentionRequest& R, int64_t b, int64_t kvh, int64_t rows_padded,
                     Workspace& ws) {
  const int64_t D = P.head_dim, Q = R.queries;
  const T* kc = static_cast<const T*>(P.k_cache);
  const T* vc = static_cast<const T*>(P.v_cache);
  ws.visible.resize(Q * Q);
  ws.visible_count.resize(Q);
  int64_t most = 0;
  for (int64_t i = 0; i < Q; ++i) {
    int64_t count = 0;
    for (int64_t j = 0; j < Q; ++j) {
      if (attention_visible(P, R, i, R.length + j)) ws.visible[i * Q + count++] = j;
    }
    ws.visible_count[i] = count;
    most = std::max(most, count);
  }
  ws.new_scores.resize(((Q + kKeyTile - 1) / kKeyTile) * kKeyTile * rows_padded);
  ws.new_values.resize(Q * D);
  int64_t offsets[kKeyTile];
  const float* keys[kKeyTile];
  const float* values[kKeyTile];
  for (int64_t j0 = 0; j0 < Q; j0 += kKeyTile) {
    const int64_t n = std::min<int64_t>(kKeyTile, Q - j0);
    for (int64_t t = 0; t < n; ++t) offsets[t] = attention_cache_row(P, R, b, R.length + j0 + t) + kvh * P.stride_head;
    tile_rows(kc, vc, offsets, n, D, ws.tile.data(), keys, values);
    float* scores = &ws.new_scores[j0 * rows_padded];
    tile_scores(ws.qt.data(), rows_padded, keys, D, scores);
    if (P.soft_cap > 0.0f) {
      for (int64_t i = 0; i < n * rows_padded; ++i) scores[i] = attention_soft_cap(scores[i], P.soft_cap);
    }
    for (int64_t t = 0; t < n; ++t) std::copy_n(values[t], D, &ws.new_values[(j0 + t) * D]);
  }
  return most;
}

// Attends the item's query rows (R.queries x G, scaled, in ws.qt) to keys [begin, end) of request b, KV head
// kvh; m, l (rows_padded) and acc (rows x D) are the item's softmax state and unnormalised output. A tree
// request's keys past its length are positions (prepare_tree), not places in the block.
template <typename T>
void attend_range(const AttentionParams& P, const AttentionRequest& R, int64_t b, int64_t kvh, int64_t begin,
                  int64_t end, Workspace& ws, float* acc, float* m, float* l) {
  const int64_t D = P.head_dim, G = P.q_heads / P.kv_heads, rows = R.queries * G;
  const int64_t rows_padded = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  const T* kc = static_cast<const T*>(P.k_cache);
  const T* vc = static_cast<const T*>(P.v_cache);
  const bool tree = P.tree_mask != nullptr && end > R.length;
  if (tree) end = std::min(end, R.length + prepare_tree<T>(P, R, b, kvh, rows_padded, ws));
  int64_t offsets[kKeyTile];
  const float* keys[kKeyTile];
  const float* values[kKeyTile];
  const float* row_values[kKeyTile];
  for (int64_t t0 = begin; t0 < end; t0 += kKeyTile) {
    const int64_t n = std::min<int64_t>(kKeyTile, end - t0);
    // keys [t0, t0 + cached) are the cache's; a tree's positions from its length on are each row's own
    const int64_t cached = tree ? std::max<int64_t>(0, std::min(n, R.length - t0)) : n;
    prefetch_keys(P, R, b, kvh, kc, vc, t0 + kPrefetchTiles * kKeyTile,
                  std::min(tree ? R.length : end, t0 + (kPrefetchTiles + 1) * kKeyTile));
    float* scores = ws.scores.data();
    if (cached > 0) {
      for (int64_t t = 0; t < cached; ++t) offsets[t] = attention_cache_row(P, R, b, t0 + t) + kvh * P.stride_head;
      tile_rows(kc, vc, offsets, cached, D, ws.tile.data(), keys, values);
      tile_scores(ws.qt.data(), rows_padded, keys, D, scores);
      if (P.soft_cap > 0.0f) {
        for (int64_t i = 0; i < cached * rows_padded; ++i) scores[i] = attention_soft_cap(scores[i], P.soft_cap);
      }
    }
    for (int64_t t = n; t < kKeyTile; ++t) std::fill_n(&scores[t * rows_padded], rows_padded, -INFINITY);
    if (attention_tile_masked(P, R, t0, t0 + cached)) {  // the tile reaches the new tokens or a row's window start
      for (int64_t t = 0; t < cached; ++t) {
        for (int64_t r = 0; r < rows; ++r) {
          if (!attention_visible(P, R, r / G, t0 + t)) scores[t * rows_padded + r] = -INFINITY;
        }
      }
    }
    if (cached == n) {
      tile_softmax(scores, rows_padded, m, l, ws.alpha.data());
      tile_accumulate(scores, rows_padded, values, n, ws.alpha.data(), rows, D, acc);
      continue;
    }
    const int64_t Q = R.queries;
    for (int64_t t = cached; t < n; ++t) {  // position t0 + t: each row's visible new key number t0 + t - length
      const int64_t depth = t0 + t - R.length;
      for (int64_t r = 0; r < rows_padded; ++r) {
        const int64_t i = r / G;
        scores[t * rows_padded + r] = r < rows && depth < ws.visible_count[i]
                                          ? ws.new_scores[ws.visible[i * Q + depth] * rows_padded + r]
                                          : -INFINITY;
      }
    }
    tile_softmax(scores, rows_padded, m, l, ws.alpha.data());
    for (int64_t r = 0; r < rows; ++r) {  // each row with its own new keys' values (probability 0 past its own)
      const int64_t i = r / G;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t depth = t0 + t - R.length;
        row_values[t] = t < cached ? values[t]
                                   : &ws.new_values[(depth < ws.visible_count[i] ? ws.visible[i * Q + depth] : 0) * D];
      }
      tile_accumulate(scores + r, rows_padded, row_values, n, ws.alpha.data() + r, 1, D, acc + r * D);
    }
  }
}

template <typename T>
void verify_attention_cpu_impl(const AttentionParams& P, const std::vector<AttentionRequest>& requests) {
  const int64_t B = P.batch, Hq = P.q_heads, Hkv = P.kv_heads, D = P.head_dim, G = Hq / Hkv;
  // Buffers are sized for the request with the most rows; each request uses its own rows only, so a request's
  // bits do not depend on the others (nor on whether q is padded or flat).
  int64_t max_queries = 0;
  for (const AttentionRequest& R : requests) max_queries = std::max(max_queries, R.queries);
  const int64_t max_rows = max_queries * G, max_rows_padded = (max_rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  // Work items (request, split, KV head), requests in order; first_split[b] is request b's first split.
  std::vector<int64_t> first_split(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    first_split[b + 1] = first_split[b] + (requests[b].queries > 0 ? attention_request_splits(P, requests[b]) : 0);
  }
  std::vector<int64_t> split_request(first_split[B]);
  for (int64_t b = 0; b < B; ++b) std::fill(&split_request[first_split[b]], &split_request[first_split[b + 1]], b);
  const int64_t items = first_split[B] * Hkv;
  if (items == 0) return;
  // Each item's unnormalised output and its rows' running max and sum (padding rows included, never read),
  // initialised by the item's worker, where the item's rows are about to be used, not in one pass up front.
  const std::unique_ptr<float[]> acc(new float[items * max_rows * D]);
  const std::unique_ptr<float[]> row_max(new float[items * max_rows_padded]), row_sum(new float[items * max_rows_padded]);
  // Items are taken from a shared counter: their sizes differ (requests' lengths, last splits), and a static
  // split of the range would leave threads idle. Each item's bits do not depend on which thread runs it.
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(items, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Workspace ws;
    ws.qt.assign(D * max_rows_padded, 0.0f);
    if (!std::is_same_v<T, float>) ws.tile.resize(2 * kKeyTile * D);
    ws.scores.resize(kKeyTile * max_rows_padded);
    ws.alpha.resize(max_rows_padded);
    for (int64_t item = next.fetch_add(1); item < items; item = next.fetch_add(1)) {
      const int64_t split = item / Hkv, kvh = item % Hkv, b = split_request[split];
      const AttentionRequest& R = requests[b];
      const int64_t rows = R.queries * G, rows_padded = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
      int64_t k0, k1;
      attention_split_keys(P, R, split - first_split[b], &k0, &k1);
      std::fill_n(&acc[item * max_rows * D], rows * D, 0.0f);
      std::fill_n(&row_max[item * max_rows_padded], rows_padded, -INFINITY);
      std::fill_n(&row_sum[item * max_rows_padded], rows_padded, 0.0f);
      if (k0 >= k1) continue;
      const T* q = static_cast<const T*>(P.q);
      std::fill(ws.qt.begin(), ws.qt.begin() + D * rows_padded, 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r / G, h = kvh * G + r % G;
        const T* qr = q + ((R.q_begin + i) * Hq + h) * D;
        for (int64_t e = 0; e < D; ++e) ws.qt[e * rows_padded + r] = static_cast<float>(qr[e]) * P.scale;
      }
      attend_range<T>(P, R, b, kvh, k0, k1, ws, &acc[item * max_rows * D], &row_max[item * max_rows_padded],
                      &row_sum[item * max_rows_padded]);
    }
  });
  // Merge the splits of each (request, KV head) in split order and write out (and lse).
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, kvh = bh % Hkv;
      const AttentionRequest& R = requests[b];
      for (int64_t r = 0; r < R.queries * G; ++r) {
        const int64_t i = r / G, h = kvh * G + r % G;
        float m = -INFINITY;
        for (int64_t s = first_split[b]; s < first_split[b + 1]; ++s) {
          m = std::max(m, row_max[(s * Hkv + kvh) * max_rows_padded + r]);
        }
        float l = 0.0f;
        std::fill(o.begin(), o.end(), 0.0f);
        if (m != -INFINITY) {
          for (int64_t s = first_split[b]; s < first_split[b + 1]; ++s) {
            const int64_t item = s * Hkv + kvh;
            const float ms = row_max[item * max_rows_padded + r];
            if (ms == -INFINITY) continue;
            const float w = std::exp(ms - m);
            l += row_sum[item * max_rows_padded + r] * w;
            const float* a = &acc[(item * max_rows + r) * D];
            for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
          }
        }
        const int64_t row = (R.q_begin + i) * Hq + h;
        T* out = static_cast<T*>(P.out) + row * D;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(o[d] * inv);
        if (P.lse != nullptr) P.lse[row] = l > 0.0f ? m + std::log(l) : -INFINITY;
      }
    }
  });
}

}  // namespace

void verify_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& k_new,
                          const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
                          const std::optional<at::Tensor>& tree_mask, std::optional<double> softmax_scale,
                          const at::Tensor& out, const std::optional<at::Tensor>& lse,
                          const std::optional<at::Tensor>& error_flags, const std::optional<at::Tensor>& qo_indptr,
                          const std::optional<at::Tensor>& kv_indptr, const std::optional<at::Tensor>& kv_indices,
                          const std::optional<at::Tensor>& kv_last_page_len, c10::string_view kv_layout,
                          int64_t window_left, double logits_soft_cap) {
  AttentionParams P = make_attention_params(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, tree_mask,
                                            softmax_scale, out, lse, error_flags, qo_indptr, kv_indptr, kv_indices,
                                            kv_last_page_len, kv_layout, window_left, logits_soft_cap);
  P.split_keys = kSplitKeys;
  // Every request is valid: its rows, its block within its cache, its pages within the paged cache (checked
  // before anything is written).
  std::vector<AttentionRequest> requests(P.batch);
  for (int64_t b = 0; b < P.batch; ++b) {
    const AttentionRequest R = attention_request(P, b);
    int32_t bits = R.errors;
    if (bits == 0 && (P.block_table != nullptr || P.kv_indices != nullptr)) {
      // The pages of the keys it reads (a sliding window skips the ones before it).
      for (int64_t pos = R.key_begin / P.page_size * P.page_size; pos < R.key_end && bits == 0; pos += P.page_size) {
        if (attention_cache_row(P, R, b, pos) < 0) bits |= kAttentionBadPage;
      }
      if (bits == 0 && P.k_new != nullptr && R.queries > 0) {  // no page written here is read or written elsewhere
        int64_t first, last;
        attention_touched_pages(P, R, &first, &last);
        for (int64_t j = first; j <= last && bits == 0; ++j) {
          if (attention_page_aliases_written(P, R, b, j)) bits |= kAttentionPageAlias;
        }
      }
    }
    if (bits != 0) {
      if (P.error_flags != nullptr) *P.error_flags |= bits;
      TORCH_CHECK_VALUE(false, attention_error_message(bits, b));
    }
    requests[b] = R;
  }
  const int64_t row = P.kv_heads * P.head_dim, elem = q.element_size();
  if (P.k_new != nullptr) {  // append the new tokens, then attend to them from the cache
    for (int64_t b = 0; b < P.batch; ++b) {
      const AttentionRequest& R = requests[b];
      for (int64_t j = 0; j < R.queries; ++j) {
        const int64_t dst = attention_cache_row(P, R, b, R.length + j);
        const char* src = static_cast<const char*>(P.k_new) + (R.q_begin + j) * row * elem;
        const char* vsrc = static_cast<const char*>(P.v_new) + (R.q_begin + j) * row * elem;
        for (int64_t h = 0; h < P.kv_heads; ++h) {
          const int64_t at = (dst + h * P.stride_head) * elem;
          std::memcpy(static_cast<char*>(P.k_cache) + at, src + h * P.head_dim * elem, P.head_dim * elem);
          std::memcpy(static_cast<char*>(P.v_cache) + at, vsrc + h * P.head_dim * elem, P.head_dim * elem);
        }
      }
    }
  }
  if (P.batch == 0) return;
  dispatch_float_types<float, c10::Half, c10::BFloat16>(q.scalar_type(), "verify_attention", [&](auto tag) {
    verify_attention_cpu_impl<typename decltype(tag)::type>(P, requests);
  });
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("verify_attention", &verify_attention_cpu); }

}  // namespace specdec
