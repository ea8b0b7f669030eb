//! The host backend of the data plane: rows in this process's memory, moved and summed with
//! the host path's own functions (the fabric's row copy, [`DType`]'s conversions, the
//! [`super::super::quant`] quantizer), so its results are the host path's bits by
//! construction. Every operation is complete when it returns.

use std::time::Instant;

use super::{check_host_runs, non_finite, CopyRun, DataPlane, Memory, QuantRow, SumRow, SumTerm};
use crate::moe::dtype::{DType, MAX_FUSED_ROWS};
use crate::moe::quant::{dequantize, dequantize_add, dequantize_to, int8_payload, Quantizer};
use crate::Result;

/// The data plane over host memory (scratch reused across calls).
#[derive(Debug, Default)]
pub struct HostPlane {
    acc: Vec<f32>,
    quant: Quantizer,
}

impl HostPlane {
    /// A host data plane.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The `len` bytes at host address `at`.
///
/// # Safety
/// `at` is valid for reads of `len` bytes, not written for the borrow's life.
unsafe fn bytes<'a>(at: u64, len: usize) -> &'a [u8] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(at as usize as *const u8, len) }
}

/// The `len` bytes at host address `at`, writable.
///
/// # Safety
/// `at` is valid for writes of `len` bytes, touched by nothing else for the borrow's life.
unsafe fn bytes_mut<'a>(at: u64, len: usize) -> &'a mut [u8] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(at as usize as *mut u8, len) }
}

impl DataPlane for HostPlane {
    fn memory(&self) -> Memory {
        Memory::Host
    }

    unsafe fn copy_runs(&mut self, runs: &[CopyRun]) -> Result<()> {
        for r in runs {
            // SAFETY: the trait's contract: valid, non-overlapping host ranges.
            unsafe {
                crate::fabric::copy::copy_bytes(
                    r.src as usize as *const u8,
                    r.dst as usize as *mut u8,
                    r.len as usize,
                )
            };
        }
        Ok(())
    }

    unsafe fn sum_rows(
        &mut self,
        dtype: DType,
        hidden: usize,
        rows: &[SumRow],
        terms: &[SumTerm],
    ) -> Result<()> {
        let row_len = hidden * dtype.size();
        let q_len = int8_payload(hidden);
        self.acc.resize(hidden, 0.0);
        let acc = &mut self.acc;
        for r in rows {
            let first = r.first_term as usize;
            let ts = &terms[first..first + r.num_terms as usize];
            // SAFETY: the trait's contract: the destination is a writable row that overlaps no
            // source.
            let out = unsafe { bytes_mut(r.dst, row_len) };
            let src = |t: &SumTerm| {
                let len = if t.int8 != 0 { q_len } else { row_len };
                // SAFETY: the trait's contract: each term's source is a readable row (or INT8
                // payload) that nobody writes during the call.
                unsafe { bytes(t.src, len) }
            };
            match ts {
                [] => {
                    out.fill(0);
                    continue;
                }
                [t] if r.init_first != 0 && t.int8 == 0 => {
                    crate::fabric::copy::copy_slice(out, src(t));
                    continue;
                }
                // Several dtype rows added as they are: `DType::sum_rows`, one pass over them
                // for aligned bf16 (the same bits as the loop below).
                _ if r.init_first != 0
                    && ts.len() <= MAX_FUSED_ROWS
                    && ts.iter().all(|t| t.int8 == 0)
                    && ts[1..].iter().all(|t| t.weight == 1.0) =>
                {
                    let mut fused: [&[u8]; MAX_FUSED_ROWS] = [&[]; MAX_FUSED_ROWS];
                    for (f, t) in fused.iter_mut().zip(ts) {
                        *f = src(t);
                    }
                    dtype.sum_rows(&fused[..ts.len()], acc, out);
                    continue;
                }
                _ => {}
            }
            let rest = if r.init_first != 0 {
                match &ts[0] {
                    t if t.int8 != 0 => dequantize(src(t), hidden, acc),
                    t => dtype.to_f32(src(t), acc),
                }
                &ts[1..]
            } else {
                acc.fill(0.0);
                ts
            };
            for t in rest {
                if t.int8 != 0 {
                    dequantize_add(src(t), hidden, acc);
                } else {
                    dtype.accumulate(src(t), t.weight, acc);
                }
            }
            dtype.from_f32(acc, out);
        }
        Ok(())
    }

    unsafe fn quantize(&mut self, dtype: DType, hidden: usize, rows: &[QuantRow]) -> Result<()> {
        let row_len = hidden * dtype.size();
        for (i, r) in rows.iter().enumerate() {
            // SAFETY: the trait's contract: a readable dtype row and a writable INT8 payload.
            let (src, dst) = unsafe {
                (
                    bytes(r.src, row_len),
                    bytes_mut(r.dst, int8_payload(hidden)),
                )
            };
            let amax = self.quant.amax(dtype, src).map_err(|e| non_finite(i, e))?;
            self.quant.quantize_amax(dtype, src, amax, dst);
        }
        Ok(())
    }

    unsafe fn dequantize(&mut self, dtype: DType, hidden: usize, rows: &[QuantRow]) -> Result<()> {
        for r in rows {
            // SAFETY: the trait's contract: a readable INT8 payload and a writable dtype row.
            let (src, dst) = unsafe {
                (
                    bytes(r.src, int8_payload(hidden)),
                    bytes_mut(r.dst, hidden * dtype.size()),
                )
            };
            dequantize_to(src, dtype, &mut self.acc, dst);
        }
        Ok(())
    }

    unsafe fn scatter(&mut self, data: &[u8], runs: &[CopyRun]) -> Result<()> {
        check_host_runs(runs, data.len(), |r| r.src, "scatter")?;
        for r in runs {
            let src = &data[r.src as usize..][..r.len as usize];
            // SAFETY: the trait's contract for the destination; the source is in `data`
            // (checked above).
            crate::fabric::copy::copy_slice(unsafe { bytes_mut(r.dst, src.len()) }, src);
        }
        Ok(())
    }

    unsafe fn gather(&mut self, runs: &[CopyRun], out: &mut [u8], _: Instant) -> Result<()> {
        check_host_runs(runs, out.len(), |r| r.dst, "gather")?;
        for r in runs {
            let dst = &mut out[r.dst as usize..][..r.len as usize];
            // SAFETY: the trait's contract for the source; the destination is in `out`.
            crate::fabric::copy::copy_slice(dst, unsafe { bytes(r.src, r.len as usize) });
        }
        Ok(())
    }

    fn complete(&mut self, _deadline: Instant) -> Result<()> {
        Ok(())
    }
}
