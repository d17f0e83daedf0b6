#include "checks/philox_uniform.h"
#include "cuda/launcher.h"
#include "kernels/philox_uniform.cuh"

namespace specdec {
namespace {

at::Tensor philox_uniform_launch(const at::Tensor& seed_in, const at::Tensor& offset_in, int64_t n, int64_t stream) {
  check_philox_args(seed_in, offset_in, n, stream);
  TORCH_CHECK_VALUE(seed_in.device().type() == kLauncherDevice, "philox_uniform: seed must be on ", kLauncherDevice);
  const LauncherGuard guard(seed_in);
  const at::Tensor seed = seed_in.contiguous();
  const at::Tensor offset = offset_in.contiguous();
  const int64_t rows = seed.size(0);
  at::Tensor out = at::empty({rows, n}, seed.options().dtype(at::kFloat));
  const int64_t work = rows * ((n + 3) / 4);
  if (work == 0) return out;
  launch_kernel("philox_uniform_kernel", philox_uniform_kernel, dim3(grid_stride_blocks(work, kPhiloxUniformThreads)),
                dim3(kPhiloxUniformThreads), 0, current_stream(seed), seed.data_ptr<int64_t>(), offset.data_ptr<int64_t>(),
                out.data_ptr<float>(), rows, n, static_cast<uint32_t>(stream));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(SPECDEC_LIB, SPECDEC_LAUNCHER_KEY, m) { m.impl("philox_uniform", &philox_uniform_launch); }

}  // namespace specdec
