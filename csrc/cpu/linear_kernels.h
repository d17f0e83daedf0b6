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
// This header: what the ISA builds share (the formats and their scalar definition are specdec/gguf_blocks.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "specdec/gguf_blocks.h"

namespace specdec::linear {

constexpr int kMaxFusedRows = 4;  // block formats: up to this many inputs decode in registers, more through a scratch
constexpr int kPanelRows = 12;  // weight rows decoded (or read) together: divisible by every NR below

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
