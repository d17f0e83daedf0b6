// Which op namespace this translation unit registers into: the real ops (torch.ops.specdec), or the
// CUDA launchers compiled as host C++ for the emulator (torch.ops.specdec_sim, SPECDEC_SIM defined).
#pragma once
#if defined(SPECDEC_SIM)
#define SPECDEC_LIB specdec_sim
#define SPECDEC_LIB_NAME "specdec_sim"
#else
#define SPECDEC_LIB specdec
#define SPECDEC_LIB_NAME "specdec"
#endif
