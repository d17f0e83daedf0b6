#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks/philox_uniform.h"
#include "specdec/philox.h"

namespace specdec {
namespace {

at::Tensor philox_uniform_cpu(const at::Tensor& seed_in, const at::Tensor& offset_in, int64_t n, int64_t stream) {
  check_philox_args(seed_in, offset_in, n, stream);
  const at::Tensor seed = seed_in.contiguous();
  const at::Tensor offset = offset_in.contiguous();
  const int64_t rows = seed.size(0);
  at::Tensor out = at::empty({rows, n}, seed.options().dtype(at::kFloat));
  const int64_t blocks_per_row = (n + 3) / 4;
  const int64_t* seed_p = seed.data_ptr<int64_t>();
  const int64_t* offset_p = offset.data_ptr<int64_t>();
  float* out_p = out.data_ptr<float>();
  const auto s = static_cast<uint32_t>(stream);
  at::parallel_for(0, rows * blocks_per_row, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = t / blocks_per_row;
      const int64_t block = t - row * blocks_per_row;
      const Philox4 r = philox_block(static_cast<uint64_t>(seed_p[row]), static_cast<uint64_t>(offset_p[row]), s,
                                     static_cast<uint32_t>(block));
      const int64_t valid = std::min<int64_t>(4, n - block * 4);
      float* dst = out_p + row * n + block * 4;
      for (int64_t k = 0; k < valid; ++k) dst[k] = uniform_from_bits(r.x[k]);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("philox_uniform", &philox_uniform_cpu); }

}  // namespace specdec
