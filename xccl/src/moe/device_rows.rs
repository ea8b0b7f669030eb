//! The protocol's device side on the cuda fabric: where the device-buffer calls' rows go.
//!
//! [`DeviceRows`] holds what the protocol needs to move rows between device buffers and the
//! windows without the host: the data plane ([`CudaPlane`], on the fabric's stream, so a
//! fabric signal is ordered after the plane's work), every rank's window as a device address
//! (this rank's own allocation, the others' IPC mappings), and device scratch (INT8 rows
//! quantized before a call publishes). It is made by the first device-buffer call of a
//! communicator ([`super::context::Context::device_rows`]) and lives with it.
//!
//! Every address it hands out is range-checked against the window it lies in: an offset the
//! protocol computed from a peer's record cannot reach past a window.

use std::time::Instant;

use super::dataplane::cuda::CudaPlane;
use super::dataplane::{CopyRun, DataPlane, QuantRow};
use crate::cuda::{DeviceMemory, DeviceRegion, Event, Stream};
use crate::fabric::cuda::CudaFabric;
use crate::fabric::Fabric;
use crate::{Error, Result};

/// Where a call writes its output rows.
#[derive(Debug)]
pub(crate) enum OutRows<'a> {
    /// Host memory: the rows' bytes.
    Host(&'a mut [u8]),
    /// Device memory of the communicator's device: the first row's address (the caller
    /// checked the buffer's length).
    Device(u64),
}

/// The device side of one communicator (see the module docs).
pub(crate) struct DeviceRows {
    /// The data plane, on the fabric's stream.
    pub(crate) plane: CudaPlane,
    /// Per rank: its window's device address here, its length, and where its device part
    /// starts (the bytes before are in host memory: [`CudaFabric::host_prefix`]).
    windows: Vec<(u64, usize, usize)>,
    /// Device scratch per use, grown on demand (contents not kept across calls).
    scratch: [Option<DeviceMemory>; 2],
    /// Recorded on the caller's stream by each device-buffer call, which orders the fabric's
    /// stream after it (one event for the communicator's life, not one per call).
    pub(crate) caller_done: Event,
    /// Scratch of the descriptors planned per call (reused, so a call allocates none on the
    /// host): [`DeviceRows::convert_rows`]'s rows, and runs a caller takes and gives back.
    quant_rows: Vec<QuantRow>,
    pub(crate) runs: Vec<CopyRun>,
}

/// Which way [`DeviceRows::convert_rows`] converts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Conversion {
    /// Dtype rows to INT8 payloads.
    Quantize,
    /// INT8 payloads to dtype rows.
    Dequantize,
}

/// Who uses a device scratch area: a relay reduces its members' replies while its own E2A
/// reply (whose INT8 rows wait in the call's area) is going out, so the two have one each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scratch {
    /// The call's own rows (INT8 rows quantized before the send).
    Call = 0,
    /// A relay's E2A reduction.
    Relay = 1,
}

impl std::fmt::Debug for DeviceRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRows")
            .field("plane", &self.plane)
            .field("windows", &self.windows.len())
            .finish()
    }
}

impl DeviceRows {
    /// The device side over `fabric` for rank `rank`; the plane's own waits bounded by
    /// `timeout`.
    pub(crate) fn new(fabric: &CudaFabric, timeout: std::time::Duration) -> Result<Self> {
        let rank = fabric.rank();
        // SAFETY: the fabric's stream lives as long as the fabric, which the communicator
        // keeps (its `Context`) for as long as this value; this value never destroys it.
        let stream = unsafe { Stream::borrowed(fabric.device(), fabric.stream().raw()) };
        let plane = CudaPlane::new(fabric.device(), stream, rank, timeout)?;
        let windows = (0..fabric.world_size())
            .map(|r| {
                let base = fabric.device_window(r).map_or(0, |p| p.addr());
                (base, fabric.window_len(r), fabric.host_prefix(r))
            })
            .collect();
        Ok(DeviceRows {
            caller_done: Event::new(fabric.device())?,
            plane,
            windows,
            scratch: [None, None],
            quant_rows: Vec::new(),
            runs: Vec::new(),
        })
    }

    /// The device address of `len` bytes at `offset` of `rank`'s window (an error naming the
    /// rank when they are not inside its device part).
    pub(crate) fn window(&self, rank: usize, offset: usize, len: usize) -> Result<u64> {
        let inside = |wlen: usize, start: usize| {
            offset >= start && offset.checked_add(len).is_some_and(|e| e <= wlen)
        };
        match self.windows.get(rank) {
            Some(&(base, wlen, start)) if base != 0 && inside(wlen, start) => {
                Ok(base + offset as u64)
            }
            _ => Err(Error::Protocol {
                peer: rank,
                detail: format!(
                    "{len} bytes at offset {offset} are outside rank {rank}'s device window"
                ),
            }),
        }
    }

    /// Queues `op` on `n` rows of `hidden` elements of `dtype`: row `i` from `src + i *
    /// src_stride` to `dst + i * dst_stride`.
    ///
    /// # Safety
    /// As [`DataPlane::quantize`] (or [`DataPlane::dequantize`]) for every row.
    pub(crate) unsafe fn convert_rows(
        &mut self,
        op: Conversion,
        (dtype, hidden): (crate::DType, usize),
        n: usize,
        (src, src_stride): (u64, usize),
        (dst, dst_stride): (u64, usize),
    ) -> Result<()> {
        self.quant_rows.clear();
        self.quant_rows.extend((0..n).map(|i| QuantRow {
            src: src + (i * src_stride) as u64,
            dst: dst + (i * dst_stride) as u64,
        }));
        // SAFETY: the caller's contract.
        unsafe {
            match op {
                Conversion::Quantize => self.plane.quantize(dtype, hidden, &self.quant_rows),
                Conversion::Dequantize => self.plane.dequantize(dtype, hidden, &self.quant_rows),
            }
        }
    }

    /// The device address of the `area` scratch [`DeviceRows::scratch`] last handed out (0
    /// before the first).
    pub(crate) fn scratch_addr(&self, area: Scratch) -> u64 {
        self.scratch[area as usize]
            .as_ref()
            .map_or(0, |s| s.ptr().addr())
    }

    /// The device address of at least `len` bytes of the `area` scratch (grown when shorter:
    /// the plane completes first, so no queued work reads the old one). What it held is not
    /// kept.
    pub(crate) fn scratch(&mut self, area: Scratch, len: usize, deadline: Instant) -> Result<u64> {
        let slot = area as usize;
        if self.scratch[slot].as_ref().is_none_or(|s| s.len() < len) {
            self.plane.complete(deadline)?;
            self.scratch[slot] = None;
            let device = self.plane.device().clone();
            self.scratch[slot] = Some(DeviceMemory::alloc(
                &device,
                len.max(1).next_power_of_two(),
                || "the protocol's device scratch".into(),
            )?);
        }
        Ok(self.scratch_addr(area))
    }
}
