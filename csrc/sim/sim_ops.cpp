// torch.ops.specdec_sim: the schemas of csrc/ops.cpp and the CUDA launchers of csrc/cuda, compiled as host
// C++ with SPECDEC_SIM so that each kernel runs under the emulator on CPU tensors. One translation unit
// includes them all so that the sources are shared with the CUDA build without compiling one object
// file twice with different flags. Each new CUDA launcher is added here.
#if !defined(SPECDEC_SIM)
#error "sim_ops.cpp is built with -DSPECDEC_SIM"
#endif
#include "../bindings.cpp"
#include "../ops.cpp"
#include "../cuda/chain_sampling.cu"
#include "../cuda/tree_sampling.cu"
#include "../cuda/philox_uniform.cu"
#include "../cuda/truncate_kv_cache.cu"
#include "../cuda/verify_attention.cu"
#include "../cuda/quantized_linear.cu"
