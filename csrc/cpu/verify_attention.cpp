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

namespace specdec {
namespace {

constexpr int kKeyTile = 32;
constexpr int kMinSplitKeys = 512;

template <typename T>
SPECDEC_CPU_CLONES void to_float_row(const T* src, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// dot(a, b) with 16 partial sums, so that the loop vectorises without reassociating a single sum.
SPECDEC_CPU_CLONES float dot(const float* a, const float* b, int64_t n) {
  float part[16] = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    for (int l = 0; l < 16; ++l) part[l] += a[d + l] * b[d + l];
  }
  float s = 0.0f;
  for (; d < n; ++d) s += a[d] * b[d];
  for (int l = 0; l < 16; ++l) s += part[l];
  return s;
}

SPECDEC_CPU_CLONES void scale_add(float* acc, float alpha, const float* v, float p, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] = acc[d] * alpha + p * v[d];
}

// Running softmax state of one query row over a range of keys.
struct RowState {
  float m = -INFINITY;
  float l = 0.0f;
};

template <typename T>
void attend_range(const AttentionParams& P, int64_t b, int64_t kvh, int64_t begin, int64_t end, const float* qrows,
                  float* acc, RowState* state) {
  const int64_t D = P.head_dim, G = P.q_heads / P.kv_heads, R = P.num_queries * G;
  const int64_t length = P.cache_seqlens[b];
  const T* kc = static_cast<const T*>(P.k_cache);
  const T* vc = static_cast<const T*>(P.v_cache);
  std::vector<float> kt(kKeyTile * D), vt(kKeyTile * D), scores(kKeyTile);
  for (int64_t t0 = begin; t0 < end; t0 += kKeyTile) {
    const int64_t n = std::min<int64_t>(kKeyTile, end - t0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = attention_cache_row(P, b, t0 + t) + kvh * D;
      to_float_row(kc + row, D, &kt[t * D]);
      to_float_row(vc + row, D, &vt[t * D]);
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = r / G;
      float tile_max = -INFINITY;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = t0 + t;
        const bool visible = pos < length || attention_visible(P, b, i, pos - length);
        scores[t] = visible ? dot(&qrows[r * D], &kt[t * D], D) : -INFINITY;
        tile_max = std::max(tile_max, scores[t]);
      }
      if (tile_max == -INFINITY) continue;
      RowState& s = state[r];
      const float m = std::max(s.m, tile_max);
      const float alpha = std::exp(s.m - m);
      float* o = &acc[r * D];
      s.l *= alpha;
      bool first = true;
      for (int64_t t = 0; t < n; ++t) {
        if (scores[t] == -INFINITY) continue;
        const float p = std::exp(scores[t] - m);
        s.l += p;
        scale_add(o, first ? alpha : 1.0f, &vt[t * D], p, D);
        first = false;
      }
      s.m = m;
    }
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
            scale_add(o.data(), 1.0f, &acc[((bh * splits + s) * R + r) * D], w, D);
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
                                                        bool return_lse) {
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  const AttentionParams P = make_attention_params(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, tree_mask,
                                                  softmax_scale, out, lse);
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
