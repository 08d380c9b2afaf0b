/* kernels/cpu/isa.c — see isa.h. */
#include "kernels/cpu/isa.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

static const char *const NAMES[] = {"portable", "avx2", "avx512", "avx512_bf16", "amx"};

const char *pd_cpu_isa_name(pd_cpu_isa_t isa)
{
    return (unsigned)isa < sizeof(NAMES) / sizeof(NAMES[0]) ? NAMES[isa] : "?";
}

pd_cpu_isa_t pd_cpu_isa_cap(void)
{
    static int cap = -1; /* a benign race: every thread computes the same value */
    int v = __atomic_load_n(&cap, __ATOMIC_ACQUIRE);
    if (v >= 0) {
        return (pd_cpu_isa_t)v;
    }
    const char *env = getenv("PD_CPU_ISA");
    v = PD_ISA_AMX;
    if (env != NULL && env[0] != '\0') {
        int found = -1;
        for (int i = 0; i < (int)(sizeof(NAMES) / sizeof(NAMES[0])); i++) {
            found = strcmp(env, NAMES[i]) == 0 ? i : found;
        }
        if (found < 0) {
            pd_log_warn("PD_CPU_ISA=%s is not one of portable|avx2|avx512|avx512_bf16|amx: no cap", env);
        } else {
            v = found;
            pd_log_info("CPU kernels capped at %s (PD_CPU_ISA)", NAMES[v]);
        }
    }
    __atomic_store_n(&cap, v, __ATOMIC_RELEASE);
    return (pd_cpu_isa_t)v;
}
