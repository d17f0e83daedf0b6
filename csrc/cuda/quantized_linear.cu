// Launchers of quantized_linear and dequantize (kernels/quantized_linear.cuh): CUDA tensors under nvcc, CPU
// tensors under the emulator.
#include "checks.h"
#include "cuda/launcher.h"
#include "kernels/quantized_linear.cuh"

namespace specdec {
namespace {

int64_t quantized_columns(const char* op, const at::Tensor& qweight, int64_t format) {
  const BlockShape s = block_shape(static_cast<int>(format));
  TORCH_CHECK_VALUE(s.weights != 0, op, ": format must be a GGUF block type (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, ",
                    "Q6_K = 14), got ", format);
  TORCH_CHECK_VALUE(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                        qweight.size(1) > 0 && qweight.size(1) % s.bytes == 0,
                    op, ": qweight must be a contiguous uint8 [N, row_bytes] tensor with row_bytes a multiple of ",
                    s.bytes, " (the block of format ", format, "), got ", qweight.scalar_type(), " ", qweight.sizes());
  TORCH_CHECK_VALUE(qweight.device().type() == kLauncherDevice, op, ": qweight must be on ", kLauncherDevice);
  return qweight.size(1) / s.bytes * s.weights;
}

at::Tensor quantized_linear_launch(const at::Tensor& x_in, const at::Tensor& qweight, int64_t format,
                                   const std::optional<at::Tensor>& bias) {
  const char* op = "quantized_linear";
  const int64_t K = quantized_columns(op, qweight, format);
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.size(0) >= 1 && x_in.size(1) == K, op,
                    ": x must be [M, K] with M >= 1 and K = ", K, " (qweight's columns), got ", x_in.sizes());
  const at::ScalarType dtype = x_in.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
                    ": x must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_VALUE(x_in.device() == qweight.device(), op, ": qweight is on ", qweight.device(), " but x is on ",
                    x_in.device());
  const int64_t M = x_in.size(0), N = qweight.size(0);
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == dtype &&
                          bias->device() == x_in.device(),
                      op, ": bias must be [N] = [", N, "] of x's dtype and device, got ", bias->sizes(), " ",
                      bias->scalar_type());
  }
  const LauncherGuard guard(x_in);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const ActivationType x_type = dtype == at::kFloat      ? ActivationType::kFloat32
                                : dtype == at::kBFloat16 ? ActivationType::kBFloat16
                                                         : ActivationType::kFloat16;
  const QuantizedLinearParams P{x.data_ptr(), x_type, qweight.data_ptr<uint8_t>(), M, N, K, qweight.size(1),
                                static_cast<int>(format), y.data_ptr<float>()};
  constexpr int rows_per_block = kQuantThreads / kWarpSize;
  launch_kernel("quantized_linear_kernel", quantized_linear_kernel, dim3(static_cast<unsigned>(ceil_div(N, rows_per_block))),
                dim3(kQuantThreads), 0, current_stream(x), P);
  if (bias.has_value()) y.add_(*bias);
  return y.to(dtype);
}

at::Tensor dequantize_launch(const at::Tensor& qweight, int64_t format) {
  const int64_t K = quantized_columns("dequantize", qweight, format);
  const int64_t N = qweight.size(0);
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(at::kFloat));
  if (N == 0) return out;
  const LauncherGuard guard(qweight);
  launch_kernel("dequantize_kernel", dequantize_kernel, dim3(grid_stride_blocks(N * (K / 32), kQuantThreads)),
                dim3(kQuantThreads), 0, current_stream(qweight), qweight.data_ptr<uint8_t>(), N, K, qweight.size(1),
                static_cast<int>(format), out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(SPECDEC_LIB, SPECDEC_LAUNCHER_KEY, m) {
  m.impl("quantized_linear", &quantized_linear_launch);
  m.impl("dequantize", &dequantize_launch);
}

}  // namespace specdec
