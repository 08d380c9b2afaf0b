/* kernels/cpu/isa.c — see isa.h. */
#include "kernels/cpu/isa.h"

#include <stdbool.h>

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

static const char *const NAMES[] = {"portable", "avx2", "avx512", "avx512_bf16", "amx"};

const char *pd_cpu_isa_name(pd_cpu_isa_t isa)
{
    return (unsigned)isa < sizeof(NAMES) / sizeof(NAMES[0]) ? NAMES[isa] : "?";
}

static int g_cap = -1; /* the cap once read or set; a benign race: every reader computes the same value */

static int isa_lookup(const char *name)
{
    for (int i = 0; i < (int)(sizeof(NAMES) / sizeof(NAMES[0])); i++) {
        if (strcmp(name, NAMES[i]) == 0) {
            return i;
        }
    }
    return -1;
}

pd_cpu_isa_t pd_cpu_isa_cap(void)
{
    int v = __atomic_load_n(&g_cap, __ATOMIC_ACQUIRE);
    if (v >= 0) {
        return (pd_cpu_isa_t)v;
    }
    const char *env = getenv("PD_CPU_ISA");
    v = PD_ISA_AMX;
    if (env != NULL && env[0] != '\0') {
        int found = isa_lookup(env);
        if (found < 0) {
            pd_log_warn("PD_CPU_ISA=%s is not one of portable|avx2|avx512|avx512_bf16|amx: no cap", env);
        } else {
            v = found;
            pd_log_info("CPU kernels capped at %s (PD_CPU_ISA)", NAMES[v]);
        }
    }
    int expected = -1;
    if (!__atomic_compare_exchange_n(&g_cap, &expected, v, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        v = expected; /* set meanwhile (pd_cpu_isa_set_cap on another thread) */
    }
    return (pd_cpu_isa_t)v;
}

pd_status_t pd_cpu_isa_set_cap(const char *name)
{
    if (name == NULL || strcmp(name, "auto") == 0) {
        return PD_OK;
    }
    int want = isa_lookup(name);
    if (want < 0) {
        pd_log_error("--cpu-isa %s: not one of auto|portable|avx2|avx512|avx512_bf16|amx", name);
        return PD_ERR_INVALID_ARG;
    }
    int expected = -1;
    if (__atomic_compare_exchange_n(&g_cap, &expected, want, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        pd_log_info("CPU kernels capped at %s (--cpu-isa)", NAMES[want]);
        return PD_OK;
    }
    if (expected == want) {
        return PD_OK;
    }
    pd_log_error("--cpu-isa %s: the CPU kernels already run capped at %s (the cap is set before the first "
                 "kernel runs)",
                 name, NAMES[expected]);
    return PD_ERR_INVALID_ARG;
}
