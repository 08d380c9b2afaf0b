/* kernels/cpu/isa.h — the ISA cap: the highest instruction-set level the CPU kernels may use, so any
 * machine can run (and test) every level it supports, the lower ones included (issue 45). */
#ifndef PD_KERNELS_CPU_ISA_H
#define PD_KERNELS_CPU_ISA_H

typedef enum pd_cpu_isa {
    PD_ISA_PORTABLE = 0,    /* no x86 extension beyond x86-64 (the portable kernels) */
    PD_ISA_AVX2 = 1,        /* AVX2 + FMA + F16C */
    PD_ISA_AVX512 = 2,      /* AVX-512 F/BW/VL */
    PD_ISA_AVX512_BF16 = 3, /* + AVX512-BF16 (vdpbf16ps) */
    PD_ISA_AMX = 4,         /* + AMX tiles */
} pd_cpu_isa_t;

/* The cap: $PD_CPU_ISA (portable | avx2 | avx512 | avx512_bf16 | amx), read once; unset means no cap
 * (amx). An unknown value is logged and means no cap. Kernels still need the CPU to have a feature:
 * the cap only takes levels away. It also caps oneDNN (dnnl_set_max_cpu_isa) at its first use. The
 * GCC target_clones of the elementwise ops pick by the CPU alone. Any thread. */
pd_cpu_isa_t pd_cpu_isa_cap(void);

/* "portable", "avx2", ... for a level. */
const char *pd_cpu_isa_name(pd_cpu_isa_t isa);

#endif
