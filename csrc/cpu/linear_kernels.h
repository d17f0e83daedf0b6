// The CPU GEMM of decode and verify steps: y [M, N] = x [M, K] @ W [N, K]^T for few rows of x (1-16 for
// skinny_linear, any count for quantized_linear, in chunks), W in float32, bfloat16 or a GGUF block format.
//
// Bytes and flops (tool-free arithmetic, per call): W is read once (N K x 4, 2, 1.06 (Q8_0), 0.625 (Q4_1) ...
// bytes), 2 M N K flops. On two cores (~35 GB/s, ~190 GFLOP/s fp32 FMA) float32 weights are bytes-bound up
// to M ~ 2 and flop-bound from M ~ 4; quantised weights are bound by their decoding at every M.
//
// Structure (one for every weight format and ISA; the ISA-specific part is linear_isa.inc):
// - Threads split W's rows in panels of kPanelRows; a panel is read (float32, bfloat16: in place) or decoded
//   into an L1/L2 scratch of float32 (block formats: one decode per call, whatever M) once, then every group
//   of up to MR inputs runs over it while it is in cache.
// - The register tile is NR weight rows x MR inputs, one accumulator vector (VW floats) each: per step of VW
//   columns NR + MR loads feed NR x MR FMAs, so FMA issue, not loads, bounds it (e.g. 3 x 4 on AVX2: 7 loads,
//   12 FMAs). Accumulators are summed across their lanes once per tile (a tree of halves).
//
// This header: the formats and the scalar decoders (the baseline kernel's, and the definition the vector ones
// must equal).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>


namespace specdec::linear {

// Weight formats, numbered as GGML's tensor types (so a GGUF tensor's type is its format here).
enum Format : int { kF32 = 0, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kBF16 = 30 };

struct BlockShape {
  int weights;  // weights per block (along K)
  int bytes;    // bytes per block
};

// The block formats' shapes; {0, 0} for a format that is not a block format.
constexpr BlockShape block_shape(int format) {
  switch (format) {
    case kQ4_0: return {32, 18};   // fp16 d, 16 bytes of nibbles: w = (q - 8) d
    case kQ4_1: return {32, 20};   // fp16 d, fp16 m, 16 bytes of nibbles: w = q d + m
    case kQ8_0: return {32, 34};   // fp16 d, 32 int8: w = q d
    case kQ4_K: return {256, 144}; // fp16 d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    case kQ6_K: return {256, 210}; // 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, fp16 d
    default: return {0, 0};
  }
}

constexpr int kMaxFusedRows = 4;  // block formats: up to this many inputs decode in registers, more through a scratch
constexpr int kPanelRows = 12;  // weight rows decoded (or read) together: divisible by every NR below

// IEEE half -> float, exact (subnormals included); scalar, used once per block.
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else {  // zero or subnormal: mant x 2^-24, exact in float
    float f = float(mant) * 5.9604644775390625e-08f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- decoding one block into float32 (llama.cpp's layouts, checked against the gguf package's dequantize in
// tests/test_quantized_linear.py).

inline void decode_q4_0(const uint8_t* b, float* out) {
  const float d = half_to_float(b);
  const uint8_t* q = b + 2;
  for (int j = 0; j < 16; ++j) out[j] = float(int(q[j] & 15) - 8) * d;
  for (int j = 0; j < 16; ++j) out[16 + j] = float(int(q[j] >> 4) - 8) * d;
}

inline void decode_q4_1(const uint8_t* b, float* out) {
  const float d = half_to_float(b), m = half_to_float(b + 2);
  const uint8_t* q = b + 4;
  for (int j = 0; j < 16; ++j) out[j] = float(q[j] & 15) * d + m;
  for (int j = 0; j < 16; ++j) out[16 + j] = float(q[j] >> 4) * d + m;
}

inline void decode_q8_0(const uint8_t* b, float* out) {
  const float d = half_to_float(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) out[j] = float(q[j]) * d;
}

// Q4_K's 6-bit scale and min of sub-block j (0-7) from the 12 packed bytes.
inline void q4_k_scale_min(int j, const uint8_t* s, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

inline void decode_q4_k(const uint8_t* b, float* out) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int pair = 0; pair < 4; ++pair, q += 32, out += 64) {  // 64 weights: low nibbles, then high nibbles
    int s0, m0, s1, m1;
    q4_k_scale_min(2 * pair, scales, s0, m0);
    q4_k_scale_min(2 * pair + 1, scales, s1, m1);
    const float d0 = d * float(s0), c0 = dmin * float(m0), d1 = d * float(s1), c1 = dmin * float(m1);
    for (int l = 0; l < 32; ++l) out[l] = d0 * float(q[l] & 15) - c0;
    for (int l = 0; l < 32; ++l) out[32 + l] = d1 * float(q[l] >> 4) - c1;
  }
}

inline void decode_q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, out += 128) {
    for (int part = 0; part < 2; ++part) {  // 16 weights share a scale: l in [16 part, 16 part + 16)
      const float s0 = d * float(sc[part]), s1 = d * float(sc[part + 2]), s2 = d * float(sc[part + 4]),
                  s3 = d * float(sc[part + 6]);
      for (int l = 16 * part; l < 16 * part + 16; ++l) {
        out[l] = s0 * float(int((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
        out[l + 32] = s1 * float(int((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
        out[l + 64] = s2 * float(int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        out[l + 96] = s3 * float(int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
  }
}

// The problem a thread works on: rows [n0, n1) of W for all M inputs.
struct Problem {
  const float* x;     // [M, K] float32, contiguous
  int64_t M, K;
  const void* w;      // [N, K] float32 / bfloat16, or [N, row_bytes] blocks
  int64_t row_bytes;  // bytes per weight row
  int format;
  float* y;           // [M, N] float32
  int64_t N;
};

}  // namespace specdec::linear
