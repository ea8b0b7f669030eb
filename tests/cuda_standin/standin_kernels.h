/*
 * The kernels of the CUDA stand-in (tests/cuda_standin/cuda_standin.c): each CUDA kernel xccl
 * launches is written again here as a C function of the same name, run on the host by
 * cuLaunchKernel with the launch's kernelParams (an array of pointers to the arguments, as the
 * driver takes them) and its grid and block sizes.
 *
 * The table is defined in kernels.c and ends with {0, 0}.
 */
#ifndef XCCL_STANDIN_KERNELS_H
#define XCCL_STANDIN_KERNELS_H

struct xccl_standin_kernel {
    /* The kernel's (extern "C") name, as cuModuleGetFunction is asked for it. */
    const char *name;
    /* Runs the whole grid: params[i] points at the i-th argument. */
    void (*run)(void **params, unsigned grid[3], unsigned block[3]);
};

extern const struct xccl_standin_kernel xccl_standin_kernels[];

#endif
