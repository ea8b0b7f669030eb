/*
 * The stand-in's kernels (see standin_kernels.h): C functions with the names and argument
 * lists of the CUDA kernels, run on the host by the stand-in's cuLaunchKernel.
 *
 * The data plane's kernels (xccl/src/moe/dataplane/kernels.cu) are written again here as
 * serial loops over the same descriptors; the per-element arithmetic is not written again but
 * included from dataplane_abi.h, the header kernels.cu includes, so a twin differs from its
 * kernel only in the order its threads would visit elements, which changes no result (each
 * element is computed alone, and a row's amax is an exact integer max). Built with
 * -ffp-contract=off: no product is fused into an add, as on the device with --fmad=false.
 *
 * xccl_test_fill_u32(unsigned *p, unsigned n, unsigned v): p[i] = v for i < n; used by the
 * tests of the CUDA layer (xccl/src/cuda) to check that launches reach the table.
 */
#include <stddef.h>
#include <string.h>

#include "dataplane_abi.h"
#include "standin_kernels.h"

#define ARG(type, i) (*(type *)params[i])

static void xccl_test_fill_u32(void **params, unsigned grid[3], unsigned block[3]) {
  (void)grid;
  (void)block;
  unsigned *p = ARG(unsigned *, 0);
  unsigned n = ARG(unsigned, 1);
  unsigned v = ARG(unsigned, 2);
  for (unsigned i = 0; i < n; i++) p[i] = v;
}

/* xccl_copy_runs(const struct xccl_copy_run *runs, unsigned n) */
static void xccl_copy_runs(void **params, unsigned grid[3], unsigned block[3]) {
  (void)grid;
  (void)block;
  const struct xccl_copy_run *runs = ARG(const struct xccl_copy_run *, 0);
  unsigned n = ARG(unsigned, 1);
  for (unsigned r = 0; r < n; r++)
    memcpy((void *)(size_t)runs[r].dst, (const void *)(size_t)runs[r].src, (size_t)runs[r].len);
}

/* xccl_sum_rows(rows, terms, n, dtype, hidden) */
static void xccl_sum_rows(void **params, unsigned grid[3], unsigned block[3]) {
  (void)grid;
  (void)block;
  const struct xccl_sum_row *rows = ARG(const struct xccl_sum_row *, 0);
  const struct xccl_sum_term *terms = ARG(const struct xccl_sum_term *, 1);
  unsigned n = ARG(unsigned, 2), dtype = ARG(unsigned, 3), hidden = ARG(unsigned, 4);
  for (unsigned r = 0; r < n; r++)
    for (unsigned i = 0; i < hidden; i++) xccl_sum_elem(dtype, hidden, &rows[r], terms, i);
}

/* xccl_quantize(rows, n, dtype, hidden, unsigned long long *bad) */
static void xccl_quantize(void **params, unsigned grid[3], unsigned block[3]) {
  (void)grid;
  (void)block;
  const struct xccl_quant_row *rows = ARG(const struct xccl_quant_row *, 0);
  unsigned n = ARG(unsigned, 1), dtype = ARG(unsigned, 2), hidden = ARG(unsigned, 3);
  unsigned long long *bad = ARG(unsigned long long *, 4);
  for (unsigned r = 0; r < n; r++) {
    xccl_u64 src = rows[r].src, dst = rows[r].dst;
    xccl_u32 amax_bits = 0, padded = xccl_scale_offset(hidden);
    signed char *q = (signed char *)(size_t)dst;
    for (unsigned i = 0; i < hidden; i++) {
      xccl_u32 a = xccl_abs_bits(dtype, src, i);
      if (a > amax_bits) amax_bits = a;
    }
    if (amax_bits >= 0x7f800000u) {
      unsigned first = 0;
      while (xccl_abs_bits(dtype, src, first) < 0x7f800000u) first++;
      unsigned long long code = ((unsigned long long)r << 32) | first;
      if (code < *bad) *bad = code;
      continue;
    }
    float amax = xccl_f32_from_bits(amax_bits);
    if (amax_bits == 0) {
      memset(q, 0, padded);
      *(float *)(size_t)(dst + padded) = 0.0f;
      continue;
    }
    float inv = XCCL_DIV(127.0f, amax);
    for (unsigned i = 0; i < hidden; i++) q[i] = xccl_quant_elem(xccl_load(dtype, src, i), inv);
    for (unsigned i = hidden; i < padded; i++) q[i] = 0;
    *(float *)(size_t)(dst + padded) = XCCL_DIV(amax, 127.0f);
  }
}

/* xccl_dequantize(rows, n, dtype, hidden) */
static void xccl_dequantize(void **params, unsigned grid[3], unsigned block[3]) {
  (void)grid;
  (void)block;
  const struct xccl_quant_row *rows = ARG(const struct xccl_quant_row *, 0);
  unsigned n = ARG(unsigned, 1), dtype = ARG(unsigned, 2), hidden = ARG(unsigned, 3);
  for (unsigned r = 0; r < n; r++) {
    float scale = xccl_int8_scale(rows[r].src, hidden);
    for (unsigned i = 0; i < hidden; i++)
      xccl_store(dtype, rows[r].dst, i, xccl_dequant(rows[r].src, i, scale));
  }
}

const struct xccl_standin_kernel xccl_standin_kernels[] = {
    {"xccl_test_fill_u32", xccl_test_fill_u32},
    {"xccl_copy_runs", xccl_copy_runs},
    {"xccl_sum_rows", xccl_sum_rows},
    {"xccl_quantize", xccl_quantize},
    {"xccl_dequantize", xccl_dequantize},
    {NULL, NULL},
};
