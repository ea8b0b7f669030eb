//! The data plane: who moves and sums the bytes of rows, apart from the protocol that plans it.
//!
//! The protocol decides, on the host, which rows go where and how they are summed; a
//! [`DataPlane`] executes that plan in the memory the rows live in. Its operations are lists of
//! descriptors, one launch each on a device:
//! - [`DataPlane::copy_runs`]: byte runs from one place to another ([`CopyRun`]);
//! - [`DataPlane::sum_rows`]: per output row, the f32 sum of its terms in their order, rounded
//!   once to the dtype ([`SumRow`], [`SumTerm`]): the expert side's weighted sum of its local
//!   experts' outputs (`init_first = 0`) and the attention side's combine of the rows expert
//!   ranks sent back (`init_first = 1`);
//! - [`DataPlane::quantize`] / [`DataPlane::dequantize`]: INT8 per-token rows
//!   ([`QuantRow`], the format and arithmetic of [`super::quant`]).
//!
//! Backends:
//! - [`host::HostPlane`]: host memory, the functions of [`super::dtype`], [`super::quant`] and
//!   the fabric's copy, so its bits are the host path's by construction;
//! - [`cuda::CudaPlane`] (device memory, kernels on a stream): `kernels.cu`, compiled at run time by
//!   NVRTC ([`nvrtc`]), whose per-element arithmetic is `dataplane_abi.h`, shared with the C
//!   twins the stand-in driver runs, and written without fused multiply-adds. Both give the
//!   same bits for f32, f16 and bf16 rows: `tests.rs` compares them on random plans.
//!
//! Addresses in descriptors are in the backend's memory (host pointers as integers for the
//! host backend, device addresses for CUDA); the operations are `unsafe` because the data plane
//! cannot check that they are valid: the protocol builds every descriptor from a window range or
//! caller buffer it has checked. Work is complete (and a quantize step's finiteness known) when
//! [`DataPlane::complete`] returns.

use std::time::Instant;

use super::dtype::DType;
use crate::Result;

pub mod cuda;
pub mod host;
pub mod nvrtc;

/// The kernels' CUDA C source.
pub const KERNELS_CU: &str = include_str!("kernels.cu");
/// The ABI header the kernels include (and the stand-in driver's C twins).
pub const ABI_HEADER: &str = include_str!("dataplane_abi.h");
/// The kernel entry points, as named in [`KERNELS_CU`].
pub const KERNEL_NAMES: [&str; 4] = [
    "xccl_copy_runs",
    "xccl_sum_rows",
    "xccl_quantize",
    "xccl_dequantize",
];

/// One copy: `len` bytes from `src` to `dst` (ranges that do not overlap).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct CopyRun {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// One output row of [`DataPlane::sum_rows`]: terms `first_term .. first_term + num_terms`.
///
/// `init_first == 0`: `acc = 0`, then `acc += term` for each term in order (a dtype term's
/// value is `weight * x`, an INT8 term's `f32(q) * scale`). `init_first == 1`: `acc` starts as
/// the first term's value (unweighted), then adds each later term; one dtype term alone is
/// copied as it is (its bits), and no term at all gives zeros. Then `acc` is rounded once to
/// the dtype (round to nearest even). Every operation is one f32 operation, never fused.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SumRow {
    /// Destination row (of the dtype).
    pub dst: u64,
    /// Index of its first term in the term list.
    pub first_term: u32,
    /// Number of terms.
    pub num_terms: u32,
    /// 1: start from the first term; 0: start from zero.
    pub init_first: u32,
    /// Zero.
    pub reserved: u32,
}

/// One term of a [`SumRow`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SumTerm {
    /// The row: `hidden` elements of the dtype, or an INT8 payload.
    pub src: u64,
    /// The weight of a dtype term (unused for INT8 terms and for an `init_first` row's first).
    pub weight: f32,
    /// 1 if `src` is an INT8 payload ([`super::quant::int8_payload`] bytes).
    pub int8: u32,
}

/// One row of [`DataPlane::quantize`] (`src` a dtype row, `dst` an INT8 payload) or
/// [`DataPlane::dequantize`] (`src` an INT8 payload, `dst` a dtype row).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct QuantRow {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
}

/// Where a data plane's rows live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Host memory of this process.
    Host,
    /// Memory of CUDA device `ordinal`.
    Cuda {
        /// The device ordinal.
        ordinal: i32,
    },
}

impl std::fmt::Display for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Memory::Host => f.write_str("host memory"),
            Memory::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// Executes the protocol's row operations where the rows live (see the module docs).
///
/// Operations are queued in order; each may start before the previous returns (a device
/// stream), and all are complete once [`DataPlane::complete`] returns.
pub trait DataPlane: Send {
    /// Where this plane's addresses point.
    fn memory(&self) -> Memory;

    /// Copies every run.
    ///
    /// # Safety
    /// Every run's `src` is valid for reads and `dst` for writes of `len` bytes in
    /// [`DataPlane::memory`], no destination overlaps a source or another destination, and no
    /// one else touches them until [`DataPlane::complete`] returns.
    unsafe fn copy_runs(&mut self, runs: &[CopyRun]) -> Result<()>;

    /// Writes every sum row (see [`SumRow`]) of `hidden` elements of `dtype`.
    ///
    /// # Safety
    /// Every row's `dst` is valid for writes of a dtype row, every term's `src` for reads of a
    /// dtype row or an INT8 payload, all aligned to 4 bytes; destinations overlap nothing else;
    /// the term ranges lie in `terms`; untouched by others until [`DataPlane::complete`].
    unsafe fn sum_rows(
        &mut self,
        dtype: DType,
        hidden: usize,
        rows: &[SumRow],
        terms: &[SumTerm],
    ) -> Result<()>;

    /// Quantizes every row to INT8 ([`super::quant`]'s quantizer). A row with a non-finite
    /// element is an error naming the row and the element, from this call (host) or from
    /// [`DataPlane::complete`] (device); then what was written is unspecified and nothing may
    /// be sent.
    ///
    /// # Safety
    /// As [`DataPlane::sum_rows`], with `src` a dtype row and `dst` an INT8 payload.
    unsafe fn quantize(&mut self, dtype: DType, hidden: usize, rows: &[QuantRow]) -> Result<()>;

    /// Dequantizes every row: `dst_i = dtype(f32(q_i) * scale)`, one rounding.
    ///
    /// # Safety
    /// As [`DataPlane::sum_rows`], with `src` an INT8 payload and `dst` a dtype row.
    unsafe fn dequantize(&mut self, dtype: DType, hidden: usize, rows: &[QuantRow]) -> Result<()>;

    /// Copies host bytes into this plane's memory: run `i` copies `data[src..src + len]`
    /// (`src` an offset into `data`) to `dst`. `data` may be reused once it returns. A run
    /// outside `data` is an error and nothing is queued.
    ///
    /// # Safety
    /// As [`DataPlane::copy_runs`] for the destinations.
    unsafe fn scatter(&mut self, data: &[u8], runs: &[CopyRun]) -> Result<()>;

    /// [`DataPlane::copy_runs`] of `runs` and [`DataPlane::scatter`] of `data` by `scattered`
    /// together (one launch on a device): a chunk of rows and their metadata.
    ///
    /// # Safety
    /// As [`DataPlane::copy_runs`] for `runs` and [`DataPlane::scatter`] for `scattered`; no
    /// destination of one overlaps the other's.
    unsafe fn copy_and_scatter(
        &mut self,
        runs: &[CopyRun],
        data: &[u8],
        scattered: &[CopyRun],
    ) -> Result<()> {
        check_host_runs(scattered, data.len(), |r| r.src, "scatter")?;
        // SAFETY: the caller's contract.
        unsafe {
            self.copy_runs(runs)?;
            self.scatter(data, scattered)
        }
    }

    /// Copies from this plane's memory to the host: run `i` copies the `len` bytes at `src` to
    /// `out[dst..dst + len]` (`dst` an offset into `out`; bytes no run covers are unspecified).
    /// Completes everything queued
    /// ([`DataPlane::complete`]) before it returns. A run outside `out` is an error and
    /// nothing is queued.
    ///
    /// # Safety
    /// As [`DataPlane::copy_runs`] for the sources.
    unsafe fn gather(&mut self, runs: &[CopyRun], out: &mut [u8], deadline: Instant) -> Result<()>;

    /// Waits (until `deadline`) for every queued operation to finish, and reports a quantize
    /// step's non-finite row.
    fn complete(&mut self, deadline: Instant) -> Result<()>;
}

/// Checks that every run's `offset(run)..+len` lies in `0..len` (the host side of a
/// [`DataPlane::scatter`] or [`DataPlane::gather`]).
pub(crate) fn check_host_runs(
    runs: &[CopyRun],
    len: usize,
    offset: impl Fn(&CopyRun) -> u64,
    what: &str,
) -> Result<()> {
    match runs.iter().find(|r| {
        offset(r)
            .checked_add(r.len)
            .is_none_or(|end| end > len as u64)
    }) {
        Some(r) => Err(crate::Error::invalid(format!(
            "a {what} run of {} bytes at offset {} is outside its {len} host bytes",
            r.len,
            offset(r)
        ))),
        None => Ok(()),
    }
}

/// The error for row `row`'s non-finite element `element` in a quantize step.
pub(crate) fn non_finite(row: usize, element: usize) -> crate::Error {
    crate::Error::invalid(format!(
        "row {row} of an INT8 quantize step has a non-finite element at {element}: INT8 needs \
         finite rows (nothing was sent)"
    ))
}

#[cfg(test)]
pub(crate) mod tests;
