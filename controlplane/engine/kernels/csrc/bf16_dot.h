// What the AVX512-BF16 kernels (int4_linear_bf16.cpp, int8_linear.cpp's int8_linear_bf16,
// cpu_ops.cpp's decode attention) share: the target attribute their functions compile under (the
// build's flags stop at AVX512-VNNI on a Zen 4, so the bf16 instructions are enabled per
// function) and the run-time check that the CPU has them.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define CP_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#endif

namespace controlplane {

// Whether this build and this CPU run VDPBF16PS.
inline bool bf16_dot_supported() {
#if defined(CPU_CAPABILITY_AVX512)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace controlplane
