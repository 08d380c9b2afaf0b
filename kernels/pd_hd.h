/* kernels/pd_hd.h — PD_HD marks index math shared by the CPU and CUDA backends. */
#ifndef PD_KERNELS_PD_HD_H
#define PD_KERNELS_PD_HD_H

#ifdef __CUDACC__
#define PD_HD __host__ __device__
#else
#define PD_HD
#endif

#endif
