// quantized_linear's 8-bit-activation path (activations="int8"): the arithmetic that every ISA's kernel follows
// (cpu/linear_int8.inc), and the quantisation of the activations.
//
// The approximation, as llama.cpp's CPU path makes it: each input row is quantised per unit of 32 values (k / 32),
//   d = max |x| / 127,  q = round-to-nearest-even(x * 127 / max |x|) in [-127, 127]  (all 0 when max |x| = 0),
// so x ~= q d; the product with the weights is then exact integer arithmetic per unit (each weight format is an
// integer times a per-unit float scale, plus a float offset for Q4_1 and Q4_K).
//
// Bytes and operations (per call): W is read once as its blocks, as on the float path; each weight unit is
// unpacked and transposed once for a group of 8 rows (16 on VNNI with several input rows: 512-bit vectors) and
// serves every input row, so a call of M rows costs, per 256 weights, about 8 (VNNI; 4 with 512 bits) or 24 (AVX2)
// integer multiply-add instructions and 4 float ones (2) per input row, against 16 float FMAs (AVX-512) or 32
// (AVX2) plus the weights' decoding on the float path. One input row skips the transpose: each row's products are
// summed across its vector by a tree of unpacks.
//
// Every output is, for each unit u in order (32 u .. 32 u + 31),
//   acc = fma(float(isum_u), scale_u * d_u, acc)     isum_u: the unit's exact integer dot product (int8_unit_dot)
//   acc = fma(offset_u, dsum_u, acc)                 Q4_1 and Q4_K only; dsum_u = d_u * sum of the unit's q
// from acc = 0: float operations on values that depend on that weight row and that input row only. So an output
// row has the same bits whatever the number of rows in the call (greedy speculative decoding stays plain greedy
// decoding), on every ISA (the kernels keep one weight row per vector lane and never add across lanes).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "specdec/gguf_blocks.h"

namespace specdec::linear {

// x quantised (int8_activations below): per input row m and unit u = k / 32, x[m][k] ~= q[m][k] d[m][u].
struct Int8Activations {
  const int8_t* q;       // [M, K]
  const float* d;        // [M, K / 32]
  const float* dsum;     // [M, K / 32]: d x (sum of the unit's q), one rounding (the offset formats' term)
  const int32_t* sum16;  // [M, K / 16]: sums of q over each 16 (the integer corrections: Q4_0, Q8_0, Q6_K)
};

// The problem a thread works on: rows [n0, n1) of W for all M inputs.
struct Int8Problem {
  Int8Activations x;
  int64_t M, K;
  const uint8_t* w;   // [N, row_bytes] blocks
  int64_t row_bytes;
  int format;
  float* y;           // [M, N] float32
  int64_t N;
};

// Row m of x [M, K] float32 (K a multiple of 32) quantised into row m of the four arrays. A unit holding a value
// that is not finite gets d = NaN: its products are NaN, as the float path's would be (its q mean nothing). Inlined into each
// ISA's kernels (int8_activations in cpu/linear_int8.inc): nearbyint is one instruction from SSE4.1 on, a libm
// call below; the values are the same.
[[gnu::always_inline]] inline void int8_activations_row(const float* x, int64_t K, int8_t* q, float* d, float* dsum, int32_t* sum16) {
  for (int64_t u = 0; u < K / 32; ++u) {
    const float* xu = x + 32 * u;
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      const float a = std::fabs(xu[i]);
      finite = finite && a <= std::numeric_limits<float>::max();
      amax = std::max(amax, a);
    }
    const float scale = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    float inverse = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
    // amax under 127 / FLT_MAX: 127 / amax overflows, and x / scale is the quotient (0 where scale underflows too)
    const bool divide = !(inverse <= std::numeric_limits<float>::max()) && scale > 0.0f;
    if (!(inverse <= std::numeric_limits<float>::max())) inverse = 0.0f;
    int32_t sums[2] = {0, 0};
    for (int i = 0; i < 32; ++i) {
      // |x| <= amax: x * inverse is within [-127, 127] up to one rounding, which the clamp absorbs
      const float v = std::min(127.0f, std::max(-127.0f, divide ? xu[i] / scale : xu[i] * inverse));
      const int32_t qi = static_cast<int32_t>(std::nearbyint(v));
      q[32 * u + i] = static_cast<int8_t>(qi);
      sums[i / 16] += qi;
    }
    d[u] = scale;
    sum16[2 * u] = sums[0];
    sum16[2 * u + 1] = sums[1];
    dsum[u] = scale * static_cast<float>(sums[0] + sums[1]);
  }
}

// A weight unit's float terms: weights = scale x (integer) + offset.
struct Int8UnitScale {
  float scale, offset;
};

constexpr bool int8_unit_has_offset(int format) { return format == kQ4_1 || format == kQ4_K; }

// The integer the vector kernels subtract per unit input sum: Q4_0 keeps its nibbles (w = (q - 8) d); VNNI reads
// Q8_0's signed bytes as unsigned w + 128 (vpdpbusd multiplies unsigned by signed bytes).
constexpr int int8_unit_zero(int format, bool vnni) {
  return format == kQ4_0 ? 8 : format == kQ8_0 && vnni ? 128 : 0;
}

// Unit j of the block at b (j = 0 for 32-weight blocks, 0-7 for the K-quants): its scale and offset.
template <int Format>
inline Int8UnitScale int8_unit_scale(const uint8_t* b, int j) {
  if constexpr (Format == kQ4_1) return {half_at(b), half_at(b + 2)};
  if constexpr (Format == kQ4_K) {
    int sc, mn;
    q4_k_scale_min(j, b + 4, sc, mn);
    return {half_at(b) * float(sc), -(half_at(b + 2) * float(mn))};  // both exact: an fp16 times 6 bits
  }
  if constexpr (Format == kQ6_K) return {half_at(b + 208), 0.0f};  // the int8 scales per 16 are in the integer
  return {half_at(b), 0.0f};                                        // Q4_0, Q8_0
}

// Unit j of the block at b against a unit of the quantised input (x: 32 int8, sum16: its two sums per 16): the
// exact integer whose product with the unit's scale (and the input's d) is the unit's dot product, less the offset.
// |result| < 2^24, so float(result) is exact (Q6_K: 2 x 128 x 16 x 32 x 127 at most).
template <int Format>
inline int32_t int8_unit_dot(const uint8_t* b, int j, const int8_t* x, const int32_t* sum16) {
  int32_t s = 0;
  if constexpr (Format == kQ4_0 || Format == kQ4_1) {
    const uint8_t* qs = b + (Format == kQ4_0 ? 2 : 4);
    for (int l = 0; l < 16; ++l) s += int32_t(qs[l] & 15) * x[l] + int32_t(qs[l] >> 4) * x[16 + l];
    if constexpr (Format == kQ4_0) s -= 8 * (sum16[0] + sum16[1]);
  } else if constexpr (Format == kQ8_0) {
    for (int l = 0; l < 32; ++l) s += int32_t(int8_t(b[2 + l])) * x[l];
  } else if constexpr (Format == kQ4_K) {
    const uint8_t* q = b + 16 + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) s += int32_t((j & 1) ? q[l] >> 4 : q[l] & 15) * x[l];
  } else {  // Q6_K: 6-bit values v = q + 32 in [0, 64), an int8 scale per 16
    const int half = j / 4, part = j % 4;
    const uint8_t* ql = b + 64 * half + 32 * (part & 1);
    const uint8_t* qh = b + 128 + 32 * half;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 2 * part;
    for (int h = 0; h < 2; ++h) {
      int32_t t = 0;
      for (int l = 16 * h; l < 16 * h + 16; ++l) {
        const int low = part < 2 ? ql[l] & 15 : ql[l] >> 4;
        t += int32_t(low | (((qh[l] >> (2 * part)) & 3) << 4)) * x[l];
      }
      s += sc[h] * (t - 32 * sum16[h]);
    }
  }
  return s;
}

}  // namespace specdec::linear
