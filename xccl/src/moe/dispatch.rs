//! A2E (dispatch): attention ranks send token rows to expert ranks.
//!
//! Sender ([`DispatchSender`], attention rank `s`, call epoch `e`, buffer `b = e % max_in_flight`
//! of records and staging, landing buffer `l` of receive areas, [`DispatchSender::landing`]):
//! 1. validate everything and build the [`DispatchLayout`]; nothing is written before this, and
//!    a call past `max_in_flight` unanswered calls fails here at once;
//! 2. wait for credit `e - max_in_flight` from every expert rank (the buffer's previous user is
//!    consumed everywhere);
//! 3. per expert rank `d` (rotated by `s` to spread incast): put the [`Record`] first, then the
//!    rows for `d` in chunks — into `d`'s receive area `l` (push) or into this rank's staging
//!    (pull) — signalling `a2e_ready[s] = progress(e, rows)` after each chunk. With a registered input
//!    (gather) only metadata rows are written; receivers read the payloads from the input.
//!
//! Receiver ([`DispatchReceiver`], expert rank `d`): one pass over all sources per wake-up until
//! every message of epoch `e` is complete; each record is checked against the epoch, its check
//! word and the exact region its count and offset address, and each row's metadata against the
//! token and expert ranges, every error naming the sender. Rows are copied out with `get` (one
//! bulk `get` per chunk from windows that are not mapped here), expert-major ([`ExpertBatch`]),
//! token-major as each source streams in ([`TokenBatch`]), or described for a view. Credit `e`
//! goes back to every source once the rows are out of the window (for a view, once it replies).

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;

use super::batch::{A2eHandle, ExpertBatch, Received, SourceInfo, TokenBatch};
use super::context::{CheckDue, Context};
use super::dataplane::{CopyRun, DataPlane, QuantRow};
use super::device_rows::{Conversion, Scratch};
use super::progress::{chunk_rows, progress, Progress};
use super::quant::{dequantize_to, scale_of, Quant, Quantizer};
use super::record::{Record, WireMode};
use super::regions;
use super::relay::{read_header, wire_order, HeaderEntry, Relay};
use super::routing::DispatchLayout;
use super::view::ViewRows;
use crate::fabric::Waiting;
use crate::{Error, Result};

/// One A2E call an attention rank has sent and not yet received the E2A of.
#[derive(Debug, Default)]
pub(crate) struct Sent {
    pub(crate) epoch: u64,
    pub(crate) num_tokens: usize,
    pub(crate) layout: DispatchLayout,
    /// Row offset of each expert rank's rows (by expert index) in staging and reply areas.
    pub(crate) offsets: Vec<usize>,
    /// With INT8 A2E: each token's `max |x|`, found while validating (reused by the
    /// quantizing copy to every destination).
    pub(crate) amax: Vec<f32>,
    /// The landing buffer its records name ([`DispatchSender::landing`]): where its pushed rows
    /// are in the expert ranks' receive areas and its replies in this rank's E2A receive area.
    pub(crate) landing: usize,
}

/// Where a call's payload rows come from.
#[derive(Clone, Copy)]
enum Payloads<'a> {
    /// The caller's `[T, hidden]` bytes.
    Caller(&'a [u8]),
    /// The registered input of this buffer, in this rank's window at this offset.
    Input(usize),
    /// The caller's `[T, hidden]` rows in device memory (cuda fabric), at this device
    /// address (the caller checked the buffer).
    Device(u64),
}

/// The attention side of A2E: sends calls and keeps each until its E2A is received.
#[derive(Debug)]
pub(crate) struct DispatchSender {
    last_epoch: u64,
    in_flight: VecDeque<Sent>,
    spare: Vec<Sent>,
    /// The epoch whose registered input `input` handed out.
    input_epoch: Option<u64>,
    /// Encoded rows of one chunk (fabrics without load/store access) or metadata rows.
    stage: Vec<u8>,
    /// One payload row read from the registered input (pull from a window not mapped here).
    row: Vec<u8>,
    /// One encoded INT8 row (payload, scale, metadata).
    qrow: Vec<u8>,
    quant: Quantizer,
    /// Scratch: the rows' `max |x|` of the call being planned (INT8 A2E).
    amax: Vec<f32>,
    /// Scratch: the route table of a call through a relay.
    table: Vec<u8>,
    /// Scratch: the payload copies of one chunk of device rows.
    device_runs: Vec<CopyRun>,
    /// The user tag the next call carries to every expert rank it reaches.
    tag: u64,
    /// The landing buffer of the last call sent.
    last_landing: usize,
}

impl DispatchSender {
    /// A sender whose first call is `epoch_base + 1`.
    pub(crate) fn new(epoch_base: u64) -> Self {
        DispatchSender {
            last_epoch: epoch_base,
            in_flight: VecDeque::new(),
            spare: Vec::new(),
            input_epoch: None,
            stage: Vec::new(),
            row: Vec::new(),
            qrow: Vec::new(),
            quant: Quantizer::default(),
            amax: Vec::new(),
            table: Vec::new(),
            device_runs: Vec::new(),
            tag: 0,
            last_landing: 0,
        }
    }

    /// Sets the user tag of the next call that publishes (consumed by it).
    pub(crate) fn set_tag(&mut self, tag: u64) {
        self.tag = tag;
    }

    /// The epoch of this rank's next call: the next one, or with DP domains the next of its
    /// domain's turns.
    fn next_epoch(&self, ctx: &Context) -> u64 {
        let d = ctx.topo.num_domains() as u64;
        let index = ctx.topo.attention_index(ctx.rank).expect("attention rank");
        let mine = ctx.topo.domain_of(index).0 as u64;
        let mut e = self.last_epoch + 1;
        while ctx.call_of(e) % d != mine {
            e += 1;
        }
        e
    }

    /// The landing buffer of call `epoch`: the receive areas (the expert ranks' A2E, this rank's
    /// E2A) its rows land in. Where credits are implied ([`Context::implied_credits`]) this
    /// rank knows which buffers are free (no call waiting for its E2A uses them: an expert rank
    /// replies only once it is done with a call's rows), so it takes the last call's buffer
    /// when that call was answered, the one the caches hold, and otherwise the first free one:
    /// back-to-back round trips touch one buffer instead of rotating through `max_in_flight`
    /// (at T=512 the rotation put the working set past the L3). Elsewhere credits are signalled
    /// per epoch, and call `e` lands in buffer `e % max_in_flight`.
    fn landing(&self, ctx: &Context, epoch: u64) -> usize {
        if !ctx.implied_credits() {
            return ctx.layout.buffer(epoch);
        }
        let busy = |b: usize| self.in_flight.iter().any(|s| s.landing == b);
        if !busy(self.last_landing) {
            return self.last_landing;
        }
        (0..ctx.cfg.max_in_flight)
            .find(|&b| !busy(b))
            .expect("check_room leaves a buffer free")
    }

    /// Fails at once when `max_in_flight` calls already wait for their E2A.
    fn check_room(&self, ctx: &Context) -> Result<()> {
        let depth = ctx.cfg.max_in_flight;
        if self.in_flight.len() >= depth {
            return Err(Error::invalid(format!(
                "{} A2E calls already wait for their E2A (max_in_flight is {depth}): receive the \
                 E2A of epoch {} before the next A2E",
                self.in_flight.len(),
                self.in_flight.front().map_or(0, |s| s.epoch)
            )));
        }
        Ok(())
    }

    /// Validates the call and builds its routing; nothing is written anywhere.
    fn plan(
        &mut self,
        ctx: &Context,
        num_tokens: usize,
        topk_idx: &[i32],
        topk_weights: &[f32],
        payloads: Payloads<'_>,
    ) -> Result<Sent> {
        self.check_room(ctx)?;
        if num_tokens > ctx.cfg.max_tokens_per_rank {
            return Err(Error::invalid(format!(
                "{num_tokens} tokens exceed max_tokens_per_rank {}",
                ctx.cfg.max_tokens_per_rank
            )));
        }
        // Filled here and swapped into the call's `Sent` (whose old list comes back as the
        // next call's scratch): no allocation per call.
        let amax = &mut self.amax;
        amax.clear();
        if ctx.cfg.a2e_quant == Quant::Int8 && !matches!(payloads, Payloads::Device(_)) {
            // INT8 needs finite rows: checked for every token before anything is written, and
            // each row's `max |x|` kept for the quantizing copies (device rows are quantized
            // on the device before the send: `send_device`).
            for t in 0..num_tokens {
                let x = Self::payload_of(ctx, payloads, t, &mut self.row)?;
                match self.quant.amax(ctx.cfg.dtype, x) {
                    Ok(a) => amax.push(a),
                    Err(i) => {
                        return Err(Error::invalid(format!(
                            "token {t} has a non-finite element at {i}: INT8 quantization needs \
                             finite hidden states"
                        )))
                    }
                }
            }
        }
        let mut sent = self.spare.pop().unwrap_or_default();
        if let Err(e) = sent.layout.build_into(
            &ctx.topo,
            ctx.rank,
            num_tokens,
            topk_idx,
            topk_weights,
            ctx.cfg.topk,
        ) {
            self.spare.push(sent);
            return Err(e);
        }
        let capacity = ctx.cfg.recv_rows_per_source();
        if let Some(&d) = ctx
            .experts()
            .iter()
            .find(|&&d| sent.layout.count(d) > capacity)
        {
            let rows = sent.layout.count(d);
            self.spare.push(sent);
            return Err(Error::invalid(format!(
                "this call would send {rows} rows to expert rank {d}, more than its receive \
                 capacity of {capacity} rows per attention rank (MoeConfig::recv_capacity); \
                 nothing was sent"
            )));
        }
        ctx.stats.borrow_mut().dropped_slots += sent.layout.dropped() as u64;
        sent.num_tokens = num_tokens;
        std::mem::swap(&mut sent.amax, &mut self.amax);
        // Each destination's first row in the message: in expert-rank order, or through a relay
        // in its wire order.
        let experts = ctx.experts();
        sent.offsets.clear();
        sent.offsets.resize(experts.len(), 0);
        let mut acc = 0;
        let place = |j: usize| {
            sent.offsets[j] = acc;
            acc += sent.layout.count(experts[j]);
        };
        match ctx.topo.relay_plan() {
            Some(plan) => {
                let index = ctx.topo.attention_index(ctx.rank).expect("attention rank");
                wire_order(ctx, plan.relay_rank_of(index)).for_each(place);
            }
            None => (0..experts.len()).for_each(place),
        }
        Ok(sent)
    }

    /// A2E send of `x` (`[T, hidden]` bytes of the communicator's dtype).
    pub(crate) fn send(
        &mut self,
        ctx: &Context,
        x: &[u8],
        topk_idx: &[i32],
        topk_weights: &[f32],
        mode: WireMode,
        deadline: Instant,
    ) -> Result<A2eHandle> {
        let payload = ctx.layout.a2e.payload;
        if !x.len().is_multiple_of(payload) {
            return Err(Error::invalid(format!(
                "x has {} bytes, not a whole number of rows of hidden {} x {}",
                x.len(),
                ctx.cfg.hidden,
                ctx.cfg.dtype.name()
            )));
        }
        let payloads = Payloads::Caller(x);
        let sent = self.plan(ctx, x.len() / payload, topk_idx, topk_weights, payloads)?;
        self.transmit(ctx, sent, payloads, mode, deadline)
    }

    /// A2E send of `num_tokens` rows at device address `x` (cuda fabric; the caller checked
    /// the buffer). With INT8 A2E every row is quantized into device scratch first and the
    /// plane completed, so a non-finite row is an error before anything is written.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send_device(
        &mut self,
        ctx: &Context,
        x: u64,
        num_tokens: usize,
        topk_idx: &[i32],
        topk_weights: &[f32],
        mode: WireMode,
        deadline: Instant,
    ) -> Result<A2eHandle> {
        let payloads = Payloads::Device(x);
        let sent = self.plan(ctx, num_tokens, topk_idx, topk_weights, payloads)?;
        if ctx.cfg.a2e_quant == Quant::Int8 && mode != WireMode::Gather {
            if let Err(e) = Self::quantize_device(ctx, x, num_tokens, deadline) {
                self.spare.push(sent);
                return Err(e);
            }
        }
        self.transmit(ctx, sent, payloads, mode, deadline)
    }

    /// Bytes from one INT8 payload to the next in the device scratch of
    /// [`DispatchSender::quantize_device`] (16-byte aligned).
    fn device_int8_stride(ctx: &Context) -> usize {
        ctx.layout.a2e.int8_payload.next_multiple_of(16)
    }

    /// Quantizes the `num_tokens` device rows at `x` into the device scratch (payload `t` at
    /// `t * device_int8_stride`) and completes, reporting a non-finite row.
    fn quantize_device(ctx: &Context, x: u64, num_tokens: usize, deadline: Instant) -> Result<()> {
        let (p, q) = (ctx.layout.a2e.payload, Self::device_int8_stride(ctx));
        let mut dev = ctx.device_rows()?;
        let scratch = dev.scratch(Scratch::Call, num_tokens * q, deadline)?;
        let (op, of) = (Conversion::Quantize, (ctx.cfg.dtype, ctx.cfg.hidden));
        // SAFETY: the sources are rows of the caller's checked device buffer, the destinations
        // distinct payloads of the scratch, which nothing else uses during the call.
        unsafe { dev.convert_rows(op, of, num_tokens, (x, p), (scratch, q))? };
        dev.plane
            .complete(deadline)
            .map_err(|e| match dev.plane.non_finite() {
                // The host path's error: quantize row `t` is token `t`.
                Some((t, i)) => Error::invalid(format!(
                    "token {t} has a non-finite element at {i}: INT8 quantization needs finite \
                 hidden states"
                )),
                None => e,
            })
    }

    /// Writes the full rows of plan `entries` from device payloads (the caller's rows at `x`,
    /// or, INT8, their quantized payloads in the device scratch) into `dst`'s window at `at`:
    /// one launch of payload copies, the metadata encoded here and scattered in one more; the
    /// plane completes before the caller signals.
    #[allow(clippy::too_many_arguments)]
    fn put_rows_device(
        &mut self,
        ctx: &Context,
        plan: &DispatchLayout,
        entries: Range<usize>,
        x: u64,
        (dst, at): (usize, usize),
        int8: bool,
    ) -> Result<()> {
        let row = ctx.layout.a2e;
        let stride = row.stride_for(int8);
        let count = entries.len();
        let mut dev = ctx.device_rows()?;
        let into = dev.window(dst, at, count * stride)?;
        let (src, src_stride) = if int8 {
            (
                dev.scratch_addr(Scratch::Call),
                Self::device_int8_stride(ctx),
            )
        } else {
            (x, row.payload)
        };
        let (meta_len, meta_at) = (row.meta_len(), row.meta_offset_for(int8));
        let payload_len = row.payload_for(int8) as u64;
        self.stage.resize(count * meta_len, 0);
        let mut payloads = std::mem::take(&mut self.device_runs);
        payloads.clear();
        let mut metas = std::mem::take(&mut dev.runs);
        metas.clear();
        for (i, e) in entries.enumerate() {
            let t = plan.token(e);
            let row_at = into + (i * stride) as u64;
            payloads.push(CopyRun {
                src: src + (t * src_stride) as u64,
                dst: row_at,
                len: payload_len,
            });
            let meta = &mut self.stage[i * meta_len..(i + 1) * meta_len];
            row.encode_meta(meta, t as u32, plan.mask(e), plan.weights(e));
            metas.push(CopyRun {
                src: (i * meta_len) as u64,
                dst: row_at + meta_at as u64,
                len: meta_len as u64,
            });
        }
        ctx.note_written(dst, count * stride);
        // SAFETY: the sources are rows of the caller's checked device buffer (or this call's
        // quantized payloads in scratch) and this rank's staged metadata; the destinations
        // (payloads and metadata of distinct rows) lie inside `dst`'s window (range-checked
        // above), reserved for this call by the credit wait.
        let queued = unsafe { dev.plane.copy_and_scatter(&payloads, &self.stage, &metas) };
        self.device_runs = payloads;
        dev.runs = metas;
        queued?;
        dev.plane.complete(ctx.call_deadline())
    }

    /// Prepares the registered input of the next call: waits for its buffer to be free and
    /// notes that the caller writes the rows for this call.
    pub(crate) fn prepare_input(&mut self, ctx: &Context, deadline: Instant) -> Result<()> {
        self.check_room(ctx)?;
        let epoch = self.next_epoch(ctx);
        ctx.wait_credits(
            epoch,
            ctx.experts(),
            ctx.slots.a2e_credit(0),
            "A2E credit (expert has not consumed an earlier dispatch)",
            deadline,
        )?;
        self.input_epoch = Some(epoch);
        Ok(())
    }

    /// The registered input prepared by [`DispatchSender::prepare_input`], `[max_tokens,
    /// hidden]` bytes in this rank's window; `None` when the window is not mapped here.
    // The slice is window memory, shared with peers through the fabric, not through `ctx`:
    // exclusivity comes from the protocol (see the SAFETY comment), not from a Rust borrow.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn input<'c>(&mut self, ctx: &'c Context) -> Result<Option<&'c mut [u8]>> {
        let epoch = self.next_epoch(ctx);
        if self.input_epoch != Some(epoch) {
            return Err(Error::invalid("the registered input was not prepared"));
        }
        let at = ctx.layout.a2e_input(ctx.layout.buffer(epoch));
        let len = ctx.cfg.max_tokens_per_rank * ctx.layout.a2e.payload;
        // SAFETY: peers read this buffer's input only between our signal of a call using it and
        // their credit for that call; `prepare_input` waited for the last such call, and the
        // communicator hands the slice out under its own `&mut self`, so this rank cannot
        // signal the next call (the only thing that lets peers read it) while the slice lives.
        unsafe { regions::exclusive(ctx, ctx.rank, at, len) }
    }

    /// A2E send of the first `num_tokens` rows of the registered input (handed out by
    /// [`DispatchSender::input`] for this call). On fabrics with load/store access only the
    /// routing metadata is written and receivers gather the rows; elsewhere rows are staged for
    /// them to pull.
    pub(crate) fn send_input(
        &mut self,
        ctx: &Context,
        num_tokens: usize,
        topk_idx: &[i32],
        topk_weights: &[f32],
        deadline: Instant,
    ) -> Result<A2eHandle> {
        let epoch = self.next_epoch(ctx);
        if self.input_epoch != Some(epoch) {
            return Err(Error::invalid(
                "a2e_send_input needs a2e_input first: the rows must be written for this call",
            ));
        }
        let input = Payloads::Input(ctx.layout.a2e_input(ctx.layout.buffer(epoch)));
        let sent = self.plan(ctx, num_tokens, topk_idx, topk_weights, input)?;
        // Gather reads the payloads from the input as they are; INT8 rows are staged instead.
        let mode = if ctx.fabric.capabilities().load_store && ctx.cfg.a2e_quant == Quant::None {
            WireMode::Gather
        } else {
            WireMode::Pull
        };
        self.transmit(ctx, sent, input, mode, deadline)
    }

    /// Sends one planned call. Before the credit wait returns nothing is written, and an error
    /// there gives the plan back; after it, an error leaves a half-sent call (the communicator
    /// poisons itself).
    fn transmit(
        &mut self,
        ctx: &Context,
        sent: Sent,
        payloads: Payloads<'_>,
        mode: WireMode,
        deadline: Instant,
    ) -> Result<A2eHandle> {
        let epoch = self.next_epoch(ctx);
        let relay;
        let credit_from = match ctx.topo.relay_plan() {
            Some(plan) => {
                let index = ctx.topo.attention_index(ctx.rank).expect("attention rank");
                relay = [plan.relay_rank_of(index)];
                &relay[..]
            }
            None => ctx.experts(),
        };
        if let Err(e) = ctx.wait_credits(
            epoch,
            credit_from,
            ctx.slots.a2e_credit(0),
            "A2E credit (expert has not consumed an earlier dispatch)",
            deadline,
        ) {
            self.spare.push(sent);
            return Err(e);
        }
        self.input_epoch = None;
        let sent = Sent {
            epoch,
            landing: self.landing(ctx, epoch),
            ..sent
        };
        self.write_all(ctx, &sent, epoch, payloads, mode)?;
        self.tag = 0;
        self.last_epoch = epoch;
        self.last_landing = sent.landing;
        let handle = A2eHandle::new(ctx, epoch, sent.num_tokens, sent.layout.total_entries());
        self.in_flight.push_back(sent);
        Ok(handle)
    }

    /// Writes every destination's record and rows of call `epoch`, signalling as it goes.
    fn write_all(
        &mut self,
        ctx: &Context,
        sent: &Sent,
        epoch: u64,
        payloads: Payloads<'_>,
        mode: WireMode,
    ) -> Result<()> {
        let layout = &ctx.layout;
        let row = layout.a2e;
        let buf = layout.buffer(epoch);
        let src_index = ctx.topo.attention_index(ctx.rank).expect("attention rank");
        let experts = ctx.experts();
        let n = experts.len();
        let slot = ctx.slots.a2e_ready(ctx.rank);
        let plan = &sent.layout;
        let int8 = mode != WireMode::Gather && ctx.cfg.a2e_quant == Quant::Int8;
        let stride = row.stride_for(int8);
        if let Some(plan) = ctx.topo.relay_plan() {
            return self.write_relayed(ctx, sent, epoch, payloads, int8, plan);
        }
        for step in 0..n {
            let j = (src_index + step) % n;
            let d = experts[j];
            let entries = plan.entries(d);
            let count = entries.len();
            // The record goes first: receivers may start on the first chunk. It names the
            // landing buffer where credits are implied (elsewhere the receiver knows it).
            let landing = if ctx.implied_credits() {
                sent.landing
            } else {
                0
            };
            let offset = sent.offsets[j] as u32;
            let rec = Record::a2e(epoch, count as u32, offset, mode, int8, landing, self.tag);
            ctx.put_record(d, layout.record(src_index, buf), &rec)?;
            fault_point!("a2e.record");
            if mode == WireMode::Gather {
                // Metadata only: the receiver gathers payloads from our registered input.
                self.stage.resize(count * row.meta_stride, 0);
                for (e, meta) in entries.zip(self.stage.chunks_exact_mut(row.meta_stride)) {
                    row.encode_meta(meta, plan.token(e) as u32, plan.mask(e), plan.weights(e));
                }
                let at = layout.a2e_stage(buf) + sent.offsets[j] * row.meta_stride;
                ctx.put(ctx.rank, at, &self.stage)?;
                fault_point!("a2e.chunk");
                ctx.signal(d, slot, progress(epoch, count))?;
                fault_point!("a2e.signal");
                continue;
            }
            if count > 0 && ctx.record_signals() {
                // The record's own signal (no rows yet): the receiver reads and checks it, and
                // reserves the rows, while this rank writes them.
                ctx.signal_quiet(d, slot, progress(epoch, 0))?;
            }
            let (dst, base) = match mode {
                WireMode::Push => (d, layout.a2e_recv(src_index, sent.landing)),
                _ => (ctx.rank, layout.a2e_stage(buf) + sent.offsets[j] * stride),
            };
            let direct = ctx.mapped(dst);
            let chunk = chunk_rows(stride, ctx.cfg.chunk_bytes);
            let mut done = 0;
            loop {
                let rows = done..(done + chunk).min(count);
                let at = base + rows.start * stride;
                let entries = entries.start + rows.start..entries.start + rows.end;
                self.put_chunk(ctx, sent, entries, payloads, (dst, at), (direct, int8))?;
                done = rows.end;
                fault_point!("a2e.chunk");
                ctx.signal(d, slot, progress(epoch, done))?;
                fault_point!("a2e.signal");
                if done == count {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Writes call `epoch` to this rank's relay: route table, one record, then every row
    /// (grouped by destination in the relay's [`wire_order`]) in chunks, signalling as it goes.
    fn write_relayed(
        &mut self,
        ctx: &Context,
        sent: &Sent,
        epoch: u64,
        payloads: Payloads<'_>,
        int8: bool,
        plan: &crate::topology::RelayPlan,
    ) -> Result<()> {
        let layout = &ctx.layout;
        let buf = layout.buffer(epoch);
        let src_index = ctx.topo.attention_index(ctx.rank).expect("attention rank");
        let relay = plan.relay_rank_of(src_index);
        let m = plan.member_slot(src_index);
        let plan_rows = &sent.layout;
        let table = &mut self.table;
        table.clear();
        table.extend_from_slice(&(sent.num_tokens as u32).to_le_bytes());
        for &d in ctx.experts() {
            table.extend_from_slice(&(plan_rows.count(d) as u32).to_le_bytes());
        }
        ctx.put(relay, layout.relay_table(m, buf), table)?;
        let count = plan_rows.total_entries();
        let rec = Record::a2e(epoch, count as u32, 0, WireMode::Push, int8, 0, self.tag);
        ctx.put_record(relay, layout.record(src_index, buf), &rec)?;
        fault_point!("a2e.record");
        let slot = ctx.slots.a2e_ready(ctx.rank);
        let stride = layout.a2e.stride_for(int8);
        let base = layout.relay_a2e(m, buf);
        let direct = ctx.mapped(relay);
        let chunk = chunk_rows(stride, ctx.cfg.chunk_bytes);
        if count == 0 {
            ctx.signal(relay, slot, progress(epoch, 0))?;
            fault_point!("a2e.signal");
            return Ok(());
        }
        // Rows signalled so far: the progress counts them in the wire order.
        let mut done = 0;
        for j in wire_order(ctx, relay) {
            let entries = plan_rows.entries(ctx.experts()[j]);
            let mut at_row = 0;
            while at_row < entries.len() {
                let n = chunk.min(entries.len() - at_row);
                let rows = entries.start + at_row..entries.start + at_row + n;
                let at = base + (sent.offsets[j] + at_row) * stride;
                self.put_chunk(ctx, sent, rows, payloads, (relay, at), (direct, int8))?;
                at_row += n;
                done += n;
                fault_point!("a2e.chunk");
                ctx.signal(relay, slot, progress(epoch, done))?;
                fault_point!("a2e.signal");
            }
        }
        Ok(())
    }

    /// Writes the full rows of plan `entries` into `dst`'s window at `at`: straight in where
    /// this rank maps it (`direct`), quantizing when `int8`, else staged then put.
    fn put_chunk(
        &mut self,
        ctx: &Context,
        sent: &Sent,
        entries: Range<usize>,
        payloads: Payloads<'_>,
        (dst, at): (usize, usize),
        (direct, int8): (bool, bool),
    ) -> Result<()> {
        if let Payloads::Device(x) = payloads {
            self.put_rows_device(ctx, &sent.layout, entries, x, (dst, at), int8)
        } else if direct && !int8 {
            self.put_rows(ctx, &sent.layout, entries, payloads, dst, at)
        } else if direct {
            self.put_rows_int8(ctx, sent, entries, payloads, dst, at)
        } else {
            self.stage_rows(ctx, sent, entries, payloads, int8)?;
            ctx.put(dst, at, &self.stage)
        }
    }

    /// Copies token `t`'s payload row into `out` (from the caller's bytes or the registered
    /// input).
    fn payload_of<'p>(
        ctx: &Context,
        payloads: Payloads<'p>,
        t: usize,
        row: &'p mut Vec<u8>,
    ) -> Result<&'p [u8]> {
        let p = ctx.layout.a2e.payload;
        match payloads {
            Payloads::Caller(x) => Ok(&x[t * p..(t + 1) * p]),
            Payloads::Input(at) => {
                row.resize(p, 0);
                ctx.get(ctx.rank, at + t * p, row)?;
                Ok(row)
            }
            Payloads::Device(_) => Err(Error::invalid(
                "device rows are read by the data plane, not by the host",
            )),
        }
    }

    /// Writes full rows of `entries` straight into `dst`'s window at `at`, one put for the
    /// payload and one for the metadata of each row.
    fn put_rows(
        &mut self,
        ctx: &Context,
        plan: &DispatchLayout,
        entries: Range<usize>,
        payloads: Payloads<'_>,
        dst: usize,
        at: usize,
    ) -> Result<()> {
        let row = ctx.layout.a2e;
        let mut meta = [0u8; 512];
        let meta_len = row.meta_len();
        let mut big_meta = Vec::new();
        let meta: &mut [u8] = if meta_len <= meta.len() {
            &mut meta[..meta_len]
        } else {
            big_meta.resize(meta_len, 0);
            &mut big_meta
        };
        for (i, e) in entries.enumerate() {
            let t = plan.token(e);
            let off = at + i * row.stride;
            let x = Self::payload_of(ctx, payloads, t, &mut self.row)?;
            ctx.put(dst, off, x)?;
            row.encode_meta(meta, t as u32, plan.mask(e), plan.weights(e));
            ctx.put(dst, off + row.meta_offset(), meta)?;
        }
        Ok(())
    }

    /// Writes INT8 rows of `entries` into `dst`'s window at `at`: each quantized in one pass
    /// into a private row with its metadata, then one put per row.
    fn put_rows_int8(
        &mut self,
        ctx: &Context,
        sent: &Sent,
        entries: Range<usize>,
        payloads: Payloads<'_>,
        dst: usize,
        at: usize,
    ) -> Result<()> {
        let row = ctx.layout.a2e;
        let len = row.meta_offset_for(true) + row.meta_len();
        let mut qrow = std::mem::take(&mut self.qrow);
        qrow.resize(len, 0);
        let result = entries.enumerate().try_for_each(|(i, e)| {
            self.encode_row(ctx, sent, e, payloads, true, &mut qrow)?;
            ctx.put(dst, at + i * row.int8_stride, &qrow)
        });
        self.qrow = qrow;
        result
    }

    /// Encodes entry `e`'s row (payload, INT8 or not, then metadata) into `out`.
    fn encode_row(
        &mut self,
        ctx: &Context,
        sent: &Sent,
        e: usize,
        payloads: Payloads<'_>,
        int8: bool,
        out: &mut [u8],
    ) -> Result<()> {
        let row = ctx.layout.a2e;
        let plan = &sent.layout;
        let t = plan.token(e);
        let x = Self::payload_of(ctx, payloads, t, &mut self.row)?;
        if int8 {
            let q = &mut out[..row.int8_payload];
            self.quant.quantize_amax(ctx.cfg.dtype, x, sent.amax[t], q);
        } else {
            out[..row.payload].copy_from_slice(x);
        }
        row.encode_meta(
            &mut out[row.meta_offset_for(int8)..],
            t as u32,
            plan.mask(e),
            plan.weights(e),
        );
        Ok(())
    }

    /// Encodes full rows of `entries` into `self.stage`.
    fn stage_rows(
        &mut self,
        ctx: &Context,
        sent: &Sent,
        entries: Range<usize>,
        payloads: Payloads<'_>,
        int8: bool,
    ) -> Result<()> {
        let stride = ctx.layout.a2e.stride_for(int8);
        self.stage.resize(entries.len() * stride, 0);
        let mut stage = std::mem::take(&mut self.stage);
        let result = entries
            .zip(stage.chunks_exact_mut(stride))
            .try_for_each(|(e, out)| self.encode_row(ctx, sent, e, payloads, int8, out));
        self.stage = stage;
        result
    }

    /// The call `handle` answers, if it is the oldest one waiting for its E2A; else an error
    /// naming both epochs (nothing changes).
    pub(crate) fn oldest(&self, ctx: &Context, handle: &A2eHandle) -> Result<&Sent> {
        if handle.comm != ctx.id {
            return Err(Error::invalid(format!(
                "the handle of A2E epoch {} comes from another communicator",
                handle.epoch
            )));
        }
        let Some(front) = self.in_flight.front() else {
            return Err(Error::invalid(format!(
                "the handle of A2E epoch {} was already used: no A2E call waits for its E2A",
                handle.epoch
            )));
        };
        match handle.epoch.cmp(&front.epoch) {
            std::cmp::Ordering::Equal => Ok(front),
            std::cmp::Ordering::Less => Err(Error::invalid(format!(
                "the handle of A2E epoch {} was already used; the next E2A is for epoch {}",
                handle.epoch, front.epoch
            ))),
            std::cmp::Ordering::Greater => Err(Error::invalid(format!(
                "E2A calls complete in A2E order: the next E2A is for epoch {}, this handle is \
                 of epoch {} (was the handle of epoch {} dropped?)",
                front.epoch, handle.epoch, front.epoch
            ))),
        }
    }

    /// The oldest call's E2A has been received: its buffers are reused by later calls.
    pub(crate) fn retire(&mut self) {
        if let Some(sent) = self.in_flight.pop_front() {
            self.spare.push(sent);
        }
    }

    /// Calls waiting for their E2A.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The calls waiting for their E2A, oldest first.
    pub(crate) fn unanswered(&self) -> impl Iterator<Item = &Sent> {
        self.in_flight.iter()
    }
}

/// One source's message of one call, as its validated record describes it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Message {
    /// The source's index among the attention ranks.
    pub(crate) index: usize,
    /// Its global rank.
    pub(crate) src: usize,
    pub(crate) rec: Record,
    pub(crate) mode: WireMode,
    /// The call's buffer of the sender's staging and registered input (`epoch %
    /// max_in_flight`).
    pub(crate) buf: usize,
    /// The buffer of this rank's receive area the rows were pushed into, and of the sender's
    /// E2A receive area the replies go to ([`Record::landing`]).
    pub(crate) landing: usize,
    /// Payloads are INT8 with a scale.
    pub(crate) int8: bool,
    /// Through relays, when the rows stayed where the source pushed them: the relay's rank and
    /// the source's member slot there; the rows are `rec.offset..` of that member's A2E area
    /// ([`crate::moe::relay`]). `None` when they lie in this rank's receive area.
    pub(crate) on_relay: Option<(usize, usize)>,
}

impl Message {
    /// Rows in the message.
    pub(crate) fn count(&self) -> usize {
        self.rec.count as usize
    }

    /// The rank and offset of full row `r` (push and pull; gather rows are metadata only).
    pub(crate) fn full_row(&self, ctx: &Context, r: usize) -> (usize, usize) {
        let l = &ctx.layout;
        let stride = l.a2e.stride_for(self.int8);
        match (self.mode, self.on_relay) {
            (WireMode::Push, Some((relay, slot))) => (
                relay,
                l.relay_a2e(slot, self.buf) + (self.rec.offset as usize + r) * stride,
            ),
            (WireMode::Push, None) => (ctx.rank, l.a2e_recv(self.index, self.landing) + r * stride),
            _ => (
                self.src,
                l.a2e_stage(self.buf) + (self.rec.offset as usize + r) * stride,
            ),
        }
    }

    /// Bytes of one payload on the wire.
    pub(crate) fn payload_len(&self, ctx: &Context) -> usize {
        ctx.layout.a2e.payload_for(self.int8)
    }

    /// The rank and offset of row `r`'s metadata.
    pub(crate) fn meta_at(&self, ctx: &Context, r: usize) -> (usize, usize) {
        let l = &ctx.layout;
        match self.mode {
            WireMode::Gather => (
                self.src,
                l.a2e_stage(self.buf) + (self.rec.offset as usize + r) * l.a2e.meta_stride,
            ),
            _ => {
                let (rank, at) = self.full_row(ctx, r);
                (rank, at + l.a2e.meta_offset_for(self.int8))
            }
        }
    }

    /// The rank and offset of the payload of row `r`, whose metadata named `token`.
    pub(crate) fn payload_at(&self, ctx: &Context, r: usize, token: u32) -> (usize, usize) {
        let l = &ctx.layout;
        match self.mode {
            WireMode::Gather => (
                self.src,
                l.a2e_input(self.buf) + token as usize * l.a2e.payload,
            ),
            _ => self.full_row(ctx, r),
        }
    }

    /// Whether rows are best fetched in bulk (full rows in a window not mapped here).
    fn bulk(&self, ctx: &Context) -> bool {
        self.mode != WireMode::Gather && !ctx.mapped(self.full_row(ctx, 0).0)
    }
}

/// Reads the rows of messages: in place where the window is mapped, else one `get` per range.
#[derive(Debug, Default)]
pub(crate) struct RowReader {
    /// Rows `landed_rows` of message `landed_of`, fetched with one `get`.
    landing: Vec<u8>,
    landed_of: Option<usize>,
    landed_rows: Range<usize>,
    meta: Vec<u8>,
    pub(crate) experts: Vec<(u32, f32)>,
    /// One payload as it crossed the wire, when it needs converting.
    raw: Vec<u8>,
    wide: Vec<f32>,
    quant: Quantizer,
    /// Rows go to device memory (a device-buffer receive): [`RowReader::prepare`] brings
    /// only the metadata to the host, [`Landing::Device`] queues copies.
    on_device: bool,
    /// The copies and dequantizations [`Landing::Device`] queued since the last
    /// [`RowReader::flush_device`].
    device_copies: Vec<CopyRun>,
    device_dequant: Vec<QuantRow>,
    /// Scratch: the metadata gathers of one prepare.
    meta_runs: Vec<CopyRun>,
}

/// Where [`RowReader::land`] puts a row's payload.
pub(crate) enum Landing<'a> {
    /// A row of the communicator's dtype (INT8 payloads dequantized).
    Row(&'a mut [u8]),
    /// INT8 bytes and the scale (dtype payloads quantized on receipt).
    Int8 {
        /// `hidden` bytes of `q`.
        q: &'a mut [u8],
        /// The row's scale.
        scale: &'a mut f32,
    },
    /// A row of the dtype at this device address (a device-buffer receive, checked by the
    /// caller): the copy (or dequantization) is queued, done by [`RowReader::flush_device`].
    Device(u64),
}

impl RowReader {
    /// Makes rows `rows` of `msg` readable (fetches them when the window is not mapped here).
    pub(crate) fn prepare(
        &mut self,
        ctx: &Context,
        msg: &Message,
        rows: Range<usize>,
    ) -> Result<()> {
        if !msg.bulk(ctx) || rows.is_empty() {
            return Ok(());
        }
        if self.on_device {
            self.gather_meta(ctx, msg, rows.clone())?;
        } else {
            let stride = ctx.layout.a2e.stride_for(msg.int8);
            let (rank, at) = msg.full_row(ctx, rows.start);
            self.landing.resize(rows.len() * stride, 0);
            ctx.get(rank, at, &mut self.landing)?;
        }
        self.landed_of = Some(msg.index);
        self.landed_rows = rows;
        Ok(())
    }

    /// [`RowReader::prepare`] of device rows: only the metadata of `rows` comes to the host,
    /// packed (row `i`'s at `i * meta_len` of `self.landing`), in one gather.
    fn gather_meta(&mut self, ctx: &Context, msg: &Message, rows: Range<usize>) -> Result<()> {
        let meta_len = ctx.layout.a2e.meta_len();
        self.landing.resize(rows.len() * meta_len, 0);
        let mut dev = ctx.device_rows()?;
        self.meta_runs.clear();
        for (i, r) in rows.enumerate() {
            let (rank, at) = msg.meta_at(ctx, r);
            self.meta_runs.push(CopyRun {
                src: dev.window(rank, at, meta_len)?,
                dst: (i * meta_len) as u64,
                len: meta_len as u64,
            });
        }
        let deadline = ctx.call_deadline();
        // SAFETY: every source is a landed row's metadata inside a window (range-checked),
        // which its writer does not touch again before this call's credit.
        unsafe {
            dev.plane
                .gather(&self.meta_runs, &mut self.landing, deadline)
        }
    }

    /// Queues the copies [`Landing::Device`] planned and completes them.
    pub(crate) fn flush_device(&mut self, ctx: &Context) -> Result<()> {
        if self.device_copies.is_empty() && self.device_dequant.is_empty() {
            return Ok(());
        }
        let mut dev = ctx.device_rows()?;
        let (dtype, hidden) = (ctx.cfg.dtype, ctx.cfg.hidden);
        // SAFETY: every source is a landed payload inside a window (range-checked when
        // queued), untouched by its writer before this call's credit, which goes out after
        // the plane completes here; every destination is a distinct row of the caller's
        // checked device buffer.
        let queued = unsafe {
            dev.plane
                .copy_runs(&self.device_copies)
                .and_then(|()| dev.plane.dequantize(dtype, hidden, &self.device_dequant))
        };
        self.device_copies.clear();
        self.device_dequant.clear();
        queued?;
        dev.plane.complete(ctx.call_deadline())
    }

    fn landed(&self, ctx: &Context, msg: &Message, r: usize) -> Option<&[u8]> {
        if self.landed_of != Some(msg.index) || !self.landed_rows.contains(&r) || !msg.bulk(ctx) {
            return None;
        }
        // Device rows: only the metadata was gathered, packed.
        let stride = if self.on_device {
            ctx.layout.a2e.meta_len()
        } else {
            ctx.layout.a2e.stride_for(msg.int8)
        };
        let i = r - self.landed_rows.start;
        Some(&self.landing[i * stride..(i + 1) * stride])
    }

    /// Decodes row `r` of `msg` (prepared) into `self.experts`; returns its source token.
    pub(crate) fn decode(&mut self, ctx: &Context, msg: &Message, r: usize) -> Result<u32> {
        let fmt = ctx.layout.a2e;
        let local = ctx.topo.local_experts(ctx.rank).len();
        let max_tokens = ctx.cfg.max_tokens_per_rank;
        let mut meta = std::mem::take(&mut self.meta);
        meta.resize(fmt.meta_len(), 0);
        let read = match self.landed(ctx, msg, r) {
            // Device rows: the metadata alone, packed.
            Some(packed) if self.on_device => {
                meta.copy_from_slice(&packed[..fmt.meta_len()]);
                Ok(())
            }
            Some(row) => {
                meta.copy_from_slice(&row[fmt.meta_offset_for(msg.int8)..][..fmt.meta_len()]);
                Ok(())
            }
            None => {
                let (rank, at) = msg.meta_at(ctx, r);
                ctx.get(rank, at, &mut meta)
            }
        };
        let token = read
            .and_then(|()| fmt.decode_row(&meta, msg.src, max_tokens, local, &mut self.experts));
        self.meta = meta;
        token
    }

    /// Puts the payload of row `r` of `msg` (metadata naming `token`) where `dst` says,
    /// converting between INT8 and the dtype as needed.
    pub(crate) fn land(
        &mut self,
        ctx: &Context,
        msg: &Message,
        r: usize,
        token: u32,
        dst: Landing<'_>,
    ) -> Result<()> {
        let hidden = ctx.cfg.hidden;
        match (msg.int8, dst) {
            (int8, Landing::Device(dst)) => {
                let (rank, at) = msg.payload_at(ctx, r, token);
                let len = msg.payload_len(ctx);
                let src = ctx.device_rows()?.window(rank, at, len)?;
                if int8 {
                    self.device_dequant.push(QuantRow { src, dst });
                } else {
                    let len = len as u64;
                    self.device_copies.push(CopyRun { src, dst, len });
                }
                Ok(())
            }
            (false, Landing::Row(out)) => self.payload(ctx, msg, r, token, out),
            (true, dst) => {
                let mut raw = std::mem::take(&mut self.raw);
                raw.resize(msg.payload_len(ctx), 0);
                let read = self.payload(ctx, msg, r, token, &mut raw);
                if read.is_ok() {
                    match dst {
                        Landing::Row(out) => {
                            dequantize_to(&raw, ctx.cfg.dtype, &mut self.wide, out)
                        }
                        Landing::Int8 { q, scale } => {
                            q.copy_from_slice(&raw[..hidden]);
                            *scale = scale_of(&raw, hidden);
                        }
                        Landing::Device(_) => unreachable!("matched above"),
                    }
                }
                self.raw = raw;
                read
            }
            (false, Landing::Int8 { q, scale }) => {
                let mut raw = std::mem::take(&mut self.raw);
                raw.resize(msg.payload_len(ctx), 0);
                let read = self.payload(ctx, msg, r, token, &mut raw).and_then(|()| {
                    let amax =
                        self.quant
                            .amax(ctx.cfg.dtype, &raw)
                            .map_err(|i| Error::Protocol {
                                peer: msg.src,
                                detail: format!(
                            "token {token} has a non-finite element at {i}: it cannot be kept \
                             as INT8"
                        ),
                            })?;
                    let mut qp = vec![0u8; super::quant::int8_payload(hidden)];
                    self.quant.quantize_amax(ctx.cfg.dtype, &raw, amax, &mut qp);
                    q.copy_from_slice(&qp[..hidden]);
                    *scale = scale_of(&qp, hidden);
                    Ok(())
                });
                self.raw = raw;
                read
            }
        }
    }

    /// Copies the payload of row `r` of `msg` (metadata naming `token`) as it crossed the wire
    /// into `out`.
    pub(crate) fn payload(
        &self,
        ctx: &Context,
        msg: &Message,
        r: usize,
        token: u32,
        out: &mut [u8],
    ) -> Result<()> {
        match self.landed(ctx, msg, r) {
            Some(row) => {
                crate::fabric::copy::copy_slice(out, &row[..out.len()]);
                Ok(())
            }
            None => {
                let (rank, at) = msg.payload_at(ctx, r, token);
                ctx.get(rank, at, out)
            }
        }
    }
}

/// Checks the landing buffer `landing` that source `index` (global rank `src`) named for call
/// `epoch` against the calls this rank has not replied to (`held`): their rows are still being
/// read there, and their replies not yet sent, so a record naming one of their buffers is an
/// error naming the source.
fn check_landing(
    held: &VecDeque<Vec<Option<usize>>>,
    index: usize,
    src: usize,
    epoch: u64,
    landing: usize,
) -> Result<usize> {
    if held.iter().any(|call| call[index] == Some(landing)) {
        return Err(Error::Protocol {
            peer: src,
            detail: format!(
                "A2E record of epoch {epoch} names landing buffer {landing}, which holds its \
                 rows of a call not yet replied to"
            ),
        });
    }
    Ok(landing)
}

/// What the receive loop reports to its caller.
enum Arrival<'m> {
    /// A source's record was seen and validated.
    Record(&'m Message),
    /// Rows of a source's message are in place (streaming receivers only).
    Rows(&'m Message, Range<usize>),
    /// Every row of a source's message is in place, this long after the receive began.
    Complete(&'m Message, std::time::Duration),
}

impl Received {
    /// Clears the per-call fields for a call whose possible sources are `ranks` (every
    /// attention rank; with DP domains those outside the call's domain stay empty).
    fn begin(&mut self, comm: u64, ranks: &[usize]) {
        self.comm = comm;
        self.epoch = 0;
        self.release_live();
        self.sources.clear();
        self.sources.extend(ranks.iter().map(|&rank| SourceInfo {
            rank,
            ..SourceInfo::default()
        }));
        self.arrival_order.clear();
        self.tag = None;
    }

    /// Notes what an arrival says about its source (its record, its completion).
    fn note(&mut self, arrival: &Arrival<'_>) {
        match *arrival {
            Arrival::Record(msg) => {
                self.sources[msg.index] = SourceInfo {
                    rank: msg.src,
                    count: msg.count(),
                    reply_offset: msg.rec.offset as usize,
                    reply_buffer: msg.landing,
                    first_token: 0,
                    arrived_after: Default::default(),
                    tag: msg.rec.tag,
                };
                // The call's tag is its first source's (lowest attention rank in the call).
                if self.tag.is_none_or(|(i, _)| msg.index < i) {
                    self.tag = Some((msg.index, msg.rec.tag));
                }
            }
            Arrival::Rows(..) => {}
            Arrival::Complete(msg, after) => {
                self.sources[msg.index].arrived_after = after;
                self.arrival_order.push(msg.index as u32);
            }
        }
    }
}

/// The expert side of A2E: receives calls and keeps each until its E2A reply.
#[derive(Debug)]
pub(crate) struct DispatchReceiver {
    last_epoch: u64,
    /// Received calls whose E2A has not been sent, oldest first.
    unreplied: VecDeque<u64>,
    /// For each of `unreplied`, the landing buffer of each source's rows (by attention index;
    /// `None` where it sent nothing): buffers a new call's record may not name.
    landings: VecDeque<Vec<Option<usize>>>,
    /// Lists of `landings` whose calls were replied to, for the next calls to fill.
    spare_landings: Vec<Vec<Option<usize>>>,
    reader: RowReader,
    messages: Vec<Option<Message>>,
    /// Per source of the call being received: rows handled so far, and whether it is complete
    /// (scratch, reused so a call allocates nothing).
    handled: Vec<usize>,
    done: Vec<bool>,
    /// Decoded metadata of every row of a call (expert-major arrangement): per row its token,
    /// and its experts at `row_experts[row_start[i]..row_start[i+1]]`.
    row_token: Vec<u32>,
    row_start: Vec<u32>,
    row_experts: Vec<(u32, f32)>,
    /// The relay's state (used when this rank is a relay).
    pub(crate) relay: Box<Relay>,
    /// The buffers of the last view that replied, for the next view (boxed once: they are
    /// large, and only views use them).
    pub(crate) spare_view: Box<Option<(ViewRows, TokenBatch)>>,
    /// Scratch of a receive through relays (boxed once: only relayed jobs use it).
    relayed: Box<RelayedScratch>,
}

/// What a receive through relays keeps per relay, kept between calls (no allocation per call).
#[derive(Debug, Default)]
struct RelayedScratch {
    /// Per relay: the rows its header announced, once read; whether all are in.
    totals: Vec<Option<usize>>,
    done: Vec<bool>,
    /// The entries of the header read last, and its raw bytes.
    entries: Vec<HeaderEntry>,
    bytes: Vec<u8>,
}

impl DispatchReceiver {
    /// A receiver whose first call is `epoch_base + 1`.
    pub(crate) fn new(epoch_base: u64) -> Self {
        DispatchReceiver {
            last_epoch: epoch_base,
            unreplied: VecDeque::new(),
            landings: VecDeque::new(),
            spare_landings: Vec::new(),
            reader: RowReader::default(),
            messages: Vec::new(),
            handled: Vec::new(),
            done: Vec::new(),
            row_token: Vec::new(),
            row_start: Vec::new(),
            row_experts: Vec::new(),
            relay: Box::default(),
            spare_view: Box::new(None),
            relayed: Box::default(),
        }
    }

    /// Epochs of the received calls whose E2A has not been sent, oldest first.
    pub(crate) fn unreplied(&self) -> impl Iterator<Item = u64> + '_ {
        self.unreplied.iter().copied()
    }

    /// Fails at once when `max_in_flight` received calls wait for their reply.
    fn check_room(&self, ctx: &Context) -> Result<()> {
        let depth = ctx.cfg.max_in_flight;
        if self.unreplied.len() >= depth {
            return Err(Error::invalid(format!(
                "{} received A2E calls wait for their E2A reply (max_in_flight is {depth}): \
                 reply to epoch {} before receiving the next",
                self.unreplied.len(),
                self.unreplied.front().copied().unwrap_or(0)
            )));
        }
        Ok(())
    }

    /// The call a reply for a batch of epoch `epoch` filled by communicator `comm` answers, if
    /// it is the oldest unreplied one; else an error naming both epochs.
    pub(crate) fn check_reply(&self, ctx: &Context, comm: u64, epoch: u64) -> Result<()> {
        if epoch == 0 {
            return Err(Error::invalid(
                "E2A send needs a batch filled by an A2E receive",
            ));
        }
        if comm != ctx.id {
            return Err(Error::invalid(format!(
                "the batch of A2E epoch {epoch} was filled by another communicator"
            )));
        }
        match self.unreplied.front() {
            Some(&front) if front == epoch => Ok(()),
            Some(&front) if epoch < front => Err(Error::invalid(format!(
                "the batch of A2E epoch {epoch} was already replied to; the next reply is for \
                 epoch {front}"
            ))),
            Some(&front) => Err(Error::invalid(format!(
                "E2A replies go in A2E order: the next is for epoch {front}, this batch is of \
                 epoch {epoch}"
            ))),
            None => Err(Error::invalid(format!(
                "the batch of A2E epoch {epoch} was already replied to: no received call waits \
                 for a reply"
            ))),
        }
    }

    /// This rank's side of relayed E2A call `epoch`: `send_own` sends its replies (calling the
    /// hook it is given after each chunk); on a relay, [`Relay::combine_e2a`] runs around it,
    /// a pass after each of those chunks.
    pub(crate) fn relay_e2a(
        &mut self,
        ctx: &Context,
        epoch: u64,
        deadline: Instant,
        own: Option<(&[u8], &[crate::SourceInfo])>,
        send_own: impl FnOnce(&mut dyn FnMut() -> Result<()>) -> Result<()>,
    ) -> Result<()> {
        match ctx.topo.relay_plan() {
            Some(plan) if plan.relay_index(ctx.rank).is_some() => {
                self.relay.combine_e2a(ctx, epoch, deadline, own, send_own)
            }
            _ => send_own(&mut || Ok(())),
        }
    }

    /// On a relay, [`Relay::release_e2a`]: the expert ranks' credit for the previous relayed
    /// E2A, once its members have read it; nothing on other ranks.
    pub(crate) fn release_relayed_e2a(&mut self, ctx: &Context, deadline: Instant) -> Result<()> {
        match ctx.topo.relay_plan() {
            Some(plan) if plan.relay_index(ctx.rank).is_some() => {
                self.relay.release_e2a(ctx, deadline)
            }
            _ => Ok(()),
        }
    }

    /// The oldest call has been replied to.
    pub(crate) fn replied(&mut self) {
        self.unreplied.pop_front();
        self.spare_landings.extend(self.landings.pop_front());
    }

    /// Tells every attention rank (every relay, with relays) that this rank is done with their
    /// rows of `epoch`; nothing goes out where credits are implied
    /// ([`Context::implied_credits`]).
    pub(crate) fn credit(&self, ctx: &Context, epoch: u64) -> Result<()> {
        if let Some(plan) = ctx.topo.relay_plan() {
            for &r in plan.relays() {
                ctx.signal(r, ctx.slots.a2e_credit(ctx.rank), epoch)?;
                fault_point!("a2e.credit");
            }
            return Ok(());
        }
        let implied = ctx.implied_credits();
        for &src in ctx.attention() {
            if !implied {
                ctx.signal(src, ctx.slots.a2e_credit(ctx.rank), epoch)?;
            }
            fault_point!("a2e.credit");
        }
        Ok(())
    }

    /// Waits until every source's message of the next call is complete, reporting arrivals to
    /// `on`. Returns the call's epoch; `self.messages` holds each source's message.
    fn receive(
        &mut self,
        ctx: &Context,
        stream: bool,
        deadline: Instant,
        on: &mut dyn FnMut(&mut RowReader, Arrival<'_>) -> Result<()>,
    ) -> Result<u64> {
        self.check_room(ctx)?;
        if ctx.topo.relay_plan().is_some() {
            return self.receive_relayed(ctx, stream, deadline, on);
        }
        let epoch = self.last_epoch + 1;
        let buf = ctx.layout.buffer(epoch);
        let start = Instant::now();
        let sources = ctx.attention();
        // With DP domains only the call's domain takes part; the others stay `done`.
        let part = ctx.call_sources(epoch);
        // A record's rows must fit this rank's receive area for that source.
        let (max_rows, attention_rows) = (ctx.layout.recv_rows, ctx.layout.attention_rows);
        self.messages.clear();
        self.messages.resize(sources.len(), None);
        self.handled.clear();
        self.handled.resize(sources.len(), 0);
        self.done.clear();
        self.done.resize(sources.len(), true);
        let (handled, done) = (&mut self.handled, &mut self.done);
        for &i in part {
            done[i] = false;
        }
        let mut missing = part.len();
        let mut failure: Option<Error> = None;
        let mut next_check = CheckDue::default();
        // Where credits are implied each record names its landing buffer (one its sender knows
        // free); elsewhere the call's buffer is the landing buffer too.
        let implied = ctx.implied_credits();
        let landing_buffers = ctx.landing_buffers();
        let (messages, reader, held) = (&mut self.messages, &mut self.reader, &self.landings);
        // Records and rows seen so far (`Waiting::progress`: the wait stays awake while they
        // stream in).
        let mut parts = 0u64;
        let mut pass = || -> Result<Option<Waiting>> {
            let mut waiting = None;
            for (i, &src) in sources.iter().enumerate() {
                if done[i] {
                    continue;
                }
                let p = Progress::of(ctx.slot_value(ctx.slots.a2e_ready(src)), epoch);
                if p == Progress::NotYet {
                    waiting.get_or_insert(Waiting::on(src, "A2E record"));
                    continue;
                }
                if messages[i].is_none() {
                    let rec = ctx.read_record(ctx.layout.record(i, buf))?;
                    let mode = rec.validate(src, epoch, max_rows, landing_buffers)?;
                    rec.check_region(src, attention_rows, "its A2E staging and E2A reply areas")?;
                    let landing = if implied {
                        check_landing(held, i, src, epoch, rec.landing())?
                    } else {
                        buf
                    };
                    ctx.note_rows_received(src, rec.count as usize);
                    parts += 1;
                    messages[i] = Some(Message {
                        index: i,
                        src,
                        rec,
                        mode,
                        buf,
                        landing,
                        int8: rec.int8(),
                        on_relay: None,
                    });
                    on(reader, Arrival::Record(messages[i].as_ref().expect("set")))?;
                }
                let msg = messages[i].as_ref().expect("set above");
                let ready = p.rows(msg.count());
                if ready > handled[i] {
                    if stream {
                        on(reader, Arrival::Rows(msg, handled[i]..ready))?;
                    }
                    parts += (ready - handled[i]) as u64;
                    handled[i] = ready;
                }
                if ready < msg.count() {
                    waiting.get_or_insert(Waiting::on(src, "A2E rows"));
                    continue;
                }
                done[i] = true;
                missing -= 1;
                on(reader, Arrival::Complete(msg, ctx.look_since(start)))?;
            }
            if missing == 0 {
                return Ok(None);
            }
            let awaited = (0..sources.len()).filter(|&i| !done[i]).map(|i| sources[i]);
            ctx.check_awaited(awaited, &mut next_check)?;
            Ok(waiting.map(|w| w.at(parts)))
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
        Ok(epoch)
    }

    /// [`DispatchReceiver::receive`] through relays: a relay forwards its members' rows in the
    /// same loop ([`Relay::forward_pass`]); one header per relay is awaited, and each of its members
    /// is reported as a message of its own whose rows lie where the direct path would have
    /// pushed them, or in the relay's member area when they stayed there
    /// ([`Message::on_relay`]); every layout reads them through [`Message::full_row`].
    fn receive_relayed(
        &mut self,
        ctx: &Context,
        stream: bool,
        deadline: Instant,
        on: &mut dyn FnMut(&mut RowReader, Arrival<'_>) -> Result<()>,
    ) -> Result<u64> {
        let plan = ctx.topo.relay_plan().expect("relayed");
        let epoch = self.last_epoch + 1;
        let buf = ctx.layout.buffer(epoch);
        let start = Instant::now();
        // A relay forwards its members' call in the same loop that receives its own rows (it
        // tells itself of them as it checks them), so it copies them while they stream in.
        let mut forwarding = plan.relay_index(ctx.rank).is_some();
        if forwarding {
            self.relay.begin_forward(ctx, epoch, deadline)?;
        }
        let relays = plan.relays();
        let attention = ctx.attention();
        let call_no = ctx.call_of(epoch);
        self.messages.clear();
        self.messages.resize(attention.len(), None);
        self.handled.clear();
        self.handled.resize(attention.len(), 0);
        // Per relay: the rows its header announced, once read; whether all are in.
        let RelayedScratch {
            totals,
            done,
            entries,
            bytes,
        } = &mut *self.relayed;
        totals.clear();
        totals.resize(relays.len(), None);
        done.clear();
        done.resize(relays.len(), false);
        let mut missing = relays.len();
        let mut failure: Option<Error> = None;
        let mut next_check = CheckDue::default();
        // Headers and rows seen so far (`Waiting::progress`).
        let mut parts = 0u64;
        let (messages, reader, handled) = (&mut self.messages, &mut self.reader, &mut self.handled);
        let relay = &mut self.relay;
        let mut pass = || -> Result<Option<Waiting>> {
            let mut waiting = None;
            if forwarding {
                waiting = relay.forward_pass(ctx)?;
                forwarding = waiting.is_some();
            }
            for (k, &r) in relays.iter().enumerate() {
                if done[k] {
                    continue;
                }
                let p = Progress::of(ctx.slot_value(ctx.slots.a2e_ready(r)), epoch);
                if p == Progress::NotYet {
                    waiting.get_or_insert(Waiting::on(r, "relay header"));
                    continue;
                }
                let total = match totals[k] {
                    Some(total) => total,
                    None => {
                        let rec = read_header(ctx, (r, k), epoch, entries, bytes)?;
                        parts += 1;
                        for (m, (&ai, e)) in plan.members(k).iter().zip(&*entries).enumerate() {
                            if !ctx.topo.in_call(attention[ai], call_no) {
                                // Outside the call's DP domain: nothing may come from it.
                                if e.count > 0 {
                                    return Err(Error::Protocol {
                                        peer: r,
                                        detail: format!(
                                            "relay header of epoch {epoch} carries {} rows of \
                                             rank {}, which is outside the call's DP domain",
                                            e.count, attention[ai]
                                        ),
                                    });
                                }
                                continue;
                            }
                            let rec = Record::with_payload(
                                epoch,
                                e.count as u32,
                                e.offset as u32,
                                WireMode::Push,
                                e.int8,
                            )
                            .tagged(e.tag);
                            let msg = messages[ai].insert(Message {
                                index: ai,
                                src: attention[ai],
                                rec,
                                mode: WireMode::Push,
                                buf,
                                landing: buf,
                                int8: e.int8,
                                on_relay: e.in_place.then_some((r, m)),
                            });
                            on(reader, Arrival::Record(msg))?;
                            if e.count == 0 {
                                on(reader, Arrival::Complete(msg, ctx.look_since(start)))?;
                            }
                        }
                        *totals[k].insert(rec.count as usize)
                    }
                };
                // The relay's progress counts this rank's rows of its members in member order.
                let ready = p.rows(total);
                let mut before = 0;
                for &ai in plan.members(k) {
                    let Some(msg) = messages[ai].as_ref() else {
                        continue;
                    };
                    let have = ready.saturating_sub(before).min(msg.count());
                    before += msg.count();
                    if have > handled[ai] {
                        if stream {
                            on(reader, Arrival::Rows(msg, handled[ai]..have))?;
                        }
                        parts += (have - handled[ai]) as u64;
                        handled[ai] = have;
                        if have == msg.count() {
                            on(reader, Arrival::Complete(msg, ctx.look_since(start)))?;
                        }
                    }
                }
                if ready < total {
                    waiting.get_or_insert(Waiting::on(r, "relayed A2E rows"));
                    continue;
                }
                done[k] = true;
                missing -= 1;
            }
            if missing == 0 && !forwarding {
                return Ok(None);
            }
            // This rank's own header is its own forwarding's, which waits for its members.
            let awaited = (0..relays.len())
                .filter(|&k| !done[k] && relays[k] != ctx.rank)
                .map(|k| relays[k]);
            let still = |r: usize| {
                let k = relays.iter().position(|&x| x == r).expect("a relay");
                let p = Progress::of(ctx.slot_value(ctx.slots.a2e_ready(r)), epoch);
                totals[k].map_or(p == Progress::NotYet, |total| p.rows(total) < total)
            };
            ctx.check_awaited_again(awaited, &mut next_check, &still)?;
            Ok(waiting.map(|w| w.at(parts)))
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
        Ok(epoch)
    }

    /// Whether every row of the next call is in place, without waiting: then the next receive
    /// (any variant) waits for no peer. On a relay this includes its members' rows and the
    /// credits its forwarding needs.
    pub(crate) fn ready(&self, ctx: &Context) -> Result<bool> {
        let epoch = self.last_epoch + 1;
        let l = &ctx.layout;
        let buf = l.buffer(epoch);
        let attention = ctx.attention();
        let landing_buffers = ctx.landing_buffers();
        // A source's message is complete when its progress covers its record's rows.
        let complete = |src: usize, record_at: usize, max_rows: usize| -> Result<bool> {
            match Progress::of(ctx.slot_value(ctx.slots.a2e_ready(src)), epoch) {
                Progress::NotYet => Ok(false),
                Progress::Done => Ok(true),
                Progress::Rows(rows) => {
                    let mut rec = Record::default();
                    ctx.fabric
                        .get(ctx.rank, record_at, bytemuck::bytes_of_mut(&mut rec))?;
                    rec.validate(src, epoch, max_rows, landing_buffers)?;
                    Ok(rows >= rec.count as usize)
                }
            }
        };
        let index_of = |a: usize| attention.iter().position(|&x| x == a).expect("attention");
        let Some(plan) = ctx.topo.relay_plan() else {
            let part = ctx.call_sources(epoch).iter().map(|&i| attention[i]);
            return ctx.all_done(part, &|a| {
                complete(a, l.record(index_of(a), buf), l.recv_rows)
            });
        };
        if let Some(k) = plan.relay_index(ctx.rank) {
            let need =
                super::progress::reuse_credit(epoch, ctx.cfg.epoch_base, ctx.cfg.max_in_flight);
            let credited =
                |d: usize| Ok(need.is_none_or(|n| ctx.slot_value(ctx.slots.a2e_credit(d)) >= n));
            if !ctx.all_done(ctx.experts().iter().copied(), &credited)? {
                return Ok(false);
            }
            let call = ctx.call_of(epoch);
            let members = plan.members(k).iter().map(|&ai| attention[ai]);
            let members = members.filter(|&a| ctx.topo.in_call(a, call));
            let rows = l.attention_rows;
            if !ctx.all_done(members, &|a| complete(a, l.record(index_of(a), buf), rows))? {
                return Ok(false);
            }
        }
        // Every other relay's header and the rows it announced (this rank's own, a relay's, are
        // written by its own receive).
        let others = plan.relays().iter().copied().filter(|&r| r != ctx.rank);
        ctx.all_done(others, &|r| {
            let k = plan.relay_index(r).expect("a relay");
            let rows = plan.members(k).len() * l.recv_rows;
            complete(r, l.relay_header(k, buf), rows)
        })
    }

    /// Marks call `epoch` received (its batch or view now answers it).
    fn received(&mut self, epoch: u64) {
        self.last_epoch = epoch;
        self.unreplied.push_back(epoch);
        let mut landings = self.spare_landings.pop().unwrap_or_default();
        landings.clear();
        landings.extend(self.messages.iter().map(|m| m.map(|m| m.landing)));
        self.landings.push_back(landings);
    }

    /// A2E receive into `batch`, expert-major: rows grouped by local expert, ordered by source
    /// rank then token. Credits every source once the rows are copied.
    pub(crate) fn recv_expert_major(
        &mut self,
        ctx: &Context,
        batch: &mut ExpertBatch,
        device_out: Option<u64>,
        deadline: Instant,
    ) -> Result<()> {
        self.reader.on_device = device_out.is_some();
        self.reader.device_copies.clear();
        self.reader.device_dequant.clear();
        let recv = &mut batch.recv;
        recv.begin(ctx.id, ctx.attention());
        let epoch = self.receive(ctx, false, deadline, &mut |_, arrival| {
            recv.note(&arrival);
            Ok(())
        })?;
        self.arrange_expert_major(ctx, batch, device_out)?;
        self.reader.on_device = false;
        self.credit(ctx, epoch)?;
        self.received(epoch);
        batch.recv.received(ctx, epoch);
        Ok(())
    }

    /// Decodes every row's metadata (pass 1), then copies payloads into their expert-major
    /// places (pass 2), reading each source where it lies; into the device rows at
    /// `device_out` (every row's copy queued on the data plane, completed before it returns)
    /// when given, else into the batch.
    fn arrange_expert_major(
        &mut self,
        ctx: &Context,
        batch: &mut ExpertBatch,
        device_out: Option<u64>,
    ) -> Result<()> {
        let local = ctx.topo.local_experts(ctx.rank).len();
        let payload = ctx.layout.a2e.payload;
        // Pass 1: decode and validate every row; count rows per local expert.
        self.row_token.clear();
        self.row_start.clear();
        self.row_experts.clear();
        self.row_start.push(0);
        batch.expert_offsets.clear();
        batch.expert_offsets.resize(local + 1, 0);
        // Tokens by source in rank order (a source outside the call's DP domain has none).
        let mut first_token = 0;
        for (info, m) in batch.recv.sources.iter_mut().zip(&self.messages) {
            info.first_token = first_token;
            first_token += m.map_or(0, |m| m.count());
        }
        for msg in self.messages.iter().flatten() {
            self.reader.prepare(ctx, msg, 0..msg.count())?;
            for r in 0..msg.count() {
                let token = self.reader.decode(ctx, msg, r)?;
                for &(j, _) in &self.reader.experts {
                    batch.expert_offsets[j as usize + 1] += 1;
                }
                self.row_token.push(token);
                self.row_experts.extend_from_slice(&self.reader.experts);
                self.row_start.push(self.row_experts.len() as u32);
            }
        }
        for j in 0..local {
            batch.expert_offsets[j + 1] += batch.expert_offsets[j];
        }
        let rows = self.row_experts.len();

        // Pass 2: place rows (source order, then wire order = token order).
        let keep = ctx.cfg.keep_int8;
        let hidden = ctx.cfg.hidden;
        batch.recv.dtype = Some(ctx.cfg.dtype);
        batch.recv.hidden = hidden;
        batch.recv.int8 = keep;
        let host_rows = !keep && device_out.is_none();
        batch
            .rows
            .resize(if host_rows { rows * payload } else { 0 });
        batch.qrows.resize(if keep { rows * hidden } else { 0 }, 0);
        batch.scales.resize(if keep { rows } else { 0 }, 0.0);
        batch.src_rank.resize(rows, 0);
        batch.src_token.resize(rows, 0);
        batch.weight.resize(rows, 0.0);
        batch.token_row_start.clear();
        batch.token_row_start.push(0);
        batch.token_rows.clear();
        batch.cursors.clear();
        batch
            .cursors
            .extend_from_slice(&batch.expert_offsets[..local]);
        let out = batch.rows.bytes_mut();
        let (qrows, scales) = (&mut batch.qrows, &mut batch.scales);
        let mut n = 0;
        for msg in self.messages.iter().flatten() {
            self.reader.prepare(ctx, msg, 0..msg.count())?;
            for r in 0..msg.count() {
                let token = self.row_token[n];
                let experts =
                    &self.row_experts[self.row_start[n] as usize..self.row_start[n + 1] as usize];
                n += 1;
                let mut first: Option<usize> = None;
                for &(j, w) in experts {
                    let dst = batch.cursors[j as usize];
                    batch.cursors[j as usize] += 1;
                    match (first, device_out) {
                        (_, Some(base)) => {
                            // Every row from the window (copies of one launch never read
                            // each other's destinations).
                            let landing = Landing::Device(base + (dst * payload) as u64);
                            self.reader.land(ctx, msg, r, token, landing)?;
                        }
                        (None, None) => {
                            let landing = if keep {
                                Landing::Int8 {
                                    q: &mut qrows[dst * hidden..(dst + 1) * hidden],
                                    scale: &mut scales[dst],
                                }
                            } else {
                                Landing::Row(&mut out[dst * payload..(dst + 1) * payload])
                            };
                            self.reader.land(ctx, msg, r, token, landing)?;
                            first = Some(dst);
                        }
                        (Some(f), None) if keep => {
                            qrows.copy_within(f * hidden..(f + 1) * hidden, dst * hidden);
                            scales[dst] = scales[f];
                        }
                        (Some(f), None) => {
                            out.copy_within(f * payload..(f + 1) * payload, dst * payload)
                        }
                    }
                    batch.src_rank[dst] = msg.src as u32;
                    batch.src_token[dst] = token;
                    batch.weight[dst] = w;
                    batch.token_rows.push(dst as u32);
                }
                batch.token_row_start.push(batch.token_rows.len() as u32);
            }
        }
        self.reader.flush_device(ctx)
    }

    /// A2E receive into `batch`, one row per token, copying each source's rows as they stream
    /// in and calling `on_arrival(batch, tokens)` when a source is complete. Credits every source
    /// once all rows are copied.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn recv_tokens(
        &mut self,
        ctx: &Context,
        batch: &mut TokenBatch,
        device_out: Option<u64>,
        on_arrival: &mut dyn FnMut(&TokenBatch, Range<usize>),
        deadline: Instant,
    ) -> Result<()> {
        let payload = ctx.layout.a2e.payload;
        self.reader.on_device = device_out.is_some();
        self.reader.device_copies.clear();
        self.reader.device_dequant.clear();
        batch.reset(ctx.id, ctx.cfg.dtype, ctx.cfg.hidden, ctx.cfg.topk);
        batch.recv.begin(ctx.id, ctx.attention());
        batch.recv.int8 = ctx.cfg.keep_int8;
        // Rows on the host unless they go to device memory (or are kept as INT8).
        let host_rows = !ctx.cfg.keep_int8 && device_out.is_none();
        // The worst case (every attention rank's every token) reserved up front: the arrays
        // never move during the receive, so what `on_arrival` was shown stays valid to its end.
        let worst = ctx.attention().len() * ctx.cfg.max_tokens_per_rank;
        batch.reserve(worst, payload, host_rows);
        let epoch = self.receive(ctx, true, deadline, &mut |reader, arrival| {
            batch.recv.note(&arrival);
            match arrival {
                Arrival::Record(msg) => {
                    // Reserve the source's rows at the end of the batch (arrival order).
                    let first = batch.num_tokens();
                    batch.grow(first + msg.count(), payload, host_rows);
                    batch.recv.sources[msg.index].first_token = first;
                }
                Arrival::Rows(msg, rows) => {
                    reader.prepare(ctx, msg, rows.clone())?;
                    let base = batch.recv.sources[msg.index].first_token;
                    for r in rows {
                        let token = reader.decode(ctx, msg, r)?;
                        let t = base + r;
                        let landing = if let Some(out) = device_out {
                            Landing::Device(out + (t * payload) as u64)
                        } else if ctx.cfg.keep_int8 {
                            let h = ctx.cfg.hidden;
                            Landing::Int8 {
                                q: &mut batch.qrows[t * h..(t + 1) * h],
                                scale: &mut batch.scales[t],
                            }
                        } else {
                            Landing::Row(
                                &mut batch.rows.bytes_mut()[t * payload..(t + 1) * payload],
                            )
                        };
                        reader.land(ctx, msg, r, token, landing)?;
                        batch.set_token(t, msg.src, token, &reader.experts);
                    }
                }
                Arrival::Complete(msg, _) => {
                    // Device rows are in place before the caller is told.
                    reader.flush_device(ctx)?;
                    let first = batch.recv.sources[msg.index].first_token;
                    on_arrival(batch, first..first + msg.count());
                }
            }
            Ok(())
        })?;
        self.reader.flush_device(ctx)?;
        self.reader.on_device = false;
        self.credit(ctx, epoch)?;
        self.received(epoch);
        batch.recv.received(ctx, epoch);
        Ok(())
    }

    /// A2E receive for a view: waits for every source, fills `meta` with every token's origin
    /// and experts (no rows; sources in rank order) and returns the epoch and each source's
    /// message. No credit goes out: the senders' buffers stay reserved until the view's reply.
    pub(crate) fn recv_view(
        &mut self,
        ctx: &Context,
        meta: &mut TokenBatch,
        messages: &mut Vec<Message>,
        deadline: Instant,
    ) -> Result<u64> {
        // A view reads rows where they are, on the host.
        self.reader.on_device = false;
        meta.reset(ctx.id, ctx.cfg.dtype, ctx.cfg.hidden, ctx.cfg.topk);
        meta.recv.begin(ctx.id, ctx.attention());
        let recv = &mut meta.recv;
        let epoch = self.receive(ctx, false, deadline, &mut |_, arrival| {
            recv.note(&arrival);
            Ok(())
        })?;
        // Every source in rank order; those outside the call's DP domain as empty messages.
        let buf = ctx.layout.buffer(epoch);
        messages.clear();
        messages.extend((self.messages.iter().enumerate()).map(|(i, m)| {
            m.unwrap_or(Message {
                index: i,
                src: ctx.attention()[i],
                rec: Record::default(),
                mode: WireMode::Push,
                buf,
                landing: buf,
                int8: false,
                on_relay: None,
            })
        }));
        let total: usize = messages.iter().map(Message::count).sum();
        meta.grow(total, 0, false);
        let mut first = 0;
        for msg in messages.iter() {
            meta.recv.sources[msg.index].first_token = first;
            self.reader.prepare(ctx, msg, 0..msg.count())?;
            for r in 0..msg.count() {
                let token = self.reader.decode(ctx, msg, r)?;
                meta.set_token(first + r, msg.src, token, &self.reader.experts);
            }
            first += msg.count();
        }
        self.received(epoch);
        meta.recv.received(ctx, epoch);
        Ok(epoch)
    }
}
