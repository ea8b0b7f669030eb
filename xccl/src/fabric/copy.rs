//! [`copy_bytes`] and [`copy_slice`]: the copies of rows into and out of windows.
//!
//! glibc's `memcpy` moves blocks of a few KiB and more with `rep movsb`, and on the AMD EPYC
//! development VM that runs 3-10x slower when the destination lies less than 32 bytes before or
//! after the source modulo 4 KiB (a cross-process one-row round trip of 14,336 bytes: 15-25 us
//! at distances 8 to 31 and 4072 to 4088 against 2.3-7.1 us at 0, 32 to 2048 and 4040 to 4064;
//! `benches/baselines/alias_copy.c`, figures in `docs/performance.md`). That is how a window
//! row and a row of a large allocation usually lie: window regions start on a page and
//! `H=7168` bf16 rows are 3.5 pages, while `malloc` (so a large `Vec` or torch tensor) starts
//! large blocks 16 bytes past a page. Every E2A reply row was such a copy. In that band a
//! vector loop copies instead, loading 256 bytes before storing them, so only one load in eight
//! can wait on an aliasing store; elsewhere `memcpy` is faster (it writes the destination
//! without reading it first) and is kept.

/// Copies shorter than this go to `memcpy` (which uses vector loops below its `rep movsb`
/// threshold, 2 KiB and more).
const MIN_LOOP_BYTES: usize = 2048;

/// Whether a copy from `src` to `dst` falls in `rep movsb`'s slow band: the destination less
/// than 32 bytes from the source modulo 4 KiB, but not at the same offset.
fn aliasing(dst: usize, src: usize) -> bool {
    let d = dst.wrapping_sub(src) % 4096;
    d != 0 && !(32..=4096 - 32).contains(&d)
}

/// Copies `len` bytes from `src` to `dst`, as [`std::ptr::copy_nonoverlapping`] does.
///
/// # Safety
/// The contract of [`std::ptr::copy_nonoverlapping`]: `src` valid for reads and `dst` for
/// writes of `len` bytes, the two ranges not overlapping.
pub(crate) unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= MIN_LOOP_BYTES
        && aliasing(dst as usize, src as usize)
        && std::arch::is_x86_feature_detected!("avx2")
    {
        // SAFETY: the CPU has AVX2 (checked just above); the ranges are the caller's.
        unsafe { copy_blocks_avx2(src, dst, len) };
        return;
    }
    // SAFETY: the caller's contract is `copy_nonoverlapping`'s.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Copies `src` into `dst` (of the same length) with [`copy_bytes`].
///
/// # Panics
/// If the lengths differ, as [`slice::copy_from_slice`] does.
pub(crate) fn copy_slice(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_slice of unequal lengths");
    // SAFETY: both slices are valid for their length, and a `&mut` cannot overlap a `&`.
    unsafe { copy_bytes(src.as_ptr(), dst.as_mut_ptr(), src.len()) }
}

/// The vector loop: 256 bytes loaded into eight registers, then stored; the tail by `memcpy`.
///
/// # Safety
/// As [`copy_bytes`], on a CPU with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_blocks_avx2(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
    const BLOCK: usize = 256;
    let blocks = len / BLOCK;
    for b in 0..blocks {
        // SAFETY: block `b` lies inside both ranges (`b < len / BLOCK`); unaligned loads and
        // stores accept any address.
        unsafe {
            let s = src.add(b * BLOCK) as *const __m256i;
            let d = dst.add(b * BLOCK) as *mut __m256i;
            let r = [
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
                _mm256_loadu_si256(s.add(4)),
                _mm256_loadu_si256(s.add(5)),
                _mm256_loadu_si256(s.add(6)),
                _mm256_loadu_si256(s.add(7)),
            ];
            for (k, v) in r.into_iter().enumerate() {
                _mm256_storeu_si256(d.add(k), v);
            }
        }
    }
    let done = blocks * BLOCK;
    // SAFETY: the tail `done..len` lies inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slow_band_is_a_distance_under_32_bytes_modulo_4k_but_not_zero() {
        for (dst, src, slow) in [
            (4096, 4112, true),      // 16 before (4080 modulo 4 KiB)
            (4112, 4096, true),      // 16 after
            (8192 + 31, 4096, true), // 31 after, a page on
            (8192 + 32, 4096, false),
            (4096 + 4064, 4096, false),
            (4096 + 4065, 4096, true),
            (4096, 8192, false), // the same offset in the page
            (4096 + 2048, 4096, false),
        ] {
            assert_eq!(aliasing(dst, src), slow, "dst {dst} src {src}");
        }
    }

    #[test]
    fn copies_give_the_source_bytes_at_every_length_and_distance() {
        // Source and destination in one buffer, so their distance modulo 4 KiB is the test's.
        let mut buf = vec![0u8; 65_536];
        let (src, rest) = buf.split_at_mut(24_560);
        for (i, b) in src.iter_mut().enumerate() {
            *b = (i * 7 + i / 251) as u8;
        }
        // Lengths around the loop's threshold and its block; distances in and out of the band.
        for len in [0, 1, 255, 2047, 2048, 2049, 2303, 14_336, 14_400, 20_000] {
            for (gap, slow) in [(0, true), (16, false), (32, true), (47, true), (48, false)] {
                // `rest` starts 24,560 = 4,080 (mod 4 KiB) after `src`: -16 in the band.
                let at = gap;
                let dst_start = rest.as_ptr() as usize + at;
                assert_eq!(
                    aliasing(dst_start, src.as_ptr() as usize),
                    slow,
                    "gap {gap}"
                );
                rest.fill(0xA5);
                copy_slice(&mut rest[at..at + len], &src[..len]);
                assert_eq!(&rest[at..at + len], &src[..len], "len {len} gap {gap}");
                assert!(rest[..at].iter().all(|&b| b == 0xA5), "before: len {len}");
                assert!(
                    rest[at + len..].iter().all(|&b| b == 0xA5),
                    "after: len {len}"
                );
            }
        }
    }
}
