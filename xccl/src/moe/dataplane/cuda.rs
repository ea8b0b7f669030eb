//! The CUDA backend of the data plane: rows in device memory, each operation one kernel launch
//! on a stream ([`crate::cuda::Stream`]), the kernels compiled by NVRTC for the device's
//! compute capability ([`super::nvrtc::cubin`]) and loaded once per plane.
//!
//! Descriptors go to the device through a staging area: a host buffer and a device buffer of
//! the same size, filled front to back by the operations queued since the last
//! [`DataPlane::complete`], so no queued copy or kernel sees its descriptors overwritten and
//! nothing waits between operations. When the area is full the plane completes what is queued
//! (a bounded wait) and starts again from the front, growing it if one operation needs more.
//! A quantize step lowers a device word to `row << 32 | element` of the first non-finite
//! element; [`DataPlane::complete`] reads it (8 bytes, device to host) and reports the row.
//!
//! Nothing of a row passes through host memory: the host writes descriptors and reads the
//! quantize word, and the rows move by kernels.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use super::{check_host_runs, non_finite, CopyRun, DataPlane, Memory, QuantRow, SumRow, SumTerm};
use crate::cuda::{Device, DeviceMemory, DeviceRegion, Function, Module, Stream};
use crate::moe::dtype::DType;
use crate::Result;

/// Threads per block of every launch (the kernels' reductions assume this many).
const BLOCK: u32 = 256;
/// Most blocks of a launch (the kernels loop over descriptors beyond it).
const MAX_BLOCKS: usize = 65_535;
/// Initial bytes of the descriptor staging area.
const INITIAL_STAGING: usize = 64 << 10;
/// The quantize word's value when every row was finite.
const ALL_FINITE: u64 = u64::MAX;

/// The kernels of one module.
#[derive(Debug)]
struct Kernels {
    _module: Module,
    copy_runs: Function,
    sum_rows: Function,
    quantize: Function,
    dequantize: Function,
}

/// The data plane over one CUDA device's memory (see the module docs).
pub struct CudaPlane {
    device: Device,
    stream: Stream,
    kernels: Kernels,
    /// Descriptor staging: host side (fixed while work is queued) and device side.
    host: Box<[u8]>,
    staging: DeviceMemory,
    /// Bytes of the staging area used by operations queued since the last completion.
    used: usize,
    /// The quantize word, and whether a quantize step was queued since the last completion.
    bad: DeviceMemory,
    quantized: bool,
    /// The quantize row and element the last [`DataPlane::complete`] found not finite.
    non_finite: Option<(usize, usize)>,
    /// Where [`DataPlane::gather`] collects its bytes before they go to the host (grown on
    /// demand).
    gathered: Option<DeviceMemory>,
    /// Runs rewritten to device addresses (scratch, reused).
    runs: Vec<CopyRun>,
    /// Bound of the waits the plane makes by itself (a full staging area).
    timeout: Duration,
    /// This rank, for the errors of waits.
    rank: usize,
}

impl std::fmt::Debug for CudaPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPlane")
            .field("device", &self.device.ordinal())
            .field("staging", &self.host.len())
            .finish()
    }
}

impl CudaPlane {
    /// A plane on `device` whose operations run on `stream` (after the work already queued
    /// there), for rank `rank`; its own waits are bounded by `timeout`. Compiles (or takes from
    /// the process's cache) the kernels for the device's compute capability and loads them.
    /// Every error names `rank` (no NVRTC, a kernel that does not compile, a module the driver
    /// refuses, out of device memory).
    pub fn new(device: &Device, stream: Stream, rank: usize, timeout: Duration) -> Result<Self> {
        Self::build(device, stream, rank, timeout)
            .map_err(|e| e.prefixed(&format!("rank {rank}'s data plane")))
    }

    fn build(device: &Device, stream: Stream, rank: usize, timeout: Duration) -> Result<Self> {
        let (major, minor) = device.compute_capability();
        let image = super::nvrtc::cubin(major as i32, minor as i32)?;
        let module = Module::load(device, &image)?;
        let kernels = Kernels {
            copy_runs: module.function("xccl_copy_runs")?,
            sum_rows: module.function("xccl_sum_rows")?,
            quantize: module.function("xccl_quantize")?,
            dequantize: module.function("xccl_dequantize")?,
            _module: module,
        };
        let what = |w: &'static str| move || format!("the data plane's {w} (rank {rank})");
        Ok(CudaPlane {
            device: device.clone(),
            staging: DeviceMemory::alloc(device, INITIAL_STAGING, what("descriptor staging"))?,
            host: vec![0u8; INITIAL_STAGING].into_boxed_slice(),
            used: 0,
            bad: DeviceMemory::alloc(device, 8, what("quantize word"))?,
            quantized: false,
            non_finite: None,
            gathered: None,
            runs: Vec::new(),
            stream,
            kernels,
            timeout,
            rank,
        })
    }

    /// The device whose memory the plane works on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The quantize row (index in its list) and element that made the last
    /// [`DataPlane::complete`] fail, when that was a non-finite row: for the caller's own
    /// error, which names what the row is (a token, a reply).
    pub fn non_finite(&self) -> Option<(usize, usize)> {
        self.non_finite
    }

    /// The stream the plane queues its work on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Makes room for `bytes` of descriptors (in lists of 16-byte aligned starts) behind what
    /// is queued: completes the queued work first when the area is full, and grows the area if
    /// `bytes` alone is larger. Every list of one operation is reserved at once, so a list
    /// staged for it is never overwritten before its launch.
    fn reserve(&mut self, bytes: usize) -> Result<()> {
        if self.used.next_multiple_of(16) + bytes <= self.host.len() {
            return Ok(());
        }
        self.complete(Instant::now() + self.timeout)?;
        if bytes > self.host.len() {
            let len = bytes.next_power_of_two();
            let rank = self.rank;
            self.staging = DeviceMemory::alloc(&self.device, len, || {
                format!("the data plane's descriptor staging (rank {rank})")
            })?;
            self.host = vec![0u8; len].into_boxed_slice();
        }
        Ok(())
    }

    /// Bytes [`CudaPlane::reserve`] needs for lists of these lengths in bytes.
    fn room(lists: &[usize]) -> usize {
        lists.iter().map(|l| l.next_multiple_of(16) + 16).sum()
    }

    /// Uploads `descs` into the staging area (room reserved) and returns their device address.
    fn stage<T: bytemuck::Pod>(&mut self, descs: &[T]) -> Result<u64> {
        let bytes: &[u8] = bytemuck::cast_slice(descs);
        let at = self.used.next_multiple_of(16);
        assert!(
            at + bytes.len() <= self.host.len(),
            "descriptors staged without room reserved"
        );
        self.host[at..at + bytes.len()].copy_from_slice(bytes);
        // SAFETY: the destination lies in the live staging buffer (`at + len <= its length`);
        // the source is `self.host`, which is neither written at these bytes nor freed before
        // the stream ran the copy: the area is reused or replaced only after `complete`.
        unsafe {
            self.stream.copy_htod_async(
                self.staging.ptr().add(at),
                self.host[at..].as_ptr(),
                bytes.len(),
                &|| "uploading the data plane's descriptors".into(),
            )?
        };
        self.used = at + bytes.len();
        Ok(self.staging.ptr().add(at).addr())
    }

    /// Launches `f` over `n` descriptors with `params`.
    ///
    /// # Safety
    /// `params` match `f`'s signature and address memory that lives until the stream ran it.
    unsafe fn launch(&self, f: &Function, n: usize, params: &mut [*mut c_void]) -> Result<()> {
        let blocks = n.clamp(1, MAX_BLOCKS) as u32;
        // SAFETY: the caller's contract.
        unsafe {
            self.stream
                .launch(f, (blocks, 1, 1), (BLOCK, 1, 1), 0, params)
        }
    }
}

/// A kernel argument: a pointer to its value.
fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

impl DataPlane for CudaPlane {
    fn memory(&self) -> Memory {
        Memory::Cuda {
            ordinal: self.device.ordinal() as i32,
        }
    }

    unsafe fn copy_runs(&mut self, runs: &[CopyRun]) -> Result<()> {
        if runs.is_empty() {
            return Ok(());
        }
        self.reserve(Self::room(&[std::mem::size_of_val(runs)]))?;
        let mut at = self.stage(runs)?;
        let mut n = runs.len() as u32;
        let f = &self.kernels.copy_runs;
        // SAFETY: the kernel's signature is (runs, n); the runs are device ranges valid until
        // completion (the trait's contract) and their descriptors live in the staging area.
        unsafe { self.launch(f, runs.len(), &mut [arg(&mut at), arg(&mut n)]) }
    }

    unsafe fn sum_rows(
        &mut self,
        dtype: DType,
        hidden: usize,
        rows: &[SumRow],
        terms: &[SumTerm],
    ) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        self.reserve(Self::room(&[
            std::mem::size_of_val(terms),
            std::mem::size_of_val(rows),
        ]))?;
        let mut t = if terms.is_empty() {
            0
        } else {
            self.stage(terms)?
        };
        let mut r = self.stage(rows)?;
        let (mut n, mut dt, mut h) = (rows.len() as u32, dtype as u32, hidden as u32);
        let f = &self.kernels.sum_rows;
        // SAFETY: the signature is (rows, terms, n, dtype, hidden); see `copy_runs`.
        unsafe {
            self.launch(
                f,
                rows.len(),
                &mut [
                    arg(&mut r),
                    arg(&mut t),
                    arg(&mut n),
                    arg(&mut dt),
                    arg(&mut h),
                ],
            )
        }
    }

    unsafe fn quantize(&mut self, dtype: DType, hidden: usize, rows: &[QuantRow]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        self.reserve(Self::room(&[std::mem::size_of_val(rows)]))?;
        let mut r = self.stage(rows)?;
        if !self.quantized {
            self.stream
                .memset(&self.bad, 0, 0xff, 8, &|| "arming the quantize word".into())?;
            self.quantized = true;
        }
        let (mut n, mut dt, mut h) = (rows.len() as u32, dtype as u32, hidden as u32);
        let mut bad = self.bad.ptr().addr();
        let f = &self.kernels.quantize;
        // SAFETY: the signature is (rows, n, dtype, hidden, bad); see `copy_runs`; `bad` is
        // this plane's live word.
        unsafe {
            self.launch(
                f,
                rows.len(),
                &mut [
                    arg(&mut r),
                    arg(&mut n),
                    arg(&mut dt),
                    arg(&mut h),
                    arg(&mut bad),
                ],
            )
        }
    }

    unsafe fn dequantize(&mut self, dtype: DType, hidden: usize, rows: &[QuantRow]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        self.reserve(Self::room(&[std::mem::size_of_val(rows)]))?;
        let mut r = self.stage(rows)?;
        let (mut n, mut dt, mut h) = (rows.len() as u32, dtype as u32, hidden as u32);
        let f = &self.kernels.dequantize;
        // SAFETY: the signature is (rows, n, dtype, hidden); see `copy_runs`.
        unsafe {
            self.launch(
                f,
                rows.len(),
                &mut [arg(&mut r), arg(&mut n), arg(&mut dt), arg(&mut h)],
            )
        }
    }

    unsafe fn scatter(&mut self, data: &[u8], runs: &[CopyRun]) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.copy_and_scatter(&[], data, runs) }
    }

    unsafe fn copy_and_scatter(
        &mut self,
        device_runs: &[CopyRun],
        data: &[u8],
        runs: &[CopyRun],
    ) -> Result<()> {
        check_host_runs(runs, data.len(), |r| r.src, "scatter")?;
        if runs.is_empty() && device_runs.is_empty() {
            return Ok(());
        }
        let runs_len = std::mem::size_of_val(runs) + std::mem::size_of_val(device_runs);
        self.reserve(Self::room(&[data.len(), runs_len]))?;
        let base = if data.is_empty() {
            0
        } else {
            self.stage(data)?
        };
        // One list: the device copies as they are, the scattered bytes from their staged copy.
        self.runs.clear();
        self.runs.extend_from_slice(device_runs);
        self.runs.extend(runs.iter().map(|r| CopyRun {
            src: base + r.src,
            ..*r
        }));
        let runs = std::mem::take(&mut self.runs);
        let staged = self.stage(&runs);
        self.runs = runs;
        let (mut at, mut n) = (staged?, self.runs.len() as u32);
        let f = &self.kernels.copy_runs;
        // SAFETY: as `copy_runs`; the scattered sources are the staged copy of `data`, which
        // lives in the staging area until completion, the others the caller's device ranges.
        unsafe { self.launch(f, self.runs.len(), &mut [arg(&mut at), arg(&mut n)]) }
    }

    unsafe fn gather(&mut self, runs: &[CopyRun], out: &mut [u8], deadline: Instant) -> Result<()> {
        check_host_runs(runs, out.len(), |r| r.dst, "gather")?;
        if runs.is_empty() {
            return Ok(());
        }
        if self.gathered.as_ref().is_none_or(|g| g.len() < out.len()) {
            // The old area may still be read by queued work: complete before it is freed.
            self.complete(deadline)?;
            let rank = self.rank;
            self.gathered = Some(DeviceMemory::alloc(
                &self.device,
                out.len().next_power_of_two(),
                || format!("the data plane's gather area (rank {rank})"),
            )?);
        }
        let base = self.gathered.as_ref().map_or(0, |g| g.ptr().addr());
        self.runs.clear();
        self.runs.extend(runs.iter().map(|r| CopyRun {
            dst: base + r.dst,
            ..*r
        }));
        let runs = std::mem::take(&mut self.runs);
        // SAFETY: the trait's contract for the sources; the destinations lie in the gather
        // area (each inside `out.len()` bytes, checked above), which only this call uses.
        let queued = unsafe { self.copy_runs(&runs) };
        self.runs = runs;
        queued?;
        // The read is ordered after the gather on the stream and waits for both (one wait);
        // `complete` then only resets the staging and reports a quantize step.
        let area = self.gathered.as_ref().expect("allocated above");
        let what = || "reading gathered bytes of the data plane".to_string();
        self.stream.read(area, 0, out, deadline, self.rank, &what)?;
        self.complete(deadline)
    }

    fn complete(&mut self, deadline: Instant) -> Result<()> {
        self.non_finite = None;
        let what = || "the data plane's kernels".to_string();
        self.stream.synchronize(deadline, self.rank, &what)?;
        self.used = 0;
        if std::mem::take(&mut self.quantized) {
            let mut word = [0u8; 8];
            self.stream
                .read(&self.bad, 0, &mut word, deadline, self.rank, &what)?;
            let code = u64::from_le_bytes(word);
            if code != ALL_FINITE {
                let (row, element) = ((code >> 32) as usize, code as u32 as usize);
                self.non_finite = Some((row, element));
                return Err(non_finite(row, element));
            }
        }
        Ok(())
    }
}
