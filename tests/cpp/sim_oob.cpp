// An emulated kernel that writes one float past a heap buffer. Built with AddressSanitizer, this program
// must die with a heap-buffer-overflow report (ctest checks the report); without it, it exits 0.
#include <cstdio>
#include <cstdlib>

#include "selftest_kernels.cuh"
#include "specdec/launch.h"

int main() {
  const int n = 100;
  float* out = static_cast<float*>(std::malloc(n * sizeof(float)));
  specdec::launch_kernel("out_of_bounds", selftest::out_of_bounds_kernel, dim3(1), dim3(128), 0, specdec::Stream{}, out, n);
  std::printf("out-of-bounds write was not detected\n");
  std::free(out);
  return 0;
}
