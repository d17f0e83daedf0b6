// The one list of ops: every schema of torch.ops.specdec (and, compiled with SPECDEC_SIM, of its
// emulated twin torch.ops.specdec_sim). Backends register implementations with TORCH_LIBRARY_IMPL.
#include <torch/library.h>

#include "specdec/library.h"

TORCH_LIBRARY(SPECDEC_LIB, m) {
  // Uniforms in (0, 1) from Philox4x32-10: row b is the stream `stream` of request (seed[b], offset[b]),
  // element i its i-th uniform (counter layout in specdec/philox.h). -> [B, n] float32.
  m.def("philox_uniform(Tensor seed, Tensor offset, int n, int stream=0) -> Tensor");
}
