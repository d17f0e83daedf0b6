// Self-tests of the SIMT emulator: each primitive of device.cuh against a host computation of CUDA's
// documented semantics, and the misuses the emulator must report instead of hanging.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "check.h"
#include "kernels/chain_sampling.cuh"
#include "selftest_kernels.cuh"
#include "specdec/launch.h"

using namespace specdec;

namespace {
std::vector<int> random_ints(size_t n, int lo, int hi, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(lo, hi);
  std::vector<int> v(n);
  for (int& x : v) x = d(rng);
  return v;
}
}  // namespace

TEST_CASE("block reduction: sum and max, partial last block") {
  constexpr int kBlock = 256;
  const int n = 3 * kBlock + 77, blocks = 4;
  const std::vector<int> in = random_ints(n, -1000, 1000, 1);
  std::vector<int> sums(blocks, -7);
  std::vector<float> maxes(blocks, -7.0f);
  launch_kernel("block_sum_max", selftest::block_sum_max_kernel<kBlock>, dim3(blocks), dim3(kBlock), 0, Stream{},
                in.data(), n, sums.data(), maxes.data());
  for (int b = 0; b < blocks; ++b) {
    const int lo = b * kBlock, hi = std::min(n, lo + kBlock);
    CHECK_EQ(sums[b], std::accumulate(in.begin() + lo, in.begin() + hi, 0));
    CHECK_EQ(maxes[b], static_cast<float>(*std::max_element(in.begin() + lo, in.begin() + hi)));
  }
}

TEST_CASE("block reduction: single warp block") {
  const std::vector<int> in = random_ints(32, 0, 100, 2);
  int sum = -1;
  float mx = -1;
  launch_kernel("block_sum_max", selftest::block_sum_max_kernel<32>, dim3(1), dim3(32), 0, Stream{}, in.data(), 32, &sum, &mx);
  CHECK_EQ(sum, std::accumulate(in.begin(), in.end(), 0));
}

TEST_CASE("block scans: inclusive, exclusive, total; 96 and 1024 threads") {
  for (const int block : {96, 1024}) {
    const int blocks = 3, n = block * blocks;
    const std::vector<int> in = random_ints(n, -50, 50, 3 + block);
    std::vector<int> inc(n, -999), exc(n, -999), tot(blocks, -999);
    if (block == 96) {
      launch_kernel("block_scan", selftest::block_scan_kernel<96>, dim3(blocks), dim3(96), 0, Stream{}, in.data(), inc.data(),
                    exc.data(), tot.data());
    } else {
      launch_kernel("block_scan", selftest::block_scan_kernel<1024>, dim3(blocks), dim3(1024), 0, Stream{}, in.data(),
                    inc.data(), exc.data(), tot.data());
    }
    for (int b = 0; b < blocks; ++b) {
      int run = 0;
      for (int t = 0; t < block; ++t) {
        const int i = b * block + t;
        CHECK_EQ(exc[i], run);
        run += in[i];
        CHECK_EQ(inc[i], run);
      }
      CHECK_EQ(tot[b], run);
    }
  }
}

TEST_CASE("shuffles and votes follow CUDA's lane rules") {
  const int threads = 64;
  std::vector<int> in(threads);
  for (int t = 0; t < threads; ++t) in[t] = 1000 + t;
  in[37] = 5;  // warp 1: not all >= 1000
  std::vector<long long> out(selftest::kShufflePatterns * threads, -12345);
  launch_kernel("shuffle", selftest::shuffle_kernel, dim3(1), dim3(threads), 0, Stream{}, in.data(), out.data(), threads);
  for (int t = 0; t < threads; ++t) {
    const int w = t / 32 * 32, lane = t % 32;
    auto at = [&](int l) { return static_cast<long long>(in[w + l]); };
    CHECK_EQ(out[0 * threads + t], at((lane * 7 + 3) % 32));
    CHECK_EQ(out[1 * threads + t], at(lane / 8 * 8 + (lane + 5) % 8));
    CHECK_EQ(out[2 * threads + t], lane >= 3 ? at(lane - 3) : at(lane));
    CHECK_EQ(out[3 * threads + t], lane % 16 + 5 < 16 ? at(lane + 5) : at(lane));
    CHECK_EQ(out[4 * threads + t], at(lane ^ 6));
    long long ballot = 0;
    bool any = false, all = true;
    for (int l = 0; l < 32; ++l) {
      if (at(l) % 3 == 0) ballot |= 1ll << l;
      any = any || at(l) == 1031;
      all = all && at(l) >= 1000;
    }
    CHECK_EQ(out[5 * threads + t], ballot);
    CHECK_EQ(out[6 * threads + t], static_cast<long long>(any));
    CHECK_EQ(out[7 * threads + t], static_cast<long long>(all));
    CHECK_EQ(out[8 * threads + t], at(31 - lane));
    CHECK_EQ(out[9 * threads + t], lane < 16 ? (lane < 15 ? at(lane + 1) : at(lane)) : -1);
  }
}

TEST_CASE("atomics: histogram and int/unsigned/float min, max, exch, cas across blocks") {
  const int n = 5000, nbins = 17;
  const std::vector<int> in = random_ints(n, 3, 100000, 4);
  std::vector<int> bins(nbins + 1, 0), winners(nbins, -1);
  unsigned ucount = 0;
  float fsum = 0, fmin = 1e30f, fmax = -1e30f;
  int imin = 1 << 30, imax = -(1 << 30), last = 0;
  launch_kernel("histogram", selftest::histogram_kernel, dim3(7), dim3(128), 0, Stream{}, in.data(), n, bins.data(), nbins,
                &ucount, &fsum, &imin, &imax, &fmin, &fmax, &last, winners.data());
  std::vector<int> want(nbins, 0);
  for (int v : in) ++want[v % nbins];
  for (int b = 0; b < nbins; ++b) {
    CHECK_EQ(bins[b], want[b]);
    CHECK(winners[b] >= 0 && in[winners[b]] % nbins == b);
  }
  CHECK_EQ(bins[nbins], nbins);  // one CAS winner per bin
  CHECK_EQ(ucount, static_cast<unsigned>(n));
  CHECK_EQ(fsum, 0.5f * n);
  CHECK_EQ(imin, *std::min_element(in.begin(), in.end()));
  CHECK_EQ(imax, *std::max_element(in.begin(), in.end()));
  CHECK_EQ(fmin, 0.25f * imin);
  CHECK_EQ(fmax, 0.25f * imax);
  CHECK_EQ(last, 7);
}

TEST_CASE("dynamic shared memory: tiled transpose with a 2-D block and 2-D grid") {
  const int rows = 70, cols = 45;
  std::vector<float> in(rows * cols), out(rows * cols, NAN);
  for (int i = 0; i < rows * cols; ++i) in[i] = static_cast<float>(i) * 0.5f + 1.0f;
  launch_kernel("transpose", selftest::transpose_kernel, dim3((cols + 31) / 32, (rows + 31) / 32), dim3(32, 8),
                32 * 33 * sizeof(float), Stream{}, in.data(), out.data(), rows, cols);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) CHECK_EQ(out[c * rows + r], in[r * cols + c]);
}

TEST_CASE("16-byte vector loads and stores; misalignment is reported") {
  alignas(16) float in[64 + 4], out[64 + 4];
  for (int i = 0; i < 68; ++i) {
    in[i] = static_cast<float>(i) + 0.25f;
    out[i] = NAN;
  }
  launch_kernel("vector_copy", selftest::vector_copy_kernel, dim3(1), dim3(16), 0, Stream{}, in, out);
  for (int i = 0; i < 64; ++i) CHECK_EQ(out[i], in[i]);
  CHECK_THROWS_WITH(launch_kernel("vector_copy", selftest::vector_copy_kernel, dim3(1), dim3(16), 0, Stream{}, in + 1, out),
                    "misaligned 16-byte load");
}

TEST_CASE("half and bfloat16 conversions round to nearest even") {
  // Every half converts to float and back to itself (NaNs stay NaN).
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = to_float(half_t{static_cast<uint16_t>(h)});
    const uint16_t back = from_float<half_t>(f).bits;
    if (std::isnan(f)) {
      CHECK((back & 0x7c00) == 0x7c00 && (back & 0x3ff) != 0);
    } else {
      CHECK_EQ(back, static_cast<uint16_t>(h));
    }
  }
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> mag(-30.0f, 17.0f);
  for (int i = 0; i < 200000; ++i) {
    const float f = std::ldexp(1.0f + (rng() % 8388608) / 8388608.0f, static_cast<int>(mag(rng))) * (rng() % 2 ? 1 : -1);
#if defined(__FLT16_MAX__)
    const _Float16 ref = static_cast<_Float16>(f);
    uint16_t ref_bits;
    std::memcpy(&ref_bits, &ref, 2);
    CHECK_EQ(from_float<half_t>(f).bits, ref_bits);
#endif
    // bfloat16: the nearest of the two neighbours, ties to even.
    const uint16_t b = from_float<bf16_t>(f).bits;
    const double err = std::fabs(static_cast<double>(to_float(bf16_t{b})) - f);
    const double other = std::fabs(static_cast<double>(to_float(bf16_t{static_cast<uint16_t>(b ^ 1)})) - f);
    CHECK(err <= other);
  }
  CHECK_EQ(from_float<half_t>(65520.0f).bits, 0x7c00);
  CHECK_EQ(from_float<half_t>(65519.0f).bits, 0x7bff);
  CHECK_EQ(from_float<half_t>(std::ldexp(1.0f, -25)).bits, 0);
  CHECK_EQ(from_float<half_t>(std::ldexp(1.5f, -25)).bits, 1);
  CHECK_EQ(from_float<bf16_t>(1.00390625f).bits, 0x3f80);  // tie: 1 + 2^-8 rounds to even (1.0)
}

template <typename T>
void check_mma(unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  alignas(16) T a[256], b[256], bt[256];
  for (int i = 0; i < 256; ++i) {
    a[i] = from_float<T>(normal(rng));
    b[i] = from_float<T>(normal(rng));
  }
  for (int k = 0; k < 16; ++k) {
    for (int n = 0; n < 16; ++n) bt[n * 16 + k] = b[k * 16 + n];
  }
  std::vector<float> c_bt(256, NAN), c_b(256, NAN);
  std::vector<uint32_t> frags(128);
  launch_kernel("mma", selftest::mma_kernel<T>, dim3(1), dim3(32), 0, Stream{}, a, b, bt, c_bt.data(), c_b.data(),
                frags.data());
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 16; ++n) {
      double ref = 0, bound = 0;
      for (int k = 0; k < 16; ++k) {
        ref += double(to_float(a[m * 16 + k])) * to_float(b[k * 16 + n]);
        bound += std::fabs(double(to_float(a[m * 16 + k])) * to_float(b[k * 16 + n]));
      }
      CHECK(std::fabs(c_bt[m * 16 + n] - ref) <= 2e-6 * bound + 1e-30);
      CHECK_EQ(c_b[m * 16 + n], c_bt[m * 16 + n]);
    }
  }
  // The A fragment layout of the PTX ISA: a[i] = A[g + 8 (i % 2)][2t + 8 (i / 2) + {0, 1}].
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int e = (g + 8 * (i % 2)) * 16 + 2 * t + 8 * (i / 2);
      CHECK_EQ(frags[lane * 4 + i], uint32_t{a[e].bits} | uint32_t{a[e + 1].bits} << 16);
    }
  }
}

TEST_CASE("tensor-core MMA, ldmatrix (plain and .trans) and cp.async follow the PTX fragment layouts") {
  check_mma<half_t>(11);
  check_mma<bf16_t>(12);
}

TEST_CASE("cp.async copies land when cp_async_wait retires their group, not before") {
  std::vector<selftest::Words4> in(64), out(96);
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 4; ++j) in[i].w[j] = static_cast<uint32_t>(i * 4 + j + 1);
  }
  launch_kernel("async_copy", selftest::async_copy_kernel, dim3(1), dim3(32), 0, Stream{}, in.data(), out.data());
  for (int t = 0; t < 32; ++t) {
    const int n = (t + 1) % 32;
    for (int j = 0; j < 4; ++j) {
      CHECK_EQ(out[t].w[j], in[n].w[j]);
      CHECK_EQ(out[32 + t].w[j], 0xFFFFFFFFu);  // not yet copied: the poison of fresh shared memory
      CHECK_EQ(out[64 + t].w[j], n % 2 == 0 ? in[32 + n].w[j] : 0u);
    }
  }
}

TEST_CASE("a barrier that only some threads reach is reported, not a hang") {
  std::vector<int> out(128, 0);
  CHECK_THROWS_WITH(launch_kernel("divergent", selftest::divergent_barrier_kernel, dim3(1), dim3(128), 0, Stream{}, out.data()),
                    "barrier divergence");
}

TEST_CASE("mismatched warp collectives are reported") {
  std::vector<int> out(32, 0);
  CHECK_THROWS_WITH(launch_kernel("mismatch", selftest::mismatched_collective_kernel, dim3(1), dim3(32), 0, Stream{}, out.data()),
                    "warp collective mismatch");
}

TEST_CASE("a full-mask shuffle in a partial warp is reported") {
  std::vector<int> in(48, 1);
  std::vector<long long> out(selftest::kShufflePatterns * 48);
  CHECK_THROWS_WITH(launch_kernel("shuffle", selftest::shuffle_kernel, dim3(1), dim3(48), 0, Stream{}, in.data(), out.data(), 48),
                    "does not exist");
}

TEST_CASE("launches the device would reject are reported") {
  std::vector<float> out(2048);
  CHECK_THROWS_WITH(launch_kernel("oob", selftest::out_of_bounds_kernel, dim3(1), dim3(1024, 2), 0, Stream{}, out.data(), 10),
                    "threads per block");
  CHECK_THROWS_WITH(launch_kernel("oob", selftest::out_of_bounds_kernel, dim3(1), dim3(2048), 0, Stream{}, out.data(), 10),
                    "blockDim.x");
  CHECK_THROWS_WITH(launch_kernel("oob", selftest::out_of_bounds_kernel, dim3(1), dim3(1, 1, 65), 0, Stream{}, out.data(), 10),
                    "blockDim.z");
  CHECK_THROWS_WITH(launch_kernel("oob", selftest::out_of_bounds_kernel, dim3(0), dim3(32), 0, Stream{}, out.data(), 10),
                    "gridDim.x");
  CHECK_THROWS_WITH(launch_kernel("oob", selftest::out_of_bounds_kernel, dim3(1), dim3(32), 300 * 1024, Stream{}, out.data(), 10),
                    "dynamic shared memory");
  CHECK_THROWS_WITH(launch_kernel("big", selftest::big_static_shared_kernel, dim3(1), dim3(32), 0, Stream{}, out.data()),
                    "static __shared__ memory");
}

TEST_CASE("thread block clusters: rank, size, distributed shared memory and the cluster barrier") {
  constexpr int kBlock = 64;
  for (const unsigned cluster : {1u, 2u, 4u, 8u}) {
    const int clusters = 3, blocks = static_cast<int>(cluster) * clusters, rounds = 5;
    const std::vector<int> in = random_ints(blocks * kBlock, -100, 100, 7 + cluster);
    std::vector<int> out(in.size() * selftest::kClusterOutputs, -999);
    launch_cluster_kernel("cluster", selftest::cluster_kernel<kBlock>, dim3(blocks), dim3(kBlock), cluster, 0, Stream{},
                          in.data(), rounds, out.data());
    CHECK_EQ(sim::last_launch_stats().cluster_blocks, cluster);
    for (int b = 0; b < blocks; ++b) {
      const int rank = b % static_cast<int>(cluster), first = b - rank;
      const int total = std::accumulate(in.begin() + first * kBlock, in.begin() + (first + static_cast<int>(cluster)) * kBlock, 0);
      // The ring: value_r(0) = r, value_r(i + 1) = value_{r-1}(i) + r.
      std::vector<int> ring(cluster);
      std::iota(ring.begin(), ring.end(), 0);
      for (int round = 0; round < rounds; ++round) {
        std::vector<int> next(cluster);
        for (unsigned r = 0; r < cluster; ++r) next[r] = ring[(r + cluster - 1) % cluster] + static_cast<int>(r);
        ring = next;
      }
      for (int t = 0; t < kBlock; ++t) {
        const int* o = &out[(static_cast<size_t>(b) * kBlock + t) * selftest::kClusterOutputs];
        CHECK_EQ(o[0], rank);
        CHECK_EQ(o[1], static_cast<int>(cluster));
        CHECK_EQ(o[2], total);
        CHECK_EQ(o[3], ring[rank]);
        CHECK_EQ(o[4], b);
      }
    }
  }
}

TEST_CASE("blocks of a cluster run ahead of each other: a missing cluster barrier changes the result") {
  // Each block runs as far as it can, past block barriers, before the next starts; the order alternates at each
  // cluster barrier and between clusters. After the first cluster barrier, cluster 0 runs rank 1 first, so
  // rank 0 reads rank 1's second value; cluster 1 runs rank 0 first, so rank 1 reads rank 0's. A correct
  // kernel (a cluster barrier before the overwrite) reads 10 + the neighbour's rank everywhere; so did the
  // schedule that interleaved the blocks between block barriers.
  std::vector<int> out(4, -1);
  launch_cluster_kernel("cluster_race", selftest::cluster_race_kernel, dim3(4), dim3(32), 2, 0, Stream{}, out.data());
  CHECK_EQ(out[0], 21);
  CHECK_EQ(out[1], 10);
  CHECK_EQ(out[2], 11);
  CHECK_EQ(out[3], 20);
}

TEST_CASE("the sampling kernel stops on a grid that splits a request group, or without its workspace") {
  const ChainSamplingParams params{};
  CHECK_THROWS_WITH(launch_cooperative_kernel("chain_sampling_kernel<float, 4>", chain_sampling_kernel<float, 4>, dim3(4),
                                              dim3(kLanes / 4), 0, Stream{}, params, SliceWorkspace{nullptr, nullptr}),
                    "a grid of whole request groups, with their workspace");
  std::vector<SliceExchange> exchange(2);
  std::vector<unsigned> arrivals(2, 0);
  CHECK_THROWS_WITH(launch_cooperative_kernel("chain_sampling_kernel<float, 4>", chain_sampling_kernel<float, 4>, dim3(6),
                                              dim3(kLanes / 4), 0, Stream{}, params,
                                              SliceWorkspace{exchange.data(), arrivals.data()}),
                    "a grid of whole request groups, with their workspace");
}

TEST_CASE("a cooperative launch runs every block together: groups of blocks meet through global memory") {
  // Each group of `group` blocks sums its inputs: every block writes its block total, all meet at the group's
  // barrier, and every thread then reads the group's total; `rounds` rounds reuse the same slots, each round's
  // values being the previous round's totals plus the block's index, so a barrier that let a block through early
  // would leave a stale or a future value somewhere.
  constexpr int kBlock = 64;
  for (const int group : {1, 2, 4, 8}) {
    const int groups = 16 / group, blocks = groups * group, rounds = 4;
    const std::vector<int> in = random_ints(blocks * kBlock, -100, 100, 11 + group);
    std::vector<int> slots(static_cast<size_t>(blocks), -999), out(static_cast<size_t>(blocks) * kBlock, -999);
    std::vector<unsigned> arrivals(static_cast<size_t>(groups), 0);
    launch_cooperative_kernel("group_sum", selftest::group_sum_kernel<kBlock>, dim3(blocks), dim3(kBlock), 0, Stream{},
                              in.data(), group, rounds, slots.data(), arrivals.data(), out.data());
    CHECK(sim::last_launch_stats().cooperative);
    CHECK_EQ(sim::last_launch_stats().blocks, static_cast<uint64_t>(blocks));
    for (int g = 0; g < groups; ++g) {
      std::vector<int> value(static_cast<size_t>(group));
      for (int r = 0; r < group; ++r) {
        const int b = g * group + r;
        value[r] = std::accumulate(in.begin() + b * kBlock, in.begin() + (b + 1) * kBlock, 0);
      }
      int total = 0;
      for (int round = 0; round < rounds; ++round) {
        total = std::accumulate(value.begin(), value.end(), 0);
        for (int r = 0; r < group; ++r) value[r] = total + r;
      }
      for (int i = g * group * kBlock; i < (g + 1) * group * kBlock; ++i) CHECK_EQ(out[i], total);
      CHECK_EQ(arrivals[g], static_cast<unsigned>(rounds * 2 * group));
    }
  }
}

TEST_CASE("cooperative launches: a spin nobody ends is a deadlock, and the grid must fit the device") {
  std::vector<unsigned> waits(1, 0);
  launch_cooperative_kernel("waits", selftest::back_to_back_waits_kernel, dim3(2), dim3(1), 0, Stream{}, waits.data());
  CHECK_EQ(waits[0], 4u);
  std::vector<unsigned> flag(1, 0);
  CHECK_THROWS_WITH(launch_cooperative_kernel("spin", selftest::spin_forever_kernel, dim3(2), dim3(32), 0, Stream{},
                                              flag.data()),
                    "deadlock");
  // The deadlocked launch's fibers were abandoned mid-frame; their stacks run the next launch cleanly (under
  // AddressSanitizer: no stale redzones).
  std::vector<int> ones(64, 1), slots(2), sums(64);
  std::vector<unsigned> counters(1, 0);
  launch_cooperative_kernel("group_sum", selftest::group_sum_kernel<32>, dim3(2), dim3(32), 0, Stream{}, ones.data(), 2, 1,
                            slots.data(), counters.data(), sums.data());
  CHECK_EQ(sums[63], 64);
  const unsigned fit = sim::resident_blocks(256);
  CHECK_EQ(fit, 16u);  // 4 SMs x 1024 threads
  std::vector<int> in(static_cast<size_t>(fit + 1) * 256, 1), big_slots(fit + 1), out(in.size());
  std::vector<unsigned> arrivals(fit + 1, 0);
  CHECK_THROWS_WITH(launch_cooperative_kernel("group_sum", selftest::group_sum_kernel<256>, dim3(fit + 1), dim3(256), 0,
                                              Stream{}, in.data(), 1, 1, big_slots.data(), arrivals.data(), out.data()),
                    "the device holds 16 at once");
}

TEST_CASE("cluster misuses are reported") {
  std::vector<int> out(64, 0);
  auto run = [&](int mode) {
    launch_cluster_kernel("cluster_misuse", selftest::cluster_misuse_kernel, dim3(4), dim3(32), 2, 0, Stream{}, mode, out.data());
  };
  CHECK_THROWS_WITH(run(0), "cluster barrier divergence");
  CHECK_THROWS_WITH(run(1), "not in this block's shared memory");
  CHECK_THROWS_WITH(run(2), "rank 2 of a cluster of 2 blocks");
  CHECK_THROWS_WITH(run(3), "has exited");
  CHECK_THROWS_WITH(launch_cluster_kernel("cluster", selftest::cluster_kernel<64>, dim3(6), dim3(64), 4, 0, Stream{},
                                          out.data(), 1, out.data()),
                    "not a multiple of the cluster");
  CHECK_THROWS_WITH(launch_cluster_kernel("cluster", selftest::cluster_kernel<64>, dim3(16), dim3(64), 16, 0, Stream{},
                                          out.data(), 1, out.data()),
                    "portable limit");
}

TEST_CASE("a kernel after a failed launch runs normally") {
  std::vector<int> out(128, 0);
  CHECK_THROWS_WITH(launch_kernel("divergent", selftest::divergent_barrier_kernel, dim3(1), dim3(128), 0, Stream{}, out.data()),
                    "barrier divergence");
  const std::vector<int> in = random_ints(256, 0, 9, 6);
  int sum = -1;
  float mx = -1;
  launch_kernel("block_sum_max", selftest::block_sum_max_kernel<256>, dim3(1), dim3(256), 0, Stream{}, in.data(), 256, &sum, &mx);
  CHECK_EQ(sum, std::accumulate(in.begin(), in.end(), 0));
}

int main(int argc, char** argv) { return specdec_test::run_all(argc, argv); }
