/*
 * The stand-in's kernels (see standin_kernels.h): C functions with the names and argument
 * lists of the CUDA kernels, run on the host by the stand-in's cuLaunchKernel.
 *
 * xccl_test_fill_u32(unsigned *p, unsigned n, unsigned v): p[i] = v for i < n; used by the
 * tests of the CUDA layer (xccl/src/cuda) to check that launches reach the table.
 */
#include <stddef.h>

#include "standin_kernels.h"

static void xccl_test_fill_u32(void **params, unsigned grid[3], unsigned block[3]) {
    (void)grid;
    (void)block;
    unsigned *p = *(unsigned **)params[0];
    unsigned n = *(unsigned *)params[1];
    unsigned v = *(unsigned *)params[2];
    for (unsigned i = 0; i < n; i++) p[i] = v;
}

const struct xccl_standin_kernel xccl_standin_kernels[] = {
    {"xccl_test_fill_u32", xccl_test_fill_u32},
    {NULL, NULL},
};
