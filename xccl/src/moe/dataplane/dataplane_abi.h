/*
 * The data plane's ABI and per-element arithmetic, shared by the CUDA kernels (kernels.cu,
 * compiled at run time by NVRTC) and their C twins in the stand-in driver
 * (tests/cuda_standin/kernels.c, compiled by gcc with -ffp-contract=off).
 *
 * The structs mirror `#[repr(C)]` types of xccl/src/dataplane/mod.rs field for field (a Rust
 * test checks their sizes and offsets). The element functions are the host path's arithmetic,
 * bit for bit (xccl/src/moe/dtype.rs and quant.rs): every product and sum is one IEEE binary32
 * operation rounded to nearest even and never fused into an FMA (XCCL_MUL / XCCL_ADD are
 * __fmul_rn / __fadd_rn on the device, plain operators under -ffp-contract=off on the host).
 */
#ifndef XCCL_DATAPLANE_ABI_H
#define XCCL_DATAPLANE_ABI_H

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define XCCL_FN static __device__ __forceinline__
#define XCCL_MUL(a, b) __fmul_rn((a), (b))
#define XCCL_ADD(a, b) __fadd_rn((a), (b))
#define XCCL_DIV(a, b) __fdiv_rn((a), (b))
#else
#define XCCL_FN static inline
#define XCCL_MUL(a, b) ((a) * (b))
#define XCCL_ADD(a, b) ((a) + (b))
#define XCCL_DIV(a, b) ((a) / (b))
#endif

typedef unsigned char xccl_u8;
typedef unsigned short xccl_u16;
typedef unsigned int xccl_u32;
typedef unsigned long long xccl_u64;

/* Element types: the values of Rust's `DType` (repr u32). */
#define XCCL_F32 0u
#define XCCL_F16 1u
#define XCCL_BF16 2u

/* One copy: `len` bytes from `src` to `dst` (device addresses; the ranges do not overlap). */
struct xccl_copy_run {
  xccl_u64 src;
  xccl_u64 dst;
  xccl_u64 len;
};

/* One output row of a sum: terms [first_term, first_term + num_terms) of the term list.
 * init_first = 0: acc = 0, then acc += term for every term (the expert side's weighted sum).
 * init_first = 1: acc = first term's value, then acc += each later term (the attention side's
 * combine); one dtype term alone is copied as it is (its bits), none gives zeros. */
struct xccl_sum_row {
  xccl_u64 dst;
  xccl_u32 first_term;
  xccl_u32 num_terms;
  xccl_u32 init_first;
  xccl_u32 reserved;
};

/* One term: a row at `src`, either of the dtype (value `weight * x`) or an INT8 payload
 * (int8 = 1: value `f32(q) * scale`, weight unused). */
struct xccl_sum_term {
  xccl_u64 src;
  float weight;
  xccl_u32 int8;
};

/* One row to quantize (src: a dtype row, dst: an INT8 payload) or dequantize (the reverse). */
struct xccl_quant_row {
  xccl_u64 src;
  xccl_u64 dst;
};

/* The layouts the Rust side has (a negative array size fails the compile). */
typedef char xccl_abi_copy_run[sizeof(struct xccl_copy_run) == 24 ? 1 : -1];
typedef char xccl_abi_sum_row[sizeof(struct xccl_sum_row) == 24 ? 1 : -1];
typedef char xccl_abi_sum_term[sizeof(struct xccl_sum_term) == 16 ? 1 : -1];
typedef char xccl_abi_quant_row[sizeof(struct xccl_quant_row) == 16 ? 1 : -1];

XCCL_FN float xccl_f32_from_bits(xccl_u32 b) {
  union {
    xccl_u32 u;
    float f;
  } v;
  v.u = b;
  return v.f;
}

XCCL_FN xccl_u32 xccl_f32_bits(float f) {
  union {
    xccl_u32 u;
    float f;
  } v;
  v.f = f;
  return v.u;
}

/* bf16 bits -> f32: a shift, exact. */
XCCL_FN float xccl_bf16_to_f32(xccl_u16 v) { return xccl_f32_from_bits(((xccl_u32)v) << 16); }

/* f32 -> bf16 bits, round to nearest even, NaN kept quiet (dtype.rs `bf16_bits`). */
XCCL_FN xccl_u16 xccl_f32_to_bf16(float f) {
  xccl_u32 b = xccl_f32_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (xccl_u16)((b >> 16) | 0x0040u);
  return (xccl_u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* f16 bits -> f32, exact; NaN gets its quiet bit (the `half` crate's conversion). */
XCCL_FN float xccl_f16_to_f32(xccl_u16 h) {
  xccl_u32 sign = ((xccl_u32)(h & 0x8000u)) << 16;
  xccl_u32 exp = h & 0x7c00u;
  xccl_u32 man = h & 0x03ffu;
  if ((h & 0x7fffu) == 0) return xccl_f32_from_bits(((xccl_u32)h) << 16);
  if (exp == 0x7c00u) {
    if (man == 0) return xccl_f32_from_bits(sign | 0x7f800000u);
    return xccl_f32_from_bits(sign | 0x7fc00000u | (man << 13));
  }
  if (exp == 0) {
    /* Subnormal: normalise. */
    xccl_u32 e = 0;
    while ((man & 0x0400u) == 0) {
      man <<= 1;
      e++;
    }
    man &= 0x03ffu;
    return xccl_f32_from_bits(sign | ((113u - e) << 23) | (man << 13));
  }
  return xccl_f32_from_bits(sign | (((exp >> 10) + 112u) << 23) | (man << 13));
}

/* f32 -> f16 bits, round to nearest even (the `half` crate's conversion). */
XCCL_FN xccl_u16 xccl_f32_to_f16(float f) {
  xccl_u32 x = xccl_f32_bits(f);
  xccl_u32 sign = x & 0x80000000u;
  xccl_u32 exp = x & 0x7f800000u;
  xccl_u32 man = x & 0x007fffffu;
  xccl_u32 half_sign = sign >> 16;
  int half_exp;
  xccl_u32 half_man, round_bit;
  if (exp == 0x7f800000u) {
    xccl_u32 nan_bit = man == 0 ? 0u : 0x0200u;
    return (xccl_u16)(half_sign | 0x7c00u | nan_bit | (man >> 13));
  }
  half_exp = (int)(exp >> 23) - 127 + 15;
  if (half_exp >= 0x1f) return (xccl_u16)(half_sign | 0x7c00u);
  if (half_exp <= 0) {
    if (14 - half_exp > 24) return (xccl_u16)half_sign;
    man |= 0x00800000u;
    half_man = man >> (14 - half_exp);
    round_bit = 1u << (13 - half_exp);
    if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) half_man += 1;
    return (xccl_u16)(half_sign | half_man);
  }
  half_man = man >> 13;
  round_bit = 0x00001000u;
  if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0)
    return (xccl_u16)((half_sign | ((xccl_u32)half_exp << 10) | half_man) + 1u);
  return (xccl_u16)(half_sign | ((xccl_u32)half_exp << 10) | half_man);
}

/* Element `i` of a dtype row at `row`, widened to f32 (exact). */
XCCL_FN float xccl_load(xccl_u32 dtype, xccl_u64 row, xccl_u32 i) {
  if (dtype == XCCL_F32) return ((const float *)row)[i];
  if (dtype == XCCL_BF16) return xccl_bf16_to_f32(((const xccl_u16 *)row)[i]);
  return xccl_f16_to_f32(((const xccl_u16 *)row)[i]);
}

/* The f32 bits of element `i` with its sign cleared (for amax). */
XCCL_FN xccl_u32 xccl_abs_bits(xccl_u32 dtype, xccl_u64 row, xccl_u32 i) {
  return xccl_f32_bits(xccl_load(dtype, row, i)) & 0x7fffffffu;
}

/* Stores `v` rounded once to the dtype as element `i` of the row at `row`. */
XCCL_FN void xccl_store(xccl_u32 dtype, xccl_u64 row, xccl_u32 i, float v) {
  if (dtype == XCCL_F32)
    ((float *)row)[i] = v;
  else if (dtype == XCCL_BF16)
    ((xccl_u16 *)row)[i] = xccl_f32_to_bf16(v);
  else
    ((xccl_u16 *)row)[i] = xccl_f32_to_f16(v);
}

/* Copies element `i` of a dtype row unchanged (its bits). */
XCCL_FN void xccl_copy_elem(xccl_u32 dtype, xccl_u64 dst, xccl_u64 src, xccl_u32 i) {
  if (dtype == XCCL_F32)
    ((xccl_u32 *)dst)[i] = ((const xccl_u32 *)src)[i];
  else
    ((xccl_u16 *)dst)[i] = ((const xccl_u16 *)src)[i];
}

/* Offset of the f32 scale in an INT8 payload of `hidden` elements (quant.rs `scale_offset`). */
XCCL_FN xccl_u32 xccl_scale_offset(xccl_u32 hidden) { return (hidden + 3u) & ~3u; }

XCCL_FN float xccl_int8_scale(xccl_u64 payload, xccl_u32 hidden) {
  return *(const float *)(payload + xccl_scale_offset(hidden));
}

/* Dequantized element `i` of an INT8 payload: f32(q_i) * scale. */
XCCL_FN float xccl_dequant(xccl_u64 payload, xccl_u32 i, float scale) {
  return XCCL_MUL((float)((const signed char *)payload)[i], scale);
}

/* The value term `t` adds at element `i` (see xccl_sum_term). */
XCCL_FN float xccl_term(xccl_u32 dtype, xccl_u32 hidden, const struct xccl_sum_term *t,
                        xccl_u32 i) {
  if (t->int8) return xccl_dequant(t->src, i, xccl_int8_scale(t->src, hidden));
  return XCCL_MUL(t->weight, xccl_load(dtype, t->src, i));
}

/* The value that starts an init_first sum: the first term unweighted. */
XCCL_FN float xccl_first(xccl_u32 dtype, xccl_u32 hidden, const struct xccl_sum_term *t,
                         xccl_u32 i) {
  if (t->int8) return xccl_dequant(t->src, i, xccl_int8_scale(t->src, hidden));
  return xccl_load(dtype, t->src, i);
}

/* Element `i` of sum row `r` (terms `terms`), written to its destination. */
XCCL_FN void xccl_sum_elem(xccl_u32 dtype, xccl_u32 hidden, const struct xccl_sum_row *r,
                           const struct xccl_sum_term *terms, xccl_u32 i) {
  const struct xccl_sum_term *t = terms + r->first_term;
  xccl_u32 n = r->num_terms, k;
  float acc;
  if (n == 0) {
    xccl_store(dtype, r->dst, i, 0.0f);
    return;
  }
  if (r->init_first && n == 1 && !t[0].int8) {
    xccl_copy_elem(dtype, r->dst, t[0].src, i);
    return;
  }
  if (r->init_first) {
    acc = xccl_first(dtype, hidden, &t[0], i);
    k = 1;
  } else {
    acc = 0.0f;
    k = 0;
  }
  for (; k < n; k++) acc = XCCL_ADD(acc, xccl_term(dtype, hidden, &t[k], i));
  xccl_store(dtype, r->dst, i, acc);
}

/* 1.5 * 2^23 and its bits: adding it rounds a magnitude below 2^22 to an integer, ties to even
 * (quant.rs `ROUNDER`). */
#define XCCL_ROUNDER 12582912.0f
#define XCCL_ROUNDER_BITS 0x4B400000

/* q = clamp(round_ties_even(x * inv), -127, 127). */
XCCL_FN signed char xccl_quant_elem(float x, float inv) {
  int r = (int)xccl_f32_bits(XCCL_ADD(XCCL_MUL(x, inv), XCCL_ROUNDER)) - XCCL_ROUNDER_BITS;
  if (r < -127) r = -127;
  if (r > 127) r = 127;
  return (signed char)r;
}

#endif /* XCCL_DATAPLANE_ABI_H */
