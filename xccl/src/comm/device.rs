//! The device-buffer calls of a communicator on the cuda fabric: A2E and E2A with the rows in
//! GPU memory ([`DeviceSlice`], [`DeviceSliceMut`]), ordered after the work the caller queued on
//! its stream, synchronous to the host on return.
//!
//! Each call:
//! 1. checks every buffer before anything is written or consumed: device memory of this
//!    communicator's device inside one allocation ([`Device::device_pointer`]), of the length
//!    the call needs; the stream's device. A bad one is [`Error::InvalidArgument`] naming it,
//!    and the call changes nothing;
//! 2. orders the fabric's stream after the caller's (an event recorded on the caller's stream);
//! 3. runs the protocol, the same planning as the host calls;
//! 4. returns once the rows are in place.
//!
//! Where the rows move: on the device. The protocol plans on the host as for the host calls
//! and the data plane ([`crate::moe::dataplane`], kernels on the fabric's stream) executes
//! the plan between the caller's buffers and the windows (`crate::moe::device_rows`):
//! - A2E send: the caller's rows are copied into the destination windows (INT8: quantized
//!   into device scratch first, so a non-finite row fails before anything is written); the
//!   rows' metadata is encoded on the host and scattered next to them.
//! - A2E receive, expert-major or token-major: the rows' metadata is gathered to the host (it
//!   plans the layout), the payloads copied (INT8: dequantized) from the window into `out`.
//! - E2A send: each token's weighted sum of its experts' outputs (or, token-major, the
//!   caller's reduced row) is written straight into the attention rank's window (INT8: summed
//!   and quantized in device scratch first).
//! - E2A receive: each token's contributions are summed where they landed into `out`.
//!
//! What crosses to the host is what the host plans with: records, metadata, the routing of a
//! [`Routing::Device`] (one copy of each array per call), signals. Relays forward and reduce
//! on the device too: no row of these calls passes through host memory (`tests/tests/
//! cuda_device.rs` counts the bytes with the stand-in driver). Bits are the host calls' on
//! every path: the kernels' arithmetic is the host path's (`docs/device.md`).

use std::time::Instant;

use super::{send_e2a, Communicator};
use crate::cuda::{Device, DeviceSlice, DeviceSliceMut, ReadRegion, Stream};
use crate::fabric::cuda::CudaFabric;
use crate::moe::batch::Received;
use crate::moe::combine::Replies;
use crate::moe::context::Context;
use crate::moe::device_rows::OutRows;
use crate::moe::dispatch::DispatchReceiver;
use crate::{A2eHandle, Error, ExpertBatch, Result, TokenBatch};

/// The routing of an A2E call: `[T, topk]` expert ids (`i32`, `-1` = none) and gating weights
/// (`f32`, finite), in host or device memory.
#[derive(Clone, Copy, Debug)]
pub enum Routing<'a> {
    /// In host memory.
    Host {
        /// `[T, topk]` expert ids.
        topk_idx: &'a [i32],
        /// `[T, topk]` gating weights.
        topk_weights: &'a [f32],
    },
    /// In device memory of the communicator's device: read by the host once per call (a
    /// device-to-host copy of each, one wait for both, on the call's stream after the caller's
    /// queued work): the host plans the call with them.
    Device {
        /// `[T, topk]` expert ids (`i32`).
        topk_idx: DeviceSlice<'a>,
        /// `[T, topk]` gating weights (`f32`).
        topk_weights: DeviceSlice<'a>,
    },
}

/// How long a buffer of a device call must be.
#[derive(Clone, Copy, Debug)]
enum Need {
    /// Exactly this many bytes.
    Exactly(usize),
    /// At least this many bytes.
    AtLeast(usize),
}

/// The cuda fabric under `ctx`, or the error of a device call `call` on another fabric.
fn cuda_fabric<'c>(ctx: &'c Context, call: &str) -> Result<&'c CudaFabric> {
    ctx.fabric.as_cuda().ok_or_else(|| {
        Error::invalid(format!(
            "{call} with device buffers needs a communicator on the cuda fabric; this one is on \
             the {} fabric (use the host-buffer call)",
            ctx.fabric.name()
        ))
    })
}

/// Checks that the `len` bytes at `ptr` (the buffer `what`) are device memory of `device`, one
/// allocation, of the length `need` says.
fn check_buffer(
    device: &Device,
    what: &str,
    ptr: crate::cuda::DevicePtr,
    len: usize,
    need: Need,
) -> Result<()> {
    let short = match need {
        Need::Exactly(n) => (len != n).then(|| format!("{n} bytes")),
        Need::AtLeast(n) => (len < n).then(|| format!("at least {n} bytes")),
    };
    if let Some(expected) = short {
        return Err(Error::invalid(format!(
            "{what} has {len} bytes; expected {expected}"
        )));
    }
    if len == 0 {
        return Ok(());
    }
    if ptr.device() != device.ordinal() {
        return Err(Error::invalid(format!(
            "{what} is memory of CUDA device {}; this communicator's device is CUDA device {}",
            ptr.device(),
            device.ordinal()
        )));
    }
    device
        .device_pointer(ptr.addr(), len)
        .map(drop)
        .map_err(|e| e.prefixed(what))
}

/// Checks `stream`'s device and makes the fabric's stream wait for the work queued on it,
/// through the communicator's one event (made at init, recorded anew each call).
fn order_after(ctx: &Context, fabric: &CudaFabric, stream: &Stream) -> Result<()> {
    let device = fabric.device();
    if stream.device().ordinal() != device.ordinal() {
        return Err(Error::invalid(format!(
            "the stream is a stream of CUDA device {}; this communicator's device is CUDA device \
             {}",
            stream.device().ordinal(),
            device.ordinal()
        )));
    }
    if stream.raw() == fabric.stream().raw() {
        return Ok(());
    }
    let dev = ctx.device_rows()?;
    dev.caller_done.record(stream)?;
    fabric.stream().wait_event(&dev.caller_done)
}

/// The `[T, topk]` routing of a device A2E on the host: checked and read where it is on the
/// device.
fn routing_on_host(
    ctx: &Context,
    fabric: &CudaFabric,
    routing: Routing<'_>,
    deadline: Instant,
) -> Result<(Vec<i32>, Vec<f32>)> {
    match routing {
        Routing::Host {
            topk_idx,
            topk_weights,
        } => Ok((topk_idx.to_vec(), topk_weights.to_vec())),
        Routing::Device {
            topk_idx,
            topk_weights,
        } => {
            let device = fabric.device();
            let idx_len = topk_idx.len();
            if idx_len % 4 != 0 {
                return Err(Error::invalid(format!(
                    "topk_idx has {idx_len} bytes, not a whole number of int32 ids"
                )));
            }
            check_buffer(
                device,
                "topk_idx",
                topk_idx.ptr(),
                idx_len,
                Need::Exactly(idx_len),
            )?;
            check_buffer(
                device,
                "topk_weights",
                topk_weights.ptr(),
                topk_weights.len(),
                Need::Exactly(idx_len),
            )?;
            // Both arrays in one wait.
            let (mut idx, mut weights) = (vec![0u8; idx_len], vec![0u8; idx_len]);
            fabric.stream().read_parts(
                &mut [
                    (&ReadRegion(topk_idx), 0, &mut idx[..]),
                    (&ReadRegion(topk_weights), 0, &mut weights[..]),
                ],
                deadline,
                ctx.rank,
                &|| "reading the routing (topk_idx, topk_weights) from device memory".into(),
            )?;
            let ids = idx
                .chunks_exact(4)
                .map(|b| i32::from_ne_bytes(b.try_into().unwrap()));
            let ws = weights
                .chunks_exact(4)
                .map(|b| f32::from_ne_bytes(b.try_into().unwrap()));
            Ok((ids.collect(), ws.collect()))
        }
    }
}

/// The error of a device receive with `keep_int8` (INT8 rows are kept on the host only).
fn no_kept_int8(ctx: &Context) -> Result<()> {
    if ctx.cfg.keep_int8 {
        return Err(Error::invalid(
            "a device receive with keep_int8 is not supported: device rows are dequantized \
             (build the communicator without keep_int8)",
        ));
    }
    Ok(())
}

impl Communicator {
    /// The CUDA device of a communicator on the cuda fabric (`None` on other fabrics): the
    /// device whose memory the device-buffer calls take.
    pub fn cuda_device(&self) -> Option<&Device> {
        self.ctx.fabric.as_cuda().map(CudaFabric::device)
    }

    /// Rows an expert-major device receive may need at most on this rank: every attention
    /// rank's every token, each in as many rows as it can pick local experts
    /// (`min(topk, local experts)`). The `out` of [`Communicator::a2e_recv_device`] holds this
    /// many rows. 0 on attention ranks.
    pub fn max_expert_rows(&self) -> usize {
        let ctx = &self.ctx;
        let local = ctx.topo.local_experts(ctx.rank).len();
        ctx.attention().len() * ctx.cfg.max_tokens_per_rank * ctx.cfg.topk.min(local)
    }

    /// [`Communicator::a2e_send`] with `x` (`[T, hidden]` of the communicator's dtype) in
    /// device memory of this communicator's device, on a communicator on the cuda fabric.
    /// Ordered after the work queued on `stream` (the caller's, e.g. torch's current stream;
    /// a stream of the same device); `x` may be reused once the call returns. Checks every
    /// buffer before anything is written (see the module docs); the failure rule is
    /// [`Communicator::a2e_send`]'s.
    pub fn a2e_send_device(
        &mut self,
        x: DeviceSlice<'_>,
        routing: Routing<'_>,
        stream: &Stream,
    ) -> Result<A2eHandle> {
        let mode = self.ctx.cfg.mode;
        self.attention("A2E send", |ctx, dispatch, _| {
            let fabric = cuda_fabric(ctx, "A2E send")?;
            let deadline = ctx.call_deadline();
            order_after(ctx, fabric, stream)?;
            let (topk_idx, topk_weights) = routing_on_host(ctx, fabric, routing, deadline)?;
            let tokens = topk_idx.len() / ctx.cfg.topk.max(1);
            let len = tokens * ctx.layout.a2e.payload;
            check_buffer(fabric.device(), "x", x.ptr(), x.len(), Need::Exactly(len))?;
            if mode == crate::TransferMode::Pull {
                super::through_relays(ctx, "pull A2E")?;
            }
            let (idx, weights) = (&topk_idx[..], &topk_weights[..]);
            let x = x.ptr().addr();
            dispatch.send_device(ctx, x, tokens, idx, weights, mode.into(), deadline)
        })
    }

    /// [`Communicator::e2a_recv`] into `out` (`[T, hidden]`) in device memory of this
    /// communicator's device. Ordered after the work queued on `stream`; the rows are in `out`
    /// when it returns. The failure rule is [`Communicator::e2a_recv`]'s.
    pub fn e2a_recv_device(
        &mut self,
        handle: &A2eHandle,
        out: DeviceSliceMut<'_>,
        stream: &Stream,
    ) -> Result<()> {
        self.attention("E2A receive", |ctx, dispatch, combine| {
            let fabric = cuda_fabric(ctx, "E2A receive")?;
            let sent = dispatch.oldest(ctx, handle)?;
            let len = sent.num_tokens * ctx.layout.e2a_stride;
            check_buffer(
                fabric.device(),
                "out",
                out.ptr(),
                out.len(),
                Need::Exactly(len),
            )?;
            order_after(ctx, fabric, stream)?;
            let deadline = ctx.call_deadline();
            combine.recv(ctx, sent, OutRows::Device(out.ptr().addr()), deadline)?;
            dispatch.retire();
            handle.answered();
            Ok(())
        })
    }

    /// [`Communicator::a2e_recv`] with the rows written into `out` (device memory of this
    /// communicator's device, at least [`Communicator::max_expert_rows`] rows of `hidden`
    /// elements): rows `0..batch.num_rows()` of `out` are the batch's rows, grouped by local
    /// expert; `batch` carries everything else and its own rows stay empty. Ordered after the
    /// work queued on `stream` (the previous use of `out`). Not with `keep_int8`.
    pub fn a2e_recv_device(
        &mut self,
        batch: &mut ExpertBatch,
        out: DeviceSliceMut<'_>,
        stream: &Stream,
    ) -> Result<()> {
        let rows = self.max_expert_rows();
        self.a2e_recv_lent(out, rows, stream, |ctx, dispatch, out, deadline| {
            dispatch.recv_expert_major(ctx, batch, Some(out), deadline)
        })
    }

    /// Tokens a token-major device receive may need at most on this rank: every attention
    /// rank's every token. The `out` of [`Communicator::a2e_recv_tokens_device`] holds this
    /// many rows. 0 on attention ranks.
    pub fn max_recv_tokens(&self) -> usize {
        let ctx = &self.ctx;
        match self.role() {
            crate::Role::Expert => ctx.attention().len() * ctx.cfg.max_tokens_per_rank,
            crate::Role::Attention => 0,
        }
    }

    /// [`Communicator::a2e_recv_tokens`] with the rows written into `out` (device memory of
    /// this communicator's device, at least [`Communicator::max_recv_tokens`] rows): row `i`
    /// of `out` is the batch's token `i`; `batch` carries everything else and its own rows
    /// stay empty. `on_arrival(batch, tokens)` runs once a source's rows are in `out`.
    /// Ordered after the work queued on `stream`. Not with `keep_int8`.
    pub fn a2e_recv_tokens_device(
        &mut self,
        batch: &mut TokenBatch,
        out: DeviceSliceMut<'_>,
        stream: &Stream,
        on_arrival: &mut dyn FnMut(&TokenBatch, std::ops::Range<usize>),
    ) -> Result<()> {
        let rows = self.max_recv_tokens();
        self.a2e_recv_lent(out, rows, stream, |ctx, dispatch, out, deadline| {
            dispatch.recv_tokens(ctx, batch, Some(out), on_arrival, deadline)
        })
    }

    /// An A2E receive into the lent `out` (at least `rows` rows of the dtype): checked,
    /// ordered after `stream`, then `receive(context, dispatch, out's address, deadline)`.
    fn a2e_recv_lent(
        &mut self,
        out: DeviceSliceMut<'_>,
        rows: usize,
        stream: &Stream,
        receive: impl FnOnce(&Context, &mut DispatchReceiver, u64, Instant) -> Result<()>,
    ) -> Result<()> {
        let need = rows * self.ctx.layout.a2e.payload;
        self.expert("A2E receive", |ctx, dispatch, _| {
            let fabric = cuda_fabric(ctx, "A2E receive")?;
            no_kept_int8(ctx)?;
            let (ptr, len) = (out.ptr(), out.len());
            check_buffer(fabric.device(), "out", ptr, len, Need::AtLeast(need))?;
            order_after(ctx, fabric, stream)?;
            receive(ctx, dispatch, ptr.addr(), ctx.call_deadline())
        })
    }

    /// [`Communicator::e2a_send_tokens`] with `reduced` (one row per token of `batch`,
    /// `[batch.num_tokens(), hidden]`) in device memory of this communicator's device. Ordered
    /// after the work queued on `stream`; `reduced` may be reused once it returns. The failure
    /// rule is [`Communicator::e2a_send_tokens`]'s.
    pub fn e2a_send_tokens_device(
        &mut self,
        batch: &TokenBatch,
        reduced: DeviceSlice<'_>,
        stream: &Stream,
    ) -> Result<()> {
        let lent = ("reduced", reduced, batch.num_tokens());
        self.e2a_send_lent(&batch.recv, batch.sources(), lent, stream, |at| {
            Replies::TokensDevice(at)
        })
    }

    /// [`Communicator::e2a_send`] with `expert_out` (one output row per row of `batch`,
    /// `[batch.num_rows(), hidden]`) in device memory of this communicator's device. Ordered
    /// after the work queued on `stream`; `expert_out` may be reused once it returns. The
    /// failure rule is [`Communicator::e2a_send`]'s.
    pub fn e2a_send_device(
        &mut self,
        batch: &ExpertBatch,
        expert_out: DeviceSlice<'_>,
        stream: &Stream,
    ) -> Result<()> {
        let lent = ("expert_out", expert_out, batch.num_rows());
        self.e2a_send_lent(&batch.recv, batch.sources(), lent, stream, |out| {
            Replies::ReduceDevice { batch, out }
        })
    }

    /// An E2A send of the rows in the lent buffer `(name, rows_in, rows)` (`rows` rows of the
    /// dtype) for the receive `recv` from `sources`: checked, ordered after `stream`, then sent
    /// as `replies(address)` says.
    fn e2a_send_lent<'b>(
        &mut self,
        recv: &Received,
        sources: &'b [crate::SourceInfo],
        (name, rows_in, rows): (&str, DeviceSlice<'_>, usize),
        stream: &Stream,
        replies: impl FnOnce(u64) -> Replies<'b>,
    ) -> Result<()> {
        let mode = self.ctx.cfg.mode;
        self.expert("E2A send", |ctx, dispatch, combine| {
            let fabric = cuda_fabric(ctx, "E2A send")?;
            dispatch.check_reply(ctx, recv.comm, recv.epoch)?;
            let len = rows * ctx.layout.e2a_stride;
            let (ptr, got) = (rows_in.ptr(), rows_in.len());
            check_buffer(fabric.device(), name, ptr, got, Need::Exactly(len))?;
            order_after(ctx, fabric, stream)?;
            let replies = replies(ptr.addr());
            send_e2a(ctx, dispatch, combine, recv.epoch, sources, mode, replies)?;
            recv.answered();
            Ok(())
        })
    }
}
