// The launch path shared by the chain and tree sampling launchers (chain_sampling.cu, tree_sampling.cu): one
// cluster of C blocks per request, C chosen from the batch and the device. Header-only so that each sampling
// family compiles in its own translation unit (each instantiates 9 kernels: 3 dtypes x 3 cluster sizes).
#pragma once
#include <atomic>

#include "cuda/launcher.h"

namespace specdec {
namespace sampling_launch {

// How many clusters of C blocks of `Kernel` (chain_sampling_kernel<T, C> or tree_sampling_kernel<T, C>) run at
// once on the tensor's device (0 without clusters), cached per device: it does not change, and the launch path
// must stay cheap.
template <auto kKernel, int C>
int sampling_clusters_at_once(const at::Tensor& t) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices];  // one per instantiation: 0 unknown, else clusters + 1
  const int device = std::max<int>(0, t.device().index());
  if (device < kCachedDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached - 1;
  }
  const int clusters = max_active_clusters(kKernel, dim3(kLanes / C), C, 0);
  if (device < kCachedDevices) cache[device].store(clusters + 1, std::memory_order_relaxed);
  return clusters;
}

// One cluster per request (blocks per cluster by sampling_cluster_blocks); a grid-stride loop covers batches
// beyond the grid limit. Kernel<C> is the kernel for clusters of C blocks.
template <template <int> class Kernel, typename Params>
void launch_sampling(const char* name, const Params& params, int64_t batch, const at::Tensor& target, Stream stream) {
  const int c = sampling_cluster_blocks(batch, multiprocessor_count(target), [&](int blocks) {
    return blocks == 4 ? sampling_clusters_at_once<Kernel<4>::kernel, 4>(target)
                       : sampling_clusters_at_once<Kernel<2>::kernel, 2>(target);
  });
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(batch, 1 << 28) * c));
  const auto launch = [&](auto kernel, unsigned blocks) {
    launch_cluster_kernel(name, kernel, grid, dim3(kLanes / blocks), blocks, 0, stream, params);
  };
  switch (c) {
    case 4:
      launch(Kernel<4>::kernel, 4);
      break;
    case 2:
      launch(Kernel<2>::kernel, 2);
      break;
    default:
      launch(Kernel<1>::kernel, 1);
  }
}

using Opt = std::optional<at::Tensor>;

}  // namespace sampling_launch
}  // namespace specdec
