//! Element types of hidden states on the wire, and their conversions to and from `f32`.
//!
//! Accumulation is always in `f32`; the wire carries the caller's dtype.

use half::{bf16, f16};

use crate::{Error, Result};

/// The element type of hidden-state rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DType {
    /// IEEE binary32.
    F32 = 0,
    /// IEEE binary16.
    F16 = 1,
    /// bfloat16.
    BF16 = 2,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Lower-case name (`"f32"`, `"f16"`, `"bf16"`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// Parses a name as printed by [`DType::name`].
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Ok(DType::F32),
            "f16" | "float16" | "fp16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            other => Err(Error::invalid(format!(
                "unknown dtype {other:?} (expected f32, f16 or bf16)"
            ))),
        }
    }

    /// Converts a row of this dtype (as bytes) to `f32`, overwriting `out`.
    pub fn to_f32(self, src: &[u8], out: &mut [f32]) {
        debug_assert_eq!(src.len(), out.len() * self.size());
        match self {
            DType::F32 => bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(src),
            DType::F16 => {
                for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            DType::BF16 => match bytemuck::try_cast_slice::<u8, u16>(src) {
                Ok(s) => kernels::bf16_to_f32(s, out),
                Err(_) => {
                    for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                        *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
            },
        }
    }

    /// Adds `scale * row` (a row of this dtype, as bytes) into `acc`.
    pub fn accumulate(self, src: &[u8], scale: f32, acc: &mut [f32]) {
        debug_assert_eq!(src.len(), acc.len() * self.size());
        match self {
            DType::F32 => match bytemuck::try_cast_slice::<u8, f32>(src) {
                Ok(s) => kernels::f32_acc(s, scale, acc),
                Err(_) => {
                    for (a, c) in acc.iter_mut().zip(src.chunks_exact(4)) {
                        *a += scale * f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                }
            },
            DType::F16 => {
                for (a, c) in acc.iter_mut().zip(src.chunks_exact(2)) {
                    *a += scale * f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            // bf16 -> f32 is a shift: exact, and the loop vectorises.
            DType::BF16 => match bytemuck::try_cast_slice::<u8, u16>(src) {
                Ok(s) => kernels::bf16_acc(s, scale, acc),
                Err(_) => {
                    for (a, c) in acc.iter_mut().zip(src.chunks_exact(2)) {
                        *a +=
                            scale * f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
                    }
                }
            },
        }
    }

    /// Converts `src` to this dtype, writing bytes into `out` (round to nearest even).
    pub fn from_f32(self, src: &[f32], out: &mut [u8]) {
        debug_assert_eq!(out.len(), src.len() * self.size());
        match self {
            DType::F32 => out.copy_from_slice(bytemuck::cast_slice(src)),
            DType::F16 => {
                for (o, &v) in out.chunks_exact_mut(2).zip(src) {
                    o.copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
            DType::BF16 => match bytemuck::try_cast_slice_mut::<u8, u16>(out) {
                Ok(o) => kernels::f32_to_bf16(src, o),
                Err(_) => {
                    for (o, &v) in out.chunks_exact_mut(2).zip(src) {
                        o.copy_from_slice(&bf16_bits(v).to_le_bytes());
                    }
                }
            },
        }
    }
}

impl DType {
    /// Writes `a + b` (two rows of this dtype, as bytes), summed in `f32` and rounded once,
    /// into `out`: the same bits as [`DType::to_f32`] of `a`, [`DType::accumulate`] of `b`
    /// with scale 1 and [`DType::from_f32`] into `out`, which it does through `acc` (a row of
    /// scratch) unless the rows are aligned bf16, where one pass reads both and writes `out`.
    pub fn add_rows(self, a: &[u8], b: &[u8], acc: &mut [f32], out: &mut [u8]) {
        if self == DType::BF16 {
            if let (Ok(a), Ok(b), Ok(o)) = (
                bytemuck::try_cast_slice::<u8, u16>(a),
                bytemuck::try_cast_slice::<u8, u16>(b),
                bytemuck::try_cast_slice_mut::<u8, u16>(out),
            ) {
                debug_assert!(a.len() == o.len() && b.len() == o.len());
                return kernels::bf16_add2(a, b, o);
            }
        }
        self.to_f32(a, acc);
        self.accumulate(b, 1.0, acc);
        self.from_f32(acc, out);
    }

    /// Writes the sum of `rows` (at least one, each a row of this dtype as bytes), in `f32` in
    /// their order and rounded once, into `out`: the bits of [`DType::to_f32`] of the first,
    /// [`DType::accumulate`] of each other with scale 1 and [`DType::from_f32`]. Aligned bf16
    /// rows (at most [`MAX_FUSED_ROWS`]) are summed a block of elements at a time, each block's
    /// sum kept in registers and the cache, so every row is read once and `out` written once;
    /// other rows go through `acc` (a row of scratch).
    pub fn sum_rows(self, rows: &[&[u8]], acc: &mut [f32], out: &mut [u8]) {
        match rows {
            [] => out.fill(0),
            [a, b] => self.add_rows(a, b, acc, out),
            _ => {
                if self == DType::BF16 && rows.len() <= MAX_FUSED_ROWS {
                    let mut wide: [&[u16]; MAX_FUSED_ROWS] = [&[]; MAX_FUSED_ROWS];
                    let aligned = rows.iter().zip(wide.iter_mut()).all(|(r, w)| {
                        bytemuck::try_cast_slice::<u8, u16>(r).is_ok_and(|r| {
                            *w = r;
                            true
                        })
                    });
                    if let (true, Ok(o)) = (aligned, bytemuck::try_cast_slice_mut::<u8, u16>(out)) {
                        return kernels::bf16_sum(&wide[..rows.len()], o);
                    }
                }
                self.to_f32(rows[0], acc);
                for r in &rows[1..] {
                    self.accumulate(r, 1.0, acc);
                }
                self.from_f32(acc, out);
            }
        }
    }
}

/// Most rows [`DType::sum_rows`] sums in one pass (more go through the scratch row).
pub const MAX_FUSED_ROWS: usize = 16;

/// The conversion and accumulation loops on aligned slices, each compiled twice: for the
/// baseline target and with AVX2 (chosen at run time). No fused multiply-add, so both give the
/// same bits.
mod kernels {
    use super::bf16_bits;

    macro_rules! multiversion {
        ($(#[$m:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $body:block) => {
            $(#[$m])*
            pub(super) fn $name($($arg: $ty),*) {
                #[inline(always)]
                fn generic($($arg: $ty),*) $body
                #[cfg(target_arch = "x86_64")]
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) {
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
        /// `out[i] = bf16 src[i]` widened (a shift: exact).
        fn bf16_to_f32(src: &[u16], out: &mut [f32]) {
            out.iter_mut()
                .zip(src)
                .for_each(|(o, &v)| *o = f32::from_bits((v as u32) << 16));
        }
    }

    multiversion! {
        /// `acc[i] += scale * bf16 src[i]`.
        fn bf16_acc(src: &[u16], scale: f32, acc: &mut [f32]) {
            acc.iter_mut()
                .zip(src)
                .for_each(|(a, &v)| *a += scale * f32::from_bits((v as u32) << 16));
        }
    }

    multiversion! {
        /// `out[i] = bf16(f32 a[i] + f32 b[i])`, round to nearest even: one pass.
        fn bf16_add2(a: &[u16], b: &[u16], out: &mut [u16]) {
            out.iter_mut().zip(a).zip(b).for_each(|((o, &x), &y)| {
                *o = bf16_bits(f32::from_bits((x as u32) << 16) + f32::from_bits((y as u32) << 16))
            });
        }
    }

    multiversion! {
        /// `out[i] = bf16(sum of f32 rows[k][i] in order)`, round to nearest even, a block of
        /// elements at a time.
        fn bf16_sum(rows: &[&[u16]], out: &mut [u16]) {
            const BLOCK: usize = 256;
            let mut acc = [0f32; BLOCK];
            for (b, o) in out.chunks_mut(BLOCK).enumerate() {
                let at = b * BLOCK;
                let acc = &mut acc[..o.len()];
                for (a, &v) in acc.iter_mut().zip(&rows[0][at..at + o.len()]) {
                    *a = f32::from_bits((v as u32) << 16);
                }
                for r in &rows[1..] {
                    for (a, &v) in acc.iter_mut().zip(&r[at..at + o.len()]) {
                        *a += f32::from_bits((v as u32) << 16);
                    }
                }
                for (o, &a) in o.iter_mut().zip(acc.iter()) {
                    *o = bf16_bits(a);
                }
            }
        }
    }

    multiversion! {
        /// `acc[i] += scale * src[i]`.
        fn f32_acc(src: &[f32], scale: f32, acc: &mut [f32]) {
            acc.iter_mut().zip(src).for_each(|(a, &v)| *a += scale * v);
        }
    }

    multiversion! {
        /// `out[i] = bf16(src[i])`, round to nearest even.
        fn f32_to_bf16(src: &[f32], out: &mut [u16]) {
            out.iter_mut().zip(src).for_each(|(o, &v)| *o = bf16_bits(v));
        }
    }
}

/// `f32` -> bf16 bits, round to nearest even, NaN kept quiet; the same bits as
/// `half::bf16::from_f32`, written branch-free so conversion loops vectorise.
#[inline(always)]
fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) | 0x0040) as u16;
    if v.is_nan() {
        nan
    } else {
        rounded
    }
}

mod sealed {
    /// Keeps [`super::Element`] to the types xccl knows how to move.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A Rust element type that xccl moves: `f32`, `half::f16`, `half::bf16` (sealed: the wire
/// format knows exactly these).
pub trait Element: bytemuck::Pod + Send + Sync + sealed::Sealed {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Widens to `f32`.
    fn to_f32(self) -> f32;
    /// Narrows from `f32` (round to nearest even).
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Converts a whole slice of `T` to `f32` (helper for callers and tests).
pub fn slice_to_f32<T: Element>(src: &[T]) -> Vec<f32> {
    src.iter().map(|v| v.to_f32()).collect()
}

/// Converts a whole `f32` slice to `T` (helper for callers and tests).
pub fn slice_from_f32<T: Element>(src: &[f32]) -> Vec<T> {
    src.iter().map(|&v| T::from_f32(v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_through_bytes_matches_half() {
        let vals = [0.0f32, 1.0, -2.5, 3.140625, 1e-3, 65504.0];
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let mut bytes = vec![0u8; vals.len() * dt.size()];
            dt.from_f32(&vals, &mut bytes);
            let mut back = vec![0f32; vals.len()];
            dt.to_f32(&bytes, &mut back);
            let mut acc = vec![1.0f32; vals.len()];
            dt.accumulate(&bytes, 2.0, &mut acc);
            for i in 0..vals.len() {
                let want = match dt {
                    DType::F32 => vals[i],
                    DType::F16 => f16::from_f32(vals[i]).to_f32(),
                    DType::BF16 => bf16::from_f32(vals[i]).to_f32(),
                };
                assert_eq!(back[i], want, "{dt:?} {}", vals[i]);
                assert_eq!(acc[i], 1.0 + 2.0 * want);
            }
        }
    }

    #[test]
    fn bf16_conversion_matches_half_bit_for_bit() {
        let mut x = 0x9e37_79b9u32;
        let mut vals = vec![
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            -0.0,
            1e-40,
        ];
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            vals.push(f32::from_bits(x));
        }
        for v in vals {
            assert_eq!(
                bf16_bits(v),
                bf16::from_f32(v).to_bits(),
                "{v:e} ({:#x})",
                v.to_bits()
            );
        }
    }

    /// A xorshift32 stream from `seed` (not 0): test bytes and bit patterns.
    fn xorshift(mut x: u32) -> impl FnMut() -> u32 {
        move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        }
    }

    /// Sums of 1 to 18 rows (past the one-pass limit; two through `add_rows` too) give the bits
    /// of widen, accumulate in order, round once, in every dtype, aligned or not, specials
    /// included.
    #[test]
    fn summing_rows_gives_the_bits_of_widen_accumulate_round() {
        let mut next = xorshift(0x9e37_79b9);
        let n = 700;
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let w = dt.size();
            for count in 1..=MAX_FUSED_ROWS + 2 {
                let mut store: Vec<Vec<u8>> = (0..count)
                    .map(|_| (0..n * w + 1).map(|_| next() as u8).collect())
                    .collect();
                // Specials in the first and the last row, one element apart: infinities of
                // both signs (NaN where they meet), NaN, the largest finite value (its sum
                // overflows).
                let specials = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX];
                let mut sp = vec![0u8; specials.len() * w];
                dt.from_f32(&specials, &mut sp);
                store[0][..sp.len()].copy_from_slice(&sp);
                let last = count - 1;
                store[last][w..w + sp.len()].copy_from_slice(&sp);
                for off in [0, 1] {
                    let rows: Vec<&[u8]> = store.iter().map(|r| &r[off..off + n * w]).collect();
                    let mut acc = vec![0f32; n];
                    let mut want = vec![0u8; n * w];
                    dt.to_f32(rows[0], &mut acc);
                    for r in &rows[1..] {
                        dt.accumulate(r, 1.0, &mut acc);
                    }
                    dt.from_f32(&acc, &mut want);
                    let mut got = vec![0u8; n * w + 1];
                    let mut scratch = vec![0f32; n];
                    dt.sum_rows(&rows, &mut scratch, &mut got[off..off + n * w]);
                    assert_eq!(&got[off..off + n * w], want, "{dt:?}, {count} rows, +{off}");
                    if let [a, b] = rows[..] {
                        dt.add_rows(a, b, &mut scratch, &mut got[off..off + n * w]);
                        assert_eq!(&got[off..off + n * w], want, "{dt:?}, add_rows, +{off}");
                    }
                }
            }
        }
    }

    #[test]
    fn dtype_names_parse_back() {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            assert_eq!(DType::parse(dt.name()).unwrap(), dt);
        }
        assert!(DType::parse("int4").is_err());
    }
}
