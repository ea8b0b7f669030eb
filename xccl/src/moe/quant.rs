//! INT8 per-token quantization on the wire: the quantizer, its inverse, and the row format.
//!
//! # The quantizer (exact specification)
//! For one token row `x` (elements of the wire dtype, widened to f32 exactly):
//! - `amax = max |x_i|` (f32). A row with a NaN or infinite element is rejected (an error
//!   naming the token, before anything is sent).
//! - `amax == 0`: `scale = 0`, every `q_i = 0`.
//! - otherwise `inv = 127.0f32 / amax`, `q_i = clamp(round_ties_even(x_i * inv), -127, 127)` as
//!   `i8`, and `scale = amax / 127.0f32` (each an f32 operation, rounded to nearest even).
//! - dequantized: `f32(q_i) * scale` (one f32 multiplication), then rounded once to the dtype
//!   where a dtype row is wanted.
//!
//! Since `|x_i * inv - q_i| <= 1/2`, the dequantized value is within `scale / 2` of `x_i` plus
//! the f32 roundings of `inv`, the product and `scale` (a few ulps of `amax`), which the property
//! test checks on random rows, rows with one huge outlier included.
//!
//! # The row format
//! An INT8 payload is `hidden` bytes of `q`, padded to 4, then the f32 `scale`: `hidden + 4`
//! bytes rounded up, against `2 * hidden` for bf16 (0.5x plus 4 bytes per token).

use super::dtype::DType;
use crate::{Error, Result};

/// Quantization of rows on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Quant {
    /// Rows travel in the communicator's dtype.
    #[default]
    None,
    /// Rows travel as INT8 with one f32 scale per token (see the module docs).
    Int8,
}

impl Quant {
    /// Parses `"none"` or `"int8"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "off" => Ok(Quant::None),
            "int8" => Ok(Quant::Int8),
            other => Err(Error::invalid(format!(
                "unknown quantization {other:?} (expected none or int8)"
            ))),
        }
    }

    /// `"none"` or `"int8"`.
    pub fn name(self) -> &'static str {
        match self {
            Quant::None => "none",
            Quant::Int8 => "int8",
        }
    }
}

/// Bytes of an INT8 payload of `hidden` elements: the `q` bytes, padded to 4, then the scale.
pub fn int8_payload(hidden: usize) -> usize {
    hidden.next_multiple_of(4) + 4
}

/// Offset of the scale within an INT8 payload.
pub fn scale_offset(hidden: usize) -> usize {
    hidden.next_multiple_of(4)
}

/// Reads the scale of an INT8 payload.
pub fn scale_of(payload: &[u8], hidden: usize) -> f32 {
    let at = scale_offset(hidden);
    f32::from_le_bytes(payload[at..at + 4].try_into().expect("4 bytes"))
}

/// Quantizes rows in one pass over them once their `amax` is known (bf16 and f32 rows straight
/// from their bytes; f16 rows through an f32 scratch row).
#[derive(Debug, Default)]
pub(crate) struct Quantizer {
    wide: Vec<f32>,
}

/// The f32 bits of `max |x_i|` of a row of `dtype` (NaN and infinity compare above every finite
/// value), reading the row once; `wide` is scratch for f16.
fn amax_bits(dtype: DType, src: &[u8], wide: &mut Vec<f32>) -> u32 {
    match dtype {
        DType::BF16 => match bytemuck::try_cast_slice::<u8, u16>(src) {
            Ok(v) => kernels::amax_bf16(v) << 16,
            Err(_) => amax_via_wide(dtype, src, wide),
        },
        DType::F32 => match bytemuck::try_cast_slice::<u8, f32>(src) {
            Ok(v) => kernels::amax_bits(v),
            Err(_) => amax_via_wide(dtype, src, wide),
        },
        DType::F16 => amax_via_wide(dtype, src, wide),
    }
}

fn amax_via_wide(dtype: DType, src: &[u8], wide: &mut Vec<f32>) -> u32 {
    wide.resize(src.len() / dtype.size(), 0.0);
    dtype.to_f32(src, wide);
    kernels::amax_bits(wide)
}

impl Quantizer {
    /// `max |x_i|` of row `src` (bytes of `dtype`), or the index of its first non-finite
    /// element. One pass over the row.
    pub(crate) fn amax(&mut self, dtype: DType, src: &[u8]) -> std::result::Result<f32, usize> {
        let bits = amax_bits(dtype, src, &mut self.wide);
        if bits >= 0x7f80_0000 {
            let n = src.len() / dtype.size();
            self.wide.resize(n, 0.0);
            dtype.to_f32(src, &mut self.wide);
            return Err(self.wide.iter().position(|v| !v.is_finite()).unwrap_or(0));
        }
        Ok(f32::from_bits(bits))
    }

    /// The scale of row `src`, or the index of its first non-finite element.
    #[cfg(test)]
    pub(crate) fn scale(&mut self, dtype: DType, src: &[u8]) -> std::result::Result<f32, usize> {
        self.amax(dtype, src).map(|a| a / 127.0)
    }

    /// Quantizes row `src` (bytes of `dtype`, all finite, with `amax` from
    /// [`Quantizer::amax`]) into `out` (an INT8 payload: [`int8_payload`] bytes) in one pass;
    /// returns the scale.
    pub(crate) fn quantize_amax(
        &mut self,
        dtype: DType,
        src: &[u8],
        amax: f32,
        out: &mut [u8],
    ) -> f32 {
        let n = src.len() / dtype.size();
        let (q, rest) = out.split_at_mut(scale_offset(n));
        let scale = if amax == 0.0 || !amax.is_finite() {
            q.fill(0);
            0.0
        } else {
            let inv = 127.0 / amax;
            let done = match dtype {
                DType::BF16 => bytemuck::try_cast_slice::<u8, u16>(src)
                    .map(|v| kernels::quantize_bf16(v, inv, &mut q[..n]))
                    .is_ok(),
                DType::F32 => bytemuck::try_cast_slice::<u8, f32>(src)
                    .map(|v| kernels::quantize(v, inv, &mut q[..n]))
                    .is_ok(),
                DType::F16 => false,
            };
            if !done {
                self.wide.resize(n, 0.0);
                dtype.to_f32(src, &mut self.wide);
                kernels::quantize(&self.wide, inv, &mut q[..n]);
            }
            q[n..].fill(0);
            amax / 127.0
        };
        rest[..4].copy_from_slice(&scale.to_le_bytes());
        scale
    }

    /// Quantizes row `src` (bytes of `dtype`, all finite) into `out`; returns the scale.
    #[cfg(test)]
    pub(crate) fn quantize(&mut self, dtype: DType, src: &[u8], out: &mut [u8]) -> f32 {
        let amax = f32::from_bits(amax_bits(dtype, src, &mut self.wide));
        self.quantize_amax(dtype, src, amax, out)
    }
}

/// Dequantizes an INT8 payload of `hidden` elements into `out` (f32, overwritten):
/// `out_i = f32(q_i) * scale`.
pub fn dequantize(payload: &[u8], hidden: usize, out: &mut [f32]) {
    let scale = scale_of(payload, hidden);
    kernels::dequantize(bytemuck::cast_slice(&payload[..hidden]), scale, out);
}

/// Adds an INT8 payload into `acc`: `acc_i = acc_i + f32(q_i) * scale`.
pub fn dequantize_add(payload: &[u8], hidden: usize, acc: &mut [f32]) {
    let scale = scale_of(payload, hidden);
    kernels::dequantize_add(bytemuck::cast_slice(&payload[..hidden]), scale, acc);
}

/// Dequantizes an INT8 payload into a row of `dtype` (one rounding): one pass for bf16, through
/// `wide` (scratch) otherwise.
pub fn dequantize_to(payload: &[u8], dtype: DType, wide: &mut Vec<f32>, out: &mut [u8]) {
    let hidden = out.len() / dtype.size();
    if dtype == DType::BF16 {
        if let Ok(o) = bytemuck::try_cast_slice_mut::<u8, u16>(out) {
            let scale = scale_of(payload, hidden);
            kernels::dequantize_bf16(bytemuck::cast_slice(&payload[..hidden]), scale, o);
            return;
        }
    }
    wide.resize(hidden, 0.0);
    dequantize(payload, hidden, wide);
    dtype.from_f32(wide, out);
}

/// The quantizing loops, compiled for the baseline target and with AVX2, chosen at run time
/// (the same bits either way: no fused multiply-add; `round_ties_even` is exact).
mod kernels {
    macro_rules! multiversion {
        ($(#[$m:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty $body:block) => {
            $(#[$m])*
            pub(super) fn $name($($arg: $ty),*) -> $ret {
                #[inline(always)]
                fn generic($($arg: $ty),*) -> $ret $body
                #[cfg(target_arch = "x86_64")]
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    generic($($arg),*)
                }
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
                generic($($arg),*)
            }
        };
    }

    multiversion! {
        /// The largest `|x_i|` as f32 bits (integer max of the sign-cleared bits: NaN and
        /// infinity compare above every finite value).
        fn amax_bits(x: &[f32]) -> u32 {
            x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff))
        }
    }

    /// 1.5 * 2^23: adding it to an f32 of magnitude below 2^22 rounds it to an integer, ties
    /// to even (the default rounding), leaving the integer in the low mantissa bits.
    const ROUNDER: f32 = 12_582_912.0;
    /// The bits of [`ROUNDER`].
    const ROUNDER_BITS: i32 = 0x4B40_0000;

    multiversion! {
        /// `q_i = clamp(round_ties_even(x_i * inv), -127, 127)`: the product is an f32
        /// operation, the rounding the add-and-subtract of [`ROUNDER`] (exact for these
        /// magnitudes: `|x_i * inv|` is at most about 127), the clamp an integer one, so the
        /// loop vectorises with no float-to-int conversion.
        fn quantize(x: &[f32], inv: f32, q: &mut [u8]) -> () {
            q.iter_mut().zip(x).for_each(|(o, &v)| {
                let r = ((v * inv + ROUNDER).to_bits() as i32).wrapping_sub(ROUNDER_BITS);
                *o = r.clamp(-127, 127) as i8 as u8;
            });
        }
    }

    multiversion! {
        /// The largest `|x_i|` of bf16 bits (the sign cleared; NaN and infinity above every
        /// finite value), as bf16 bits.
        fn amax_bf16(x: &[u16]) -> u32 {
            x.iter().fold(0u16, |m, &v| m.max(v & 0x7fff)) as u32
        }
    }

    multiversion! {
        /// [`quantize`] straight from bf16 bits (widening is a shift: exact).
        fn quantize_bf16(x: &[u16], inv: f32, q: &mut [u8]) -> () {
            q.iter_mut().zip(x).for_each(|(o, &b)| {
                let v = f32::from_bits((b as u32) << 16);
                let r = ((v * inv + ROUNDER).to_bits() as i32).wrapping_sub(ROUNDER_BITS);
                *o = r.clamp(-127, 127) as i8 as u8;
            });
        }
    }

    multiversion! {
        /// `out_i = bf16(f32(q_i) * scale)`, round to nearest even (never NaN: finite inputs).
        fn dequantize_bf16(q: &[i8], scale: f32, out: &mut [u16]) -> () {
            out.iter_mut().zip(q).for_each(|(o, &v)| {
                let b = (v as f32 * scale).to_bits();
                *o = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
            });
        }
    }

    multiversion! {
        /// `out_i = f32(q_i) * scale`.
        fn dequantize(q: &[i8], scale: f32, out: &mut [f32]) -> () {
            out.iter_mut().zip(q).for_each(|(o, &v)| *o = v as f32 * scale);
        }
    }

    multiversion! {
        /// `acc_i = acc_i + f32(q_i) * scale`.
        fn dequantize_add(q: &[i8], scale: f32, acc: &mut [f32]) -> () {
            acc.iter_mut().zip(q).for_each(|(a, &v)| *a += v as f32 * scale);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use proptest::prelude::*;

    fn round_trip(dtype: DType, x: &[f32]) -> (Vec<f32>, f32) {
        let mut src = vec![0u8; x.len() * dtype.size()];
        dtype.from_f32(x, &mut src);
        let mut exact = vec![0f32; x.len()];
        dtype.to_f32(&src, &mut exact);
        let mut q = Quantizer::default();
        let mut payload = vec![0u8; int8_payload(x.len())];
        let scale = q.quantize(dtype, &src, &mut payload);
        assert_eq!(q.scale(dtype, &src), Ok(scale));
        let mut back = vec![0f32; x.len()];
        dequantize(&payload, x.len(), &mut back);
        for (i, (&b, &e)) in back.iter().zip(&exact).enumerate() {
            // Within scale/2, plus a few ulps of amax for the f32 roundings.
            let amax = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
            let bound = scale / 2.0 + 4.0 * f32::EPSILON * amax;
            assert!((b - e).abs() <= bound, "[{i}] {e} -> {b}, bound {bound}");
        }
        (back, scale)
    }

    #[test]
    fn zero_rows_have_scale_zero_and_quantize_to_zero() {
        let (back, scale) = round_trip(DType::BF16, &[0.0; 37]);
        assert_eq!(scale, 0.0);
        assert!(back.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn the_quantizer_follows_its_specification() {
        let x = [1.0f32, -0.5, 0.25, 127.0, -127.0, 0.6];
        let mut src = vec![0u8; 24];
        DType::F32.from_f32(&x, &mut src);
        let mut payload = vec![0u8; int8_payload(6)];
        let scale = Quantizer::default().quantize(DType::F32, &src, &mut payload);
        assert_eq!(scale, 1.0);
        let q: Vec<i8> = payload[..6].iter().map(|&b| b as i8).collect();
        assert_eq!(q, vec![1, 0, 0, 127, -127, 1], "ties to even: -0.5 -> 0");
        assert_eq!(payload.len(), 12);
        assert_eq!(int8_payload(7168), 7172, "about 0.5x of bf16's 14336");
    }

    #[test]
    fn non_finite_rows_are_reported_with_the_index() {
        let mut q = Quantizer::default();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let x = [1.0, 2.0, bad, 3.0];
            let mut src = vec![0u8; 8];
            DType::BF16.from_f32(&x, &mut src);
            assert_eq!(q.scale(DType::BF16, &src), Err(2));
        }
    }

    #[test]
    fn dequantize_add_is_the_sum_of_the_dequantized_row() {
        let x: Vec<f32> = (0..50).map(|i| (i as f32 - 25.0) / 3.0).collect();
        let mut src = vec![0u8; 100];
        DType::BF16.from_f32(&x, &mut src);
        let mut payload = vec![0u8; int8_payload(50)];
        Quantizer::default().quantize(DType::BF16, &src, &mut payload);
        let mut d = vec![0f32; 50];
        dequantize(&payload, 50, &mut d);
        let mut acc = vec![1.5f32; 50];
        dequantize_add(&payload, 50, &mut acc);
        for i in 0..50 {
            assert_eq!(acc[i].to_bits(), (1.5 + d[i]).to_bits());
        }
        let mut row = vec![0u8; 100];
        dequantize_to(&payload, DType::BF16, &mut Vec::new(), &mut row);
        let got: &[bf16] = bytemuck::cast_slice(&row);
        for i in 0..50 {
            assert_eq!(got[i], bf16::from_f32(d[i]));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

        #[test]
        fn dequantized_rows_stay_within_half_a_scale(
            row in prop::collection::vec(-1000.0f32..1000.0, 1..300),
            outlier in prop::option::of((0usize..300, 1e3f32..1e30)),
            dtype in prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)],
        ) {
            let mut row = row;
            if let Some((at, big)) = outlier {
                let n = row.len();
                row[at % n] = if dtype == DType::F16 { big.min(6e4) } else { big };
            }
            round_trip(dtype, &row);
        }
    }
}
