// xccl's data-plane kernels: the row copies, sums and INT8 conversions of the protocol's plan,
// on the device. Compiled at run time by NVRTC (xccl/src/dataplane/nvrtc.rs) with
// --fmad=false for the device's architecture; the per-element arithmetic is in
// dataplane_abi.h, shared with the C twins of the stand-in driver, so each kernel's result is
// the host path's bit for bit. Each kernel is one launch over a list of descriptors (uploaded
// by the host), one block (or a grid-stride of blocks) per descriptor.
#include "dataplane_abi.h"

#define XCCL_BLOCK 256

// Copies every run: block b takes runs b, b + gridDim.x, ...; 16-byte words where the run's
// addresses and length allow, else bytes.
extern "C" __global__ void xccl_copy_runs(const struct xccl_copy_run *runs, unsigned int n) {
  for (unsigned int r = blockIdx.x; r < n; r += gridDim.x) {
    xccl_u64 src = runs[r].src, dst = runs[r].dst, len = runs[r].len;
    if (((src | dst | len) & 15ull) == 0) {
      const uint4 *s = (const uint4 *)src;
      uint4 *d = (uint4 *)dst;
      for (xccl_u64 i = threadIdx.x; i < len / 16; i += blockDim.x) d[i] = s[i];
    } else if (((src | dst | len) & 3ull) == 0) {
      // Rows whose length is a multiple of 4 only (INT8 payloads: hidden bytes and a scale).
      const xccl_u32 *s = (const xccl_u32 *)src;
      xccl_u32 *d = (xccl_u32 *)dst;
      for (xccl_u64 i = threadIdx.x; i < len / 4; i += blockDim.x) d[i] = s[i];
    } else {
      const xccl_u8 *s = (const xccl_u8 *)src;
      xccl_u8 *d = (xccl_u8 *)dst;
      for (xccl_u64 i = threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
    }
  }
}

// Writes every sum row: block b takes rows b, b + gridDim.x, ...; its threads the elements.
extern "C" __global__ void xccl_sum_rows(const struct xccl_sum_row *rows,
                                         const struct xccl_sum_term *terms, unsigned int n,
                                         unsigned int dtype, unsigned int hidden) {
  for (unsigned int r = blockIdx.x; r < n; r += gridDim.x)
    for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x)
      xccl_sum_elem(dtype, hidden, &rows[r], terms, i);
}

// Quantizes every row (one block a row, XCCL_BLOCK threads): amax by an exact integer max of
// the sign-cleared bits; a row with a non-finite element writes nothing and lowers `*bad` to
// (row << 32 | its first non-finite element), which the host reads before anything is sent.
extern "C" __global__ void xccl_quantize(const struct xccl_quant_row *rows, unsigned int n,
                                         unsigned int dtype, unsigned int hidden,
                                         unsigned long long *bad) {
  __shared__ xccl_u32 part[XCCL_BLOCK];
  for (unsigned int r = blockIdx.x; r < n; r += gridDim.x) {
    xccl_u64 src = rows[r].src, dst = rows[r].dst;
    xccl_u32 m = 0;
    for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x) {
      xccl_u32 a = xccl_abs_bits(dtype, src, i);
      m = a > m ? a : m;
    }
    part[threadIdx.x] = m;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s /= 2) {
      if (threadIdx.x < s && part[threadIdx.x + s] > part[threadIdx.x])
        part[threadIdx.x] = part[threadIdx.x + s];
      __syncthreads();
    }
    xccl_u32 amax_bits = part[0];
    __syncthreads();
    if (amax_bits >= 0x7f800000u) {
      xccl_u32 first = 0xffffffffu;
      for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x)
        if (xccl_abs_bits(dtype, src, i) >= 0x7f800000u && i < first) first = i;
      part[threadIdx.x] = first;
      __syncthreads();
      for (unsigned int s = blockDim.x / 2; s > 0; s /= 2) {
        if (threadIdx.x < s && part[threadIdx.x + s] < part[threadIdx.x])
          part[threadIdx.x] = part[threadIdx.x + s];
        __syncthreads();
      }
      if (threadIdx.x == 0) atomicMin(bad, ((unsigned long long)r << 32) | part[0]);
      __syncthreads();
      continue;
    }
    float amax = xccl_f32_from_bits(amax_bits);
    signed char *q = (signed char *)dst;
    xccl_u32 padded = xccl_scale_offset(hidden);
    if (amax_bits == 0) {
      for (unsigned int i = threadIdx.x; i < padded; i += blockDim.x) q[i] = 0;
      if (threadIdx.x == 0) *(float *)(dst + padded) = 0.0f;
    } else {
      float inv = XCCL_DIV(127.0f, amax);
      for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x)
        q[i] = xccl_quant_elem(xccl_load(dtype, src, i), inv);
      for (unsigned int i = hidden + threadIdx.x; i < padded; i += blockDim.x) q[i] = 0;
      if (threadIdx.x == 0) *(float *)(dst + padded) = XCCL_DIV(amax, 127.0f);
    }
  }
}

// Dequantizes every row into the dtype (one rounding): src an INT8 payload, dst a dtype row.
extern "C" __global__ void xccl_dequantize(const struct xccl_quant_row *rows, unsigned int n,
                                           unsigned int dtype, unsigned int hidden) {
  for (unsigned int r = blockIdx.x; r < n; r += gridDim.x) {
    float scale = xccl_int8_scale(rows[r].src, hidden);
    for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x)
      xccl_store(dtype, rows[r].dst, i, xccl_dequant(rows[r].src, i, scale));
  }
}
