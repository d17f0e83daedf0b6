// verify_attention on the CPU: work items are (request, KV head, KV split). Each item streams its share of
// the request's keys in tiles, reads every K and V row once for all Q x (Hq/Hkv) query rows of the KV head,
// and keeps a running max, sum and output per query row (fp32); splits are merged by their log-sum-exp.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "checks.h"
#include "cpu/simd.h"
#include "specdec/sampling_math.h"

namespace specdec {
namespace {

constexpr int kKeyTile = 32;  // K and V tiles in float stay in L1
constexpr int kMinSplitKeys = 512;

template <typename T>
SPECDEC_CPU_CLONES void to_float_row(const T* src, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// Loads a tile of n cache rows (given by offsets) as float rows.
template <typename T>
SPECDEC_CPU_CLONES void load_tile(const T* k, const T* v, const int64_t* rows, int64_t n, int64_t d, float* kt, float* vt) {
  for (int64_t t = 0; t < n; ++t) {
    const T* kr = k + rows[t];
    const T* vr = v + rows[t];
    for (int64_t e = 0; e < d; ++e) kt[t * d + e] = static_cast<float>(kr[e]);
    for (int64_t e = 0; e < d; ++e) vt[t * d + e] = static_cast<float>(vr[e]);
  }
}

// Running softmax state of one query row over a range of keys.
struct RowState {
  float m = -INFINITY;
  float l = 0.0f;
};

constexpr int kRowBlock = 32;

// scores[r][t] = q_r . k_t for a tile, from the transposed queries qt[e][r] (rows padded to a multiple of
// kRowBlock): for each key, a block of rows accumulates in vector registers, with no horizontal sums.
SPECDEC_CPU_CLONES void tile_scores(const float* qt, int64_t rows_padded, const float* k, int64_t n, int64_t d,
                                    float* scores) {
  for (int64_t r0 = 0; r0 < rows_padded; r0 += kRowBlock) {
    for (int64_t t = 0; t < n; ++t) {
      float acc[kRowBlock] = {};
      for (int64_t e = 0; e < d; ++e) {
        const float ke = k[t * d + e];
        for (int r = 0; r < kRowBlock; ++r) acc[r] += qt[e * rows_padded + r0 + r] * ke;
      }
      for (int r = 0; r < kRowBlock; ++r) scores[(r0 + r) * kKeyTile + t] = acc[r];
    }
  }
}

// Folds one tile into each row's running max, sum and output (masked scores are -inf; exp is det_exp,
// which vectorises).
SPECDEC_CPU_CLONES void tile_accumulate(float* scores, const float* v, int64_t rows, int64_t n, int64_t d,
                                        RowState* state, float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = &scores[r * kKeyTile];
    float tile_max = -INFINITY;
    for (int64_t t = 0; t < n; ++t) tile_max = s[t] > tile_max ? s[t] : tile_max;
    if (tile_max == -INFINITY) continue;
    const float m = state[r].m > tile_max ? state[r].m : tile_max;
    const float alpha = det_exp(state[r].m - m);
    float sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = det_exp(s[t] - m);
      sum += s[t];
    }
    state[r].l = state[r].l * alpha + sum;
    state[r].m = m;
    // Output blocks of 16 stay in registers across the tile's keys.
    float* o = &acc[r * d];
    int64_t e0 = 0;
    for (; e0 + 16 <= d; e0 += 16) {
      float block[16];
      for (int l = 0; l < 16; ++l) block[l] = o[e0 + l] * alpha;
      for (int64_t t = 0; t < n; ++t) {
        const float p = s[t];
        for (int l = 0; l < 16; ++l) block[l] += p * v[t * d + e0 + l];
      }
      for (int l = 0; l < 16; ++l) o[e0 + l] = block[l];
    }
    for (; e0 < d; ++e0) {
      float x = o[e0] * alpha;
      for (int64_t t = 0; t < n; ++t) x += s[t] * v[t * d + e0];
      o[e0] = x;
    }
  }
}

template <typename T>
void attend_range(const AttentionParams& P, int64_t b, int64_t kvh, int64_t begin, int64_t end, const float* qrows,
                  float* acc, RowState* state) {
  const int64_t D = P.head_dim, G = P.q_heads / P.kv_heads, R = P.num_queries * G;
  const int64_t rows_padded = (R + kRowBlock - 1) / kRowBlock * kRowBlock;
  std::vector<float> qt(D * rows_padded, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t e = 0; e < D; ++e) qt[e * rows_padded + r] = qrows[r * D + e];
  }
  const int64_t length = P.cache_seqlens[b];
  const T* kc = static_cast<const T*>(P.k_cache);
  const T* vc = static_cast<const T*>(P.v_cache);
  std::vector<float> kt(kKeyTile * D), vt(kKeyTile * D), scores(rows_padded * kKeyTile);
  int64_t rows[kKeyTile];
  for (int64_t t0 = begin; t0 < end; t0 += kKeyTile) {
    const int64_t n = std::min<int64_t>(kKeyTile, end - t0);
    for (int64_t t = 0; t < n; ++t) rows[t] = attention_cache_row(P, b, t0 + t) + kvh * D;
    load_tile(kc, vc, rows, n, D, kt.data(), vt.data());
    tile_scores(qt.data(), rows_padded, kt.data(), n, D, scores.data());
    if (t0 + n > length) {  // the tile reaches the new tokens: apply the mask
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t t = std::max<int64_t>(0, length - t0); t < n; ++t) {
          if (!attention_visible(P, b, r / G, t0 + t - length)) scores[r * kKeyTile + t] = -INFINITY;
        }
      }
    }
    tile_accumulate(scores.data(), vt.data(), R, n, D, state, acc);
  }
}

template <typename T>
void verify_attention_cpu_impl(const AttentionParams& P) {
  const int64_t B = P.batch, Q = P.num_queries, Hq = P.q_heads, Hkv = P.kv_heads, D = P.head_dim;
  const int64_t G = Hq / Hkv, R = Q * G;
  int64_t max_keys = 0;
  for (int64_t b = 0; b < B; ++b) max_keys = std::max<int64_t>(max_keys, P.cache_seqlens[b] + Q);
  // Splits only when requests x KV heads cannot keep the threads busy (long contexts at small batch).
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max<int64_t>(
      1, std::min<int64_t>((2 * threads + B * Hkv - 1) / (B * Hkv), (max_keys + kMinSplitKeys - 1) / kMinSplitKeys));
  std::vector<float> acc(B * Hkv * splits * R * D, 0.0f);
  std::vector<RowState> state(B * Hkv * splits * R);
  at::parallel_for(0, B * Hkv * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qrows(R * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (Hkv * splits), kvh = item / splits % Hkv, split = item % splits;
      const int64_t keys = P.cache_seqlens[b] + Q;
      const int64_t per = (keys + splits - 1) / splits;
      const int64_t k0 = std::min(keys, split * per), k1 = std::min(keys, k0 + per);
      if (k0 >= k1) continue;
      const T* q = static_cast<const T*>(P.q);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = r / G, h = kvh * G + r % G;
        to_float_row(q + ((b * Q + i) * Hq + h) * D, D, &qrows[r * D]);
        for (int64_t d = 0; d < D; ++d) qrows[r * D + d] *= P.scale;
      }
      attend_range<T>(P, b, kvh, k0, k1, qrows.data(), &acc[item * R * D], &state[item * R]);
    }
  });
  // Merge the splits of each (request, KV head) and write out and lse.
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, kvh = bh % Hkv;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = r / G, h = kvh * G + r % G;
        float m = -INFINITY;
        for (int64_t s = 0; s < splits; ++s) m = std::max(m, state[(bh * splits + s) * R + r].m);
        float l = 0.0f;
        std::fill(o.begin(), o.end(), 0.0f);
        if (m != -INFINITY) {
          for (int64_t s = 0; s < splits; ++s) {
            const RowState& st = state[(bh * splits + s) * R + r];
            if (st.m == -INFINITY) continue;
            const float w = std::exp(st.m - m);
            l += st.l * w;
            const float* a = &acc[((bh * splits + s) * R + r) * D];
            for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
          }
        }
        T* out = static_cast<T*>(P.out) + ((b * Q + i) * Hq + h) * D;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(o[d] * inv);
        P.lse[(b * Q + i) * Hq + h] = l > 0.0f ? m + std::log(l) : -INFINITY;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> verify_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                        const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                                                        const std::optional<at::Tensor>& v_new,
                                                        const std::optional<at::Tensor>& block_table,
                                                        const std::optional<at::Tensor>& tree_mask, double softmax_scale,
                                                        bool return_lse, const std::optional<at::Tensor>& error_flags) {
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  const AttentionParams P = make_attention_params(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, tree_mask,
                                                  softmax_scale, error_flags, out, lse);
  // Every request's block must fit in its cache and pages (checked before anything is written).
  for (int64_t b = 0; b < P.batch; ++b) {
    const int64_t length = P.cache_seqlens[b];
    TORCH_CHECK_VALUE(length >= 0 && length + P.num_queries <= P.capacity, "verify_attention: request ", b,
                      ": the block [cache_seqlens, cache_seqlens + Q) = [", length, ", ", length + P.num_queries,
                      ") runs outside the cache of ", P.capacity, " positions");
    if (P.block_table != nullptr) {
      for (int64_t pos = 0; pos < length + P.num_queries; pos += P.page_size) {
        TORCH_CHECK_VALUE(attention_cache_row(P, b, pos) >= 0, "verify_attention: request ", b,
                          ": block_table points outside the paged cache at position ", pos);
      }
    }
  }
  const int64_t row = P.kv_heads * P.head_dim, elem = q.element_size();
  if (P.k_new != nullptr) {  // append the new tokens, then attend to them from the cache
    for (int64_t b = 0; b < P.batch; ++b) {
      for (int64_t j = 0; j < P.num_queries; ++j) {
        const int64_t dst = attention_cache_row(P, b, P.cache_seqlens[b] + j) * elem;
        const int64_t src = (b * P.num_queries + j) * row * elem;
        std::memcpy(static_cast<char*>(P.k_cache) + dst, static_cast<const char*>(P.k_new) + src, row * elem);
        std::memcpy(static_cast<char*>(P.v_cache) + dst, static_cast<const char*>(P.v_new) + src, row * elem);
      }
    }
  }
  switch (q.scalar_type()) {
    case at::kFloat: verify_attention_cpu_impl<float>(P); break;
    case at::kHalf: verify_attention_cpu_impl<c10::Half>(P); break;
    default: verify_attention_cpu_impl<c10::BFloat16>(P);
  }
  (void)return_lse;
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("verify_attention", &verify_attention_cpu); }

}  // namespace specdec
