// The argument checks of philox_uniform (cpu/philox_uniform.cpp, cuda/philox_uniform.cu).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace specdec {

inline void check_philox_args(const at::Tensor& seed, const at::Tensor& offset, int64_t n, int64_t stream) {
  TORCH_CHECK_VALUE(seed.dim() == 1 && seed.scalar_type() == at::kLong, "philox_uniform: seed must be a 1-D int64 tensor, got ",
                    seed.sizes(), " ", seed.scalar_type());
  TORCH_CHECK_VALUE(offset.dim() == 1 && offset.scalar_type() == at::kLong,
                    "philox_uniform: offset must be a 1-D int64 tensor, got ", offset.sizes(), " ", offset.scalar_type());
  TORCH_CHECK_VALUE(seed.size(0) == offset.size(0), "philox_uniform: seed and offset must have the same length, got ",
                    seed.size(0), " and ", offset.size(0));
  TORCH_CHECK_VALUE(seed.device() == offset.device(), "philox_uniform: seed and offset must be on the same device, got ",
                    seed.device(), " and ", offset.device());
  TORCH_CHECK_VALUE(n >= 0 && n <= (int64_t{1} << 34), "philox_uniform: n must be in [0, 2^34], got ", n);
  TORCH_CHECK_VALUE(stream >= 0 && stream <= 0xffffffffLL, "philox_uniform: stream must be in [0, 2^32), got ", stream);
}

}  // namespace specdec
