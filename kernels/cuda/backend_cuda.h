/* kernels/cuda/backend_cuda.h — the CUDA backend's entry points (built with CUDA). The function
 * table itself is pd_cuda_backend_ops; pd_backend_create("cuda") calls pd_cuda_backend_init. */
#ifndef PD_KERNELS_CUDA_BACKEND_CUDA_H
#define PD_KERNELS_CUDA_BACKEND_CUDA_H

#include "kernels/backend.h"

extern const pd_backend_ops_t pd_cuda_backend_ops;

/* Number of CUDA devices (0 without a driver or device). */
int pd_cuda_device_count(void);

/* Binds be to CUDA device `device`: stream, cuBLAS handle, metadata scratch; sets be->ops.
 * PD_ERR_UNSUPPORTED without that device, PD_ERR_BACKEND when CUDA/cuBLAS init fails (logged). */
pd_status_t pd_cuda_backend_init(pd_backend_t *be, int device);

/* Releases what init created (not the memory the backend handed out). */
void pd_cuda_backend_fini(pd_backend_t *be);

#endif
