// The AVX2+FMA+F16C build of kernels.cpp, chosen at run time by driver.cpp when torch itself
// runs its AVX2 or AVX512 kernels (at::get_cpu_capability()), so the extension stays portable
// while using the same fused multiply-adds as torch's kernels (bit-equal fp32 results).
//
// Code generation is switched by `#pragma GCC target` rather than per-file compiler flags
// because setuptools compiles every source of an extension with the same flags. GCC only;
// other compilers and non-x86 targets get no AVX2 variant and run the DEFAULT one.
//
// Caveat shared with torch's own per-capability kernels: inline functions of c10 and the
// standard library used here are emitted with AVX2 encoding and may be the copy the linker
// keeps; the library therefore assumes an AVX-capable x86-64 CPU when this variant is built.
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(_M_X64)) && \
    !defined(ACCUM_FUSED_NO_AVX2)
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
// g++ does not define the ISA macros for a target pragma (gcc does); sleef.h and at::vec key on them.
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "kernels.cpp"

namespace accum_fused::cpu::AVX2 {
const Kernels* const kernels_ptr = &kernels;
}
#else
#include "kernels.h"

namespace accum_fused::cpu::AVX2 {
const Kernels* const kernels_ptr = nullptr;
}
#endif
