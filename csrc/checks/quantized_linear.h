// The argument checks of quantized_linear and dequantize, shared by the CPU kernel (cpu/linear.cpp) and the CUDA
// launcher (cuda/quantized_linear.cu, also the emulator's).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <limits>
#include <optional>

#include "specdec/gguf_blocks.h"

namespace specdec {

// K of a [N, row_bytes] block tensor in `format`, checked.
inline int64_t check_quantized_weight(const char* op, const at::Tensor& qweight, int64_t format) {
  const BlockShape s = block_shape(static_cast<int>(format));
  TORCH_CHECK_VALUE(s.weights != 0, op, ": format must be a GGUF block type (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, ",
                    "Q6_K = 14), got ", format);
  TORCH_CHECK_VALUE(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                        qweight.size(1) > 0 && qweight.size(1) % s.bytes == 0,
                    op, ": qweight must be a contiguous uint8 [N, row_bytes] tensor with row_bytes a multiple of ",
                    s.bytes, " (the block of format ", format, "), got ", qweight.scalar_type(), " ", qweight.sizes());
  return qweight.size(1) / s.bytes * s.weights;
}

// quantized_linear's arguments; returns K.
inline int64_t check_quantized_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                                      const std::optional<at::Tensor>& bias, c10::string_view activations) {
  const char* op = "quantized_linear";
  TORCH_CHECK_VALUE(activations == "float" || activations == "int8", op,
                    ": activations must be \"float\" or \"int8\", got \"", activations, "\"");
  const int64_t K = check_quantized_weight(op, qweight, format);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == K, op, ": x must be [M, K] with M >= 1 and K = ", K,
                    " (qweight's columns), got ", x.sizes());
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
                    ": x must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_VALUE(x.device() == qweight.device(), op, ": qweight is on ", qweight.device(), " but x is on ",
                    x.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == qweight.size(0) && bias->scalar_type() == dtype &&
                          bias->device() == x.device(),
                      op, ": bias must be [N] = [", qweight.size(0), "] of x's dtype and device, got ", bias->sizes(), " ",
                      bias->scalar_type());
  }
  return K;
}

// x [M, K] float32 with each unit of 32 values replaced by its 8-bit quantisation q d (cpu/linear_int8.h has the
// definition, which this equals value for value): what activations="int8" multiplies where the kernel multiplies
// floats (the CUDA launcher).
inline at::Tensor int8_round_trip(const at::Tensor& x) {
  const at::Tensor units = x.to(at::kFloat).reshape({x.size(0), -1, 32});
  const at::Tensor amax = units.abs().amax(-1, /*keepdim=*/true);
  const at::Tensor finite = units.isfinite().all(-1, /*keepdim=*/true);
  // Tensor-by-tensor divisions: a division by a scalar may multiply by its reciprocal (CUDA does), not the same bits
  const at::Tensor full = at::full_like(amax, 127.0);
  const at::Tensor scale = at::where(finite, amax.div(full), std::numeric_limits<float>::quiet_NaN());
  at::Tensor inverse = at::where(finite & (amax > 0), full.div(amax), 0.0);
  // amax under 127 / FLT_MAX: the inverse overflows, and x / scale is the quotient (0 where the scale underflows)
  const at::Tensor overflow = inverse.isinf();
  inverse = at::where(overflow, 0.0, inverse);
  const at::Tensor scaled = at::where(overflow & (scale > 0), units.div(scale), units * inverse);
  const at::Tensor q = at::round(at::clamp(scaled, -127.0, 127.0));
  return (q * scale).reshape(x.sizes());
}

}  // namespace specdec
