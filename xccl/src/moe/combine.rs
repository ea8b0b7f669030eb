//! E2A (combine): expert ranks send weighted sums back; attention ranks add them up.
//!
//! E2A call `e` answers A2E call `e` (same epoch) and uses buffer `e % max_in_flight` of
//! records and staging; pushed replies go to the landing buffer of the source's A2E record (see
//! [`crate::moe::window_layout`]).
//!
//! Sender ([`CombineSender`], expert rank `d`): after credit `e - max_in_flight` from every
//! attention rank, for each source `s` (rotated by `d`) it puts the record, then the reply rows
//! in chunks into `s`'s reply area at the offset `s` named in its A2E record (push) or into its
//! own staging at the token's index in the batch (pull), signalling `e2a_ready[d] =
//! progress(e, rows)` after each chunk.
//!
//! Receiver ([`CombineReceiver`], attention rank `s`): one pass over every expert rank's progress
//! per wake-up; every token whose rows have all arrived (below the watermark) is combined at
//! once. Each record is checked (epoch, check word, row count equal to what was dispatched to
//! that rank, offset equal to the one assigned, or inside the sender's staging for pull), and an
//! error names the expert rank.
//!
//! # The exact arithmetic (bit for bit, documented in the API)
//! - On the expert rank, for each received token with local experts `j` ascending (their
//!   gating weights `w_j` as dispatched, expert outputs `y_j` in the wire dtype): `acc = 0.0f32`,
//!   then `acc = acc + w_j * f32(y_j)` element by element (a product then a sum, never a fused
//!   multiply-add), then one rounding of `acc` to the wire dtype (round to nearest even). The
//!   token-major and view paths take the caller's already-reduced row as it is.
//! - On the attention rank, for each token: no contributing expert rank gives zeros; one gives
//!   its row unchanged; several give `acc = f32(r_first)`, then `acc = acc + f32(r)` for each
//!   further contribution in ascending expert-rank order, then one rounding to the dtype.
//! - With INT8 replies (`MoeConfig::e2a_quant`), the expert quantizes each reduced row (see
//!   `moe::quant`) and the attention rank dequantizes inside the sum: `f32(r)` above becomes
//!   `f32(q) * scale`, and a single INT8 contribution is dequantized and rounded once.
//!
//! Both sides' sums are planned here (which rows, which weights, in which order: one
//! [`super::dataplane::SumRow`] per token) and executed by the data plane
//! ([`super::dataplane`]), whose host and CUDA backends give the same bits. The relay's own
//! reduction (`relay`) still sums on the host.

use std::time::Instant;

use super::batch::{AlignedBytes, ExpertBatch, SourceInfo};
use super::config::TransferMode;
use super::context::{CheckDue, Context};
use super::dataplane::host::HostPlane;
use super::dataplane::{CopyRun, DataPlane, SumRow, SumTerm};
use super::device_rows::{Conversion, DeviceRows, OutRows, Scratch};
use super::dispatch::Sent;
use super::progress::{chunk_rows, progress, Progress};
use super::quant::{dequantize_to, int8_payload, Quant, Quantizer};
use super::record::{Record, WireMode};
use super::routing::DispatchLayout;
use crate::fabric::Waiting;
use crate::{Error, Result};

/// Writes reply row `t` of a view into `(rank, offset)`: `(context, token, rank, offset)`.
pub(crate) type FillRow<'a> = dyn FnMut(&Context, usize, usize, usize) -> Result<()> + 'a;

/// How the reply rows of one E2A call are produced.
pub(crate) enum Replies<'a> {
    /// The expert-major outputs of a batch (`[num_rows, hidden]` bytes): each token's rows are
    /// weighted and summed as the module docs say.
    Reduce {
        /// The batch the outputs belong to.
        batch: &'a ExpertBatch,
        /// One output row per batch row.
        out: &'a [u8],
    },
    /// [`Replies::Reduce`] with the outputs in device memory (cuda fabric): `out` is the
    /// device address of `[num_rows, hidden]` rows (checked by the caller); the sums run on
    /// the data plane straight into the destination windows.
    ReduceDevice {
        /// The batch the outputs belong to.
        batch: &'a ExpertBatch,
        /// The device address of the first output row.
        out: u64,
    },
    /// One reduced row per token of the batch (`[num_tokens, hidden]` bytes).
    Tokens(&'a [u8]),
    /// [`Replies::Tokens`] in device memory (cuda fabric): the device address of the first
    /// row (the caller checked the buffer); copied on the device into the windows.
    TokensDevice(u64),
    /// Already written into this rank's staging (registered output): records and signals only.
    Staged,
    /// Written by a callback where each goes (a view's reply in the dtype).
    Fill(&'a mut FillRow<'a>),
    /// INT8 rows quantized (and so checked) by the caller before the send, one per token of the
    /// call (`[num_tokens, int8 stride]` bytes; a view's INT8 reply): put as they are.
    Quantized(&'a [u8]),
}

/// Whether a relay leaves the E2A replies for its members where they landed in its window, and
/// each member sums its tokens' contributions there, as the direct path's attention rank sums
/// its own window's (`moe::relay`): on fabrics with load/store access, replies in the dtype.
pub(crate) fn relay_sums_at_members(ctx: &Context) -> bool {
    ctx.fabric.capabilities().load_store && ctx.cfg.e2a_quant != Quant::Int8
}

/// A relay's own reduced replies, one row per token of its batch in the dtype, when its
/// reduction reads them where the caller has them instead of from a copy in its window:
/// replies given as token rows, not INT8 on the wire, and summed by the relay (not by its
/// members: [`relay_sums_at_members`], which needs them in the window).
pub(crate) fn own_replies_in_place<'a>(ctx: &Context, replies: &Replies<'a>) -> Option<&'a [u8]> {
    match replies {
        Replies::Tokens(rows)
            if !relay_sums_at_members(ctx) && ctx.cfg.e2a_quant != Quant::Int8 =>
        {
            Some(rows)
        }
        _ => None,
    }
}

/// The expert side of E2A.
#[derive(Debug, Default)]
pub(crate) struct CombineSender {
    /// One reduced reply row (INT8 replies are quantized from it).
    row: Vec<u8>,
    /// Executes the weighted sums this side plans (host memory today; boxed, as the device
    /// backend will be).
    plane: Box<HostPlane>,
    /// The plan of one [`CombineSender::reduce_rows`] (scratch, reused).
    sum_rows: Vec<SumRow>,
    sum_terms: Vec<SumTerm>,
    /// Reply rows computed here: one chunk in the dtype, put at once; with INT8 replies every
    /// token's quantized row, computed (and checked) before the first put.
    stage: Vec<u8>,
    pub(crate) quant: Quantizer,
    /// One reply row a view's caller fills before it goes out (lent by
    /// [`CombineSender::take_scratch`]).
    scratch: AlignedBytes,
    /// The epoch whose registered output `prepare_output` handed out.
    output_for: Option<u64>,
    /// Where [`CombineSender::quantize_all_device`] left this call's INT8 replies (device
    /// scratch).
    device_quantized: Option<u64>,
}

impl CombineSender {
    /// Prepares the registered output of the reply to call `epoch`: waits for its buffer to be
    /// free and notes that the caller writes the rows.
    pub(crate) fn prepare_output(
        &mut self,
        ctx: &Context,
        epoch: u64,
        deadline: Instant,
    ) -> Result<()> {
        ctx.wait_credits(
            epoch,
            ctx.previous_sources(epoch),
            ctx.slots.e2a_credit(0),
            "E2A credit (attention rank has not consumed an earlier combine)",
            deadline,
        )?;
        self.output_for = Some(epoch);
        Ok(())
    }

    /// The registered output prepared for call `epoch`: `tokens` rows in this rank's staging;
    /// `None` when the window is not mapped here.
    // The slice is window memory, shared with peers through the fabric, not through `ctx`:
    // exclusivity comes from the protocol (see the SAFETY comment), not from a Rust borrow.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn output<'c>(
        &mut self,
        ctx: &'c Context,
        epoch: u64,
        tokens: usize,
    ) -> Result<Option<&'c mut [u8]>> {
        if self.output_for != Some(epoch) {
            return Err(Error::invalid("the registered output was not prepared"));
        }
        let at = ctx.layout.e2a_stage(ctx.layout.buffer(epoch));
        let len = tokens * ctx.layout.e2a_stride;
        // SAFETY: attention ranks read this buffer's staging only between our signal of a call
        // using it and their credit for it; `prepare_output` waited for the last such call, and
        // the communicator hands the slice out under its own `&mut self`, so the signal of this
        // reply (`e2a_send_output`) cannot go out while the slice lives.
        unsafe { super::regions::exclusive(ctx, ctx.rank, at, len) }
    }

    /// The staging buffer, lent to a view that quantizes its INT8 reply itself
    /// ([`Replies::Quantized`]); [`CombineSender::give_stage`] returns it, keeping its capacity.
    pub(crate) fn take_stage(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.stage)
    }

    /// Returns the buffer [`CombineSender::take_stage`] lent.
    pub(crate) fn give_stage(&mut self, stage: Vec<u8>) {
        self.stage = stage;
    }

    /// Lends the one-row scratch (aligned for every dtype), until
    /// [`CombineSender::give_scratch`].
    pub(crate) fn take_scratch(&mut self) -> AlignedBytes {
        std::mem::take(&mut self.scratch)
    }

    /// Returns the scratch [`CombineSender::take_scratch`] lent.
    pub(crate) fn give_scratch(&mut self, scratch: AlignedBytes) {
        self.scratch = scratch;
    }

    /// Whether the registered output of call `epoch` was prepared (and so may be sent); it stays
    /// prepared until [`CombineSender::take_output`].
    pub(crate) fn output_prepared(&self, epoch: u64) -> bool {
        self.output_for == Some(epoch)
    }

    /// Whether the registered output of call `epoch` was prepared; it is given up (sent).
    pub(crate) fn take_output(&mut self, epoch: u64) -> bool {
        if self.output_for == Some(epoch) {
            self.output_for = None;
            true
        } else {
            false
        }
    }

    /// Sends the E2A of call `epoch` to every source of `sources` (rank order, tokens at
    /// `first_token..first_token + count`). Nothing is written before the credit wait returns.
    pub(crate) fn send(
        &mut self,
        ctx: &Context,
        epoch: u64,
        sources: &[SourceInfo],
        mode: TransferMode,
        mut replies: Replies<'_>,
        deadline: Instant,
    ) -> Result<()> {
        let ranks = ctx.attention();
        if sources.len() != ranks.len() || sources.iter().zip(ranks).any(|(s, &r)| s.rank != r) {
            return Err(Error::invalid("batch does not come from this communicator"));
        }
        let buf = ctx.layout.buffer(epoch);
        let staged = matches!(replies, Replies::Staged);
        let int8 = !staged && ctx.cfg.e2a_quant == Quant::Int8;
        let p = ctx.layout.e2a_stride;
        self.row.resize(p, 0);
        // The whole reply is quantized (so checked) before anything is written.
        self.quantize_all(ctx, &replies, int8, sources)?;
        ctx.wait_credits(
            epoch,
            ctx.previous_sources(epoch),
            ctx.slots.e2a_credit(0),
            "E2A credit (attention rank has not consumed an earlier combine)",
            deadline,
        )?;
        let my_index = ctx.topo.expert_index(ctx.rank).expect("expert rank");
        let stride = ctx.layout.e2a_stride_for(int8);
        let mode = if staged { TransferMode::Pull } else { mode };
        let slot = ctx.slots.e2a_ready(ctx.rank);
        let chunk = chunk_rows(stride, ctx.cfg.chunk_bytes);
        let n = ranks.len();
        let part = ctx.call_sources(epoch);
        for step in 0..n {
            let i = (my_index + step) % n;
            if part.len() != n && !part.contains(&i) {
                // Not in this call's DP domain: no message.
                continue;
            }
            let s = ranks[i];
            let info = sources[i];
            let count = info.count;
            let (dst, base, offset) = match mode {
                TransferMode::Push => (
                    s,
                    ctx.layout.e2a_recv(info.reply_buffer) + info.reply_offset * stride,
                    info.reply_offset,
                ),
                TransferMode::Pull => (
                    ctx.rank,
                    ctx.layout.e2a_stage(buf) + info.first_token * stride,
                    info.first_token,
                ),
            };
            // The record goes first: the receiver may start on the first chunk.
            let rec = Record::with_payload(epoch, count as u32, offset as u32, mode, int8);
            ctx.put_record(s, ctx.layout.record(my_index, buf), &rec)?;
            fault_point!("e2a.record");
            if matches!(replies, Replies::Staged) {
                ctx.signal(s, slot, progress(epoch, count))?;
                fault_point!("e2a.signal");
                continue;
            }
            if count > 0 && ctx.record_signals() {
                // The record's own signal: the receiver checks it while the rows are written.
                ctx.signal_quiet(s, slot, progress(epoch, 0))?;
            }
            let mut done = 0;
            loop {
                let rows = done..(done + chunk).min(count);
                let first = info.first_token + rows.start;
                let at = base + rows.start * stride;
                self.fill_rows(ctx, &mut replies, int8, first, rows.len(), dst, at)?;
                done = rows.end;
                fault_point!("e2a.chunk");
                ctx.signal(s, slot, progress(epoch, done))?;
                fault_point!("e2a.signal");
                if done == count {
                    break;
                }
            }
        }
        Ok(())
    }

    /// With INT8 replies, quantizes the reply row of every token of the call (`sources` in
    /// rank order) into the staging, before anything is written: a non-finite row is an
    /// [`Error::InvalidArgument`] naming the token, and the call has published nothing.
    /// [`CombineSender::fill_rows`] then puts the staged rows. Nothing to do in the dtype (no
    /// reply row can fail there) or for rows the caller quantized or staged itself.
    fn quantize_all(
        &mut self,
        ctx: &Context,
        replies: &Replies<'_>,
        int8: bool,
        sources: &[SourceInfo],
    ) -> Result<()> {
        if !int8 {
            return Ok(());
        }
        let tokens = call_tokens(sources);
        let (p, stride) = (ctx.layout.e2a_stride, ctx.layout.e2a_stride_for(true));
        match replies {
            Replies::Quantized(q) if q.len() != tokens * stride => {
                return Err(Error::invalid(format!(
                    "{} bytes of INT8 replies for {tokens} tokens of {stride} bytes",
                    q.len()
                )))
            }
            Replies::Fill(_) => {
                return Err(Error::invalid(
                    "INT8 replies are quantized before the send, not filled in place",
                ))
            }
            // Quantized by the caller (a view's, in the stage it borrowed) or staged already.
            Replies::Quantized(_) | Replies::Staged => return Ok(()),
            Replies::ReduceDevice { batch, out } => {
                return self.quantize_all_device(ctx, Some((batch, *out)), 0, tokens);
            }
            Replies::TokensDevice(reduced) => {
                return self.quantize_all_device(ctx, None, *reduced, tokens);
            }
            Replies::Reduce { .. } | Replies::Tokens(_) => {}
        }
        let mut stage = std::mem::take(&mut self.stage);
        stage.resize(tokens * stride, 0);
        let rows = stage.chunks_exact_mut(stride).enumerate();
        let staged = match replies {
            Replies::Reduce { batch, out } => rows.into_iter().try_for_each(|(t, slot)| {
                let mut row = std::mem::take(&mut self.row);
                let reduced = self.reduce_rows(ctx, batch, out, t, 1, &mut row, p);
                self.row = row;
                reduced?;
                quantize_reply(&mut self.quant, ctx, &self.row, t, slot)
            }),
            Replies::Tokens(reduced) => rows.into_iter().try_for_each(|(t, slot)| {
                quantize_reply(&mut self.quant, ctx, &reduced[t * p..(t + 1) * p], t, slot)
            }),
            _ => unreachable!("handled above"),
        };
        self.stage = stage;
        staged
    }

    /// Writes the replies of batch tokens `first..first + n` at `(dst, at)`, one row after the
    /// other; rows computed here are staged and put at once. INT8 rows were all quantized
    /// before the send ([`CombineSender::quantize_all`]): one put of the chunk's.
    #[allow(clippy::too_many_arguments)]
    fn fill_rows(
        &mut self,
        ctx: &Context,
        replies: &mut Replies<'_>,
        int8: bool,
        first: usize,
        n: usize,
        dst: usize,
        at: usize,
    ) -> Result<()> {
        let p = ctx.layout.e2a_stride;
        let stride = ctx.layout.e2a_stride_for(int8);
        match replies {
            Replies::ReduceDevice { batch, out } => {
                let reduce = Some((*batch, *out));
                return self.fill_rows_device(ctx, reduce, 0, int8, (first, n), (dst, at));
            }
            Replies::TokensDevice(reduced) => {
                return self.fill_rows_device(ctx, None, *reduced, int8, (first, n), (dst, at));
            }
            _ => {}
        }
        if int8 {
            let staged = match replies {
                Replies::Quantized(q) => q,
                _ => &self.stage[..],
            };
            return ctx.put(dst, at, &staged[first * stride..(first + n) * stride]);
        }
        match replies {
            // Rows computed here are staged for the chunk, then one put: one RDMA write
            // per chunk on fabrics without load/store access.
            Replies::Reduce { batch, out } => {
                let mut stage = std::mem::take(&mut self.stage);
                stage.resize(n * stride, 0);
                let sent = self
                    .reduce_rows(ctx, batch, out, first, n, &mut stage, stride)
                    .and_then(|()| ctx.put(dst, at, &stage));
                self.stage = stage;
                sent?;
            }
            Replies::Tokens(reduced) => {
                let bytes = &reduced[first * p..(first + n) * p];
                ctx.put(dst, at, bytes)?;
            }
            Replies::Fill(fill) => {
                for k in 0..n {
                    fill(ctx, first + k, dst, at + k * stride)?;
                }
            }
            Replies::Quantized(_) => {
                return Err(Error::invalid(
                    "INT8 replies on a communicator whose E2A replies are not INT8",
                ))
            }
            Replies::Staged => unreachable!("staged replies write no rows"),
            Replies::ReduceDevice { .. } | Replies::TokensDevice(_) => {
                unreachable!("written on the device above")
            }
        }
        Ok(())
    }

    /// [`CombineSender::send`] through relays: after credit `e - max_in_flight` from every
    /// relay, for each relay (rotated by this rank's index) the replies for each of its
    /// members' tokens go into the member's reply area on the relay at the offset the relay's
    /// header named, then one record and one signal per relay. Push, in the dtype or INT8
    /// (`MoeConfig::e2a_quant`). A relay's own replies to its members stay where the caller
    /// has them when [`own_replies_in_place`] gives them (the relay reduces them from there):
    /// the record and the signal still go out, so its wait counts them like everyone's.
    /// `after_chunk` runs after every signal (a relay combines what has landed so far there).
    pub(crate) fn send_relayed(
        &mut self,
        ctx: &Context,
        epoch: u64,
        sources: &[SourceInfo],
        mut replies: Replies<'_>,
        deadline: Instant,
        after_chunk: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let plan = ctx.topo.relay_plan().expect("relayed");
        let ranks = ctx.attention();
        if sources.len() != ranks.len() || sources.iter().zip(ranks).any(|(s, &r)| s.rank != r) {
            return Err(Error::invalid("batch does not come from this communicator"));
        }
        let l = &ctx.layout;
        let int8 = ctx.cfg.e2a_quant == Quant::Int8;
        self.row.resize(l.e2a_stride, 0);
        // The whole reply is quantized (so checked) before anything is written.
        self.quantize_all(ctx, &replies, int8, sources)?;
        ctx.wait_credits(
            epoch,
            plan.relays(),
            ctx.slots.e2a_credit(0),
            "E2A credit (relay has not consumed an earlier combine)",
            deadline,
        )?;
        let buf = l.buffer(epoch);
        let my_index = ctx.topo.expert_index(ctx.rank).expect("expert rank");
        let stride = l.e2a_stride_for(int8);
        let r_count = plan.count();
        let chunk = chunk_rows(stride, ctx.cfg.chunk_bytes);
        let slot = ctx.slots.e2a_ready(ctx.rank);
        for step in 0..r_count {
            let k = (my_index + step) % r_count;
            let relay = plan.relays()[k];
            let members = plan.members(k);
            let total: usize = members.iter().map(|&ai| sources[ai].count).sum();
            // The record goes first: the relay reduces each chunk as it lands.
            let rec = Record::with_payload(epoch, total as u32, 0, WireMode::Push, int8);
            ctx.put_record(relay, l.relay_e2a_record(my_index, buf), &rec)?;
            fault_point!("e2a.record");
            if total == 0 {
                ctx.signal(relay, slot, progress(epoch, 0))?;
                fault_point!("e2a.signal");
                after_chunk()?;
                continue;
            }
            if relay == ctx.rank && own_replies_in_place(ctx, &replies).is_some() {
                ctx.signal(relay, slot, progress(epoch, total))?;
                fault_point!("e2a.signal");
                after_chunk()?;
                continue;
            }
            // Rows for the members in member order, in chunks; the progress counts them all.
            let mut done = 0;
            for (m, &ai) in members.iter().enumerate() {
                let info = sources[ai];
                let base = l.relay_e2a(m, buf) + info.reply_offset * stride;
                let mut at = 0;
                while at < info.count {
                    let n = chunk.min(info.count - at);
                    let first = info.first_token + at;
                    let dst = base + at * stride;
                    self.fill_rows(ctx, &mut replies, int8, first, n, relay, dst)?;
                    at += n;
                    done += n;
                    fault_point!("e2a.chunk");
                    ctx.signal(relay, slot, progress(epoch, done))?;
                    fault_point!("e2a.signal");
                    after_chunk()?;
                }
            }
        }
        Ok(())
    }

    /// [`CombineSender::quantize_all`] of device outputs: every token's reply summed into
    /// device scratch, then quantized next to it, and the plane completed, so a non-finite
    /// row is an error before anything is written; [`CombineSender::fill_rows_device`] copies
    /// the quantized rows from there.
    /// Reduced rows (`reduce = None`) are quantized from where the caller has them (`reduced`).
    fn quantize_all_device(
        &mut self,
        ctx: &Context,
        reduce: Option<(&ExpertBatch, u64)>,
        reduced: u64,
        tokens: usize,
    ) -> Result<()> {
        let (p, stride) = (ctx.layout.e2a_stride, ctx.layout.e2a_stride_for(true));
        let deadline = ctx.call_deadline();
        let mut dev = ctx.device_rows()?;
        let sums = dev.scratch(Scratch::Call, tokens * (p + stride), deadline)?;
        let quantized = sums + (tokens * p) as u64;
        let rows_at = match reduce {
            Some((batch, out)) => {
                self.plan_sums(ctx, batch, out, 0, tokens, sums, p);
                sums
            }
            None => {
                self.sum_rows.clear();
                self.sum_terms.clear();
                reduced
            }
        };
        let (dtype, hidden) = (ctx.cfg.dtype, ctx.cfg.hidden);
        // SAFETY: the terms (and reduced rows) are rows of the caller's checked buffer, the
        // sums and the quantized rows distinct rows of this call's scratch, which nothing else
        // uses until the plane completes below.
        unsafe {
            dev.plane
                .sum_rows(dtype, hidden, &self.sum_rows, &self.sum_terms)?;
            let (from, to) = ((rows_at, p), (quantized, stride));
            dev.convert_rows(Conversion::Quantize, (dtype, hidden), tokens, from, to)?;
        }
        dev.plane
            .complete(deadline)
            .map_err(|e| match dev.plane.non_finite() {
                // The host path's error: quantize row `t` is the reply of token `t`.
                Some((t, i)) => Error::invalid(format!(
                "the reply of token {t} has a non-finite element at {i}: INT8 needs finite rows \
                 (nothing was sent)"
            )),
                None => e,
            })?;
        self.device_quantized = Some(quantized);
        Ok(())
    }

    /// [`CombineSender::fill_rows`] of device outputs: the replies of batch tokens
    /// `first..first + n` summed (or, INT8, copied from where
    /// [`CombineSender::quantize_all_device`] put them) into `dst`'s window at `at` on the
    /// device; the plane completes before the caller signals.
    #[allow(clippy::too_many_arguments)]
    fn fill_rows_device(
        &mut self,
        ctx: &Context,
        reduce: Option<(&ExpertBatch, u64)>,
        reduced: u64,
        int8: bool,
        (first, n): (usize, usize),
        (dst, at): (usize, usize),
    ) -> Result<()> {
        let stride = ctx.layout.e2a_stride_for(int8);
        let mut dev = ctx.device_rows()?;
        let into = dev.window(dst, at, n * stride)?;
        ctx.note_written(dst, n * stride);
        if int8 {
            let quantized = self
                .device_quantized
                .ok_or_else(|| Error::invalid("INT8 device replies were not quantized"))?;
            let run = CopyRun {
                src: quantized + (first * stride) as u64,
                dst: into,
                len: (n * stride) as u64,
            };
            // SAFETY: the source is this call's quantized rows in scratch, the destination
            // `n` rows inside `dst`'s window (range-checked), which the credit wait reserved
            // for this reply.
            unsafe { dev.plane.copy_runs(&[run])? };
        } else if reduce.is_none() {
            // Reduced rows: `n` consecutive rows, one copy.
            let p = ctx.layout.e2a_stride;
            let run = CopyRun {
                src: reduced + (first * p) as u64,
                dst: into,
                len: (n * p) as u64,
            };
            // SAFETY: the source is `n` rows of the caller's checked buffer, the destination
            // `n` rows inside `dst`'s window (range-checked) reserved by the credit wait.
            unsafe { dev.plane.copy_runs(&[run])? };
        } else if let Some((batch, out)) = reduce {
            self.plan_sums(ctx, batch, out, first, n, into, stride);
            let (dtype, hidden) = (ctx.cfg.dtype, ctx.cfg.hidden);
            // SAFETY: the terms are rows of the caller's checked output buffer, the
            // destinations `n` rows inside `dst`'s window (range-checked above) reserved for
            // this reply by the credit wait.
            unsafe {
                dev.plane
                    .sum_rows(dtype, hidden, &self.sum_rows, &self.sum_terms)?
            };
        }
        dev.plane.complete(ctx.call_deadline())
    }

    /// Plans the weighted sums of batch tokens `first..first + n` ([`SumRow`]s into
    /// `self.sum_rows`/`self.sum_terms`): for each, its rows' outputs at `out + r * row`
    /// (`row` = one dtype row) with their gating weights, in the batch's order, into `dst`,
    /// `stride` bytes apart. The addresses are in whatever memory `out` and `dst` are.
    #[allow(clippy::too_many_arguments)]
    fn plan_sums(
        &mut self,
        ctx: &Context,
        batch: &ExpertBatch,
        out: u64,
        first: usize,
        n: usize,
        dst: u64,
        stride: usize,
    ) {
        let p = ctx.layout.e2a_stride as u64;
        let (rows, terms) = (&mut self.sum_rows, &mut self.sum_terms);
        rows.clear();
        terms.clear();
        for k in 0..n {
            let start = terms.len() as u32;
            for &r in batch.token_rows(first + k) {
                terms.push(SumTerm {
                    src: out + u64::from(r) * p,
                    weight: batch.weight[r as usize],
                    int8: 0,
                });
            }
            rows.push(SumRow {
                dst: dst + (k * stride) as u64,
                first_term: start,
                num_terms: terms.len() as u32 - start,
                init_first: 0,
                reserved: 0,
            });
        }
    }

    /// Reduces tokens `first..first + n` of `batch` into the rows of `dst` (`stride` bytes
    /// apart, from its start): for each, `acc = 0; acc += w_j * y_j` over its rows (expert
    /// outputs `out`, in the batch's order), then one rounding to the wire dtype. The plan (which
    /// rows, which weights, in which order) is built here; the data plane executes it.
    #[allow(clippy::too_many_arguments)]
    fn reduce_rows(
        &mut self,
        ctx: &Context,
        batch: &ExpertBatch,
        out: &[u8],
        first: usize,
        n: usize,
        dst: &mut [u8],
        stride: usize,
    ) -> Result<()> {
        let p = ctx.layout.e2a_stride;
        assert!(stride >= p, "reduce_rows: rows overlap");
        assert!(
            n == 0 || dst.len() >= (n - 1) * stride + p,
            "reduce_rows: dst too short"
        );
        let rows_needed = (first..first + n)
            .flat_map(|t| batch.token_rows(t))
            .map(|&r| (r as usize + 1) * p)
            .max()
            .unwrap_or(0);
        assert!(out.len() >= rows_needed, "reduce_rows: out too short");
        let (out_at, dst_at) = (out.as_ptr() as u64, dst.as_mut_ptr() as u64);
        self.plan_sums(ctx, batch, out_at, first, n, dst_at, stride);
        // SAFETY: every term is a whole row of `out` (its length checked above) and every destination
        // a whole row of `dst` (its length checked above), which the exclusive borrow keeps from
        // every other access for the call; the host plane completes before it returns.
        unsafe {
            self.plane.sum_rows(
                ctx.cfg.dtype,
                ctx.cfg.hidden,
                &self.sum_rows,
                &self.sum_terms,
            )
        }
    }
}

/// Tokens of one call whose sources are `sources` (each source's tokens consecutive).
fn call_tokens(sources: &[SourceInfo]) -> usize {
    sources
        .iter()
        .map(|s| s.first_token + s.count)
        .max()
        .unwrap_or(0)
}

/// Quantizes `row` (token `t`'s reply in the dtype) into `out` (an INT8 row): the row's amax
/// pass checks it is finite (else an [`Error::InvalidArgument`] naming the token and the
/// element), then one quantizing pass.
pub(crate) fn quantize_reply(
    quant: &mut Quantizer,
    ctx: &Context,
    row: &[u8],
    t: usize,
    out: &mut [u8],
) -> Result<()> {
    let amax = quant.amax(ctx.cfg.dtype, row).map_err(|i| {
        Error::invalid(format!(
            "the reply of token {t} has a non-finite element at {i}: INT8 needs finite rows \
             (nothing was sent)"
        ))
    })?;
    let q = &mut out[..int8_payload(ctx.cfg.hidden)];
    quant.quantize_amax(ctx.cfg.dtype, row, amax, q);
    Ok(())
}

/// An attention rank's per-token sums: which expert ranks answer each token, in ascending
/// order, planned as one [`SumRow`] per token and executed by the data plane (scratch reused
/// across calls).
#[derive(Debug, Default)]
struct TokenSums {
    /// Contributions fetched from windows not mapped here, one slot each.
    fetched: Vec<u8>,
    /// Per expert index, the next of its layout entries (rows in token order).
    cursors: Vec<usize>,
    /// The current token's contributions: (expert index, row among that rank's rows).
    contributions: Vec<(usize, usize)>,
    /// The current token's plan.
    terms: Vec<SumTerm>,
    /// Executes the plan in host memory.
    plane: Box<HostPlane>,
    /// The plan of the device rows planned since the last flush (scratch, reused).
    device_rows: Vec<SumRow>,
    device_terms: Vec<SumTerm>,
}

/// Where contribution `(j, i)` (row `i` of expert index `j`'s replies) lies: its window's rank,
/// the row's offset, whether it is INT8.
type RowAt<'a> = dyn Fn(usize, usize) -> (usize, usize, bool) + 'a;

impl TokenSums {
    /// Starts a call whose dispatch layout is `hl` (expert ranks `experts`).
    fn begin(&mut self, hl: &DispatchLayout, experts: &[usize]) {
        self.cursors.clear();
        self.cursors
            .extend(experts.iter().map(|&d| hl.entries(d).start));
        self.device_rows.clear();
        self.device_terms.clear();
    }

    /// Token `t`'s contributions into `self.contributions`, in ascending expert order (tokens
    /// in ascending order, each once).
    fn next_contributions(&mut self, hl: &DispatchLayout, experts: &[usize], t: usize) {
        self.contributions.clear();
        for (j, &d) in experts.iter().enumerate() {
            let e = self.cursors[j];
            let r = hl.entries(d);
            if e < r.end && hl.token(e) == t {
                self.cursors[j] += 1;
                self.contributions.push((j, e - r.start));
            }
        }
    }

    /// [`TokenSums::combine`] into device memory: plans token `t`'s [`SumRow`] into the
    /// device address `dst` with every contribution read where it landed (every window is
    /// mapped on the device), queued by [`TokenSums::flush_device`].
    #[allow(clippy::too_many_arguments)]
    fn plan_device(
        &mut self,
        ctx: &Context,
        hl: &DispatchLayout,
        experts: &[usize],
        t: usize,
        row_at: &RowAt<'_>,
        dev: &DeviceRows,
        dst: u64,
    ) -> Result<()> {
        let (hidden, p) = (ctx.cfg.hidden, ctx.layout.e2a_stride);
        self.next_contributions(hl, experts, t);
        let first_term = self.device_terms.len() as u32;
        for &(j, i) in &self.contributions {
            let (rank, at, int8) = row_at(j, i);
            let len = if int8 { int8_payload(hidden) } else { p };
            self.device_terms.push(SumTerm {
                src: dev.window(rank, at, len)?,
                weight: 1.0,
                int8: int8 as u32,
            });
        }
        self.device_rows.push(SumRow {
            dst,
            first_term,
            num_terms: self.contributions.len() as u32,
            init_first: 1,
            reserved: 0,
        });
        Ok(())
    }

    /// Queues the sums [`TokenSums::plan_device`] planned since the last flush.
    fn flush_device(&mut self, ctx: &Context, dev: &mut DeviceRows) -> Result<()> {
        // SAFETY: every term is a whole landed row inside a window (range-checked by
        // `DeviceRows::window`), not written again before this call's credit, which goes out
        // after the plane completes; every destination is a distinct row of the caller's
        // checked output buffer.
        let queued = unsafe {
            dev.plane.sum_rows(
                ctx.cfg.dtype,
                ctx.cfg.hidden,
                &self.device_rows,
                &self.device_terms,
            )
        };
        self.device_rows.clear();
        self.device_terms.clear();
        queued
    }

    /// Writes token `t`'s combined row into `out_row` (tokens in ascending order, each once;
    /// every contribution landed): no contribution gives zeros, one its row (an INT8 row
    /// dequantized and rounded once), several their f32 sum in ascending expert order rounded
    /// once ([`SumRow`] with `init_first`). Rows are read where they lie when `mapped` (every
    /// window they can be in is mapped here), else fetched first.
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &mut self,
        ctx: &Context,
        hl: &DispatchLayout,
        experts: &[usize],
        t: usize,
        mapped: bool,
        row_at: &RowAt<'_>,
        out_row: &mut [u8],
    ) -> Result<()> {
        let (hidden, p) = (ctx.cfg.hidden, ctx.layout.e2a_stride);
        self.next_contributions(hl, experts, t);
        let n = self.contributions.len();
        if !mapped && n == 1 && !row_at(self.contributions[0].0, self.contributions[0].1).2 {
            // One row in the dtype from a window not mapped here: fetched straight into place.
            let (j, i) = self.contributions[0];
            let (rank, at, _) = row_at(j, i);
            return ctx.get(rank, at, out_row);
        }
        // Every contribution's address: where it landed, or a slot it is fetched into (all
        // slots sized before any address is taken, so none moves; also where `mapped` holds,
        // so a window that turns out not to be mapped is fetched rather than indexed past).
        let slot = p.max(int8_payload(hidden));
        if self.fetched.len() < n * slot {
            self.fetched.resize(n * slot, 0);
        }
        self.terms.clear();
        for (c, &(j, i)) in self.contributions.iter().enumerate() {
            let (rank, at, int8) = row_at(j, i);
            let len = if int8 { int8_payload(hidden) } else { p };
            // SAFETY: the caller combines token `t` only once every contribution has landed (a
            // progress signal covers it), and its writer writes that buffer again only after
            // this call's credit, which goes out after the receive returns (or, where credits
            // are implied, once this rank names the buffer as the landing buffer of a later
            // A2E, after this call has retired).
            let src = match unsafe { super::regions::landed(ctx, rank, at, len)? } {
                Some(row) => row.as_ptr() as u64,
                None => {
                    let into = &mut self.fetched[c * slot..c * slot + len];
                    ctx.get(rank, at, into)?;
                    into.as_ptr() as u64
                }
            };
            self.terms.push(SumTerm {
                src,
                weight: 1.0,
                int8: int8 as u32,
            });
        }
        let row = SumRow {
            dst: out_row.as_mut_ptr() as u64,
            first_term: 0,
            num_terms: n as u32,
            init_first: 1,
            reserved: 0,
        };
        assert_eq!(
            out_row.len(),
            p,
            "combine: an output row of the wrong length"
        );
        // SAFETY: every term addresses a whole landed row (or INT8 payload) that nobody writes
        // until this call's credit (see above) or a fetched slot of `self.fetched`, not resized
        // since; the destination is `out_row`, borrowed exclusively, of one row's length.
        unsafe {
            self.plane.sum_rows(
                ctx.cfg.dtype,
                hidden,
                std::slice::from_ref(&row),
                &self.terms,
            )
        }
    }
}

/// The attention side of E2A.
#[derive(Debug, Default)]
pub(crate) struct CombineReceiver {
    acc: Vec<f32>,
    row: Vec<u8>,
    sums: TokenSums,
    /// Per expert rank of the call being received: its record once read, and the rows it has
    /// delivered (scratch, reused so a call allocates nothing).
    recs: Vec<Option<(Record, WireMode)>>,
    delivered: Vec<usize>,
}

impl CombineReceiver {
    /// Whether every contribution to the E2A of `sent` has landed, without waiting: then
    /// [`CombineReceiver::recv`] of it waits for no peer.
    pub(crate) fn ready(ctx: &Context, sent: &Sent) -> Result<bool> {
        let epoch = sent.epoch;
        let landed = |peer: usize, count: usize| {
            let p = Progress::of(ctx.slot_value(ctx.slots.e2a_ready(peer)), epoch);
            Ok(p != Progress::NotYet && p.rows(count) >= count)
        };
        if let Some(plan) = ctx.topo.relay_plan() {
            let index = ctx.topo.attention_index(ctx.rank).expect("attention rank");
            let relay = plan.relay_rank_of(index);
            return ctx.all_done([relay], &|r| landed(r, sent.num_tokens));
        }
        ctx.all_done(ctx.experts().iter().copied(), &|d| {
            landed(d, sent.layout.count(d))
        })
    }

    /// [`CombineReceiver::recv`] through a relay: one record from this rank's relay, then
    /// either one fully reduced row per token, copied as it is (or, INT8, dequantized and
    /// rounded once), or (a pull record: [`relay_sums_at_members`]) every token's
    /// contributions where the expert ranks wrote them in this rank's reply area on the relay,
    /// summed here as the direct path sums them, as the relay's progress says they are
    /// complete; then the relay is credited.
    fn recv_relayed(
        &mut self,
        ctx: &Context,
        sent: &Sent,
        mut out: OutRows<'_>,
        deadline: Instant,
    ) -> Result<()> {
        let plan = ctx.topo.relay_plan().expect("relayed");
        let epoch = sent.epoch;
        let l = &ctx.layout;
        let buf = l.buffer(epoch);
        let index = ctx.topo.attention_index(ctx.rank).expect("attention rank");
        let relay = plan.relay_rank_of(index);
        let j = ctx
            .topo
            .expert_index(relay)
            .expect("relays are expert ranks");
        let t = sent.num_tokens;
        // The relay's record, once read: its rows are INT8, they are summed here (pull).
        let mut rec: Option<(bool, bool)> = None;
        let mut failure: Option<Error> = None;
        let mut copied = 0;
        let (row, acc) = (&mut self.row, &mut self.acc);
        let experts = ctx.experts();
        self.sums.begin(&sent.layout, experts);
        let sums = &mut self.sums;
        // Contributions summed here lie in this rank's reply area on the relay, at the offsets
        // of its A2E rows (grouped by expert rank, as the direct path's reply area).
        let area = l.relay_e2a(plan.member_slot(index), buf);
        let row_at = |j: usize, i: usize| {
            let at = area + (sent.offsets[j] + i) * l.e2a_stride;
            (relay, at, false)
        };
        let mapped = ctx.mapped(relay);
        // Rows are copied out (or summed) chunk by chunk as the relay's progress covers them.
        let mut take = |rows: std::ops::Range<usize>, (int8, pull): (bool, bool)| -> Result<()> {
            let p = l.e2a_stride;
            let out = match &mut out {
                OutRows::Host(out) => out,
                OutRows::Device(base) => {
                    // The relay pushes reduced rows (pull needs load/store access, which the
                    // cuda fabric has not): copied or dequantized on the device.
                    let s = l.e2a_stride_for(int8);
                    let at = l.e2a_recv(buf) + rows.start * s;
                    return take_device(ctx, (at, s), rows, int8, *base);
                }
            };
            if pull {
                for t in rows {
                    let out_row = &mut out[t * p..(t + 1) * p];
                    sums.combine(ctx, &sent.layout, experts, t, mapped, &row_at, out_row)?;
                }
                return Ok(());
            }
            if !int8 {
                let at = l.e2a_recv(buf) + rows.start * p;
                return ctx.get(ctx.rank, at, &mut out[rows.start * p..rows.end * p]);
            }
            // One INT8 row per token: dequantized and rounded once, straight into `out`.
            let (s, payload) = (l.e2a_stride_for(true), int8_payload(ctx.cfg.hidden));
            row.resize(rows.len() * s, 0);
            ctx.get(ctx.rank, l.e2a_recv(buf) + rows.start * s, row)?;
            for (i, t) in rows.enumerate() {
                let q = &row[i * s..i * s + payload];
                dequantize_to(q, ctx.cfg.dtype, acc, &mut out[t * p..(t + 1) * p]);
            }
            Ok(())
        };
        ctx.wait(deadline, &mut || {
            let p = Progress::of(ctx.slot_value(ctx.slots.e2a_ready(relay)), epoch);
            if p == Progress::NotYet {
                return Some(Waiting::on(relay, "relayed E2A"));
            }
            if rec.is_none() {
                let checked = ctx.read_record(l.record(j, buf)).and_then(|r| {
                    let mode = r.validate(relay, epoch, t, 1)?;
                    let pull = mode == WireMode::Pull;
                    if r.count as usize != t
                        || r.offset != 0
                        || !(mode == WireMode::Push || pull && !r.int8())
                    {
                        return Err(Error::Protocol {
                            peer: relay,
                            detail: format!(
                                "relayed E2A of epoch {epoch} brings {} rows at offset {} \
                                 ({mode:?}, int8 {}); {t} tokens were sent, push or (rows \
                                 summed here) pull in the dtype",
                                r.count,
                                r.offset,
                                r.int8()
                            ),
                        });
                    }
                    Ok((r.int8(), pull))
                });
                match checked {
                    Ok(r) => {
                        ctx.note_rows_received(relay, t);
                        rec = Some(r);
                    }
                    Err(e) => {
                        failure = Some(e);
                        return None;
                    }
                }
            }
            // The relay's record says whether its rows are INT8 (as the expert ranks' replies
            // were).
            let ready = p.rows(t);
            if ready > copied {
                if let Err(e) = take(copied..ready, rec.expect("read above")) {
                    failure = Some(e);
                    return None;
                }
                copied = ready;
            }
            if copied < t {
                return Some(Waiting::on(relay, "relayed E2A rows").at(copied as u64 + 1));
            }
            None
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        credit_after_receipt(ctx, relay, epoch)?;
        fault_point!("e2a.credit");
        Ok(())
    }

    /// Receives the E2A of `sent` and writes each token's combined row into `out`
    /// (`[num_tokens, hidden]` bytes, checked by the caller); then credits every expert rank.
    pub(crate) fn recv(
        &mut self,
        ctx: &Context,
        sent: &Sent,
        out: OutRows<'_>,
        deadline: Instant,
    ) -> Result<()> {
        let mut out = out;
        if ctx.topo.relay_plan().is_some() {
            return self.recv_relayed(ctx, sent, out, deadline);
        }
        let mut dev = match out {
            OutRows::Device(_) => Some(ctx.device_rows()?),
            OutRows::Host(_) => None,
        };
        let epoch = sent.epoch;
        let buf = ctx.layout.buffer(epoch);
        let experts = ctx.experts();
        let hl = &sent.layout;
        let t_count = sent.num_tokens;
        let p = ctx.layout.e2a_stride;
        let (max_rows, expert_rows) = (ctx.layout.attention_rows, ctx.layout.expert_rows());
        self.recs.clear();
        self.recs.resize(experts.len(), None);
        self.delivered.clear();
        self.delivered.resize(experts.len(), 0);
        let (recs, delivered) = (&mut self.recs, &mut self.delivered);
        let mut next_token = 0usize;
        let mut failure: Option<Error> = None;
        let mut next_check = CheckDue::default();
        self.sums.begin(hl, experts);
        let sums = &mut self.sums;
        // Whether every window a reply row can be in is mapped here (then rows are read where
        // they landed).
        let windows_mapped = ctx.fabric.local_window().is_some()
            && experts.iter().all(|&d| ctx.fabric.peer_window(d).is_some());
        let mut pass = || -> Result<Option<Waiting>> {
            let mut waiting = None;
            for (j, &d) in experts.iter().enumerate() {
                let count = hl.count(d);
                if recs[j].is_some() && delivered[j] == count {
                    continue;
                }
                let p = Progress::of(ctx.slot_value(ctx.slots.e2a_ready(d)), epoch);
                if p == Progress::NotYet {
                    waiting.get_or_insert(Waiting::on(d, "E2A record"));
                    continue;
                }
                if recs[j].is_none() {
                    let rec = ctx.read_record(ctx.layout.record(j, buf))?;
                    let mode = rec.validate(d, epoch, max_rows, 1)?;
                    ctx.note_rows_received(d, rec.count as usize);
                    let bad = |detail: String| Err(Error::Protocol { peer: d, detail });
                    if rec.count as usize != count {
                        return bad(format!(
                            "E2A of epoch {epoch} brings {} rows, {count} tokens were dispatched \
                             to it",
                            rec.count
                        ));
                    }
                    match mode {
                        WireMode::Gather => {
                            return bad("E2A record in gather mode (only A2E gathers)".into())
                        }
                        WireMode::Push if rec.offset as usize != sent.offsets[j] => {
                            return bad(format!(
                                "E2A of epoch {epoch} wrote its rows at row {}, the A2E record \
                                 assigned row {}",
                                rec.offset, sent.offsets[j]
                            ));
                        }
                        WireMode::Push => {}
                        WireMode::Pull => rec.check_region(d, expert_rows, "its E2A staging")?,
                    }
                    recs[j] = Some((rec, mode));
                }
                delivered[j] = p.rows(count);
                if delivered[j] < count {
                    waiting.get_or_insert(Waiting::on(d, "E2A rows"));
                }
            }
            // Watermark: the first token some expert rank has not delivered yet.
            let watermark = experts
                .iter()
                .enumerate()
                .map(|(j, &d)| {
                    let r = hl.entries(d);
                    if delivered[j] == r.len() {
                        t_count
                    } else {
                        hl.token(r.start + delivered[j])
                    }
                })
                .min()
                .unwrap_or(t_count);
            let recs_now = &*recs;
            let row_at = |j: usize, i: usize| {
                let (rec, mode) = recs_now[j].expect("delivered rows have a record");
                let stride = ctx.layout.e2a_stride_for(rec.int8());
                let (rank, at) = match mode {
                    WireMode::Push => (
                        ctx.rank,
                        ctx.layout.e2a_recv(sent.landing) + (sent.offsets[j] + i) * stride,
                    ),
                    _ => (
                        experts[j],
                        ctx.layout.e2a_stage(buf) + (rec.offset as usize + i) * stride,
                    ),
                };
                (rank, at, rec.int8())
            };
            while next_token < watermark {
                let t = next_token;
                match (&mut out, dev.as_deref()) {
                    (OutRows::Host(out), _) => {
                        let out_row = &mut out[t * p..(t + 1) * p];
                        sums.combine(ctx, hl, experts, t, windows_mapped, &row_at, out_row)?;
                    }
                    (OutRows::Device(base), Some(dev)) => {
                        let dst = *base + (t * p) as u64;
                        sums.plan_device(ctx, hl, experts, t, &row_at, dev, dst)?;
                    }
                    (OutRows::Device(_), None) => unreachable!("device rows taken above"),
                }
                next_token += 1;
            }
            if let Some(dev) = dev.as_deref_mut() {
                sums.flush_device(ctx, dev)?;
            }
            if waiting.is_some() {
                let awaited = (0..experts.len())
                    .filter(|&j| recs[j].is_none() || delivered[j] < hl.count(experts[j]))
                    .map(|j| experts[j]);
                // An expert rank that left after its last signal is not missing: look again.
                let still = |d: usize| {
                    let count = hl.count(d);
                    let p = Progress::of(ctx.slot_value(ctx.slots.e2a_ready(d)), epoch);
                    p == Progress::NotYet || p.rows(count) < count
                };
                ctx.check_awaited_again(awaited, &mut next_check, &still)?;
            }
            // Records and rows seen so far (`Waiting::progress`).
            let parts = delivered.iter().sum::<usize>() + recs.iter().flatten().count();
            Ok(waiting.map(|w| w.at(parts as u64)))
        };
        ctx.wait(deadline, &mut || match pass() {
            Ok(w) => w,
            Err(e) => {
                failure = Some(e);
                None
            }
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        if let Some(dev) = dev.as_deref_mut() {
            // The rows are read before the credit lets the expert ranks write again.
            dev.plane.complete(deadline)?;
        }
        // Where credits are implied, the next A2E is this call's credit.
        let implied = ctx.implied_credits();
        for &d in experts {
            if !implied {
                credit_after_receipt(ctx, d, epoch)?;
            }
            fault_point!("e2a.credit");
        }
        Ok(())
    }
}

/// A relayed E2A receive's tokens `rows` into device rows at `base` (one row of the dtype
/// each): from this rank's window at `at` (rows `s` bytes apart), copied in one run or, INT8,
/// dequantized; complete when it returns (before the relay's credit).
fn take_device(
    ctx: &Context,
    (at, s): (usize, usize),
    rows: std::ops::Range<usize>,
    int8: bool,
    base: u64,
) -> Result<()> {
    let p = ctx.layout.e2a_stride;
    let mut dev = ctx.device_rows()?;
    let src = dev.window(ctx.rank, at, rows.len() * s)?;
    let dst = base + (rows.start * p) as u64;
    // SAFETY: the sources are the relay's signalled rows inside this rank's window
    // (range-checked), untouched until this rank's credit; the destinations are rows of the
    // caller's checked device buffer.
    unsafe {
        if int8 {
            let of = (ctx.cfg.dtype, ctx.cfg.hidden);
            let n = rows.len();
            dev.convert_rows(Conversion::Dequantize, of, n, (src, s), (dst, p))?;
        } else {
            let len = (rows.len() * p) as u64;
            dev.plane.copy_runs(&[CopyRun { src, dst, len }])?;
        }
    }
    dev.plane.complete(ctx.call_deadline())
}

/// Credits `peer` for E2A call `epoch`, whose every row has arrived. A peer that has left the
/// job since (an expert rank whose loop ended with this reply, and which dropped its fabric)
/// needs no credit, and the call has succeeded: that is not this call's failure (a peer that
/// died instead is reported by the next call that waits for it).
fn credit_after_receipt(ctx: &Context, peer: usize, epoch: u64) -> Result<()> {
    match ctx.signal(peer, ctx.slots.e2a_credit(ctx.rank), epoch) {
        Err(Error::PeerFailed { .. }) => Ok(()),
        other => other,
    }
}
