// The argument checks of skinny_linear (cpu/linear.cpp; on CUDA the op is at::linear, which checks its own).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

namespace specdec {

constexpr int64_t kMaxSkinnyRows = 16;  // skinny_linear's row limit (decode and verify steps)

inline void check_skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "skinny_linear";
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxSkinnyRows, op, ": x must be [M, K] with M in [1, ",
                    kMaxSkinnyRows, "], got ", x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.size(1) && weight.is_contiguous(), op,
                    ": weight must be a contiguous [N, K] tensor with K = ", x.size(1), ", got ", weight.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type(), op, ": x and weight must have the same dtype, got ",
                    x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK_VALUE(x.device() == weight.device(), op, ": weight is on ", weight.device(), " but x is on ", x.device());
  if (bias.has_value()) {
    const int64_t N = weight.size(0);
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type() &&
                          bias->device() == x.device(),
                      op, ": bias must be [N] = [", N, "] of x's dtype and device, got ", bias->sizes(), " ",
                      bias->scalar_type());
  }
}

}  // namespace specdec
