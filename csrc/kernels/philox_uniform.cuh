// philox_uniform: one thread per Philox block of 4 uniforms. Bytes: 16 in + 4n out per row; no reuse,
// so the kernel is a streaming write and only needs enough threads in flight.
#pragma once
#include "specdec/device.cuh"

namespace specdec {

constexpr int kPhiloxUniformThreads = 256;

__global__ void __launch_bounds__(kPhiloxUniformThreads)
philox_uniform_kernel(const int64_t* __restrict__ seed, const int64_t* __restrict__ offset, float* __restrict__ out,
                      int64_t rows, int64_t n, uint32_t stream) {
  const int64_t blocks_per_row = (n + 3) / 4;
  const int64_t total = rows * blocks_per_row;
  // Whole rows of 16-byte vectors are aligned when n % 4 == 0 (the tensor itself is 16-byte aligned).
  const bool vector_store = n % 4 == 0;
  for (int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = t / blocks_per_row;
    const int64_t block = t - row * blocks_per_row;
    const Philox4 r = philox_block(static_cast<uint64_t>(seed[row]), static_cast<uint64_t>(offset[row]), stream,
                                   static_cast<uint32_t>(block));
    float* dst = out + row * n + block * 4;
    if (vector_store) {
      Vec16<float> v;
      for (int k = 0; k < 4; ++k) v.v[k] = uniform_from_bits(r.x[k]);
      store_vec16(dst, v);
    } else {
      const int64_t valid = n - block * 4 < 4 ? n - block * 4 : 4;
      for (int k = 0; k < valid; ++k) dst[k] = uniform_from_bits(r.x[k]);
    }
  }
}

}  // namespace specdec
