// verify_attention on tensor cores (docs/design.md §3.2), flash-decoding style.
//
// A block serves one (request, KV head, row tile, KV split). The rows of the MMA M dimension are the
// Q x (Hq/Hkv) query rows that share the KV head (row r = query r / G, head kvh * G + r % G), up to 64 per
// block, so every K/V tile is read from global memory once per KV head and row tile. Keys stream through
// shared memory in tiles of 64 with cp.async, two stages deep, loaded by every thread. Warp w owns rows
// 16w .. 16w + 15 of the tile and runs every key of the split through them in order (warps without rows only load):
// a row's scores, its online softmax and its P·V sums are the same operations in the same order whatever the
// other rows of its block, so its bits depend neither on Q nor on the batch (the split plan too depends on the
// request's cached length only: attention_split_size). Scores are fp32 in the log2 domain (scale * log2(e) folded
// in), with an online softmax per row; P is rounded to the input type for the P·V MMA.
//
// Bytes per block: its keys' K and V rows, once. FLOPs: 4 x rows x keys x D (two MMAs), which the 16-row
// padding of a row tile can at most quadruple: still far below the tensor cores' rate per byte loaded.
//
// Head dim 256: the Q fragments (D/16 x 4 registers per lane) would not fit beside the output accumulators, so
// the block's Q rows are staged in shared memory and read with ldmatrix for each key subtile (165 KiB of shared
// memory: one block per SM).
// ptxas, sm_90a, nvcc 13 (not yet timed on a GPU): D = 16: 120 registers; 32: 106; 64: 128; 128: 179; 256: 224; no
// spills; 2.1 KB of static shared memory (the tiles' row sources, the bit-packed tree-mask rows).
//
// A key tile's row addresses (page-table lookups included) are found once per tile by one thread per key, not by
// each of a row's D / 8 chunk copies.
//
// A request with several splits has its partial outputs merged by a second kernel, launched as a programmatic
// dependent launch on sm_90 (it starts while the attention kernel's last blocks run and waits for their writes).
//
// Layouts (padded or flat q, NHD or HND caches with any page stride, block table or CSR table), the sliding
// window and the soft cap are those of specdec/attention.h; every cache row goes through attention_cache_row.
//
// Requests are validated on the device: a request whose block does not fit its cache, or whose pages are
// outside the paged cache, gets NaN outputs and lse in every row (and an error bit), and no row outside the
// cache is read or written.
//
// Invariance: a request's blocks are its own KV splits at the multiples of its split size (attention_split_size,
// from its cached length), merged in split order, so a row's output bits depend neither on the other requests of
// the batch nor on its request's number of new tokens.
#pragma once
#include "specdec/attention.h"
#include "specdec/device.cuh"

namespace specdec {

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / kWarpSize;
constexpr int kAttnRows = 16 * kAttnWarps;  // query rows per block
constexpr int kAttnKeys = 64;               // keys per shared-memory stage: four 16-key subtiles
constexpr int kAttnStages = 2;
constexpr int kAttnMergeWarps = 4;          // rows merged per block of the split-merge kernel

// Shared-memory rows are padded by 8 elements (16 bytes), so the eight rows an ldmatrix reads fall in
// different banks.
template <int D> constexpr int attn_smem_stride() { return D + 8; }
template <int D> constexpr bool attn_q_in_smem() { return D > 128; }
template <int D> constexpr size_t attention_smem_bytes() {
  return (size_t{kAttnStages} * 2 * kAttnKeys + (attn_q_in_smem<D>() ? kAttnRows : 0)) * attn_smem_stride<D>() * 2;
}

// Where a key tile's rows come from: row_src[r] is the element offset of key p0 + r's head-kvh row in the cache, or
// in k_new / v_new where row_new[r], or -1 (past k_end, or a page outside the cache: zero-filled). Found once per tile
// by one thread per key, so that the D / 8 chunk loads of a row read no page table.
struct KvTileRows {
  int64_t* row_src;  // [kAttnKeys], shared
  bool* row_new;     // [kAttnKeys], shared
};

// Issues the loads of keys [p0, p0 + kAttnKeys) of K and V into one stage: the rows' sources into `rows` by the first
// kAttnKeys threads, a block barrier, then every thread's 16-byte copies. Every thread of the block calls it; `rows`
// must not be the buffer of the previous tile (its copies may still be being issued): callers alternate two.
// Keys at or past k_end are zero-filled (a masked key must not bring NaN into P·V); new tokens come from k_new/v_new
// when given. Returns AttentionError bits.
template <typename T, int D>
SPECDEC_DEVICE int32_t load_kv_tile(const AttentionParams& P, const AttentionRequest& R, int64_t b, int64_t kvh,
                                    int64_t k_end, int64_t p0, T* ks, T* vs, KvTileRows rows) {
  const int64_t length = R.length;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  int32_t errors = 0;
  if (threadIdx.x < kAttnKeys) {
    const int64_t pos = p0 + threadIdx.x;
    int64_t src = -1;
    bool from_new = false;
    if (pos < k_end) {
      if (pos >= length && P.k_new != nullptr) {
        src = ((R.q_begin + pos - length) * P.kv_heads + kvh) * D;
        from_new = true;
      } else {
        const int64_t offset = attention_cache_row(P, R, b, pos);
        if (offset >= 0) {
          src = offset + kvh * P.stride_head;
        } else {
          errors |= kAttentionBadPage;
        }
      }
    }
    rows.row_src[threadIdx.x] = src;
    rows.row_new[threadIdx.x] = from_new;
  }
  sync_threads();
  const T* kc = static_cast<const T*>(P.k_cache);
  const T* vc = static_cast<const T*>(P.v_cache);
  for (int c = threadIdx.x; c < kAttnKeys * kChunks; c += kAttnThreads) {
    const int row = c / kChunks, col = c % kChunks * 8;
    const int64_t src = rows.row_src[row];
    const bool fill = src >= 0, from_new = rows.row_new[row];
    const T* kbase = from_new ? static_cast<const T*>(P.k_new) : kc;
    const T* vbase = from_new ? static_cast<const T*>(P.v_new) : vc;
    cp_async_16(ks + row * attn_smem_stride<D>() + col, fill ? kbase + src + col : kc, fill);
    cp_async_16(vs + row * attn_smem_stride<D>() + col, fill ? vbase + src + col : vc, fill);
  }
  return errors;
}

// Writes the new tokens of (request b, KV head kvh) into the cache; the attention reads them from
// k_new/v_new, so no block waits for this copy. Returns AttentionError bits.
template <typename T, int D>
SPECDEC_DEVICE int32_t append_new_tokens(const AttentionParams& P, const AttentionRequest& R, int64_t b, int64_t kvh) {
  constexpr int kChunks = D / 8;
  int32_t errors = 0;
  for (int c = threadIdx.x; c < R.queries * kChunks; c += kAttnThreads) {
    const int64_t j = c / kChunks, col = c % kChunks * 8;
    const int64_t dst = attention_cache_row(P, R, b, R.length + j);
    if (dst < 0) {
      errors |= kAttentionBadPage;
      continue;
    }
    const int64_t src = ((R.q_begin + j) * P.kv_heads + kvh) * D + col, at = dst + kvh * P.stride_head + col;
    store_vec16(static_cast<T*>(P.k_cache) + at, load_vec16(static_cast<const T*>(P.k_new) + src));
    store_vec16(static_cast<T*>(P.v_cache) + at, load_vec16(static_cast<const T*>(P.v_new) + src));
  }
  return errors;
}

template <typename T>
SPECDEC_DEVICE uint32_t load_pair(const T* p) {
  const VecN<T, 2> v = load_vecn<2>(p);
  uint32_t r;
  memcpy(&r, &v, 4);
  return r;
}

// Two adjacent outputs rounded to T as one 4-byte store (p 4-byte aligned).
template <typename T>
SPECDEC_DEVICE void store_pair(T* p, float lo, float hi) {
  const uint32_t word = pack2<T>(lo, hi);
#if defined(SPECDEC_SIM)
  std::memcpy(p, &word, 4);
#else
  *reinterpret_cast<uint32_t*>(p) = word;
#endif
}

// grid (num_splits, Hkv * row_tiles, B), kAttnThreads threads, attention_smem_bytes<D>() of shared memory.
template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) verify_attention_kernel(const AttentionParams params) {
  static_assert(D % 16 == 0 && D <= 256, "head dim: a multiple of 16, at most 256");
  static_assert(kAttnSplitAlign % kAttnKeys == 0, "splits hold whole key tiles");
  constexpr int kStride = attn_smem_stride<D>();
  constexpr int kDTiles = D / 8;  // n-tiles of the output
  constexpr bool kQInSmem = attn_q_in_smem<D>();
  const AttentionParams& P = params;
  const int64_t split = blockIdx.x, kvh = blockIdx.y / P.row_tiles, row_tile = blockIdx.y % P.row_tiles;
  const int64_t b = blockIdx.z;
  const AttentionRequest req = attention_request(P, b);
  // A request without rows (Q_b = 0, or rows unknown because qo_indptr is inconsistent) writes nothing; its first
  // block reports its errors. Uniform across the block, before any barrier.
  if (req.queries == 0 || (req.errors & kAttentionBadQoIndptr)) {
    if (req.errors != 0 && split == 0 && blockIdx.y == 0 && threadIdx.x == 0 && P.error_flags != nullptr) {
      atomic_or(P.error_flags, req.errors);
    }
    return;
  }
  const int64_t Q = req.queries, G = P.q_heads / P.kv_heads, R = Q * G;
  const int64_t row0 = row_tile * kAttnRows;
  if (row0 >= R) return;  // the grid is sized for the request with the most rows
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, g = lane / 4, t = lane % 4;
  const bool has_rows = row0 + warp * 16 < R;  // uniform across the warp

  // The request's own splits only.
  const int64_t request_splits = attention_request_splits(P, req);
  if (split >= request_splits) return;

  SPECDEC_DYNAMIC_SHARED(T, smem);
  SPECDEC_SHARED(int32_t, block_errors, 1);
  SPECDEC_SHARED(int64_t, tile_row_src, 2 * kAttnKeys);  // KvTileRows of two tiles, alternating
  SPECDEC_SHARED(bool, tile_row_new, 2 * kAttnKeys);
  constexpr int kTreeWords = kMaxVerifyQueries / 32;
  SPECDEC_SHARED(uint32_t, tree_bits, kAttnRows * kTreeWords);  // the block's queries' tree-mask rows, bit-packed
  const auto tile_rows = [&](int64_t tile) {
    return KvTileRows{tile_row_src + tile % 2 * kAttnKeys, tile_row_new + tile % 2 * kAttnKeys};
  };
  const int64_t length = req.length;
  const bool valid = req.errors == 0;
  if (threadIdx.x == 0) *block_errors = req.errors;
  sync_threads();
  // Every block of the request checks the pages its new tokens go to (the attention reads them from k_new),
  // so that a request that cannot be appended fails in all of its row tiles and splits, and nothing of it
  // is appended.
  if (valid && P.k_new != nullptr && (P.block_table != nullptr || P.kv_indices != nullptr)) {
    for (int64_t j = threadIdx.x; j < Q; j += kAttnThreads) {
      if (attention_cache_row(P, req, b, length + j) < 0) atomic_or(block_errors, int32_t{kAttentionBadPage});
    }
    // Strict mode (an error word to fill) also refuses a written page listed twice: a debugging check that reads
    // the request's table once per block, too slow for every call.
    if (P.error_flags != nullptr) {
      int64_t first, last;
      attention_touched_pages(P, req, &first, &last);
      for (int64_t j = first + threadIdx.x; j <= last; j += kAttnThreads) {
        if (attention_page_aliases_written(P, req, b, j)) atomic_or(block_errors, int32_t{kAttentionPageAlias});
      }
    }
  }
  sync_threads();
  const bool appendable = *block_errors == 0;
  int64_t k_begin = 0, k_end = 0;
  if (valid) attention_split_keys(P, req, split, &k_begin, &k_end);
  const int64_t num_tiles = k_begin < k_end ? (k_end - k_begin + kAttnKeys - 1) / kAttnKeys : 0;
  int32_t errors = 0;
  if (appendable && P.k_new != nullptr && split == 0 && row_tile == 0) errors |= append_new_tokens<T, D>(P, req, b, kvh);

  // Stage s holds K at smem + 2s * kStageElems and V right after it; with kQInSmem the block's Q rows follow.
  constexpr int kStageElems = kAttnKeys * kStride;
  T* qs = smem + kAttnStages * 2 * kStageElems;
  // This lane's A fragments of Q (rows g and g + 8 of its row group; rows past R are zero), in registers, or
  // the block's rows in shared memory.
  uint32_t qf[kQInSmem ? 1 : D / 16][4];
  if constexpr (kQInSmem) {
    constexpr int kChunks = D / 8;
    for (int c = threadIdx.x; c < kAttnRows * kChunks; c += kAttnThreads) {
      const int64_t r = row0 + c / kChunks, col = c % kChunks * 8;
      Vec16<T> v{};
      if (r < R) v = load_vec16(static_cast<const T*>(P.q) + ((req.q_begin + r / G) * P.q_heads + kvh * G + r % G) * D + col);
      store_vec16(qs + c / kChunks * kStride + col, v);
    }
  } else {
    for (int half = 0; half < 2; ++half) {
      const int64_t r = row0 + warp * 16 + g + 8 * half;
      const T* q = r < R ? static_cast<const T*>(P.q) + ((req.q_begin + r / G) * P.q_heads + kvh * G + r % G) * D : nullptr;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        qf[kk][half] = q != nullptr ? load_pair(q + kk * 16 + 2 * t) : 0u;
        qf[kk][half + 2] = q != nullptr ? load_pair(q + kk * 16 + 2 * t + 8) : 0u;
      }
    }
  }
  float o[kDTiles][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float scale_log2 = P.scale * kLog2e;

  // The tree-mask rows of the block's queries (q0 .. q0 + 63 at most), bit-packed once for the masked subtiles, which
  // test them per score; read only when the split holds new tokens.
  const int64_t q0 = row0 / G;
  if (P.tree_mask != nullptr && num_tiles > 0 && k_end > length) {
    for (int w = threadIdx.x; w < kAttnRows * kTreeWords; w += kAttnThreads) {
      const int64_t i = q0 + w / kTreeWords, j0 = w % kTreeWords * 32;
      uint32_t bits = 0;
      for (int64_t j = j0; i < Q && j < j0 + 32 && j < Q; ++j) {
        bits |= uint32_t{P.tree_mask[req.mask_offset + i * req.mask_stride + j]} << (j - j0);
      }
      tree_bits[w] = bits;
    }
  }
  const auto tree_sees = [&](int64_t i, int64_t j) {
    return ((tree_bits[(i - q0) * kTreeWords + j / 32] >> (j % 32)) & 1u) != 0;
  };

  if (num_tiles > 0) errors |= load_kv_tile<T, D>(P, req, b, kvh, k_end, k_begin, smem, smem + kStageElems, tile_rows(0));
  cp_async_commit();
  for (int64_t tile = 0; tile < num_tiles; ++tile) {
    if (tile + 1 < num_tiles) {
      T* next = smem + (tile + 1) % kAttnStages * 2 * kStageElems;
      errors |= load_kv_tile<T, D>(P, req, b, kvh, k_end, k_begin + (tile + 1) * kAttnKeys, next, next + kStageElems,
                                   tile_rows(tile + 1));
    }
    cp_async_commit();
    cp_async_wait<1>();  // this tile's group has landed (the next one may still be in flight)
    sync_threads();      // (and, on the first tile, the Q rows staged in shared memory)
    const T* ks = smem + tile % kAttnStages * 2 * kStageElems;
    const T* vs = ks + kStageElems;
    const int64_t p0 = k_begin + tile * kAttnKeys;
    for (int sub = 0; has_rows && sub < kAttnKeys / 16; ++sub) {
      const int64_t pos0 = p0 + sub * 16;
      if (pos0 >= k_end) break;  // uniform across the warp
      // S = Q K^T for 16 rows x 16 keys: two n-tiles of 8 keys.
      float s[2][4] = {};
      const int mat = lane / 8;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t kf[4];  // matrices: (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15)
        ldmatrix_x4(kf, ks + (sub * 16 + mat / 2 * 8 + lane % 8) * kStride + kk * 16 + mat % 2 * 8, false);
        if constexpr (kQInSmem) {
          uint32_t a[4];  // matrices: (rows 0-7, d 0-7), (rows 8-15, d 0-7), (rows 0-7, d 8-15), (rows 8-15, d 8-15)
          ldmatrix_x4(a, qs + (warp * 16 + mat % 2 * 8 + lane % 8) * kStride + kk * 16 + mat / 2 * 8, false);
          mma_m16n8k16<T>(s[0], a, {kf[0], kf[1]});
          mma_m16n8k16<T>(s[1], a, {kf[2], kf[3]});
        } else {
          mma_m16n8k16<T>(s[0], qf[kk], {kf[0], kf[1]});
          mma_m16n8k16<T>(s[1], qf[kk], {kf[2], kf[3]});
        }
      }
      const bool masked = pos0 + 16 > k_end || attention_tile_masked(P, req, pos0, pos0 + 16);
      for (int nt = 0; nt < 2; ++nt) {
        for (int e = 0; e < 4; ++e) {
          const int64_t pos = pos0 + nt * 8 + 2 * t + e % 2;
          const int64_t r = row0 + warp * 16 + g + 8 * (e / 2);
          float x = P.soft_cap > 0.0f ? attention_soft_cap(s[nt][e] * P.scale, P.soft_cap) * kLog2e : s[nt][e] * scale_log2;
          if (masked && (pos >= k_end ||
                         (r < R && !attention_visible_with(P, req, r / G, pos,
                                                           [&](int64_t j) { return tree_sees(r / G, j); })))) {
            x = -INFINITY;
          }
          s[nt][e] = x;
        }
      }
      // Online softmax per row; the four lanes of a quad hold one row's 16 scores.
      for (int half = 0; half < 2; ++half) {
        float mx = fmaxf(fmaxf(s[0][2 * half], s[0][2 * half + 1]), fmaxf(s[1][2 * half], s[1][2 * half + 1]));
        mx = fmaxf(mx, shfl_xor(kFullMask, mx, 1));
        mx = fmaxf(mx, shfl_xor(kFullMask, mx, 2));
        const float m_new = fmaxf(m[half], mx);
        // A row that has seen no visible key yet keeps m = -inf, l = 0 and P = 0.
        const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m[half] - m_new);
        float sum = 0.0f;
        for (int nt = 0; nt < 2; ++nt) {
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            s[nt][e] = m_new == -INFINITY ? 0.0f : exp2f(s[nt][e] - m_new);
            sum += s[nt][e];
          }
        }
        l[half] = l[half] * alpha + sum;
        m[half] = m_new;
#pragma unroll
        for (int n = 0; n < kDTiles; ++n) {
          o[n][2 * half] *= alpha;
          o[n][2 * half + 1] *= alpha;
        }
      }
      // O += P V: P's accumulator layout is the A fragment layout of the next MMA (keys = k).
      const uint32_t pf[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]), pack2<T>(s[1][0], s[1][1]),
                              pack2<T>(s[1][2], s[1][3])};
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        uint32_t vf[4];  // transposed: (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15)
        ldmatrix_x4(vf, vs + (sub * 16 + mat % 2 * 8 + lane % 8) * kStride + np * 16 + mat / 2 * 8, true);
        mma_m16n8k16<T>(o[2 * np], pf, {vf[0], vf[1]});
        mma_m16n8k16<T>(o[2 * np + 1], pf, {vf[2], vf[3]});
      }
    }
    sync_threads();  // every warp is done with this stage before it is refilled
  }
  cp_async_wait<0>();
  allow_dependent_launch();  // the split merge may launch now; it waits for this grid's writes
  for (int half = 0; half < 2; ++half) {
    l[half] += shfl_xor(kFullMask, l[half], 1);
    l[half] += shfl_xor(kFullMask, l[half], 2);
  }
  if (errors != 0) atomic_or(block_errors, errors);
  sync_threads();
  const int32_t block_error_bits = *block_errors;
  if (threadIdx.x == 0 && block_error_bits != 0 && P.error_flags != nullptr) atomic_or(P.error_flags, block_error_bits);
  if (!has_rows) return;
  // Each warp writes its own rows: lane (g, t) holds columns n * 8 + 2t, + 1 of rows g and g + 8. (Unrolled, so that
  // o is indexed by constants and stays in registers.)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t r = row0 + warp * 16 + g + 8 * half;
    if (r >= R) continue;
    const float total = l[half];
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    float lse = total > 0.0f ? (m[half] + log2f(total)) * kLn2 : -INFINITY;
    const bool invalid = block_error_bits != 0;
    if (invalid) lse = NAN;
    const int64_t out_row = (req.q_begin + r / G) * P.q_heads + kvh * G + r % G;
    if (request_splits == 1) {
      T* out = static_cast<T*>(P.out) + out_row * D;
#pragma unroll
      for (int n = 0; n < kDTiles; ++n) {
        const float x0 = invalid ? NAN : o[n][2 * half] * inv, x1 = invalid ? NAN : o[n][2 * half + 1] * inv;
        store_pair(out + n * 8 + 2 * t, x0, x1);
      }
      if (t == 0 && P.lse != nullptr) P.lse[out_row] = lse;
    } else {
      const int64_t partial_row = split * P.total_queries * P.q_heads + out_row;
      float* out = P.partial_out + partial_row * D;
#pragma unroll
      for (int n = 0; n < kDTiles; ++n) {
        out[n * 8 + 2 * t] = invalid ? NAN : o[n][2 * half] * inv;
        out[n * 8 + 2 * t + 1] = invalid ? NAN : o[n][2 * half + 1] * inv;
      }
      if (t == 0) P.partial_lse[partial_row] = lse;
    }
  }
}

// Merges the splits of each output row by their lse, in split order: one warp per row; grid
// (ceil(num_queries * Hq / kAttnMergeWarps), B). Rows of requests with one split were written by the attention
// kernel itself.
template <typename T>
__global__ void __launch_bounds__(kAttnMergeWarps * kWarpSize) merge_attention_splits_kernel(const AttentionParams params) {
  const AttentionParams& P = params;
  wait_for_prerequisite_grid();  // the attention kernel's partial outputs (a programmatic dependent launch)
  const int64_t b = blockIdx.y, D = P.head_dim;
  const AttentionRequest req = attention_request(P, b);
  const int64_t in_request = int64_t{blockIdx.x} * kAttnMergeWarps + threadIdx.x / kWarpSize;
  if ((req.errors & kAttentionBadQoIndptr) || in_request >= req.queries * P.q_heads) return;  // uniform across the warp
  const int64_t splits = attention_request_splits(P, req);
  if (splits == 1) return;
  const int64_t rows = P.total_queries * P.q_heads, row = req.q_begin * P.q_heads + in_request;
  float mx = -INFINITY;
  bool invalid = false;
  for (int64_t s = 0; s < splits; ++s) {
    const float x = P.partial_lse[s * rows + row];
    invalid |= x != x;
    mx = fmaxf(mx, x);
  }
  float total = 0.0f;
  if (!invalid && mx != -INFINITY) {
    for (int64_t s = 0; s < splits; ++s) total += expf(P.partial_lse[s * rows + row] - mx);
  }
  for (int64_t d = threadIdx.x % kWarpSize; d < D; d += kWarpSize) {
    float acc = 0.0f;
    if (total > 0.0f) {
      for (int64_t s = 0; s < splits; ++s) {
        acc += expf(P.partial_lse[s * rows + row] - mx) * P.partial_out[(s * rows + row) * D + d];
      }
      acc /= total;
    }
    static_cast<T*>(P.out)[row * D + d] = from_float<T>(invalid ? NAN : acc);
  }
  if (threadIdx.x % kWarpSize == 0 && P.lse != nullptr) P.lse[row] = invalid ? NAN : total > 0.0f ? mx + logf(total) : -INFINITY;
}

}  // namespace specdec
