// quantized_linear on a GPU (and under the emulator): y [M, N] = x [M, K] @ W^T with W [N, K] kept as GGUF blocks
// (specdec/gguf_blocks.h), x float32 / bfloat16 / float16, accumulated in float32: the W4/W8 x A16 product of a
// decode or verify step (1-64 rows; more rows run in tiles of kQuantRowTile).
//
// Bytes and flops: W's blocks are read once per tile of kQuantRowTile inputs (Q4_1: 0.625 bytes a weight), x once
// per weight row from L2; 2 M N K flops. At M <= 16 the product is bound by reading W, so the simplest mapping
// serves: one warp per weight row, each lane decoding whole 32-weight units (decode_unit, the definition the CPU
// kernels also equal) in registers and multiplying them with every input of the tile; a warp sum per input.
#pragma once
#include "specdec/device.cuh"
#include "specdec/gguf_blocks.h"

namespace specdec {

constexpr int kQuantThreads = 128;  // 4 warps: 4 weight rows per block
constexpr int kQuantRowTile = 16;   // inputs accumulated in registers per pass over a weight row

enum class ActivationType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct QuantizedLinearParams {
  const void* x;  // [M, K] contiguous, of x_type
  ActivationType x_type;
  const uint8_t* w;  // [N, row_bytes]
  int64_t M, N, K, row_bytes;
  int format;
  float* y;  // [M, N]
};

SPECDEC_DEVICE float activation(const QuantizedLinearParams& P, int64_t index) {
  if (P.x_type == ActivationType::kFloat32) return static_cast<const float*>(P.x)[index];
  const uint16_t bits = static_cast<const uint16_t*>(P.x)[index];
  if (P.x_type == ActivationType::kFloat16) {
    const uint8_t bytes[2] = {static_cast<uint8_t>(bits & 0xff), static_cast<uint8_t>(bits >> 8)};
    return half_at(bytes);
  }
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  memcpy(&f, &wide, 4);
  return f;
}

__global__ void __launch_bounds__(kQuantThreads) quantized_linear_kernel(const QuantizedLinearParams params) {
  const QuantizedLinearParams P = params;
  const int64_t n = int64_t{blockIdx.x} * (kQuantThreads / kWarpSize) + threadIdx.x / kWarpSize;
  if (n >= P.N) return;  // a whole warp: no collective below is left short
  const unsigned lane = lane_id();
  const BlockShape shape = block_shape(P.format);
  const int units_per_block = shape.weights / 32;
  const int64_t units = P.K / 32;
  const uint8_t* row = P.w + n * P.row_bytes;
  for (int64_t m0 = 0; m0 < P.M; m0 += kQuantRowTile) {
    const int rows = static_cast<int>(P.M - m0 < kQuantRowTile ? P.M - m0 : kQuantRowTile);
    float acc[kQuantRowTile];
    for (int m = 0; m < kQuantRowTile; ++m) acc[m] = 0.0f;
    for (int64_t u = lane; u < units; u += kWarpSize) {
      float w[32];
      decode_unit(P.format, row + (u / units_per_block) * shape.bytes, static_cast<int>(u % units_per_block), w);
      for (int m = 0; m < rows; ++m) {
        const int64_t base = (m0 + m) * P.K + 32 * u;
        float s = 0.0f;
        for (int i = 0; i < 32; ++i) s += w[i] * activation(P, base + i);
        acc[m] += s;
      }
    }
    for (int m = 0; m < rows; ++m) {
      float s = acc[m];
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2) s += shfl_xor(kFullMask, s, offset);
      if (lane == 0) P.y[(m0 + m) * P.N + n] = s;
    }
  }
}

// dequantize: one thread per 32-weight unit.
__global__ void __launch_bounds__(kQuantThreads) dequantize_kernel(const uint8_t* w, int64_t N, int64_t K,
                                                                   int64_t row_bytes, int format, float* out) {
  const BlockShape shape = block_shape(format);
  const int64_t units = K / 32, total = N * units;
  for (int64_t t = int64_t{blockIdx.x} * kQuantThreads + threadIdx.x; t < total;
       t += int64_t{gridDim.x} * kQuantThreads) {
    const int64_t n = t / units, u = t % units;
    decode_unit(format, w + n * row_bytes + (u / (shape.weights / 32)) * shape.bytes,
                static_cast<int>(u % (shape.weights / 32)), out + n * K + 32 * u);
  }
}

}  // namespace specdec
