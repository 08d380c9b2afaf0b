/* kernels/cpu/isa.h — the ISA cap: the highest instruction-set level the CPU kernels may use, so any
 * machine can run (and test) every level it supports, the lower ones included (issue 45). */
#ifndef PD_KERNELS_CPU_ISA_H
#define PD_KERNELS_CPU_ISA_H

#include "common/status.h"

typedef enum pd_cpu_isa {
    PD_ISA_PORTABLE = 0,    /* no x86 extension beyond x86-64 (the portable kernels) */
    PD_ISA_AVX2 = 1,        /* AVX2 + FMA + F16C */
    PD_ISA_AVX512 = 2,      /* AVX-512 F/BW/VL */
    PD_ISA_AVX512_BF16 = 3, /* + AVX512-BF16 (vdpbf16ps) */
    PD_ISA_AMX = 4,         /* + AMX tiles */
} pd_cpu_isa_t;

/* The cap: $PD_CPU_ISA (portable | avx2 | avx512 | avx512_bf16 | amx), read once; unset means no cap
 * (amx). An unknown value is logged and means no cap. Kernels still need the CPU to have a feature:
 * the cap only takes levels away. It also caps oneDNN (dnnl_set_max_cpu_isa) at its first use and
 * picks the build of the elementwise ops (PD_CPU_VARIANTS, simd.h). Any thread. */
pd_cpu_isa_t pd_cpu_isa_cap(void);

/* --cpu-isa NAME (every binary that runs CPU kernels): sets the cap, over $PD_CPU_ISA; "auto" (or
 * NULL) leaves it to $PD_CPU_ISA. Call before the first kernel runs (the usable checks cache their
 * answers): once the cap is read, setting another is PD_ERR_INVALID_ARG (logged), as is an unknown
 * name. */
pd_status_t pd_cpu_isa_set_cap(const char *name);

/* The highest level the kernels run at: the cap, lowered to what this CPU has (AMX: also the kernel's
 * permission to use its tiles). Defined with the kernels' own checks (backend_cpu.c). */
pd_cpu_isa_t pd_cpu_isa_level(void);

/* Whether the kernels may use level isa here (the cap allows it and the CPU has it). */
int pd_cpu_isa_usable(pd_cpu_isa_t isa);

/* "portable", "avx2", ... for a level. */
const char *pd_cpu_isa_name(pd_cpu_isa_t isa);

#endif
