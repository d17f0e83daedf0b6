// verify_attention on tensor cores (docs/design.md §3.2), flash-decoding style.
//
// A block serves one (request, KV head, row tile, KV split). The rows of the MMA M dimension are the
// Q x (Hq/Hkv) query rows that share the KV head (row r = query r / G, head kvh * G + r % G), up to 64 per
// block, so every K/V tile is read from global memory once per KV head and row tile. Keys stream through
// shared memory in tiles of 64 with cp.async, two stages deep. Each warp owns 16 rows; when the block has
// fewer than 64 rows, warps with the same rows split every tile's four 16-key subtiles between them and are
// merged through shared memory at the end. Scores are fp32 in the log2 domain (scale * log2(e) folded in),
// with an online softmax per row; P is rounded to the input type for the P·V MMA.
//
// Bytes per block: its keys' K and V rows, once. FLOPs: 4 x rows x keys x D (two MMAs), which the 16-row
// padding of a row tile can at most quadruple: still far below the tensor cores' rate per byte loaded.
//
// Head dim 256: the Q fragments (D/16 x 4 registers per lane) would not fit beside the output accumulators, so
// the block's Q rows are staged in shared memory and read with ldmatrix for each key subtile (165 KiB of shared
// memory: one block per SM).
// ptxas, sm_90a, nvcc 13 (not yet run on a GPU): D = 64: 128 registers, 8 bytes spilled; D = 128: 168 registers,
// 40 bytes spilled (__launch_bounds__(128, 1) removes the spills at 194 registers, i.e. two blocks per SM instead
// of three; to be measured); D = 256: 218 registers, no spills.
//
// Layouts (padded or flat q, NHD or HND caches with any page stride, block table or CSR table), the sliding
// window and the soft cap are those of specdec/attention.h; every cache row goes through attention_cache_row.
//
// Requests are validated on the device: a request whose block does not fit its cache, or whose pages are
// outside the paged cache, gets NaN outputs and lse in every row (and an error bit), and no row outside the
// cache is read or written.
//
// Batch invariance: a request's blocks are its own KV splits of split_keys keys (attention_request_splits),
// merged in split order, so its output bits do not depend on the other requests of the batch.
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

// Issues the loads of keys [p0, p0 + kAttnKeys) of K and V into one stage. Keys at or past k_end are
// zero-filled (a masked key must not bring NaN into P·V); new tokens come from k_new/v_new when given.
// Returns AttentionError bits.
template <typename T, int D>
SPECDEC_DEVICE int32_t load_kv_tile(const AttentionParams& P, const AttentionRequest& R, int64_t b, int64_t kvh,
                                    int64_t k_end, int64_t p0, T* ks, T* vs) {
  const int64_t length = R.length;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  const T* kc = static_cast<const T*>(P.k_cache);
  const T* vc = static_cast<const T*>(P.v_cache);
  int32_t errors = 0;
  for (int c = threadIdx.x; c < kAttnKeys * kChunks; c += kAttnThreads) {
    const int row = c / kChunks, col = c % kChunks * 8;
    const int64_t pos = p0 + row;
    const T* ksrc = kc;
    const T* vsrc = vc;
    bool fill = false;
    if (pos < k_end) {
      if (pos >= length && P.k_new != nullptr) {
        const int64_t offset = ((R.q_begin + pos - length) * P.kv_heads + kvh) * D + col;
        ksrc = static_cast<const T*>(P.k_new) + offset;
        vsrc = static_cast<const T*>(P.v_new) + offset;
        fill = true;
      } else {
        const int64_t offset = attention_cache_row(P, R, b, pos);
        if (offset >= 0) {
          ksrc = kc + offset + kvh * P.stride_head + col;
          vsrc = vc + offset + kvh * P.stride_head + col;
          fill = true;
        } else {
          errors |= kAttentionBadPage;
        }
      }
    }
    cp_async_16(ks + row * attn_smem_stride<D>() + col, ksrc, fill);
    cp_async_16(vs + row * attn_smem_stride<D>() + col, vsrc, fill);
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
  const int64_t rows = R - row0 < kAttnRows ? R - row0 : kAttnRows;
  // Warps with the same 16 rows (row group) split the subtiles of each key tile: key_slices of them.
  const int row_groups = rows <= 16 ? 1 : rows <= 32 ? 2 : 4;
  const int key_slices = kAttnWarps / row_groups;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, g = lane / 4, t = lane % 4;
  const int row_group = warp % row_groups, key_slice = warp / row_groups;

  // The request's own splits only.
  const int64_t request_splits = attention_request_splits(P, req);
  if (split >= request_splits) return;

  SPECDEC_DYNAMIC_SHARED(T, smem);
  SPECDEC_SHARED(int32_t, block_errors, 1);
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
      const int64_t r = row0 + row_group * 16 + g + 8 * half;
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

  if (num_tiles > 0) errors |= load_kv_tile<T, D>(P, req, b, kvh, k_end, k_begin, smem, smem + kStageElems);
  cp_async_commit();
  for (int64_t tile = 0; tile < num_tiles; ++tile) {
    if (tile + 1 < num_tiles) {
      T* next = smem + (tile + 1) % kAttnStages * 2 * kStageElems;
      errors |= load_kv_tile<T, D>(P, req, b, kvh, k_end, k_begin + (tile + 1) * kAttnKeys, next, next + kStageElems);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this tile's group has landed (the next one may still be in flight)
    sync_threads();      // (and, on the first tile, the Q rows staged in shared memory)
    const T* ks = smem + tile % kAttnStages * 2 * kStageElems;
    const T* vs = ks + kStageElems;
    const int64_t p0 = k_begin + tile * kAttnKeys;
    for (int sub = key_slice; sub < kAttnKeys / 16; sub += key_slices) {
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
          ldmatrix_x4(a, qs + (row_group * 16 + mat % 2 * 8 + lane % 8) * kStride + kk * 16 + mat / 2 * 8, false);
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
          const int64_t r = row0 + row_group * 16 + g + 8 * (e / 2);
          float x = P.soft_cap > 0.0f ? attention_soft_cap(s[nt][e] * P.scale, P.soft_cap) * kLog2e : s[nt][e] * scale_log2;
          if (masked && (pos >= k_end || (r < R && !attention_visible(P, req, r / G, pos)))) x = -INFINITY;
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
  for (int half = 0; half < 2; ++half) {
    l[half] += shfl_xor(kFullMask, l[half], 1);
    l[half] += shfl_xor(kFullMask, l[half], 2);
  }
  if (errors != 0) atomic_or(block_errors, errors);

  // Each warp's (m, l, O) goes to shared memory (the K/V stages are free), then the warps of each row
  // group are merged and the block's rows written.
  float* merge_o = reinterpret_cast<float*>(smem);                // [warp][16][D]
  float* merge_ml = merge_o + kAttnWarps * 16 * D;                 // [warp][16][2]
  static_assert(kAttnWarps * 16 * (D + 2) * 4 <= kAttnStages * 2 * kAttnKeys * kStride * 2, "the merge fits the stages");
  sync_threads();
  for (int n = 0; n < kDTiles; ++n) {
    for (int e = 0; e < 4; ++e) merge_o[(warp * 16 + g + 8 * (e / 2)) * D + n * 8 + 2 * t + e % 2] = o[n][e];
  }
  if (t == 0) {
    for (int half = 0; half < 2; ++half) {
      merge_ml[(warp * 16 + g + 8 * half) * 2] = m[half];
      merge_ml[(warp * 16 + g + 8 * half) * 2 + 1] = l[half];
    }
  }
  sync_threads();
  const int32_t block_error_bits = *block_errors;
  if (threadIdx.x == 0 && block_error_bits != 0 && P.error_flags != nullptr) atomic_or(P.error_flags, block_error_bits);
  constexpr int kChunks = D / 8;
  for (int c = threadIdx.x; c < row_groups * 16 * kChunks; c += kAttnThreads) {
    const int br = c / kChunks, col = c % kChunks * 8;
    const int64_t r = row0 + br;
    if (r >= R) continue;
    float mx = -INFINITY;
    for (int k = 0; k < key_slices; ++k) mx = fmaxf(mx, merge_ml[((br / 16 + k * row_groups) * 16 + br % 16) * 2]);
    float total = 0.0f, acc[8] = {};
    if (mx != -INFINITY) {
      for (int k = 0; k < key_slices; ++k) {
        const int w = br / 16 + k * row_groups;
        const float weight = exp2f(merge_ml[(w * 16 + br % 16) * 2] - mx);
        total += weight * merge_ml[(w * 16 + br % 16) * 2 + 1];
        for (int d = 0; d < 8; ++d) acc[d] += weight * merge_o[(w * 16 + br % 16) * D + col + d];
      }
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    float lse = total > 0.0f ? (mx + log2f(total)) * kLn2 : -INFINITY;
    for (int d = 0; d < 8; ++d) acc[d] *= inv;
    if (block_error_bits != 0) {
      lse = NAN;
      for (int d = 0; d < 8; ++d) acc[d] = NAN;
    }
    const int64_t out_row = (req.q_begin + r / G) * P.q_heads + kvh * G + r % G;
    if (request_splits == 1) {
      Vec16<T> v;
      for (int d = 0; d < 8; ++d) v.v[d] = from_float<T>(acc[d]);
      store_vec16(static_cast<T*>(P.out) + out_row * D + col, v);
      if (col == 0 && P.lse != nullptr) P.lse[out_row] = lse;
    } else {
      const int64_t partial_row = split * P.total_queries * P.q_heads + out_row;
      for (int d = 0; d < 8; ++d) P.partial_out[partial_row * D + col + d] = acc[d];
      if (col == 0) P.partial_lse[partial_row] = lse;
    }
  }
}

// Merges the splits of each output row by their lse, in split order: one warp per row; grid
// (ceil(num_queries * Hq / kAttnMergeWarps), B). Rows of requests with one split were written by the attention
// kernel itself.
template <typename T>
__global__ void __launch_bounds__(kAttnMergeWarps * kWarpSize) merge_attention_splits_kernel(const AttentionParams params) {
  const AttentionParams& P = params;
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
