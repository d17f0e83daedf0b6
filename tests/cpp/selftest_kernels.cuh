// Small kernels that exercise every emulated primitive of device.cuh. Each is a real CUDA kernel: it
// compiles with nvcc too, so the emulator's semantics can be compared with a GPU's.
#pragma once
#include "specdec/device.cuh"

namespace selftest {
using namespace specdec;

template <int kBlock>
__global__ void block_sum_max_kernel(const int* in, int n, int* sums, float* maxes) {
  SPECDEC_SHARED(int, scratch_i, kBlock / kWarpSize);
  SPECDEC_SHARED(float, scratch_f, kBlock / kWarpSize);
  const int i = blockIdx.x * kBlock + threadIdx.x;
  const int v = i < n ? in[i] : 0;
  const int s = block_reduce<kBlock>(v, Sum{}, scratch_i);
  const float m = block_reduce<kBlock>(i < n ? static_cast<float>(v) : -1e30f, Max{}, scratch_f);
  if (threadIdx.x == 0) {
    sums[blockIdx.x] = s;
    maxes[blockIdx.x] = m;
  }
}

template <int kBlock>
__global__ void block_scan_kernel(const int* in, int* inclusive, int* exclusive, int* totals) {
  SPECDEC_SHARED(int, scratch, kBlock / kWarpSize);
  const int i = blockIdx.x * kBlock + threadIdx.x;
  int total = 0;
  inclusive[i] = block_inclusive_scan<kBlock>(in[i], Sum{}, scratch, &total);
  exclusive[i] = block_exclusive_scan<kBlock>(in[i], Sum{}, 0, scratch);
  if (threadIdx.x == 0) totals[blockIdx.x] = total;
}

// out[k][t] for pattern k: 0 shfl(idx), 1 shfl width 8, 2 up 3, 3 down 5 width 16, 4 xor 6 width 8,
// 5 ballot, 6 any, 7 all, 8 shfl of a double, 9 half-warp masked shuffle (lanes 0..15 only, -1 elsewhere).
constexpr int kShufflePatterns = 10;
__global__ void shuffle_kernel(const int* in, long long* out, int threads) {
  const int t = threadIdx.x;
  const int v = in[t];
  long long* o = out;
  o[0 * threads + t] = shfl(kFullMask, v, (t * 7 + 3) % 32);
  o[1 * threads + t] = shfl(kFullMask, v, t + 5, 8);
  o[2 * threads + t] = shfl_up(kFullMask, v, 3);
  o[3 * threads + t] = shfl_down(kFullMask, v, 5, 16);
  o[4 * threads + t] = shfl_xor(kFullMask, v, 6, 8);
  o[5 * threads + t] = ballot(kFullMask, v % 3 == 0);
  o[6 * threads + t] = any(kFullMask, v == 1000 + 31);
  o[7 * threads + t] = all(kFullMask, v >= 1000);
  o[8 * threads + t] = static_cast<long long>(shfl(kFullMask, v * 0.5, 31 - lane_id()) * 2.0);
  long long half = -1;
  if (lane_id() < 16) {
    half = shfl_down(0x0000ffffu, v, 1, 16);
    sync_warp(0x0000ffffu);
  }
  o[9 * threads + t] = half;
}

__global__ void histogram_kernel(const int* in, int n, int* bins, int nbins, unsigned* ucount, float* fsum,
                                 int* imin, int* imax, float* fmin, float* fmax, int* exch_last, int* cas_winners) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int v = in[i];
    atomic_add(&bins[v % nbins], 1);
    atomic_add(ucount, 1u);
    atomic_add(fsum, 0.5f);
    atomic_min(imin, v);
    atomic_max(imax, v);
    atomic_min(fmin, static_cast<float>(v) * 0.25f);
    atomic_max(fmax, static_cast<float>(v) * 0.25f);
    atomic_exch(exch_last, 7);
    // Exactly one thread per bin wins the CAS from -1.
    if (atomic_cas(&cas_winners[v % nbins], -1, i) == -1) atomic_add(&bins[nbins], 1);
  }
}

// Transposes a rows x cols matrix through a dynamic shared tile of 32 x 33 floats.
__global__ void transpose_kernel(const float* in, float* out, int rows, int cols) {
  SPECDEC_DYNAMIC_SHARED(float, tile);
  const int bx = blockIdx.x * 32, by = blockIdx.y * 32;
  for (int j = threadIdx.y; j < 32; j += blockDim.y) {
    const int r = by + j, c = bx + threadIdx.x;
    if (r < rows && c < cols) tile[j * 33 + threadIdx.x] = in[r * cols + c];
  }
  sync_threads();
  for (int j = threadIdx.y; j < 32; j += blockDim.y) {
    const int r = bx + j, c = by + threadIdx.x;
    if (r < cols && c < rows) out[r * rows + c] = tile[threadIdx.x * 33 + j];
  }
}

// Threads of the first warp wait at a barrier the others never reach.
__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x < 32) sync_threads();
  out[threadIdx.x] = 1;
}

// Lane 0 shuffles while lanes 1..31 vote: mismatched collectives.
__global__ void mismatched_collective_kernel(int* out) {
  if (lane_id() == 0) {
    out[threadIdx.x] = shfl(kFullMask, 1, 0);
  } else {
    out[threadIdx.x] = ballot(kFullMask, true);
  }
}

__global__ void big_static_shared_kernel(float* out) {
  SPECDEC_SHARED(float, big, 13 * 1024);  // 52 KiB: over the 48 KiB static limit
  big[threadIdx.x] = 1.0f;
  out[threadIdx.x] = big[threadIdx.x];
}

__global__ void vector_copy_kernel(const float* in, float* out) {
  store_vec16(out + 4 * threadIdx.x, load_vec16(in + 4 * threadIdx.x));
}

// Writes one element past the end of `out` (n elements): AddressSanitizer must report it.
__global__ void out_of_bounds_kernel(float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) out[i] = 1.0f;
}

// One warp: C = A B for 16 x 16 x 16 through cp.async, ldmatrix and two m16n8k16 MMAs, with B's fragments
// loaded twice: from a transposed copy (n-major rows, plain ldmatrix) and from the row-major copy
// (ldmatrix .trans). Also writes each lane's A fragment as ldmatrix delivered it.
template <typename T>
__global__ void mma_kernel(const T* a, const T* b, const T* bt, float* c_from_bt, float* c_from_b, uint32_t* a_frags) {
  constexpr int kStride = 24;  // padded rows of 48 bytes: 16-byte aligned
  SPECDEC_SHARED(T, sa, 16 * kStride);
  SPECDEC_SHARED(T, sb, 16 * kStride);
  SPECDEC_SHARED(T, sbt, 16 * kStride);
  const int lane = threadIdx.x;
  const int row = lane / 2, col = lane % 2 * 8;  // 32 chunks of 16 bytes per matrix
  cp_async_16(sa + row * kStride + col, a + row * 16 + col, true);
  cp_async_16(sb + row * kStride + col, b + row * 16 + col, true);
  cp_async_16(sbt + row * kStride + col, bt + row * 16 + col, true);
  cp_async_commit();
  cp_async_wait<0>();
  sync_warp();
  const int mat = lane / 8, r = lane % 8;
  uint32_t af[4], bf[4], bf_trans[4];
  ldmatrix_x4(af, sa + (mat % 2 * 8 + r) * kStride + mat / 2 * 8, false);
  ldmatrix_x4(bf, sbt + (mat / 2 * 8 + r) * kStride + mat % 2 * 8, false);
  ldmatrix_x4(bf_trans, sb + (mat % 2 * 8 + r) * kStride + mat / 2 * 8, true);
  float c[2][4] = {}, d[2][4] = {};
  for (int n = 0; n < 2; ++n) {
    mma_m16n8k16<T>(c[n], af, {bf[2 * n], bf[2 * n + 1]});
    mma_m16n8k16<T>(d[n], af, {bf_trans[2 * n], bf_trans[2 * n + 1]});
  }
  const int g = lane / 4, t = lane % 4;
  for (int n = 0; n < 2; ++n) {
    for (int e = 0; e < 4; ++e) {
      const int i = (g + 8 * (e / 2)) * 16 + n * 8 + 2 * t + e % 2;
      c_from_bt[i] = c[n][e];
      c_from_b[i] = d[n][e];
    }
  }
  for (int i = 0; i < 4; ++i) a_frags[lane * 4 + i] = af[i];
}

// Two cp.async groups of 16 bytes per thread: after cp_async_wait<1> the first is visible (read through
// another thread's slot after a barrier) and the second not yet; after cp_async_wait<0> both are. Reading
// the second group early is a race on a GPU; the emulator answers it with the shared-memory poison.
struct alignas(16) Words4 {
  uint32_t w[4];
};
__global__ void async_copy_kernel(const Words4* in, Words4* out) {
  SPECDEC_SHARED(Words4, first, 32);
  SPECDEC_SHARED(Words4, second, 32);
  const int t = threadIdx.x, neighbour = (t + 1) % 32;
  cp_async_16(&first[t], &in[t], true);
  cp_async_commit();
  cp_async_16(&second[t], &in[32 + t], t % 2 == 0);  // odd threads zero-fill
  cp_async_commit();
  cp_async_wait<1>();
  sync_threads();
  out[t] = first[neighbour];
  out[32 + t] = second[neighbour];
  sync_threads();
  cp_async_wait<0>();
  sync_threads();
  out[64 + t] = second[neighbour];
}

// Thread block clusters: each block sums its slice of `in` into shared memory, then every thread reads all
// blocks' sums through distributed shared memory. Then `rounds` rounds of passing a token around the ring
// of blocks: in round i block r reads block r - 1's value and adds its rank, which only works if the blocks
// of a cluster run together and the cluster barrier orders each round. One output row per thread:
// rank, size, cluster total, ring value, blockIdx.x.
constexpr int kClusterOutputs = 5;
template <int kBlock>
__global__ void cluster_kernel(const int* in, int rounds, int* out) {
  SPECDEC_SHARED(int, partial, kBlock / kWarpSize);
  SPECDEC_SHARED(int, block_total, 1);
  SPECDEC_SHARED(int, ring, 2);
  const unsigned rank = cluster_rank(), size = cluster_size();
  const int i = blockIdx.x * kBlock + threadIdx.x;
  const int s = block_reduce<kBlock>(in[i], Sum{}, partial);
  if (threadIdx.x == 0) {
    *block_total = s;
    ring[0] = static_cast<int>(rank);
  }
  sync_cluster();
  int total = 0;
  for (unsigned r = 0; r < size; ++r) total += *map_cluster_shared(block_total, r);
  for (int round = 0; round < rounds; ++round) {
    const int from = round % 2, to = 1 - from;
    if (threadIdx.x == 0) ring[to] = *map_cluster_shared(&ring[from], (rank + size - 1) % size) + static_cast<int>(rank);
    sync_cluster();
  }
  const int ring_value = ring[rounds % 2];
  sync_cluster();  // no block exits while another may still read its shared memory
  int* o = out + static_cast<size_t>(i) * kClusterOutputs;
  o[0] = static_cast<int>(rank);
  o[1] = static_cast<int>(size);
  o[2] = total;
  o[3] = ring_value;
  o[4] = static_cast<int>(blockIdx.x);
}

// A race the emulator's schedule exposes: each block publishes 10 + rank, reads its neighbour's value after
// a cluster barrier, then, after only a block barrier (the bug), publishes 20 + rank. out[block] = what it read.
__global__ void cluster_race_kernel(int* out) {
  SPECDEC_SHARED(int, value, 1);
  const unsigned rank = cluster_rank();
  if (threadIdx.x == 0) *value = 10 + static_cast<int>(rank);
  sync_cluster();
  if (threadIdx.x == 0) out[blockIdx.x] = *map_cluster_shared(value, (rank + 1) % cluster_size());
  sync_threads();  // needs to be sync_cluster()
  if (threadIdx.x == 0) *value = 20 + static_cast<int>(rank);
  sync_cluster();
}

// Misuses: 0 block rank 1 exits before the cluster barrier; 1 maps a pointer that is not shared memory;
// 2 maps a rank outside the cluster; 3 reads a block's shared memory after that block has exited.
__global__ void cluster_misuse_kernel(int mode, int* out) {
  SPECDEC_SHARED(int, value, 1);
  *value = 1;
  if (mode == 0) {
    if (cluster_rank() == 1) return;
    sync_cluster();
  } else if (mode == 1) {
    sync_cluster();
    out[threadIdx.x] = *map_cluster_shared(out, 0);
  } else if (mode == 2) {
    sync_cluster();
    out[threadIdx.x] = *map_cluster_shared(value, cluster_size());
  } else {
    sync_cluster();
    if (cluster_rank() == 0) return;
    for (int i = 0; i < 3; ++i) sync_threads();  // block 0 runs to its end meanwhile
    out[threadIdx.x] = *map_cluster_shared(value, 0);
  }
}

// Groups of `group` consecutive blocks of a cooperative launch: in each of `rounds` rounds every block publishes
// a value in slots[block], the group meets (arrive_and_wait on arrivals[group index]) and every thread reads the
// group's total; the next round's value is that total plus the block's rank in the group. A second barrier per
// round keeps a block from overwriting its slot while another still reads it. out[thread] = the last total.
template <int kBlock>
__global__ void group_sum_kernel(const int* in, int group, int rounds, int* slots, unsigned* arrivals, int* out) {
  SPECDEC_SHARED(int, partial, kBlock / kWarpSize);
  const int b = static_cast<int>(blockIdx.x), first = b / group * group;
  const int i = b * kBlock + static_cast<int>(threadIdx.x);
  int value = block_reduce<kBlock>(in[i], Sum{}, partial), total = 0;
  unsigned passed = 0;
  for (int round = 0; round < rounds; ++round) {
    if (threadIdx.x == 0) slots[b] = value;
    for (int phase = 0; phase < 2; ++phase) {  // after the writes, then after the reads
      sync_threads();
      if (threadIdx.x == 0) arrive_and_wait(&arrivals[b / group], ++passed * static_cast<unsigned>(group));
      sync_threads();
      if (phase == 0) {
        total = 0;
        for (int r = 0; r < group; ++r) total += load_coherent(&slots[first + r]);
      }
    }
    value = total + (b - first);
  }
  out[i] = total;
}

// Back-to-back waits of blocks of one thread, with nothing between them: each block arrives at the second barrier in
// the same turn as it passes the first, which is progress (not a deadlock).
__global__ void back_to_back_waits_kernel(unsigned* arrivals) {
  arrive_and_wait(arrivals, gridDim.x);
  arrive_and_wait(arrivals, 2 * gridDim.x);
}

// Waits for a flag nobody sets.
__global__ void spin_forever_kernel(unsigned* flag) {
  if (threadIdx.x == 0) arrive_and_wait(flag, 1000u);
  sync_threads();
}

}  // namespace selftest
