// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), usable on the
// host, on the device and under the SIMT emulator. Matches the Random123 known-answer vectors.
//
// The library's one counter layout (the RNG contract of docs/design.md §3.1): uniform number `index` of
// stream `stream` for a request keyed by (seed, offset) is word (index & 3) of
//     philox4x32_10(counter = {index >> 2, stream, offset_lo, offset_hi}, key = {seed_lo, seed_hi}).
// Every backend (CPU, CUDA, emulator, torch reference) derives its uniforms from this function.
#pragma once
#include <stdint.h>

// Functions shared by the host and device code of every backend. On the host they are always inlined: the
// CPU kernels' loops are compiled for several instruction sets (target_clones), and an out-of-line call
// would run the baseline build of a helper inside the AVX-512 loop.
#if defined(__CUDACC__)
#define SPECDEC_HD __host__ __device__ __forceinline__
#else
#define SPECDEC_HD inline __attribute__((always_inline))
#endif

namespace specdec {

struct Philox4 {
  uint32_t x[4];
};

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1

SPECDEC_HD uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  return a * b;
#else
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
#endif
}

SPECDEC_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(kPhiloxM0, ctr.x[0], &hi0);
    const uint32_t lo1 = mulhilo32(kPhiloxM1, ctr.x[2], &hi1);
    ctr = Philox4{{hi1 ^ ctr.x[1] ^ k0, lo1, hi0 ^ ctr.x[3] ^ k1, lo0}};
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return ctr;
}

// The four raw words for block `block` (= index >> 2) of a request's stream.
SPECDEC_HD Philox4 philox_block(uint64_t seed, uint64_t offset, uint32_t stream, uint32_t block) {
  return philox4x32_10(
      Philox4{{block, stream, static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Maps a word to (2k + 1) * 2^-24 with k = x >> 9 < 2^23: exact in float32, strictly inside (0, 1),
// (min 2^-24, max 1 - 2^-24), identical on every backend because no rounding happens.
SPECDEC_HD float uniform_from_bits(uint32_t x) {
  return static_cast<float>(((x >> 9) << 1) | 1u) * 5.9604644775390625e-08f;  // 2^-24
}

SPECDEC_HD float philox_uniform_at(uint64_t seed, uint64_t offset, uint32_t stream, uint64_t index) {
  const Philox4 r = philox_block(seed, offset, stream, static_cast<uint32_t>(index >> 2));
  return uniform_from_bits(r.x[index & 3]);
}

}  // namespace specdec
