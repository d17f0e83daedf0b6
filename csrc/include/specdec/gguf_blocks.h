// GGUF block formats (llama.cpp's Q4_0, Q4_1, Q8_0, Q4_K, Q6_K): their shapes and the definition of their
// weights, one 32-weight unit at a time, on the host, on the device and under the SIMT emulator. The CPU GEMM's
// vector decoders (cpu/linear_isa.inc) and the CUDA kernel must equal decode_unit; it equals the gguf package's
// dequantize bit for bit (tests/test_quantized_linear.py): every weight is one rounding of an exact product.
#pragma once
#include <stdint.h>
#include <string.h>

#include "specdec/philox.h"  // SPECDEC_HD

namespace specdec {

// Weight formats, numbered as GGML's tensor types (so a GGUF tensor's type is its format here).
enum QuantFormat : int { kF32 = 0, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kBF16 = 30 };

struct BlockShape {
  int weights;  // weights per block (along K)
  int bytes;    // bytes per block
};

// The block formats' shapes; {0, 0} for a format that is not a block format.
SPECDEC_HD constexpr BlockShape block_shape(int format) {
  switch (format) {
    case kQ4_0: return {32, 18};    // fp16 d, 16 bytes of nibbles: w = (q - 8) d
    case kQ4_1: return {32, 20};    // fp16 d, fp16 m, 16 bytes of nibbles: w = q d + m
    case kQ8_0: return {32, 34};    // fp16 d, 32 int8: w = q d
    case kQ4_K: return {256, 144};  // fp16 d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    case kQ6_K: return {256, 210};  // 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, fp16 d
    default: return {0, 0};
  }
}

// IEEE half at p (little-endian, unaligned) -> float, exact (subnormals included).
SPECDEC_HD float half_at(const uint8_t* p) {
  const uint32_t h = uint32_t(p[0]) | (uint32_t(p[1]) << 8);
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else {  // zero or subnormal: mant x 2^-24, exact in float
    const float f = float(mant) * 5.9604644775390625e-08f;
    memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// Q4_K's 6-bit scale and min of sub-block j (0-7) from the 12 packed bytes.
SPECDEC_HD void q4_k_scale_min(int j, const uint8_t* s, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Weights [32 j, 32 j + 32) of the block at b (j = 0 for 32-weight blocks, 0-7 for the K-quants) -> out[32].
SPECDEC_HD void decode_unit(int format, const uint8_t* b, int j, float* out) {
  switch (format) {
    case kQ4_0: {
      const float d = half_at(b);
      for (int l = 0; l < 16; ++l) {
        out[l] = float(int(b[2 + l] & 15) - 8) * d;
        out[16 + l] = float(int(b[2 + l] >> 4) - 8) * d;
      }
      break;
    }
    case kQ4_1: {
      const float d = half_at(b), m = half_at(b + 2);
      for (int l = 0; l < 16; ++l) {
        out[l] = float(b[4 + l] & 15) * d + m;
        out[16 + l] = float(b[4 + l] >> 4) * d + m;
      }
      break;
    }
    case kQ8_0: {
      const float d = half_at(b);
      for (int l = 0; l < 32; ++l) out[l] = float(int8_t(b[2 + l])) * d;
      break;
    }
    case kQ4_K: {  // unit j: the low (even j) or high (odd j) nibbles of bytes [32 (j / 2), + 32) of the quants
      int sc, mn;
      q4_k_scale_min(j, b + 4, sc, mn);
      const float scale = half_at(b) * float(sc), offset = half_at(b + 2) * float(mn);
      const uint8_t* q = b + 16 + 32 * (j / 2);
      for (int l = 0; l < 32; ++l) out[l] = scale * float((j & 1) ? q[l] >> 4 : q[l] & 15) - offset;
      break;
    }
    case kQ6_K: {  // unit j = 4 half + part: 6-bit q = nibble of ql | 2 bits of qh, minus 32; a scale per 16
      const int half = j / 4, part = j % 4;
      const uint8_t* ql = b + 64 * half + 32 * (part & 1);
      const uint8_t* qh = b + 128 + 32 * half;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 2 * part;
      const float d = half_at(b + 208);
      for (int l = 0; l < 32; ++l) {
        const int low = part < 2 ? ql[l] & 15 : ql[l] >> 4;
        const int q = (low | (((qh[l] >> (2 * part)) & 3) << 4)) - 32;
        out[l] = d * float(sc[l / 16]) * float(q);
      }
      break;
    }
    default: break;
  }
}

}  // namespace specdec
