// The one place where kernels meet CUDA. Every CUDA feature a kernel in csrc/kernels uses goes through
// this header, and each primitive here has an emulated twin (csrc/sim) selected by SPECDEC_SIM, so the
// same kernel source runs on a GPU and under the emulator.
//
// Primitives (twinned): built-in variables, sync_threads/sync_warp, thread block clusters (rank, barrier,
// distributed shared memory), blocks meeting through global memory, shuffles, votes, atomics, shared memory declarations, 16-byte vector
// loads/stores, half/bfloat16 conversions, tensor-core MMA, ldmatrix and asynchronous global -> shared copies.
// Compound helpers (warp/block reductions and scans) are written once, on top of the primitives.
#pragma once
#include <stdint.h>

#include <type_traits>

#include "sampling_math.h"

#if defined(SPECDEC_SIM)
// ---------------------------------------------------------------------------------------------------
// Emulated CUDA: host C++ with fibers.
#include <cstring>
#include <source_location>
#include <vector>

#include "../../sim/sim.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define threadIdx (::specdec::sim::thread_idx())
#define blockIdx (::specdec::sim::block_idx())
#define blockDim (::specdec::sim::block_dim())
#define gridDim (::specdec::sim::grid_dim())
#define SPECDEC_DEVICE inline
#define SPECDEC_DEVICE_NOINLINE __attribute__((noinline))

// __shared__ T name[count]: one array per block, shared by its threads.
#define SPECDEC_SHARED(T, name, count)                                                           \
  static const char name##_specdec_site = 0;                                                     \
  T* name = static_cast<T*>(::specdec::sim::static_shared(&name##_specdec_site, sizeof(T) * (count), alignof(T)))
// extern __shared__: the dynamic shared memory given at launch, 16-byte aligned.
#define SPECDEC_DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(::specdec::sim::dynamic_shared())

#else
// ---------------------------------------------------------------------------------------------------
// CUDA.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define SPECDEC_DEVICE __device__ __forceinline__
// A device function kept out of line: for large bodies called from several places, so that ptxas allocates
// registers for each once instead of for one huge inlined kernel.
#define SPECDEC_DEVICE_NOINLINE __device__ __noinline__
#define SPECDEC_SHARED(T, name, count)  \
  __shared__ T name##_specdec_storage[count]; \
  T* name = name##_specdec_storage
#define SPECDEC_DYNAMIC_SHARED(T, name)                          \
  extern __shared__ __align__(16) unsigned char specdec_dynamic_smem[]; \
  T* name = reinterpret_cast<T*>(specdec_dynamic_smem)
#endif

namespace specdec {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ----- barriers ------------------------------------------------------------------------------------
#if defined(SPECDEC_SIM)
inline void sync_threads(std::source_location loc = std::source_location::current()) {
  sim::sync_block(loc.file_name(), loc.line());
}
inline void sync_warp(unsigned mask = kFullMask, std::source_location loc = std::source_location::current()) {
  sim::warp_collective(sim::WarpOp::kSync, mask, 0, 0, kWarpSize, loc.file_name(), loc.line());
}
#else
SPECDEC_DEVICE void sync_threads() { __syncthreads(); }
SPECDEC_DEVICE void sync_warp(unsigned mask = kFullMask) { __syncwarp(mask); }
#endif

// ----- thread block clusters (sm_90) ---------------------------------------------------------------
// A launch without clusters runs clusters of one block. Code compiled for an architecture without clusters
// (before sm_90) sees clusters of one block, so a launcher must not request more there.
// map_cluster_shared(p, rank): the same shared-memory element in block `rank` of the cluster (distributed
// shared memory); valid between two sync_cluster() calls that every block of the cluster makes.
#if defined(SPECDEC_SIM)
inline unsigned cluster_rank() { return sim::cluster_block_rank(); }
inline unsigned cluster_size() { return sim::cluster_num_blocks(); }
inline void sync_cluster(std::source_location loc = std::source_location::current()) {
  sim::sync_cluster(loc.file_name(), loc.line());
}
template <typename T>
T* map_cluster_shared(T* p, unsigned rank, std::source_location loc = std::source_location::current()) {
  return static_cast<T*>(sim::map_shared_rank(p, rank, loc.file_name(), loc.line()));
}
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
SPECDEC_DEVICE unsigned cluster_rank() { return cooperative_groups::this_cluster().block_rank(); }
SPECDEC_DEVICE unsigned cluster_size() { return cooperative_groups::this_cluster().num_blocks(); }
SPECDEC_DEVICE void sync_cluster() { cooperative_groups::this_cluster().sync(); }
template <typename T>
SPECDEC_DEVICE T* map_cluster_shared(T* p, unsigned rank) { return cooperative_groups::this_cluster().map_shared_rank(p, rank); }
#else
SPECDEC_DEVICE unsigned cluster_rank() { return 0; }
SPECDEC_DEVICE unsigned cluster_size() { return 1; }
SPECDEC_DEVICE void sync_cluster() { __syncthreads(); }
template <typename T>
SPECDEC_DEVICE T* map_cluster_shared(T* p, unsigned) { return p; }
#endif

// ----- programmatic dependent launch (sm_90) --------------------------------------------------------------
// A kernel launched by launch_dependent_kernel may start while the kernel before it in the stream is still running:
// it calls wait_for_prerequisite_grid() before reading anything that kernel writes (the wait returns once that grid
// has completed and its writes are visible). The kernel before it calls allow_dependent_launch() once its blocks no
// longer need to run ahead of the dependent's. Without sm_90 code (and in the emulator, which runs launches in
// stream order) both are no-ops, and the launcher makes an ordinary launch.
#if defined(SPECDEC_SIM)
inline void wait_for_prerequisite_grid() {}
inline void allow_dependent_launch() {}
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
SPECDEC_DEVICE void wait_for_prerequisite_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
SPECDEC_DEVICE void allow_dependent_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
#else
SPECDEC_DEVICE void wait_for_prerequisite_grid() {}
SPECDEC_DEVICE void allow_dependent_launch() {}
#endif

// Ends the launch when an invariant that the launcher guarantees is broken (never for bad input, which
// kernels record and survive): a trap on the GPU, which leaves the process's CUDA context unusable, so it is
// for states no input can reach; SimError with `message` in the emulator.
#if defined(SPECDEC_SIM)
inline void invariant_failed(const char* message, std::source_location loc = std::source_location::current()) {
  sim::fail(message, loc.file_name(), loc.line());
}
#else
SPECDEC_DEVICE void invariant_failed(const char*) { __trap(); }
#endif

// Kernels using the helpers below run 1-D blocks, so the lane is threadIdx.x % 32.
SPECDEC_DEVICE unsigned lane_id() { return threadIdx.x % kWarpSize; }

// ----- shuffles and votes (32- and 64-bit trivially copyable values) -------------------------------
#if defined(SPECDEC_SIM)
namespace detail {
template <typename T>
uint64_t to_payload(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffled values are at most 64 bits");
  uint64_t p = 0;
  std::memcpy(&p, &v, sizeof(T));
  return p;
}
template <typename T>
T from_payload(uint64_t p) {
  T v;
  std::memcpy(&v, &p, sizeof(T));
  return v;
}
}  // namespace detail
template <typename T>
T shfl(unsigned mask, T v, int src_lane, int width = kWarpSize, std::source_location loc = std::source_location::current()) {
  return detail::from_payload<T>(sim::warp_collective(sim::WarpOp::kShflIdx, mask, detail::to_payload(v), src_lane, width, loc.file_name(), loc.line()));
}
template <typename T>
T shfl_up(unsigned mask, T v, unsigned delta, int width = kWarpSize, std::source_location loc = std::source_location::current()) {
  return detail::from_payload<T>(sim::warp_collective(sim::WarpOp::kShflUp, mask, detail::to_payload(v), static_cast<int>(delta), width, loc.file_name(), loc.line()));
}
template <typename T>
T shfl_down(unsigned mask, T v, unsigned delta, int width = kWarpSize, std::source_location loc = std::source_location::current()) {
  return detail::from_payload<T>(sim::warp_collective(sim::WarpOp::kShflDown, mask, detail::to_payload(v), static_cast<int>(delta), width, loc.file_name(), loc.line()));
}
template <typename T>
T shfl_xor(unsigned mask, T v, int lane_mask, int width = kWarpSize, std::source_location loc = std::source_location::current()) {
  return detail::from_payload<T>(sim::warp_collective(sim::WarpOp::kShflXor, mask, detail::to_payload(v), lane_mask, width, loc.file_name(), loc.line()));
}
inline unsigned ballot(unsigned mask, bool pred, std::source_location loc = std::source_location::current()) {
  return static_cast<unsigned>(sim::warp_collective(sim::WarpOp::kBallot, mask, pred, 0, kWarpSize, loc.file_name(), loc.line()));
}
inline bool any(unsigned mask, bool pred, std::source_location loc = std::source_location::current()) {
  return sim::warp_collective(sim::WarpOp::kAny, mask, pred, 0, kWarpSize, loc.file_name(), loc.line()) != 0;
}
inline bool all(unsigned mask, bool pred, std::source_location loc = std::source_location::current()) {
  return sim::warp_collective(sim::WarpOp::kAll, mask, pred, 0, kWarpSize, loc.file_name(), loc.line()) != 0;
}
#else
template <typename T>
SPECDEC_DEVICE T shfl(unsigned mask, T v, int src_lane, int width = kWarpSize) { return __shfl_sync(mask, v, src_lane, width); }
template <typename T>
SPECDEC_DEVICE T shfl_up(unsigned mask, T v, unsigned delta, int width = kWarpSize) { return __shfl_up_sync(mask, v, delta, width); }
template <typename T>
SPECDEC_DEVICE T shfl_down(unsigned mask, T v, unsigned delta, int width = kWarpSize) { return __shfl_down_sync(mask, v, delta, width); }
template <typename T>
SPECDEC_DEVICE T shfl_xor(unsigned mask, T v, int lane_mask, int width = kWarpSize) { return __shfl_xor_sync(mask, v, lane_mask, width); }
SPECDEC_DEVICE unsigned ballot(unsigned mask, bool pred) { return __ballot_sync(mask, pred); }
SPECDEC_DEVICE bool any(unsigned mask, bool pred) { return __any_sync(mask, pred) != 0; }
SPECDEC_DEVICE bool all(unsigned mask, bool pred) { return __all_sync(mask, pred) != 0; }
#endif

// Butterfly exchange of a trivially copyable struct made of 32-bit words, one shuffle per word.
template <typename T>
SPECDEC_DEVICE T shfl_xor_words(unsigned mask, T v, int lane_mask) {
  static_assert(sizeof(T) % 4 == 0 && std::is_trivially_copyable_v<T>, "a struct of 32-bit words");
  uint32_t w[sizeof(T) / 4];
  memcpy(w, &v, sizeof(T));
#pragma unroll
  for (unsigned i = 0; i < sizeof(T) / 4; ++i) w[i] = shfl_xor(mask, w[i], lane_mask);
  memcpy(&v, w, sizeof(T));
  return v;
}

// Index of the lowest set bit of a non-zero mask (the first lane of a ballot).
#if defined(SPECDEC_SIM)
inline int lowest_set_bit(unsigned mask) { return __builtin_ctz(mask); }
#else
SPECDEC_DEVICE int lowest_set_bit(unsigned mask) { return __ffs(mask) - 1; }
#endif

// ----- atomics (int, unsigned, float); return the old value ----------------------------------------
// Under the emulator, fibers switch only at barriers and collectives, so a plain read-modify-write is
// atomic.
#if defined(SPECDEC_SIM)
template <typename T> T atomic_add(T* p, T v) { T old = *p; *p = old + v; return old; }
template <typename T> T atomic_min(T* p, T v) { T old = *p; *p = v < old ? v : old; return old; }
template <typename T> T atomic_max(T* p, T v) { T old = *p; *p = v > old ? v : old; return old; }
template <typename T> T atomic_exch(T* p, T v) { T old = *p; *p = v; return old; }
template <typename T> T atomic_cas(T* p, T compare, T v) { T old = *p; if (old == compare) *p = v; return old; }
template <typename T> T atomic_or(T* p, T v) { T old = *p; *p = old | v; return old; }
#else
template <typename T> SPECDEC_DEVICE T atomic_add(T* p, T v) { return atomicAdd(p, v); }
template <typename T> SPECDEC_DEVICE T atomic_min(T* p, T v) { return atomicMin(p, v); }
template <typename T> SPECDEC_DEVICE T atomic_max(T* p, T v) { return atomicMax(p, v); }
template <typename T> SPECDEC_DEVICE T atomic_exch(T* p, T v) { return atomicExch(p, v); }
template <typename T> SPECDEC_DEVICE T atomic_cas(T* p, T compare, T v) { return atomicCAS(p, compare, v); }
template <typename T> SPECDEC_DEVICE T atomic_or(T* p, T v) { return atomicOr(p, v); }
// CUDA has no float atomicMin/Max: a CAS loop on the bit pattern.
template <> SPECDEC_DEVICE float atomic_min<float>(float* p, float v) {
  int* ip = reinterpret_cast<int*>(p);
  int old = *ip;
  while (v < __int_as_float(old)) {
    const int seen = atomicCAS(ip, old, __float_as_int(v));
    if (seen == old) break;
    old = seen;
  }
  return __int_as_float(old);
}
template <> SPECDEC_DEVICE float atomic_max<float>(float* p, float v) {
  int* ip = reinterpret_cast<int*>(p);
  int old = *ip;
  while (v > __int_as_float(old)) {
    const int seen = atomicCAS(ip, old, __float_as_int(v));
    if (seen == old) break;
    old = seen;
  }
  return __int_as_float(old);
}
template <> SPECDEC_DEVICE float atomic_cas<float>(float* p, float compare, float v) {
  return __int_as_float(atomicCAS(reinterpret_cast<int*>(p), __float_as_int(compare), __float_as_int(v)));
}
#endif

// ----- blocks that meet through global memory (a cooperative launch: all of them resident) -----------
// arrive_and_wait(counter, target), by one thread of each block after a block barrier: adds the block's
// arrival to `counter` and waits until it reaches `target`. The block's global writes before the barrier are
// visible to every block that passed the same target (a fence before the arrival, an acquire load and a fence
// after it: the grid barrier of cooperative groups, kept per group of blocks). load_coherent reads such a
// write: from L2, never from a line this SM's L1 kept from before the barrier.
#if defined(SPECDEC_SIM)
inline void arrive_and_wait(unsigned* counter, unsigned target,
                            std::source_location loc = std::source_location::current()) {
  *counter += 1u;
  for (bool again = false; *static_cast<volatile unsigned*>(counter) < target; again = true) {
    sim::spin_wait(loc.file_name(), loc.line(), again);
  }
}
template <typename T>
T load_coherent(const T* p) {
  return *p;
}
#else
SPECDEC_DEVICE void arrive_and_wait(unsigned* counter, unsigned target) {
  __threadfence();
  atomicAdd(counter, 1u);
  for (;;) {
    unsigned seen;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    if (seen >= target) break;
    __nanosleep(32);
  }
  __threadfence();
}
template <typename T>
SPECDEC_DEVICE T load_coherent(const T* p) {
  static_assert(sizeof(T) % 4 == 0 && std::is_trivially_copyable_v<T>, "a struct of 32-bit words");
  uint32_t w[sizeof(T) / 4];
#pragma unroll
  for (unsigned i = 0; i < sizeof(T) / 4; ++i) w[i] = __ldcg(reinterpret_cast<const unsigned*>(p) + i);
  T v;
  memcpy(&v, w, sizeof(T));
  return v;
}
#endif

// ----- 16-bit floating point -----------------------------------------------------------------------
#if defined(SPECDEC_SIM)
struct half_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };


inline float to_float(float v) { return v; }
inline float to_float(bf16_t v) { return bits_as_float(uint32_t{v.bits} << 16); }
inline float to_float(half_t v) {
  const uint32_t sign = uint32_t{v.bits & 0x8000u} << 16;
  uint32_t exp = (v.bits >> 10) & 0x1f, mant = v.bits & 0x3ff;
  if (exp == 0) {
    if (mant == 0) return bits_as_float(sign);
    exp = 1;  // subnormal: normalise
    while (!(mant & 0x400)) { mant <<= 1; --exp; }
    mant &= 0x3ff;
    return bits_as_float(sign | ((exp + 112) << 23) | (mant << 13));
  }
  if (exp == 31) return bits_as_float(sign | 0x7f800000u | (mant << 13));
  return bits_as_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// Round to nearest even, as __float2half_rn / __float2bfloat16_rn.
template <typename T> T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline bf16_t from_float<bf16_t>(float f) {
  const uint32_t x = float_as_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((x >> 16) | 0x40)};  // quiet NaN
  return bf16_t{static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
}
template <> inline half_t from_float<half_t>(float f) {
  uint32_t x = float_as_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return half_t{static_cast<uint16_t>(sign | 0x7e00u)};
  if (x >= 0x477ff000u) return half_t{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (x < 0x38800000u) {                                                       // below 2^-14: subnormal
    if (x <= 0x33000000u) return half_t{sign};                                  // <= 2^-25 rounds to 0
    const uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return half_t{static_cast<uint16_t>(sign | r)};
  }
  uint32_t r = (x - 0x38000000u) >> 13;
  const uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return half_t{static_cast<uint16_t>(sign | r)};
}
#else
using half_t = __half;
using bf16_t = __nv_bfloat16;
SPECDEC_DEVICE float to_float(float v) { return v; }
SPECDEC_DEVICE float to_float(half_t v) { return __half2float(v); }
SPECDEC_DEVICE float to_float(bf16_t v) { return __bfloat162float(v); }
template <typename T> SPECDEC_DEVICE T from_float(float f);
template <> SPECDEC_DEVICE float from_float<float>(float f) { return f; }
template <> SPECDEC_DEVICE half_t from_float<half_t>(float f) { return __float2half_rn(f); }
template <> SPECDEC_DEVICE bf16_t from_float<bf16_t>(float f) { return __float2bfloat16_rn(f); }
#endif

// ----- 16-byte vector memory access ----------------------------------------------------------------
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// `p` must be 16-byte aligned (a misaligned vector access faults on the GPU; the emulator reports it).
#if defined(SPECDEC_SIM)
template <typename T>
Vec16<T> load_vec16(const T* p, std::source_location loc = std::source_location::current()) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    sim::fail("misaligned 16-byte load", loc.file_name(), loc.line());
  }
  Vec16<T> r;
  std::memcpy(&r, p, 16);
  return r;
}
template <typename T>
void store_vec16(T* p, const Vec16<T>& v, std::source_location loc = std::source_location::current()) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    sim::fail("misaligned 16-byte store", loc.file_name(), loc.line());
  }
  std::memcpy(p, &v, 16);
}
#else
template <typename T>
SPECDEC_DEVICE Vec16<T> load_vec16(const T* p) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  Vec16<T> r;
  static_assert(sizeof(r) == sizeof(raw));
  memcpy(&r, &raw, 16);
  return r;
}
template <typename T>
SPECDEC_DEVICE void store_vec16(T* p, const Vec16<T>& v) {
  uint4 raw;
  memcpy(&raw, &v, 16);
  *reinterpret_cast<uint4*>(p) = raw;
}
#endif

// N consecutive elements in one load of N * sizeof(T) bytes (4, 8 or 16); `p` must be aligned to that.
template <typename T, int N>
struct alignas(N * sizeof(T)) VecN {
  T v[N];
};
#if defined(SPECDEC_SIM)
template <int N, typename T>
VecN<T, N> load_vecn(const T* p, std::source_location loc = std::source_location::current()) {
  if (reinterpret_cast<uintptr_t>(p) % (N * sizeof(T)) != 0) sim::fail("misaligned vector load", loc.file_name(), loc.line());
  VecN<T, N> r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
#else
template <int N, typename T>
SPECDEC_DEVICE VecN<T, N> load_vecn(const T* p) {
  constexpr int kBytes = N * sizeof(T);
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "4, 8 or 16 bytes");
  VecN<T, N> r;
  if constexpr (kBytes == 16) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    memcpy(&r, &raw, 16);
  } else if constexpr (kBytes == 8) {
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
    memcpy(&r, &raw, 8);
  } else {
    const unsigned raw = __ldg(reinterpret_cast<const unsigned*>(p));
    memcpy(&r, &raw, 4);
  }
  return r;
}
#endif

// ----- tensor cores and asynchronous copies (sm_80+) ------------------------------------------------
// Fragments of mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.f32 for lane = 4 * g + t (PTX ISA,
// "Matrix Fragments for mma.m16n8k16"). Each 32-bit register holds two 16-bit elements, the lower index in
// the low half:
//   A (16 x 16, row-major): a[0] = A[g][2t, 2t+1]    a[1] = A[g+8][2t, 2t+1]
//                           a[2] = A[g][2t+8, 2t+9]  a[3] = A[g+8][2t+8, 2t+9]
//   B (16 x 8, k x n):      b[0] = B[2t, 2t+1][g]    b[1] = B[2t+8, 2t+9][g]
//   C (16 x 8, fp32):       c[0], c[1] = C[g][2t, 2t+1]   c[2], c[3] = C[g+8][2t, 2t+1]
// ldmatrix.x4 loads four 8 x 8 matrices of 16-bit elements from shared memory: lanes 8i..8i+7 give the
// addresses of matrix i's rows (16 bytes each, 16-byte aligned), and lane 4 * g + t receives in r[i]
// row g, columns 2t and 2t+1 of matrix i; with .trans, rows 2t and 2t+1 of column g.
// cp_async_16 copies 16 bytes global -> shared without passing through registers (zero-fills when !fill);
// cp_async_wait<N> waits until at most N of the committed groups are still in flight.
#if defined(SPECDEC_SIM)
namespace detail {
// The emulated warp-wide matrix instructions exchange operands through this area: 8 words per lane, one
// slot per warp of the block (emulator-only shared memory, not part of the kernel's budget on a GPU).
// The calling thread's index within its block, x fastest (the order lanes and warps are numbered in).
inline unsigned linear_thread() {
  const dim3 bd = sim::block_dim();
  const uint3 t = sim::thread_idx();
  return t.x + bd.x * (t.y + bd.y * t.z);
}
inline uint32_t* warp_exchange_slots() {
  static const char site = 0;
  const dim3 bd = sim::block_dim();
  auto* base = static_cast<uint32_t*>(sim::static_shared(&site, bd.x * bd.y * bd.z * 8 * sizeof(uint32_t), 16));
  return base + linear_thread() / kWarpSize * kWarpSize * 8;
}
template <typename T>
float half_word(uint32_t word, unsigned which) {
  return to_float(T{static_cast<uint16_t>(which ? word >> 16 : word & 0xffffu)});
}
inline void check_row_address(const void* p, const std::source_location& loc) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) sim::fail("ldmatrix row address not 16-byte aligned", loc.file_name(), loc.line());
}
}  // namespace detail

template <typename T>
uint32_t pack2(float lo, float hi) {
  return uint32_t{from_float<T>(lo).bits} | uint32_t{from_float<T>(hi).bits} << 16;
}

template <typename T>
void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                  std::source_location loc = std::source_location::current()) {
  static_assert(std::is_same_v<T, half_t> || std::is_same_v<T, bf16_t>, "fp16 or bf16 operands");
  uint32_t* slots = detail::warp_exchange_slots();
  const unsigned lane = lane_id();
  for (int i = 0; i < 4; ++i) slots[lane * 8 + i] = a[i];
  slots[lane * 8 + 4] = b[0];
  slots[lane * 8 + 5] = b[1];
  sync_warp(kFullMask, loc);
  auto a_at = [&](unsigned row, unsigned k) {
    const unsigned src = (row % 8) * 4 + (k % 8) / 2, reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return detail::half_word<T>(slots[src * 8 + reg], k % 2);
  };
  auto b_at = [&](unsigned k, unsigned n) {
    const unsigned src = n * 4 + (k % 8) / 2, reg = 4 + (k >= 8 ? 1 : 0);
    return detail::half_word<T>(slots[src * 8 + reg], k % 2);
  };
  const unsigned g = lane / 4, t = lane % 4;
  float d[4];
  for (int i = 0; i < 4; ++i) {
    const unsigned row = g + (i >= 2 ? 8 : 0), col = 2 * t + i % 2;
    float acc = c[i];
    for (unsigned k = 0; k < 16; ++k) acc += a_at(row, k) * b_at(k, col);
    d[i] = acc;
  }
  sync_warp(kFullMask, loc);  // every lane has read the slots before any lane reuses them
  for (int i = 0; i < 4; ++i) c[i] = d[i];
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans,
                        std::source_location loc = std::source_location::current()) {
  detail::check_row_address(row, loc);
  uint32_t* slots = detail::warp_exchange_slots();
  const unsigned lane = lane_id();
  const uintptr_t address = reinterpret_cast<uintptr_t>(row);
  slots[lane * 8] = static_cast<uint32_t>(address);
  slots[lane * 8 + 1] = static_cast<uint32_t>(address >> 32);
  sync_warp(kFullMask, loc);
  auto row_of = [&](unsigned src) {
    return reinterpret_cast<const uint16_t*>(uintptr_t{slots[src * 8]} | uintptr_t{slots[src * 8 + 1]} << 32);
  };
  const unsigned g = lane / 4, t = lane % 4;
  uint32_t out[4];
  for (unsigned i = 0; i < 4; ++i) {
    if (!trans) {
      out[i] = uint32_t{row_of(8 * i + g)[2 * t]} | uint32_t{row_of(8 * i + g)[2 * t + 1]} << 16;
    } else {
      out[i] = uint32_t{row_of(8 * i + 2 * t)[g]} | uint32_t{row_of(8 * i + 2 * t + 1)[g]} << 16;
    }
  }
  sync_warp(kFullMask, loc);
  for (int i = 0; i < 4; ++i) r[i] = out[i];
}

// cp.async is emulated as asynchronous as the hardware may be: a copy is carried out only when the
// thread's cp_async_wait retires its group, so a kernel that reads a stage before waiting for it reads
// stale data or the shared-memory poison, and its tests fail.
namespace detail {
struct PendingCopy {
  void* shared;
  const void* global;
  bool fill;
};
struct AsyncCopies {
  uint64_t block = 0;                            // block_serial() of the block these belong to
  std::vector<PendingCopy> open;                 // issued, not committed
  std::vector<std::vector<PendingCopy>> groups;  // committed, oldest first
};
inline AsyncCopies& async_copies() {
  static thread_local std::vector<AsyncCopies> per_thread;  // the fibers of a block share one OS thread
  const unsigned linear = linear_thread();
  if (per_thread.size() <= linear) per_thread.resize(linear + 1);
  AsyncCopies& mine = per_thread[linear];
  if (mine.block != sim::block_serial()) {  // left over from an earlier block: its copies died with it
    mine.block = sim::block_serial();
    mine.open.clear();
    mine.groups.clear();
  }
  return mine;
}
}  // namespace detail

inline void cp_async_16(void* shared, const void* global, bool fill,
                        std::source_location loc = std::source_location::current()) {
  if (reinterpret_cast<uintptr_t>(shared) % 16 != 0 || reinterpret_cast<uintptr_t>(global) % 16 != 0) {
    sim::fail("cp.async of 16 bytes with a misaligned address", loc.file_name(), loc.line());
  }
  detail::async_copies().open.push_back({shared, global, fill});
}
inline void cp_async_commit() {
  detail::AsyncCopies& mine = detail::async_copies();
  mine.groups.push_back(std::move(mine.open));
  mine.open.clear();
}
template <int N>
void cp_async_wait() {
  detail::AsyncCopies& mine = detail::async_copies();
  while (mine.groups.size() > static_cast<size_t>(N)) {
    for (const detail::PendingCopy& c : mine.groups.front()) {
      if (c.fill) {
        std::memcpy(c.shared, c.global, 16);
      } else {
        std::memset(c.shared, 0, 16);
      }
    }
    mine.groups.erase(mine.groups.begin());
  }
}
#else
template <typename T> SPECDEC_DEVICE uint32_t pack2(float lo, float hi);
template <> SPECDEC_DEVICE uint32_t pack2<half_t>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &h, 4);
  return r;
}
template <> SPECDEC_DEVICE uint32_t pack2<bf16_t>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &h, 4);
  return r;
}

template <typename T> SPECDEC_DEVICE void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <> SPECDEC_DEVICE void mma_m16n8k16<half_t>(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> SPECDEC_DEVICE void mma_m16n8k16<bf16_t>(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

SPECDEC_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if (trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  }
}

SPECDEC_DEVICE void cp_async_16(void* shared, const void* global, bool fill) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(fill ? 16 : 0));
}
SPECDEC_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> SPECDEC_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
#endif

// ----- compound helpers: one source for both backends ----------------------------------------------
struct Sum {
  template <typename T> SPECDEC_DEVICE T operator()(T a, T b) const { return a + b; }
};
struct Max {
  template <typename T> SPECDEC_DEVICE T operator()(T a, T b) const { return a > b ? a : b; }
};
struct Min {
  template <typename T> SPECDEC_DEVICE T operator()(T a, T b) const { return a < b ? a : b; }
};

// Butterfly reduction over aligned groups of kWidth lanes (a power of two <= 32), offsets ascending. For
// a commutative op every lane of a group gets the same value, and it is bit for bit the balanced pairwise
// tree over the group's lanes in order (((l0 op l1) op (l2 op l3)) op ...): the order a CPU can reproduce.
// Every lane of the warp must call it.
template <int kWidth, typename T, typename Op>
SPECDEC_DEVICE T group_reduce(T v, Op op) {
  static_assert(kWidth >= 1 && kWidth <= kWarpSize && (kWidth & (kWidth - 1)) == 0, "group width");
#pragma unroll
  for (int offset = 1; offset < kWidth; offset *= 2) {
    if constexpr (std::is_arithmetic_v<T>) {
      v = op(v, shfl_xor(kFullMask, v, offset));
    } else {
      v = op(v, shfl_xor_words(kFullMask, v, offset));
    }
  }
  return v;
}

// All 32 lanes of the warp must call it; every lane gets the result (the pairwise tree over the lanes).
template <typename T, typename Op>
SPECDEC_DEVICE T warp_reduce(T v, Op op) {
  return group_reduce<kWarpSize>(v, op);
}

// Inclusive scan over the warp's lanes (Hillis-Steele). All 32 lanes must call it.
template <typename T, typename Op>
SPECDEC_DEVICE T warp_inclusive_scan(T v, Op op) {
  const unsigned lane = lane_id();
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const T other = shfl_up(kFullMask, v, offset);
    if (lane >= static_cast<unsigned>(offset)) v = op(other, v);
  }
  return v;
}

// Block-wide reduction for a 1-D block of kBlock threads (a multiple of 32). `scratch` holds kBlock/32
// elements of shared memory. Every thread gets the result; scratch may be reused after the call.
template <int kBlock, typename T, typename Op>
SPECDEC_DEVICE T block_reduce(T v, Op op, T* scratch) {
  static_assert(kBlock % kWarpSize == 0 && kBlock <= 1024, "block size must be a multiple of 32");
  constexpr int kWarps = kBlock / kWarpSize;
  v = warp_reduce(v, op);
  if constexpr (kWarps == 1) {
    return v;
  } else {
    const unsigned warp = threadIdx.x / kWarpSize;
    if (lane_id() == 0) scratch[warp] = v;
    sync_threads();
    T r = scratch[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) r = op(r, scratch[w]);  // same order in every thread
    sync_threads();
    return r;
  }
}

// Block-wide inclusive scan for a 1-D block of kBlock threads (a multiple of 32). `scratch` holds
// kBlock/32 elements of shared memory; `total`, if given, receives the sum over the block.
template <int kBlock, typename T, typename Op>
SPECDEC_DEVICE T block_inclusive_scan(T v, Op op, T* scratch, T* total = nullptr) {
  static_assert(kBlock % kWarpSize == 0 && kBlock <= 1024, "block size must be a multiple of 32");
  constexpr int kWarps = kBlock / kWarpSize;
  v = warp_inclusive_scan(v, op);
  const unsigned warp = threadIdx.x / kWarpSize;
  if (lane_id() == kWarpSize - 1) scratch[warp] = v;
  sync_threads();
  T prefix{};
  bool has_prefix = false;
  for (unsigned w = 0; w < warp; ++w) {
    prefix = has_prefix ? op(prefix, scratch[w]) : scratch[w];
    has_prefix = true;
  }
  if (total != nullptr) {
    T t = scratch[0];
    for (int w = 1; w < kWarps; ++w) t = op(t, scratch[w]);
    *total = t;
  }
  sync_threads();
  return has_prefix ? op(prefix, v) : v;
}

// Exclusive scan: the first thread gets `identity`.
template <int kBlock, typename T, typename Op>
SPECDEC_DEVICE T block_exclusive_scan(T v, Op op, T identity, T* scratch, T* total = nullptr) {
  const T inclusive = block_inclusive_scan<kBlock>(v, op, scratch, total);
  const T up = shfl_up(kFullMask, inclusive, 1);
  const unsigned warp = threadIdx.x / kWarpSize;
  // Lane 0 of each warp needs the inclusive value of the previous warp's last lane.
  SPECDEC_SHARED(T, warp_last, kBlock / kWarpSize);
  if (lane_id() == kWarpSize - 1) warp_last[warp] = inclusive;
  sync_threads();
  T r = lane_id() != 0 ? up : (warp == 0 ? identity : warp_last[warp - 1]);
  sync_threads();
  return r;
}

}  // namespace specdec
