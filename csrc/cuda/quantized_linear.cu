// Launchers of quantized_linear and dequantize (kernels/quantized_linear.cuh): CUDA tensors under nvcc, CPU
// tensors under the emulator.
#include "checks/quantized_linear.h"
#include "cuda/launcher.h"
#include "kernels/quantized_linear.cuh"

namespace specdec {
namespace {

at::Tensor quantized_linear_launch(const at::Tensor& x_in, const at::Tensor& qweight, int64_t format,
                                   const std::optional<at::Tensor>& bias, c10::string_view activations) {
  const int64_t K = check_quantized_linear(x_in, qweight, format, bias, activations);
  TORCH_CHECK_VALUE(qweight.device().type() == kLauncherDevice, "quantized_linear: qweight must be on ", kLauncherDevice);
  const at::ScalarType dtype = x_in.scalar_type();
  const int64_t M = x_in.size(0), N = qweight.size(0);
  const LauncherGuard guard(x_in);
  // activations="int8": the same quantised activations as the CPU's integer path, multiplied as floats here
  const at::Tensor x = activations == "int8" ? int8_round_trip(x_in) : x_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const at::ScalarType x_dtype = x.scalar_type();
  const ActivationType x_type = x_dtype == at::kFloat      ? ActivationType::kFloat32
                                : x_dtype == at::kBFloat16 ? ActivationType::kBFloat16
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
  const int64_t K = check_quantized_weight("dequantize", qweight, format);
  TORCH_CHECK_VALUE(qweight.device().type() == kLauncherDevice, "dequantize: qweight must be on ", kLauncherDevice);
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
