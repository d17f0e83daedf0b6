// The one launch helper: CUDA launchers and the emulator both start kernels through launch_kernel, so
// a launch configuration is written once and checked the same way on both backends.
#pragma once
#include <cstddef>
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

template <typename... KernelArgs, typename... Args>
void launch_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t dynamic_smem,
                   Stream, Args&&... args) {
  // Arguments are converted to the kernel's parameter types once, as cudaLaunchKernel does.
  const std::tuple<KernelArgs...> params(std::forward<Args>(args)...);
  sim::launch(name, grid, block, dynamic_smem, [&] { std::apply(kernel, params); });
}
#else
using Stream = cudaStream_t;

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("specdec: ") + what + ": " + cudaGetErrorString(err));
}

template <typename... KernelArgs, typename... Args>
void launch_kernel(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t dynamic_smem,
                   Stream stream, Args&&... args) {
  if (dynamic_smem > 48 * 1024) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic_smem)),
               name);
  }
  kernel<<<grid, block, dynamic_smem, stream>>>(std::forward<Args>(args)...);
  check_cuda(cudaGetLastError(), name);
}
#endif

inline unsigned ceil_div(size_t a, size_t b) { return static_cast<unsigned>((a + b - 1) / b); }

}  // namespace specdec
