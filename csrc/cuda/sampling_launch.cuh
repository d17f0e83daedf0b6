// The launch path shared by the chain and tree sampling launchers (chain_sampling.cu, tree_sampling.cu): one group of
// S blocks per request (its slices, chain_sampling.cuh), S chosen from the batch and the device. Header-only so that
// each sampling family compiles in its own translation unit (each instantiates 18 kernels: 3 dtypes x 6 slice counts).
#pragma once
#include <atomic>
#include <cstdlib>

#include "cuda/launcher.h"
#include "kernels/chain_sampling.cuh"

namespace specdec {
namespace sampling_launch {

// How many blocks of `Kernel` (chain_sampling_kernel<T, S> or tree_sampling_kernel<T, S>) the tensor's device holds at
// once (0 without cooperative launches), cached per device: it does not change, and the launch path must stay cheap.
template <auto kKernel, int S>
int sampling_resident_blocks(const at::Tensor& t) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices];  // one per instantiation: 0 unknown, else blocks + 1
  const int device = std::max<int>(0, t.device().index());
  if (device < kCachedDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached - 1;
  }
  const int blocks = max_resident_blocks(kKernel, dim3(kLanes / S), 0);
  if (device < kCachedDevices) cache[device].store(blocks + 1, std::memory_order_relaxed);
  return blocks;
}

// SPECDEC_SAMPLING_SLICES=S (a power of two from 1 to 32) forces the blocks per request, for tests: every split must
// give the same bits. 0 when unset.
inline int forced_sampling_slices() {
  return static_cast<int>(launch_override(
      "SPECDEC_SAMPLING_SLICES", [](long long s) { return s >= 1 && s <= kMaxSamplingSlices && (s & (s - 1)) == 0; },
      "a power of two from 1 to 32"));
}
static_assert(kMaxSamplingSlices == 32, "the override's message names the largest split");

// Request groups of S blocks (S by sampling_slices, or forced); a grid-stride loop covers batches beyond what the
// device holds at once. S > 1: a cooperative launch, with a workspace of one SliceExchange and one zeroed barrier
// counter per group. Kernel<S> is the kernel for S slices.
template <template <int> class Kernel, typename Params>
void launch_sampling(const char* name, const Params& params, int64_t batch, const at::Tensor& target, Stream stream) {
  const auto resident = [&](int s) {
    switch (s) {
      case 32: return sampling_resident_blocks<Kernel<32>::kernel, 32>(target);
      case 16: return sampling_resident_blocks<Kernel<16>::kernel, 16>(target);
      case 8: return sampling_resident_blocks<Kernel<8>::kernel, 8>(target);
      case 4: return sampling_resident_blocks<Kernel<4>::kernel, 4>(target);
      case 2: return sampling_resident_blocks<Kernel<2>::kernel, 2>(target);
      default: return 1 << 30;  // not cooperative: any grid
    }
  };
  const int forced = forced_sampling_slices();
  const int s = forced > 0 ? forced : sampling_slices(batch, multiprocessor_count(target), resident);
  const int64_t groups = sampling_groups(batch, s, resident(s));
  TORCH_CHECK(groups > 0, name, ": the device cannot hold the ", s, " blocks of one request at once");
  SliceWorkspace workspace{nullptr, nullptr};
  at::Tensor storage;  // freed in stream order after the launch, as PyTorch's own temporaries
  if (s > 1) {
    const int64_t bytes = groups * static_cast<int64_t>(sizeof(SliceExchange) + sizeof(unsigned));
    storage = at::empty({bytes}, target.options().dtype(at::kByte));
    workspace.exchange = reinterpret_cast<SliceExchange*>(storage.data_ptr());
    workspace.arrivals = reinterpret_cast<unsigned*>(workspace.exchange + groups);
    zero_device_bytes(workspace.arrivals, static_cast<size_t>(groups) * sizeof(unsigned), stream);
  }
  const dim3 grid(static_cast<unsigned>(groups * s));
  const auto launch = [&](auto kernel) {
    if (s > 1) {
      launch_cooperative_kernel(name, kernel, grid, dim3(kLanes / s), 0, stream, params, workspace);
    } else {
      launch_kernel(name, kernel, grid, dim3(kLanes), 0, stream, params, workspace);
    }
  };
  switch (s) {
    case 32: launch(Kernel<32>::kernel); break;
    case 16: launch(Kernel<16>::kernel); break;
    case 8: launch(Kernel<8>::kernel); break;
    case 4: launch(Kernel<4>::kernel); break;
    case 2: launch(Kernel<2>::kernel); break;
    default: launch(Kernel<1>::kernel);
  }
}

using Opt = std::optional<at::Tensor>;

}  // namespace sampling_launch
}  // namespace specdec
