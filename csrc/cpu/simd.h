// Hot CPU loops are compiled for AVX-512, AVX2+FMA and baseline x86-64 and picked at load time (ifunc), so
// one build runs everywhere and uses the vector units that are there.
#pragma once
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPECDEC_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPECDEC_CPU_CLONES
#endif

// For loops that need accuracy but not the bitwise reproducibility that -ffp-contract=off buys the sampling
// kernels (dot products): let the compiler fuse their multiply-adds (one rounding instead of two, half the
// instructions). Only on functions that do not compute det_exp2, whose bits stay those of sampling_math.h.
#if defined(__GNUC__) && !defined(__clang__)
#define SPECDEC_FUSED_MADD __attribute__((optimize("fp-contract=fast")))
#else
#define SPECDEC_FUSED_MADD
#endif
