// skinny_linear on the CPU: y [M, N] = x [M, K] @ weight [N, K]^T (+ bias) for the few rows (M <= 16) of a
// decode or verify step, float32 or bfloat16, accumulated in float32.
//
// Bytes and flops: the weight's N x K values are read once; 2 M flops per weight value, so for M <= 16 the
// product is bound by reading the weight. MKL's sgemv runs such a product on one thread (14 GB/s on this
// project's 2-core machines, against the 38 GB/s that both cores read), and its sgemm is slower still for
// 2-8 rows. Here threads split the weight rows; each row is read once for every group of up to 8 inputs
// (the row block stays in L2 for the next group), 8 floats per vector, one accumulator vector per input;
// bf16 weights are widened in registers.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstring>

#include "checks.h"
#include "cpu/simd.h"

namespace specdec {
namespace {

constexpr int kGroupRows = 8;            // inputs per pass over a row block: accumulators in registers
constexpr int64_t kRowsPerTask = 32;     // weight rows per parallel task (~37-74 KB of fp32 weights: L2)

typedef float f32x8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

SPECDEC_HD f32x8 load8(const float* p) { return *reinterpret_cast<const f32x8*>(p); }
SPECDEC_HD f32x8 load8(const c10::BFloat16* p) {
  const u32x8 bits = __builtin_convertvector(*reinterpret_cast<const u16x8*>(p), u32x8) << 16;  // bf16 -> f32
  f32x8 f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// y[m, n] for weight rows [n0, n1) and inputs [m0, m0 + G) (x as float, [M, K]).
template <typename W, int G>
SPECDEC_HD void rows_times_inputs(const float* x, int64_t m0, int64_t K, const W* w, int64_t n0, int64_t n1,
                                  float* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * K;
    f32x8 acc[G] = {};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const f32x8 wv = load8(row + k);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[g] += wv * load8(x + (m0 + g) * K + k);
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      float s = ((acc[g][0] + acc[g][1]) + (acc[g][2] + acc[g][3])) + ((acc[g][4] + acc[g][5]) + (acc[g][6] + acc[g][7]));
      for (int64_t j = k; j < K; ++j) s += static_cast<float>(row[j]) * x[(m0 + g) * K + j];
      y[(m0 + g) * N + n] = s;
    }
  }
}

template <typename W>
SPECDEC_CPU_CLONES SPECDEC_FUSED_MADD void row_block(const float* x, int64_t M, int64_t K, const W* w, int64_t n0,
                                                     int64_t n1, float* y, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += kGroupRows) {
    switch (std::min<int64_t>(kGroupRows, M - m0)) {
      case 8: rows_times_inputs<W, 8>(x, m0, K, w, n0, n1, y, N); break;
      case 7: rows_times_inputs<W, 7>(x, m0, K, w, n0, n1, y, N); break;
      case 6: rows_times_inputs<W, 6>(x, m0, K, w, n0, n1, y, N); break;
      case 5: rows_times_inputs<W, 5>(x, m0, K, w, n0, n1, y, N); break;
      case 4: rows_times_inputs<W, 4>(x, m0, K, w, n0, n1, y, N); break;
      case 3: rows_times_inputs<W, 3>(x, m0, K, w, n0, n1, y, N); break;
      case 2: rows_times_inputs<W, 2>(x, m0, K, w, n0, n1, y, N); break;
      default: rows_times_inputs<W, 1>(x, m0, K, w, n0, n1, y, N);
    }
  }
}

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "skinny_linear";
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxSkinnyRows, op, ": x must be [M, K] with M in [1, ",
                    kMaxSkinnyRows, "], got ", x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.size(1) && weight.is_contiguous(), op,
                    ": weight must be a contiguous [N, K] tensor with K = ", x.size(1), ", got ", weight.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type(), op, ": x and weight must have the same dtype, got ",
                    x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK_VALUE(x.device() == weight.device(), op, ": weight is on ", weight.device(), " but x is on ", x.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == x.scalar_type() &&
                          bias->device() == x.device(),
                      op, ": bias must be [N] = [", weight.size(0), "] of x's dtype and device, got ", bias->sizes());
  }
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  dispatch_float_types<float, void, c10::BFloat16>(x.scalar_type(), op, [&](auto tag) {
    using W = typename decltype(tag)::type;
    const W* w = weight.data_ptr<W>();
    at::parallel_for(0, (N + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
      row_block<W>(xf.data_ptr<float>(), M, K, w, begin * kRowsPerTask, std::min(N, end * kRowsPerTask),
                   y.data_ptr<float>(), N);
    });
  });
  if (bias.has_value()) y.add_(*bias);
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("skinny_linear", &skinny_linear_cpu); }

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
