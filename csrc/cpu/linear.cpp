// The CPU GEMM ops (cpu/linear_kernels.h has the plan and the byte/flop counts):
// - skinny_linear: y [M, N] = x [M, K] @ weight [N, K]^T (+ bias) for the 1-16 rows of a decode or verify step,
//   float32 or bfloat16 weights, accumulated in float32;
// - quantized_linear: the same with weights kept as GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), any M (in chunks);
// - quantized_linear with activations="int8": x quantised to 8 bits per 32 values and multiplied with the blocks on
//   integer dot products (cpu/linear_int8.h has the arithmetic);
// - dequantize: GGUF blocks -> float32 rows (embedding lookups of a quantised table).
// One kernel per ISA (AVX-512, AVX2 + FMA + F16C, SSE2), compiled from one source and chosen at run time: the best
// the CPU has, or SPECDEC_CPU_ISA (avx512, avx2, sse2) when set. The integer path's AVX-512 kernel is its VNNI one
// (vpdpbusd) where the CPU has AVX512-VNNI, the AVX2 one (vpmaddubsw) where it does not.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/cpu_ops.h"
#include "checks/common.h"
#include "checks/quantized_linear.h"
#include "checks/skinny_linear.h"
#include "cpu/linear_int8.h"
#include "cpu/linear_kernels.h"

// Dot products need accuracy, not the bitwise reproducibility that -ffp-contract=off buys the sampling kernels:
// every function below may fuse its multiply-adds (one rounding instead of two, half the instructions).
#pragma GCC optimize("fp-contract=fast")

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace specdec::linear::avx512 {
#define SPECDEC_LINEAR_VW 16
#include "cpu/linear_isa.inc"
#undef SPECDEC_LINEAR_VW
}  // namespace specdec::linear::avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace specdec::linear::avx512_vnni {
#define SPECDEC_INT8_DOT 2
#include "cpu/linear_int8.inc"
#undef SPECDEC_INT8_DOT
}  // namespace specdec::linear::avx512_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace specdec::linear::avx2 {
#define SPECDEC_LINEAR_VW 8
#include "cpu/linear_isa.inc"
#undef SPECDEC_LINEAR_VW
#define SPECDEC_INT8_DOT 1
#include "cpu/linear_int8.inc"
#undef SPECDEC_INT8_DOT
}  // namespace specdec::linear::avx2
#pragma GCC pop_options
#endif

// x86-64's baseline (SSE2), and the generic build of other CPUs (GCC vector extensions of 4 floats).
namespace specdec::linear::sse2 {
#define SPECDEC_LINEAR_VW 4
#include "cpu/linear_isa.inc"
#undef SPECDEC_LINEAR_VW
#define SPECDEC_INT8_DOT 0
#include "cpu/linear_int8.inc"
#undef SPECDEC_INT8_DOT
}  // namespace specdec::linear::sse2

namespace specdec {

namespace {

using linear::Int8Problem;
using linear::Problem;

using Int8Rows = void (*)(const Int8Problem&, int64_t, int64_t, float*);

struct IsaKernels {
  const char* name;
  void (*product_rows)(const Problem&, int64_t, int64_t, float*);
  void (*dequantize_rows)(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*);
  void (*int8_activations)(const float*, int64_t, int64_t, int64_t, int8_t*, float*, float*, int32_t*);
  Int8Rows int8_rows;
};

constexpr IsaKernels kIsas[] = {
#if defined(__x86_64__)
    {"avx512", linear::avx512::product_rows, linear::avx512::dequantize_rows, linear::avx2::int8_activations,
     linear::avx2::int8_rows},
    {"avx2", linear::avx2::product_rows, linear::avx2::dequantize_rows, linear::avx2::int8_activations,
     linear::avx2::int8_rows},
#endif
    {"sse2", linear::sse2::product_rows, linear::sse2::dequantize_rows, linear::sse2::int8_activations,
     linear::sse2::int8_rows},
};
constexpr int kIsaCount = sizeof(kIsas) / sizeof(kIsas[0]);

bool cpu_has(const IsaKernels& isa) {
#if defined(__x86_64__)
  const std::string name = isa.name;
  if (name == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  if (name == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
#endif
  return true;  // SSE2 is x86-64's baseline; elsewhere "sse2" is the generic build, the only one
}

// The kernels for this call: SPECDEC_CPU_ISA if set (read on every call, so a test or a benchmark can switch),
// else the best this CPU has.
const IsaKernels& isa_kernels() {
  const char* wanted = std::getenv("SPECDEC_CPU_ISA");
  if (wanted != nullptr && *wanted != '\0') {
    std::string name(wanted);  // case aside: AVX2 is avx2
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    for (const IsaKernels& isa : kIsas) {
      if (name == isa.name) {
        TORCH_CHECK_VALUE(cpu_has(isa), "SPECDEC_CPU_ISA=", wanted, ": this CPU lacks the instructions it needs");
        return isa;
      }
    }
    TORCH_CHECK_VALUE(false, "SPECDEC_CPU_ISA must be avx512, avx2 or sse2 (any case; or unset), got '", wanted, "'");
  }
  for (const IsaKernels& isa : kIsas) {
    if (cpu_has(isa)) return isa;
  }
  return kIsas[kIsaCount - 1];
}

// The integer path's kernel for the ISA: VNNI's on an AVX-512 CPU that has it (every kernel gives the same bits).
Int8Rows int8_kernel(const IsaKernels& isa) {
#if defined(__x86_64__)
  if (std::string(isa.name) == "avx512" && __builtin_cpu_supports("avx512vnni")) return linear::avx512_vnni::int8_rows;
#endif
  return isa.int8_rows;
}

// Weight rows per parallel task: whole panels, about an even share per thread (each thread streams one contiguous
// part of the weight).
int64_t rows_per_task(int64_t N) {
  const int64_t panels = (N + linear::kPanelRows - 1) / linear::kPanelRows;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::max<int64_t>(1, (panels + threads - 1) / threads) * linear::kPanelRows;
}

// y [M, N] float32 = x [M, K] float32 @ W^T, W given by p (format, pointer, row bytes).
void product(const IsaKernels& isa, Problem p) {
  const int64_t chunk = rows_per_task(p.N);
  const bool blocks = block_shape(p.format).weights != 0;
  at::parallel_for(0, (p.N + chunk - 1) / chunk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(blocks ? linear::kPanelRows * p.K : 0);
    isa.product_rows(p, begin * chunk, std::min(p.N, end * chunk), scratch.data());
  });
}

}  // namespace

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "skinny_linear";
  check_skinny_linear(x, weight, bias);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  int format = kF32;
  dispatch_float_types<float, void, c10::BFloat16>(x.scalar_type(), op, [&](auto tag) {
    format = std::is_same_v<typename decltype(tag)::type, float> ? kF32 : kBF16;
  });
  const IsaKernels& isa = isa_kernels();
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  product(isa, Problem{xf.data_ptr<float>(), M, K, weight.data_ptr(), K * static_cast<int64_t>(weight.element_size()),
                       format, y.data_ptr<float>(), N});
  if (bias.has_value()) y.add_(*bias);
  return y.to(x.scalar_type());
}

// y [M, N] float32 = x quantised to 8 bits per 32 (xf [M, K] float32) @ W^T on integer dot products. Inputs in
// chunks whose quantised rows stay in L2 while every group of 8 weight rows passes over them; each chunk unpacks
// the weight once.
static void int8_product(const IsaKernels& isa, const at::Tensor& xf, const at::Tensor& qweight, int format, at::Tensor& y) {
  const int64_t M = xf.size(0), K = xf.size(1), N = qweight.size(0), units = K / 32;
  const Int8Rows kernel = int8_kernel(isa);
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * units), dsum(M * units);
  std::vector<int32_t> sum16(M * 2 * units);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    isa.int8_activations(xf.data_ptr<float>(), K, begin, end, q.data(), d.data(), dsum.data(), sum16.data());
  });
  const int64_t chunk = std::max<int64_t>(16, (int64_t{1} << 17) / K);
  const int64_t groups = (N + 7) / 8;
  const int64_t groups_per_task = std::max<int64_t>(1, (groups + at::get_num_threads() - 1) / at::get_num_threads());
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    const Int8Problem p{{q.data() + m0 * K, d.data() + m0 * units, dsum.data() + m0 * units, sum16.data() + m0 * 2 * units},
                        rows, K, qweight.data_ptr<uint8_t>(), qweight.size(1), format, y.data_ptr<float>() + m0 * N, N};
    at::parallel_for(0, (groups + groups_per_task - 1) / groups_per_task, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(16 * rows);  // the kernels' scratch: 8 or 16 floats per input row
      kernel(p, begin * groups_per_task * 8, std::min(N, end * groups_per_task * 8), acc.data());
    });
  }
}

at::Tensor quantized_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                                const std::optional<at::Tensor>& bias, c10::string_view activations) {
  const int64_t K = check_quantized_linear(x, qweight, format, bias, activations);
  const int64_t M = x.size(0), N = qweight.size(0);
  const IsaKernels& isa = isa_kernels();
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (activations == "int8") {
    int8_product(isa, xf, qweight, static_cast<int>(format), y);
    if (bias.has_value()) y.add_(*bias);
    return y.to(x.scalar_type());
  }
  // Inputs in chunks whose float32 rows stay in L2 (~256 KB) while every weight panel passes over them; each chunk
  // decodes the weight once.
  const int64_t chunk = std::max<int64_t>(16, (int64_t{1} << 16) / K);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    at::Tensor yc = rows == M ? y : at::empty({rows, N}, y.options());
    product(isa, Problem{xf.data_ptr<float>() + m0 * K, rows, K, qweight.data_ptr(), qweight.size(1),
                         static_cast<int>(format), yc.data_ptr<float>(), N});
    if (rows != M) y.narrow(0, m0, rows).copy_(yc);
  }
  if (bias.has_value()) y.add_(*bias);
  return y.to(x.scalar_type());
}

at::Tensor dequantize_cpu(const at::Tensor& qweight, int64_t format) {
  const int64_t K = check_quantized_weight("dequantize", qweight, format);
  const int64_t N = qweight.size(0);
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(at::kFloat));
  const IsaKernels& isa = isa_kernels();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    isa.dequantize_rows(static_cast<int>(format), qweight.data_ptr<uint8_t>(), qweight.size(1), K, begin, end,
                        out.data_ptr<float>() + begin * K);
  });
  return out;
}

// The ISA the CPU kernels use now (for build_info and the benchmarks).
const char* cpu_isa_name() { return isa_kernels().name; }

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("skinny_linear", &skinny_linear_cpu);
  m.impl("quantized_linear", &quantized_linear_cpu);
  m.impl("dequantize", &dequantize_cpu);
}

#if defined(SPECDEC_WITH_CUDA)
// On a GPU cuBLAS already serves skinny products near the bandwidth bound: the op is at::linear there, so that
// callers need no device branch.
TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("skinny_linear", [](const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    return at::linear(x, weight, bias);
  });
}
#endif

}  // namespace specdec
