/* tests/unit/test_impl_nvcc.cu — the shared index math (kernels/paged_impl.h, dtype_impl.h)
 * compiled by nvcc: the same inputs and expected values as test_kernels.c's test_index_math,
 * checked on the host side of an nvcc build, and on the device when one exists (skipped, and
 * said so, without one). Built only when CUDA is enabled. */
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>

extern "C" {
#include "kernels/dtype_impl.h"
#include "kernels/paged_impl.h"
}

#define NCHECKS 17

/* Fills out[NCHECKS] with index-math results; runs on host and device alike. */
PD_HD static void index_checks(long long *out, const int32_t *table)
{
    out[0] = pd_page_elems(16, 2, 8);
    out[1] = pd_slot_block(37, 16);
    out[2] = pd_slot_offset_in_block(37, 16);
    out[3] = pd_slot_kv_index(37, 1, 1, 16, 2, 8);
    out[4] = pd_kv_index(3, 0, 0, 0, 16, 2, 8);
    out[5] = pd_gqa_kv_head(3, 8, 2);
    out[6] = pd_gqa_kv_head(4, 8, 2);
    out[7] = pd_block_table_lookup(table, 4, 0, 33, 16);
    out[8] = pd_block_table_slot(table, 4, 1, 17, 16);
    out[9] = pd_blocks_for_tokens(17, 16);
    out[10] = pd_query_pos(10, 3, 0);
    out[11] = pd_attn_first_key(10, 4);
    out[12] = pd_attn_first_key(2, 4);
    out[13] = pd_f32_to_bf16(1.0f);
    out[14] = pd_f32_to_f16(65520.0f);
    out[15] = pd_f32_to_f16(-2.0f);
    out[16] = (long long)(pd_f16_to_f32(0x3c00) * 1000.0f); /* 1.0 */
}

__global__ void index_kernel(long long *out, const int32_t *table)
{
    index_checks(out, table);
}

int main()
{
    const long long want[NCHECKS] = {512,        2,      5,      ((2 * 2 + 1) * 16 + 5) * 2 * 8 + 1 * 8,
                                     3 * 512,    0,      1,      9,
                                     5 * 16 + 1, 2,      7,      7,
                                     0,          0x3f80, 0x7c00, 0xc000,
                                     1000};
    const int32_t table[8] = {7, 3, 9, 1, 2, 5, 0, 0};
    long long host[NCHECKS];
    index_checks(host, table);
    int failed = 0;
    for (int i = 0; i < NCHECKS; i++) {
        if (host[i] != want[i]) {
            printf("host check %d: got %lld, want %lld\n", i, host[i], want[i]);
            failed++;
        }
    }
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        printf("device checks skipped: no CUDA device\n");
    } else {
        long long *d_out = nullptr;
        int32_t *d_table = nullptr;
        long long dev[NCHECKS];
        if (cudaMalloc(&d_out, sizeof(dev)) != cudaSuccess ||
            cudaMalloc(&d_table, sizeof(table)) != cudaSuccess ||
            cudaMemcpy(d_table, table, sizeof(table), cudaMemcpyHostToDevice) != cudaSuccess) {
            printf("device setup failed\n");
            return 1;
        }
        index_kernel<<<1, 1>>>(d_out, d_table);
        if (cudaGetLastError() != cudaSuccess ||
            cudaMemcpy(dev, d_out, sizeof(dev), cudaMemcpyDeviceToHost) != cudaSuccess) {
            printf("device kernel failed\n");
            return 1;
        }
        for (int i = 0; i < NCHECKS; i++) {
            if (dev[i] != want[i]) {
                printf("device check %d: got %lld, want %lld\n", i, dev[i], want[i]);
                failed++;
            }
        }
        cudaFree(d_out);
        cudaFree(d_table);
    }
    printf("%d passed, %d failed\n", NCHECKS - failed, failed);
    return failed == 0 ? 0 : 1;
}
