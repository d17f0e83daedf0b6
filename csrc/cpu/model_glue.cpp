// The elementwise steps of a Llama decoder layer on the CPU, one call each where torch takes 4-14 small ops: at a
// decode step of a 135M model every op costs ~4-10 us of dispatch against ~0.2 us of arithmetic, and a layer had
// ~40 of them (bench/RESULTS.md). Each computes what the torch expression in models/llama.py computes, in the same
// dtype steps (float32 math, rounded to the tensor's dtype where torch rounds), so results differ from torch's
// only by the order of one sum (rms_norm's mean).
//   rms_norm(x, w, eps)            w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)
//   add_rms_norm(x!, d, w, eps)    x += d (in x's dtype), then rms_norm(x, w, eps)
//   rotary_split(qkv, cos, sin, hq, hkv)
//                                  q, k, v = qkv.split(...); q, k rotated: x cos + cat(-x2, x1) sin; contiguous
//   silu_mul(gate_up)              silu(gate) * up, gate and up the two halves of the last dim
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>

#include "cpu/cpu_ops.h"
#include "checks/common.h"

namespace specdec {
namespace {

template <typename T>
void rms_norm_row(const T* x, const T* w, float eps, int64_t H, T* y) {
  double sum = 0.0;
  for (int64_t i = 0; i < H; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += static_cast<double>(v * v);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(sum / static_cast<double>(H)) + eps);
  for (int64_t i = 0; i < H; ++i) {
    const T h = static_cast<T>(static_cast<float>(x[i]) * scale);  // .to(x.dtype)
    y[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(h));
  }
}

void check_norm(const char* op, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.is_contiguous() && x.size(-1) > 0, op, ": x must be a contiguous [..., H] tensor");
  TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type() && w.is_contiguous(),
                    op, ": weight must be a contiguous [H] = [", x.size(-1), "] tensor of x's dtype, got ", w.sizes(),
                    " ", w.scalar_type());
}

template <typename F>
void for_rows(int64_t rows, F&& f) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) f(r);
  });
}

}  // namespace

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm("rms_norm", x, weight);
  at::Tensor y = at::empty_like(x);
  const int64_t H = x.size(-1), rows = x.numel() / H;
  dispatch_float_types<float, void, c10::BFloat16>(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    for_rows(rows, [&](int64_t r) { rms_norm_row(xp + r * H, wp, static_cast<float>(eps), H, yp + r * H); });
  });
  return y;
}

at::Tensor add_rms_norm_cpu(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_norm("add_rms_norm", x, weight);
  TORCH_CHECK_VALUE(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type() && delta.is_contiguous(),
                    "add_rms_norm: delta must be a contiguous tensor of x's shape and dtype, got ", delta.sizes());
  at::Tensor y = at::empty_like(x);
  const int64_t H = x.size(-1), rows = x.numel() / H;
  dispatch_float_types<float, void, c10::BFloat16>(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* xp = x.data_ptr<T>();
    const T* dp = delta.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    for_rows(rows, [&](int64_t r) {
      T* row = xp + r * H;
      for (int64_t i = 0; i < H; ++i) row[i] = static_cast<T>(static_cast<float>(row[i]) + static_cast<float>(dp[r * H + i]));
      rms_norm_row(row, wp, static_cast<float>(eps), H, yp + r * H);
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_split_cpu(const at::Tensor& qkv, const at::Tensor& cos,
                                                                 const at::Tensor& sin, int64_t hq, int64_t hkv) {
  const char* op = "rotary_split";
  TORCH_CHECK_VALUE(qkv.dim() == 3 && qkv.is_contiguous() && hq > 0 && hkv > 0 && qkv.size(2) % (hq + 2 * hkv) == 0,
                    op, ": qkv must be a contiguous [B, Q, (hq + 2 hkv) D] tensor, got ", qkv.sizes(), " with hq = ", hq,
                    ", hkv = ", hkv);
  const int64_t B = qkv.size(0), Q = qkv.size(1), D = qkv.size(2) / (hq + 2 * hkv);
  TORCH_CHECK_VALUE(D % 2 == 0, op, ": the head dim must be even, got ", D);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK_VALUE(t->dim() == 4 && t->size(0) == B && t->size(1) == Q && t->size(2) == 1 && t->size(3) == D &&
                          t->is_contiguous() && t->scalar_type() == qkv.scalar_type(),
                      op, ": cos and sin must be contiguous [B, Q, 1, D] = [", B, ", ", Q, ", 1, ", D,
                      "] tensors of qkv's dtype, got ", t->sizes(), " ", t->scalar_type());
  }
  at::Tensor q = at::empty({B, Q, hq, D}, qkv.options());
  at::Tensor k = at::empty({B, Q, hkv, D}, qkv.options());
  at::Tensor v = at::empty({B, Q, hkv, D}, qkv.options());
  dispatch_float_types<float, void, c10::BFloat16>(qkv.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t width = (hq + 2 * hkv) * D, half = D / 2;
    for_rows(B * Q, [&](int64_t t) {
      const T* src = qkv.data_ptr<T>() + t * width;
      const T* c = cos.data_ptr<T>() + t * D;
      const T* s = sin.data_ptr<T>() + t * D;
      auto rotate = [&](const T* x, T* out) {  // x cos + cat(-x2, x1) sin, each product and the sum rounded to T
        for (int64_t i = 0; i < D; ++i) {
          const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
          const T a = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
          const T b = static_cast<T>(static_cast<float>(static_cast<T>(rotated)) * static_cast<float>(s[i]));
          out[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
        }
      };
      T* qo = q.data_ptr<T>() + t * hq * D;
      T* ko = k.data_ptr<T>() + t * hkv * D;
      T* vo = v.data_ptr<T>() + t * hkv * D;
      for (int64_t h = 0; h < hq; ++h) rotate(src + h * D, qo + h * D);
      for (int64_t h = 0; h < hkv; ++h) rotate(src + (hq + h) * D, ko + h * D);
      for (int64_t i = 0; i < hkv * D; ++i) vo[i] = src[(hq + hkv) * D + i];
    });
  });
  return {q, k, v};
}

at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  TORCH_CHECK_VALUE(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: gate_up must be a [..., 2 I] tensor, got ",
                    gate_up.sizes());
  TORCH_CHECK_VALUE(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
                    "silu_mul: no kernel for dtype ", gate_up.scalar_type());
  // ATen's vectorised silu (its exp is the one F.silu uses), rounded to the dtype, then the product in place: torch's
  // two ops, bit for bit, from one dispatch.
  const int64_t I = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, I)).mul_(gate_up.narrow(-1, I, I));
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("rotary_split", &rotary_split_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
}

}  // namespace specdec
