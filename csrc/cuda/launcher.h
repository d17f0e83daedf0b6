// What every CUDA launcher needs, for both of its builds: nvcc (torch.ops.specdec, CUDA tensors) and
// host C++ under the emulator (torch.ops.specdec_sim, CPU tensors). Launchers are written once against
// these names.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdlib>

#include "specdec/launch.h"
#include "specdec/library.h"

#if defined(SPECDEC_SIM)
#define SPECDEC_LAUNCHER_KEY CPU
namespace specdec {
inline constexpr c10::DeviceType kLauncherDevice = c10::DeviceType::CPU;
struct LauncherGuard {
  explicit LauncherGuard(const at::Tensor&) {}
};
inline Stream current_stream(const at::Tensor&) { return {}; }
// The emulated device's (sim::DeviceLimits: a small device, so that the tests' modest shapes already take the
// multi-block paths).
inline int multiprocessor_count(const at::Tensor&) { return static_cast<int>(sim::device_limits().multiprocessors); }
}  // namespace specdec
#else
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define SPECDEC_LAUNCHER_KEY CUDA
namespace specdec {
inline constexpr c10::DeviceType kLauncherDevice = c10::DeviceType::CUDA;
struct LauncherGuard {
  c10::cuda::CUDAGuard guard;
  explicit LauncherGuard(const at::Tensor& t) : guard(t.device()) {}
};
inline Stream current_stream(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
inline int multiprocessor_count(const at::Tensor& t) {
  return at::cuda::getDeviceProperties(t.device().index())->multiProcessorCount;
}
}  // namespace specdec
#endif

namespace specdec {
// A test's override of a launch choice: the integer in environment variable `name` (read at every launch, so that a
// test can change it within a process), or 0 when unset or empty. A value that is not an integer, or that `valid`
// refuses, raises a ValueError: "<name> must be <requirement>, got '<value>'".
template <typename Valid>
long long launch_override(const char* name, Valid&& valid, const char* requirement) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  const long long n = std::strtoll(value, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && valid(n), name, " must be ", requirement, ", got '", value, "'");
  return n;
}

// Grid size for grid-stride kernels: enough blocks to fill any current GPU, never more than the work.
inline unsigned grid_stride_blocks(int64_t work_items, int threads_per_block) {
  const int64_t needed = (work_items + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(needed < 132 * 16 ? (needed > 0 ? needed : 1) : 132 * 16);
}
}  // namespace specdec
