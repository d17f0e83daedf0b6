// The one launch helper: CUDA launchers and the emulator both start kernels through launch_kernel, so
// a launch configuration is written once and checked the same way on both backends.
#pragma once
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#if defined(SPECDEC_SIM)
#include "../../sim/sim.h"
#else
#include <cuda_runtime.h>
#endif

namespace specdec {

#if defined(SPECDEC_SIM)
using Stream = sim::Stream;

// Launches thread block clusters of `cluster_blocks` blocks along x (grid.x a multiple of it).
template <typename... KernelArgs, typename... Args>
void launch_cluster_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, unsigned cluster_blocks,
                           size_t dynamic_smem, Stream, Args&&... args) {
  // Arguments are converted to the kernel's parameter types once, as cudaLaunchKernel does.
  const std::tuple<KernelArgs...> params(std::forward<Args>(args)...);
  sim::launch(name, grid, block, dim3(cluster_blocks), dynamic_smem, [&] { std::apply(kernel, params); });
}

template <typename... KernelArgs, typename... Args>
void launch_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t dynamic_smem,
                   Stream stream, Args&&... args) {
  launch_cluster_kernel(name, kernel, grid, block, 1, dynamic_smem, stream, std::forward<Args>(args)...);
}

// How many clusters of `cluster_blocks` blocks of `kernel` run at once: the emulator runs any number.
template <typename... KernelArgs>
int max_active_clusters(void (*)(KernelArgs...), dim3, unsigned, size_t) { return 1 << 30; }

// A cooperative launch: every block of the grid resident at once (at most max_resident_blocks), so that blocks may
// wait for each other (arrive_and_wait, device.cuh).
template <typename... KernelArgs, typename... Args>
void launch_cooperative_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t dynamic_smem,
                               Stream, Args&&... args) {
  const std::tuple<KernelArgs...> params(std::forward<Args>(args)...);
  sim::launch(name, grid, block, dim3(1), dynamic_smem, [&] { std::apply(kernel, params); }, /*cooperative=*/true);
}

// A dependent launch (programmatic on sm_90): the emulator runs launches in stream order, so an ordinary one.
template <typename... KernelArgs, typename... Args>
void launch_dependent_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t dynamic_smem,
                             Stream stream, Args&&... args) {
  launch_kernel(name, kernel, grid, block, dynamic_smem, stream, std::forward<Args>(args)...);
}

// How many blocks of `kernel` the device holds at once (sim::resident_blocks).
template <typename... KernelArgs>
int max_resident_blocks(void (*)(KernelArgs...), dim3 block, size_t) {
  return static_cast<int>(sim::resident_blocks(block.x * block.y * block.z));
}
#else
using Stream = cudaStream_t;

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("specdec: ") + what + ": " + cudaGetErrorString(err));
}

// Above 48 KiB, dynamic shared memory needs the kernel's opt-in.
template <typename... KernelArgs>
void opt_in_dynamic_smem(const char* name, void (*kernel)(KernelArgs...), size_t dynamic_smem) {
  if (dynamic_smem > 48 * 1024) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic_smem)),
               name);
  }
}

template <typename... KernelArgs, typename... Args>
void launch_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t dynamic_smem,
                   Stream stream, Args&&... args) {
  opt_in_dynamic_smem(name, kernel, dynamic_smem);
  kernel<<<grid, block, dynamic_smem, stream>>>(std::forward<Args>(args)...);
  check_cuda(cudaGetLastError(), name);
}

// A launch configuration with one launch attribute: a cluster shape (cluster_attribute), a cooperative launch
// (cooperative_attribute) or a programmatic dependent launch (programmatic_attribute).
struct LaunchConfig {
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t config{};
  LaunchConfig(dim3 grid, dim3 block, size_t dynamic_smem, Stream stream, cudaLaunchAttribute a) : attribute(a) {
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = dynamic_smem;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  LaunchConfig(const LaunchConfig&) = delete;  // config points into the object
  LaunchConfig& operator=(const LaunchConfig&) = delete;
};
// Thread block clusters of `cluster_blocks` blocks along x.
inline cudaLaunchAttribute cluster_attribute(unsigned cluster_blocks) {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = cluster_blocks;
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}
inline cudaLaunchAttribute cooperative_attribute() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeCooperative;
  a.val.cooperative = 1;
  return a;
}
inline cudaLaunchAttribute programmatic_attribute() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

// Whether `kernel` runs sm_90 code on an sm_90+ device: the code where clusters and griddepcontrol exist (PTX compiled
// by the driver for a newer device keeps its own __CUDA_ARCH__). A failed query clears its error and says no.
template <typename... KernelArgs>
bool runs_sm90_code(void (*kernel)(KernelArgs...)) {
  cudaFuncAttributes attributes{};
  int device = 0, major = 0;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess || cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attributes.ptxVersion >= 90 && major >= 9;
}

// Launches thread block clusters of `cluster_blocks` blocks along x (sm_90 and later; grid.x a multiple of it).
template <typename... KernelArgs, typename... Args>
void launch_cluster_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, unsigned cluster_blocks,
                           size_t dynamic_smem, Stream stream, Args&&... args) {
  if (cluster_blocks == 1) {
    launch_kernel(name, kernel, grid, block, dynamic_smem, stream, std::forward<Args>(args)...);
    return;
  }
  opt_in_dynamic_smem(name, kernel, dynamic_smem);
  LaunchConfig c(grid, block, dynamic_smem, stream, cluster_attribute(cluster_blocks));
  check_cuda(cudaLaunchKernelEx(&c.config, kernel, std::forward<Args>(args)...), name);
}

// How many clusters of `cluster_blocks` blocks of `kernel` the current device runs at once; 0 where the
// running code has no clusters (a device before sm_90, or code compiled for an older architecture: PTX
// compiled by the driver for a newer device keeps its own __CUDA_ARCH__, so cluster_rank() there is 0), or
// where a query fails (its error is cleared, so that it is not blamed on a later launch).
template <typename... KernelArgs>
int max_active_clusters(void (*kernel)(KernelArgs...), dim3 block, unsigned cluster_blocks, size_t dynamic_smem) {
  int clusters = 0;
  if (!runs_sm90_code(kernel)) return 0;
  LaunchConfig c(dim3(cluster_blocks), block, dynamic_smem, nullptr, cluster_attribute(cluster_blocks));
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &c.config) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return clusters;
}

// A cooperative launch (cudaLaunchAttributeCooperative, which stream capture keeps): every block of the grid resident
// at once, so that blocks may wait for each other (arrive_and_wait, device.cuh). The grid must not exceed
// max_resident_blocks.
template <typename... KernelArgs, typename... Args>
void launch_cooperative_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t dynamic_smem,
                               Stream stream, Args&&... args) {
  opt_in_dynamic_smem(name, kernel, dynamic_smem);
  LaunchConfig c(grid, block, dynamic_smem, stream, cooperative_attribute());
  check_cuda(cudaLaunchKernelEx(&c.config, kernel, std::forward<Args>(args)...), name);
}

// A launch that may begin while the stream's previous kernel finishes (programmatic dependent launch), where the
// kernel runs sm_90 code; elsewhere an ordinary launch. The kernel waits for that grid (wait_for_prerequisite_grid,
// device.cuh) before it reads what the grid wrote.
template <typename... KernelArgs, typename... Args>
void launch_dependent_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t dynamic_smem,
                             Stream stream, Args&&... args) {
  if (!runs_sm90_code(kernel)) {
    launch_kernel(name, kernel, grid, block, dynamic_smem, stream, std::forward<Args>(args)...);
    return;
  }
  opt_in_dynamic_smem(name, kernel, dynamic_smem);
  LaunchConfig c(grid, block, dynamic_smem, stream, programmatic_attribute());
  check_cuda(cudaLaunchKernelEx(&c.config, kernel, std::forward<Args>(args)...), name);
}

// How many blocks of `kernel` the current device holds at once; 0 without cooperative launches or where a query
// fails (its error is cleared, so that it is not blamed on a later launch).
template <typename... KernelArgs>
int max_resident_blocks(void (*kernel)(KernelArgs...), dim3 block, size_t dynamic_smem) {
  int device = 0, cooperative = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, static_cast<int>(block.x * block.y * block.z),
                                                    dynamic_smem) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return cooperative != 0 ? per_sm * sms : 0;
}
#endif

// Zeroes n bytes of device memory in stream order (a memset node under graph capture).
#if defined(SPECDEC_SIM)
inline void zero_device_bytes(void* p, size_t n, Stream) { std::memset(p, 0, n); }
#else
inline void zero_device_bytes(void* p, size_t n, Stream stream) { check_cuda(cudaMemsetAsync(p, 0, n, stream), "cudaMemsetAsync"); }
#endif

inline unsigned ceil_div(size_t a, size_t b) { return static_cast<unsigned>((a + b - 1) / b); }

}  // namespace specdec
