/* Run-time choice of the kernel table: the best ISA the CPU (and the OS, for the wide
 * register state) supports, overridable for tests and for comparing paths on one machine. */
#include "tw.h"

static const tw_kernels *active;

int tw_isa_supported(int isa) {
    switch (isa) {
    case TW_ISA_SCALAR: return 1;
#if defined(__x86_64__) || defined(__i386__)
    /* libgcc's checks include XGETBV, so a kernel that disabled AVX-512 state reads as unsupported. */
    case TW_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case TW_ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
               tw_isa_supported(TW_ISA_AVX2);
#endif
    default: return 0;
    }
}

int tw_isa_best(void) {
    if (tw_isa_supported(TW_ISA_AVX512)) return TW_ISA_AVX512;
    if (tw_isa_supported(TW_ISA_AVX2)) return TW_ISA_AVX2;
    return TW_ISA_SCALAR;
}

const tw_kernels *tw_kernels_for(int isa) {
    if (!tw_isa_supported(isa)) return NULL;
    switch (isa) {
    case TW_ISA_AVX512: return &tw_kernels_avx512;
    case TW_ISA_AVX2: return &tw_kernels_avx2;
    default: return &tw_kernels_scalar;
    }
}

const tw_kernels *tw_active(void) {
    if (!active) active = tw_kernels_for(tw_isa_best());
    return active;
}

int tw_set_isa(int isa) {
    const tw_kernels *k = tw_kernels_for(isa);
    if (!k) return -1;
    active = k;
    return 0;
}
