//! The protocol's side of a view (`crate::TokenView`, which lives with the communicator):
//! where an A2E call's rows are read in place until the E2A reply, receiving them, and the
//! reply's rows.
//!
//! A view waits for every source and hands back the rows in place: this rank's receive area
//! (push), the sender's staging (pull) or the sender's registered input (gather); rows in windows
//! not mapped in this process are fetched once into a private buffer. The senders' buffers stay
//! reserved until the view replies — the credits that free them go out then — so the rows cannot
//! change under the caller. The reply ([`send_reply`]) hands the caller each token's input row
//! and the output row where the reply goes (the attention rank's window when it is mapped here),
//! so an identity expert costs one copy for the whole E2A.

use super::batch::TokenBatch;
use super::combine::{quantize_reply, CombineSender, Replies};
use super::config::TransferMode;
use super::context::Context;
use super::dispatch::{DispatchReceiver, Message};
use super::dtype::Element;
use super::quant::{dequantize_to, Quant};
use super::regions;
use crate::{Error, Result};

/// Where a view's rows are: each source's message, and the rows fetched for sources whose
/// windows are not mapped here. Kept by the receiver between views (with the view's metadata,
/// [`DispatchReceiver::spare_view`]), so a view allocates nothing once these have grown.
#[derive(Debug, Default)]
pub(crate) struct ViewRows {
    messages: Vec<Message>,
    landing: Vec<u8>,
    /// Per source: where its payloads start in `landing`, if fetched.
    fetched: Vec<Option<usize>>,
    /// Scratch of a fetch: one raw row, and its elements widened to f32.
    raw: Vec<u8>,
    wide: Vec<f32>,
}

impl ViewRows {
    /// Token `i`'s payload bytes (the token's source index `s`, row `r`, token id `token`).
    fn payload<'a>(&'a self, ctx: &'a Context, s: usize, r: usize, token: u32) -> Result<&'a [u8]> {
        let p = ctx.layout.a2e.payload;
        if let Some(at) = self.fetched[s] {
            return Ok(&self.landing[at + r * p..at + (r + 1) * p]);
        }
        let (rank, at) = self.messages[s].payload_at(ctx, r, token);
        // SAFETY: the source signalled progress covering every row of its message before the
        // view was built, and it writes this buffer again only after our A2E credit for this
        // call, which goes out when the view replies or drops: both need the view itself, so no
        // borrow handed out by it is alive then.
        let landed = unsafe { regions::landed(ctx, rank, at, p)? };
        landed.ok_or_else(|| Error::invalid("view row not mapped and not fetched"))
    }
}

/// What a view needs once its call has been received (owned, so receiving can fail without
/// holding any borrow).
pub(crate) struct ViewParts {
    pub(crate) epoch: u64,
    pub(crate) rows: ViewRows,
    pub(crate) meta: TokenBatch,
}

impl ViewParts {
    /// Receives the next A2E call for a view and fetches the rows of windows not mapped here.
    pub(crate) fn receive(
        ctx: &Context,
        receiver: &mut DispatchReceiver,
        deadline: std::time::Instant,
    ) -> Result<Self> {
        let (mut rows, mut meta) = receiver.spare_view.take().unwrap_or_default();
        let epoch = match receiver.recv_view(ctx, &mut meta, &mut rows.messages, deadline) {
            Ok(epoch) => epoch,
            Err(e) => {
                *receiver.spare_view = Some((rows, meta));
                return Err(e);
            }
        };
        // The epoch is taken: a later receive would wait for the next one, and nobody could
        // reply to this one. Any failure from here poisons (and aborts the job at once),
        // however retryable the error is in itself.
        ctx.note_consumed();
        rows.fetched.clear();
        rows.fetched.resize(rows.messages.len(), None);
        rows.landing.clear();
        if let Err(e) = Self::fetch(ctx, &meta, &mut rows) {
            // The call fails (and poisons) with `e`: not with the drop of its metadata.
            meta.recv.answered();
            return Err(e);
        }
        Ok(ViewParts { epoch, rows, meta })
    }

    /// Fetches the rows of the sources whose windows are not mapped here (or are INT8).
    fn fetch(ctx: &Context, meta: &TokenBatch, rows: &mut ViewRows) -> Result<()> {
        let p = ctx.layout.a2e.payload;
        for (s, info) in meta.sources().iter().enumerate() {
            let msg = rows.messages[s];
            if msg.count() == 0 || (!msg.int8 && ctx.mapped(msg.payload_at(ctx, 0, 0).0)) {
                continue;
            }
            // Not mapped here, or INT8 (dequantized once into the dtype): fetched.
            let at = rows.landing.len();
            rows.landing.resize(at + msg.count() * p, 0);
            let (raw, wide) = (&mut rows.raw, &mut rows.wide);
            raw.resize(msg.payload_len(ctx), 0);
            for r in 0..msg.count() {
                let token = meta.src_token()[info.first_token() + r];
                let (rank, off) = msg.payload_at(ctx, r, token);
                let out = &mut rows.landing[at + r * p..at + (r + 1) * p];
                if msg.int8 {
                    ctx.get(rank, off, raw)?;
                    dequantize_to(raw, ctx.cfg.dtype, wide, out);
                } else {
                    ctx.get(rank, off, out)?;
                }
            }
            rows.fetched[s] = Some(at);
        }
        Ok(())
    }
}

/// The reply of `TokenView::e2a_send`: every row filled (and with INT8 replies quantized)
/// and sent, `scratch` holding one row where a reply cannot be written in place.
pub(crate) fn send_reply<T: Element>(
    ctx: &Context,
    sender: &mut CombineSender,
    rows: &ViewRows,
    meta: &TokenBatch,
    (epoch, mode, deadline): (u64, TransferMode, std::time::Instant),
    scratch: &mut [T],
    fill: &mut impl FnMut(usize, &[T], &mut [T]),
) -> Result<()> {
    let n = meta.num_tokens();
    if ctx.cfg.e2a_quant == Quant::Int8 {
        // Every row computed and quantized before anything is written: a non-finite
        // row fails here, with nothing sent.
        let stride = ctx.layout.e2a_stride_for(true);
        let mut stage = sender.take_stage();
        stage.resize(n * stride, 0);
        let mut quant = std::mem::take(&mut sender.quant);
        let staged = stage
            .chunks_exact_mut(stride)
            .enumerate()
            .try_for_each(|(t, slot)| {
                fill(t, row_of::<T>(ctx, rows, meta, t)?, scratch);
                quantize_reply(&mut quant, ctx, bytemuck::cast_slice(scratch), t, slot)
            });
        sender.quant = quant;
        let sources = meta.sources();
        let sent = staged.and_then(|()| {
            let replies = Replies::Quantized(&stage);
            sender.send(ctx, epoch, sources, mode, replies, deadline)
        });
        sender.give_stage(stage);
        sent
    } else {
        // Every row is found before anything is written (none can fail later).
        for t in 0..n {
            row_of::<T>(ctx, rows, meta, t)?;
        }
        let p = ctx.layout.e2a_stride;
        let mut write = |ctx: &Context, t: usize, dst: usize, at: usize| -> Result<()> {
            let input = row_of::<T>(ctx, rows, meta, t)?;
            // SAFETY: the sender waited for the credit of this buffer's previous use
            // from every attention rank before writing anything (where credits are
            // implied, each attention rank named this buffer free in its record), and
            // signals the progress covering this row only after this closure returns;
            // until then nobody reads or writes the row, and the slice does not outlive
            // this call.
            match unsafe { regions::exclusive(ctx, dst, at, p)? } {
                Some(out) => match bytemuck::try_cast_slice_mut::<u8, T>(out) {
                    Ok(out) => fill(t, input, out),
                    // Not aligned for `T` (never on the fabrics xccl has): via a row.
                    Err(_) => {
                        fill(t, input, scratch);
                        out.copy_from_slice(bytemuck::cast_slice(scratch));
                    }
                },
                None => {
                    fill(t, input, scratch);
                    ctx.put(dst, at, bytemuck::cast_slice(scratch))?;
                }
            }
            Ok(())
        };
        let replies = Replies::Fill(&mut write);
        sender.send(ctx, epoch, meta.sources(), mode, replies, deadline)
    }
}

/// Token `i`'s row in place, typed.
pub(crate) fn row_of<'a, T: Element>(
    ctx: &'a Context,
    rows: &'a ViewRows,
    meta: &TokenBatch,
    i: usize,
) -> Result<&'a [T]> {
    if T::DTYPE != ctx.cfg.dtype {
        return Err(Error::invalid(format!(
            "view rows are {}, asked for {}",
            ctx.cfg.dtype.name(),
            T::DTYPE.name()
        )));
    }
    if i >= meta.num_tokens() {
        return Err(Error::invalid(format!(
            "token {i} out of range: the view holds {}",
            meta.num_tokens()
        )));
    }
    // Sources hold consecutive token ranges in rank order: the first not ending by `i`.
    let sources = meta.sources();
    let s = sources.partition_point(|s| s.first_token() + s.count() <= i);
    let r = i - sources[s].first_token();
    let bytes = rows.payload(ctx, s, r, meta.src_token()[i])?;
    bytemuck::try_cast_slice(bytes).map_err(|e| {
        Error::invalid(format!(
            "row {i} is not aligned for {}: {e}",
            T::DTYPE.name()
        ))
    })
}
