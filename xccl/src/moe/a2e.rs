//! A2E (dispatch): attention ranks send token rows to expert ranks.
//!
//! Sender (attention rank `s`, call epoch `e`, parity `p = e & 1`):
//! 1. validate everything and build the [`DispatchLayout`]; nothing is written before this;
//! 2. wait for credit `e - 2` from every expert rank (the parity's previous user is consumed);
//! 3. per expert rank `d` (rotated by `s` to spread incast): put the [`Record`] first, then encode
//!    the rows for `d` in chunks — straight into `d`'s receive area (push, load/store fabrics),
//!    into local staging then `put` (push, other fabrics), or into local staging only (pull) —
//!    signalling `a2e_ready[s] = progress(e, rows)` after each chunk. With a registered input
//!    (gather) only metadata rows are written; receivers read the payloads from the input.
//!
//! Receiver (expert rank `d`, [`Communicator::a2e_recv`]): one pass over all sources per wake-up
//! until every message of epoch `e` is complete (arrival order and times are kept), then rows are
//! arranged expert-major straight from where they lie (`SourceRows`), and credit `e` goes back
//! to every source.

use std::ops::Range;
use std::time::Instant;

use super::batch::{A2eHandle, ExpertBatch, SourceInfo};
use super::dtype::Element;
use super::layout::DispatchLayout;
use super::wire::{chunk_rows, progress, A2eRow, Progress, Record, TransferMode, WireMode};
use crate::comm::Communicator;
use crate::fabric::Waiting;
use crate::topology::Role;
use crate::{Error, Result};

impl Communicator {
    /// A2E send on raw bytes: `x` is `[T, hidden]` of the communicator's dtype.
    pub fn a2e_send_bytes(
        &mut self,
        x: &[u8],
        topk_idx: &[i32],
        topk_weights: &[f32],
        mode: TransferMode,
    ) -> Result<A2eHandle> {
        self.require_role(Role::Attention, "A2E send")?;
        let payload = self.layout.a2e.payload;
        if !x.len().is_multiple_of(payload) {
            return Err(Error::invalid(format!(
                "x has {} bytes, not a whole number of rows of hidden {} x {}",
                x.len(),
                self.cfg.hidden,
                self.cfg.dtype.name()
            )));
        }
        let layout = self.a2e_layout(x.len() / payload, topk_idx, topk_weights)?;
        self.a2e_transmit(layout, Some(x), mode.into())
    }

    /// The registered A2E input of the next call: `[max_tokens_per_rank, hidden]` rows in this
    /// rank's window. Write token `t`'s hidden state into row `t` (ideally the layer that
    /// produces it writes there directly), then call [`Communicator::a2e_send_input`]: expert
    /// ranks read the rows from here, so the dispatch costs one copy in all instead of two.
    ///
    /// Waits until the buffer's previous use (two calls back) has been consumed everywhere.
    pub fn a2e_input<T: Element>(&mut self) -> Result<&mut [T]> {
        self.require_role(Role::Attention, "A2E input")?;
        self.require_dtype::<T>()?;
        let epoch = self.a2e_epoch + 1;
        self.wait_a2e_credits(epoch)?;
        self.input_epoch = Some(epoch);
        let at = self.layout.a2e_input((epoch & 1) as usize);
        let len = self.cfg.max_tokens_per_rank * self.layout.a2e.payload;
        // SAFETY: peers read this parity's input only between our signal of an epoch with this
        // parity and their credit for it; the wait above covers epoch - 2, the last such epoch,
        // and the `&mut self` borrow keeps us from signalling while the slice lives.
        let bytes = unsafe {
            self.fabric
                .local_window()
                .expect("host window")
                .slice_mut(at, len)?
        };
        bytemuck::try_cast_slice_mut(bytes).map_err(|e| {
            Error::invalid(format!(
                "registered input is not aligned for {}: {e}",
                T::DTYPE.name()
            ))
        })
    }

    /// A2E send of the first `num_tokens` rows of the registered input
    /// ([`Communicator::a2e_input`], which must have been called for this call). On fabrics
    /// with load/store access only the routing metadata is written and expert ranks gather the
    /// rows from the input; elsewhere rows are staged for them to pull.
    pub fn a2e_send_input(
        &mut self,
        num_tokens: usize,
        topk_idx: &[i32],
        topk_weights: &[f32],
    ) -> Result<A2eHandle> {
        self.require_role(Role::Attention, "A2E send")?;
        if self.input_epoch != Some(self.a2e_epoch + 1) {
            return Err(Error::invalid(
                "a2e_send_input needs a2e_input first: the rows must be written for this call",
            ));
        }
        let layout = self.a2e_layout(num_tokens, topk_idx, topk_weights)?;
        let mode = if self.fabric.capabilities().load_store {
            WireMode::Gather
        } else {
            WireMode::Pull
        };
        self.a2e_transmit(layout, None, mode)
    }

    /// Checks the token count and builds the routing layout; nothing is written anywhere.
    fn a2e_layout(
        &mut self,
        num_tokens: usize,
        topk_idx: &[i32],
        topk_weights: &[f32],
    ) -> Result<DispatchLayout> {
        if num_tokens > self.cfg.max_tokens_per_rank {
            return Err(Error::invalid(format!(
                "{num_tokens} tokens exceed max_tokens_per_rank {}",
                self.cfg.max_tokens_per_rank
            )));
        }
        let mut layout = self.spare_layout.take().unwrap_or_default();
        if let Err(e) = layout.build_into(
            &self.topo,
            self.rank,
            num_tokens,
            topk_idx,
            topk_weights,
            self.cfg.topk,
        ) {
            self.spare_layout = Some(layout);
            return Err(e);
        }
        Ok(layout)
    }

    /// Sends one A2E call: rows from `x`, or from the registered input when `x` is `None`.
    fn a2e_transmit(
        &mut self,
        layout: DispatchLayout,
        x: Option<&[u8]>,
        mode: WireMode,
    ) -> Result<A2eHandle> {
        let epoch = self.a2e_epoch + 1;
        let parity = (epoch & 1) as usize;
        let num_tokens = layout.num_tokens();
        let topo = self.topo.clone();
        let experts = topo.expert_ranks();
        let src_index = self
            .topo
            .attention_index(self.rank)
            .expect("attention rank");
        self.input_epoch = None;

        // Flow control: the parity's previous user (epoch - 2) must be consumed everywhere.
        self.wait_a2e_credits(epoch)?;

        let mut offsets = Vec::with_capacity(experts.len());
        let mut acc = 0usize;
        for &d in experts {
            offsets.push(acc);
            acc += layout.count(d);
        }

        let n = experts.len();
        let direct = self.fabric.capabilities().load_store;
        let row = self.layout.a2e;
        let mut own = self.fabric.local_window().expect("host window");
        let x: &[u8] = match x {
            Some(x) => x,
            // SAFETY: the caller wrote the registered input before this call (`a2e_input`
            // handed it out under `&mut self`); nobody writes it until our next `a2e_input`.
            None => unsafe { own.slice(self.layout.a2e_input(parity), num_tokens * row.payload)? },
        };
        for step in 0..n {
            let j = (src_index + step) % n;
            let d = experts[j];
            let entries = layout.entries(d);
            let count = entries.len();
            // The record goes first: receivers may start on the first chunk.
            let rec = Record::new(epoch, count as u32, offsets[j] as u32, mode);
            self.fabric.put(
                d,
                self.layout.record(src_index, parity),
                bytemuck::bytes_of(&rec),
            )?;
            let slot = self.slots.a2e_ready(self.rank);
            if mode == WireMode::Gather {
                // Metadata only: the receiver gathers payloads from our registered input.
                let at = self.layout.a2e_stage(parity) + offsets[j] * row.meta_stride;
                // SAFETY: as for staged rows below: peers read this staging only between our
                // signal and their credit, and the credit wait covers the last such epoch.
                let metas = unsafe { own.slice_mut(at, count * row.meta_stride)? };
                for (e, meta) in entries.zip(metas.chunks_exact_mut(row.meta_stride)) {
                    let t = layout.token(e) as u32;
                    row.encode_meta(meta, t, layout.mask(e), layout.weights(e));
                }
                self.fabric.signal(d, slot, progress(epoch, count))?;
                continue;
            }
            let bytes = count * row.stride;
            let remote = self.layout.a2e_recv(src_index, parity);
            let (dst, staged) = if mode == WireMode::Push && direct {
                let mut win = self.fabric.peer_window(d).expect("load/store fabric");
                // SAFETY: the credit wait above guarantees that `d` finished reading this parity's
                // rows from us (epoch - 2) and will not read them again before our signal of
                // `epoch`; no one else writes our receive area at `d`.
                (unsafe { win.slice_mut(remote, bytes)? }, false)
            } else {
                let stage = self.layout.a2e_stage(parity) + offsets[j] * row.stride;
                // SAFETY: our staging area for this parity is read by peers only between our
                // signal of an epoch with this parity and their credit for it; the credit wait
                // above covers epoch - 2, the last such epoch.
                (unsafe { own.slice_mut(stage, bytes)? }, true)
            };
            let chunk = chunk_rows(row.stride, self.cfg.chunk_bytes);
            let mut done = 0;
            loop {
                let n = chunk.min(count - done);
                let part = &mut dst[done * row.stride..(done + n) * row.stride];
                encode_rows(
                    &layout,
                    entries.start + done..entries.start + done + n,
                    x,
                    &row,
                    part,
                );
                if staged && mode == WireMode::Push {
                    self.fabric.put(d, remote + done * row.stride, part)?;
                }
                done += n;
                self.fabric.signal(d, slot, progress(epoch, done))?;
                if done == count {
                    break;
                }
            }
        }
        self.a2e_epoch = epoch;
        Ok(A2eHandle {
            epoch,
            num_tokens,
            layout,
            offsets,
        })
    }

    /// A2E receive on an expert rank: fills `batch` with this call's rows, grouped by local
    /// expert. Collective with every attention rank's [`Communicator::a2e_send`].
    pub fn a2e_recv(&mut self, batch: &mut ExpertBatch) -> Result<()> {
        self.require_role(Role::Expert, "A2E receive")?;
        let epoch = self.a2e_epoch + 1;
        let records =
            self.a2e_wait_complete(epoch, &mut batch.sources, &mut batch.arrival_order)?;
        self.arrange_expert_major(batch, &records, (epoch & 1) as usize)?;
        self.a2e_credit_all(epoch)?;
        self.a2e_epoch = epoch;
        batch.epoch = epoch;
        Ok(())
    }

    /// Waits until every attention rank's message of `epoch` is complete (record validated, all
    /// rows signalled), one pass over all sources per wake-up; fills `sources` (rank order) and
    /// `arrival_order`. Returns each source's record and mode.
    pub(crate) fn a2e_wait_complete(
        &self,
        epoch: u64,
        sources_out: &mut Vec<SourceInfo>,
        arrival_order: &mut Vec<u32>,
    ) -> Result<Vec<(Record, WireMode)>> {
        let parity = (epoch & 1) as usize;
        let start = Instant::now();
        let sources = self.topo.attention_ranks();
        let max_tokens = self.cfg.max_tokens_per_rank;
        sources_out.clear();
        sources_out.resize(sources.len(), SourceInfo::default());
        arrival_order.clear();
        let mut records: Vec<Option<(Record, WireMode)>> = vec![None; sources.len()];
        let mut failure: Option<Error> = None;
        let f = &*self.fabric;
        let (slots, layout) = (self.slots, &self.layout);
        let win = f.local_window().expect("host window");
        let mut missing = sources.len();
        let mut first_token = 0;
        f.wait_until(self.deadline(), &mut || {
            let mut first_missing = None;
            for (i, &src) in sources.iter().enumerate() {
                if records[i].is_some() {
                    continue;
                }
                let progress = Progress::of(f.signal_value(slots.a2e_ready(src)), epoch);
                if progress == Progress::NotYet {
                    first_missing.get_or_insert(src);
                    continue;
                }
                let mut rec = Record::default();
                let checked = win
                    .read(layout.record(i, parity), bytemuck::bytes_of_mut(&mut rec))
                    .and_then(|_| rec.validate(src, epoch, max_tokens));
                let mode = match checked {
                    Ok(mode) => mode,
                    Err(e) => {
                        failure = Some(e);
                        return None;
                    }
                };
                if progress.rows(rec.count as usize) < rec.count as usize {
                    // Rows still streaming in.
                    first_missing.get_or_insert(src);
                    continue;
                }
                records[i] = Some((rec, mode));
                sources_out[i] = SourceInfo {
                    rank: src,
                    count: rec.count as usize,
                    reply_offset: rec.offset as usize,
                    first_token: 0,
                    arrived_after: start.elapsed(),
                };
                arrival_order.push(i as u32);
                missing -= 1;
            }
            if missing == 0 {
                return None;
            }
            first_missing.map(|peer| Waiting {
                peer,
                what: "A2E record",
            })
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        // Tokens are numbered source by source, in rank order.
        for s in sources_out.iter_mut() {
            s.first_token = first_token;
            first_token += s.count;
        }
        Ok(records
            .into_iter()
            .map(|r| r.expect("all arrived"))
            .collect())
    }

    /// Tells every attention rank that this rank is done with their rows of `epoch`.
    pub(crate) fn a2e_credit_all(&self, epoch: u64) -> Result<()> {
        for &src in self.topo.attention_ranks() {
            self.fabric
                .signal(src, self.slots.a2e_credit(self.rank), epoch)?;
        }
        Ok(())
    }

    /// Where rows `rows` of source `i`'s A2E message lie, read in place: this rank's receive
    /// area (push), or the sender's staging (pull) or staging plus registered input (gather) in
    /// its mapped window. `None` when the fabric cannot map peer windows and the rows must be
    /// fetched with [`Communicator::a2e_fetch_rows`].
    pub(crate) fn a2e_rows_in_place(
        &self,
        i: usize,
        rec: &Record,
        mode: WireMode,
        parity: usize,
        rows: Range<usize>,
    ) -> Result<Option<SourceRows<'_>>> {
        let fmt = self.layout.a2e;
        let src = self.topo.attention_ranks()[i];
        let f = &*self.fabric;
        let bytes = rows.len() * fmt.stride;
        Ok(Some(match (mode, f.peer_window(src)) {
            (WireMode::Push, _) => {
                let at = self.layout.a2e_recv(i, parity) + rows.start * fmt.stride;
                // SAFETY: the sender signalled progress past these rows after writing them and
                // writes this parity again only after our credit, sent once we are done.
                SourceRows::Packed(unsafe {
                    f.local_window().expect("host window").slice(at, bytes)?
                })
            }
            (WireMode::Pull, None) => return Ok(None),
            (WireMode::Pull, Some(win)) => {
                let at =
                    self.layout.a2e_stage(parity) + (rec.offset as usize + rows.start) * fmt.stride;
                // SAFETY: the sender's staging is stable from its signal until our credit.
                SourceRows::Packed(unsafe { win.slice(at, bytes)? })
            }
            (WireMode::Gather, None) => {
                return Err(Error::Protocol {
                    peer: src,
                    detail: "gather-mode A2E over a fabric without load/store access".into(),
                })
            }
            (WireMode::Gather, Some(win)) => {
                let metas = self.layout.a2e_stage(parity)
                    + (rec.offset as usize + rows.start) * fmt.meta_stride;
                let input = self.layout.a2e_input(parity);
                // SAFETY: the sender's staging and registered input for this parity are stable
                // from its signal until our credit (it waits for that credit before handing the
                // input buffer out again).
                unsafe {
                    SourceRows::Gathered {
                        metas: win.slice(metas, rows.len() * fmt.meta_stride)?,
                        input: win.slice(input, self.cfg.max_tokens_per_rank * fmt.payload)?,
                    }
                }
            }
        }))
    }

    /// Fetches rows `rows` of source `i`'s pulled A2E message into `landing` (exactly their
    /// size) with `get`, for fabrics without load/store access.
    pub(crate) fn a2e_fetch_rows(
        &self,
        i: usize,
        rec: &Record,
        parity: usize,
        rows: Range<usize>,
        landing: &mut [u8],
    ) -> Result<()> {
        let fmt = self.layout.a2e;
        let at = self.layout.a2e_stage(parity) + (rec.offset as usize + rows.start) * fmt.stride;
        self.fabric.get(self.topo.attention_ranks()[i], at, landing)
    }

    /// Copies every source's rows into `batch`, expert-major, straight from where they lie.
    fn arrange_expert_major(
        &mut self,
        batch: &mut ExpertBatch,
        records: &[(Record, WireMode)],
        parity: usize,
    ) -> Result<()> {
        let stride = self.layout.a2e.stride;
        let direct = self.fabric.capabilities().load_store;
        // Without load/store access, fetch every pulled message into one landing buffer first.
        let mut landing = std::mem::take(&mut self.pull_buf);
        let mut fetched = Vec::with_capacity(records.len());
        let mut total = 0;
        for (rec, mode) in records {
            let n = if *mode == WireMode::Pull && !direct {
                rec.count as usize * stride
            } else {
                0
            };
            fetched.push(total..total + n);
            total += n;
        }
        landing.resize(total, 0);
        let mut experts = std::mem::take(&mut self.experts_scratch);
        let mut result = Ok(());
        for (i, (rec, _)) in records.iter().enumerate() {
            if !fetched[i].is_empty() && result.is_ok() {
                let rows = 0..rec.count as usize;
                result =
                    self.a2e_fetch_rows(i, rec, parity, rows, &mut landing[fetched[i].clone()]);
            }
        }
        if result.is_ok() {
            result = self.arrange_from(batch, records, parity, &landing, &fetched, &mut experts);
        }
        self.pull_buf = landing;
        self.experts_scratch = experts;
        result
    }

    /// Arranges rows expert-major, reading each source in place or from `landing`.
    fn arrange_from(
        &self,
        batch: &mut ExpertBatch,
        records: &[(Record, WireMode)],
        parity: usize,
        landing: &[u8],
        fetched: &[Range<usize>],
        experts: &mut Vec<(u32, f32)>,
    ) -> Result<()> {
        let row = self.layout.a2e;
        let local = self.topo.local_experts(self.rank).len();
        let max_tokens = self.cfg.max_tokens_per_rank;
        let sources = self.topo.attention_ranks();
        let mut views = Vec::with_capacity(records.len());
        for (i, (rec, mode)) in records.iter().enumerate() {
            let rows = 0..rec.count as usize;
            views.push(match self.a2e_rows_in_place(i, rec, *mode, parity, rows)? {
                Some(v) => v,
                None => SourceRows::Packed(&landing[fetched[i].clone()]),
            });
        }

        // Pass 1: count rows per local expert and tokens, validating every row.
        batch.expert_offsets.clear();
        batch.expert_offsets.resize(local + 1, 0);
        let mut tokens = 0usize;
        let mut rows = 0usize;
        for (i, view) in views.iter().enumerate() {
            batch.sources[i].first_token = tokens;
            for r in 0..view.len(&row) {
                row.decode_row(view.meta(&row, r), sources[i], max_tokens, local, experts)?;
                for &(j, _) in experts.iter() {
                    batch.expert_offsets[j as usize + 1] += 1;
                }
                rows += experts.len();
                tokens += 1;
            }
        }
        for j in 0..local {
            batch.expert_offsets[j + 1] += batch.expert_offsets[j];
        }

        // Pass 2: place rows (source order, then wire order = token order).
        let payload = row.payload;
        batch.hidden = self.cfg.hidden;
        batch.elem = self.cfg.dtype.size();
        batch.rows.resize(rows * payload);
        batch.src_rank.resize(rows, 0);
        batch.src_token.resize(rows, 0);
        batch.weight.resize(rows, 0.0);
        batch.token_row_start.clear();
        batch.token_row_start.reserve(tokens + 1);
        batch.token_rows.clear();
        batch.token_rows.reserve(rows);
        batch.token_row_start.push(0);
        let cursors = &mut batch.cursors;
        cursors.clear();
        cursors.extend_from_slice(&batch.expert_offsets[..local]);
        let out = batch.rows.bytes_mut();
        for (i, view) in views.iter().enumerate() {
            for r in 0..view.len(&row) {
                let token =
                    row.decode_row(view.meta(&row, r), sources[i], max_tokens, local, experts)?;
                let src_row = view.payload(&row, r, token);
                for &(j, w) in experts.iter() {
                    let dst = cursors[j as usize];
                    cursors[j as usize] += 1;
                    out[dst * payload..(dst + 1) * payload].copy_from_slice(src_row);
                    batch.src_rank[dst] = sources[i] as u32;
                    batch.src_token[dst] = token;
                    batch.weight[dst] = w;
                    batch.token_rows.push(dst as u32);
                }
                batch.token_row_start.push(batch.token_rows.len() as u32);
            }
        }
        Ok(())
    }
}

/// One source's received A2E rows, read where they lie.
pub(crate) enum SourceRows<'a> {
    /// Full rows (payload, then metadata), `stride` apart.
    Packed(&'a [u8]),
    /// Metadata rows `meta_stride` apart; token `t`'s payload is row `t` of `input`.
    Gathered {
        /// The metadata rows.
        metas: &'a [u8],
        /// The sender's registered input, `[max_tokens, hidden]`.
        input: &'a [u8],
    },
}

impl<'a> SourceRows<'a> {
    /// Number of rows.
    pub(crate) fn len(&self, fmt: &A2eRow) -> usize {
        match self {
            SourceRows::Packed(b) => b.len() / fmt.stride,
            SourceRows::Gathered { metas, .. } => metas.len() / fmt.meta_stride,
        }
    }

    /// Metadata of row `r`.
    pub(crate) fn meta(&self, fmt: &A2eRow, r: usize) -> &'a [u8] {
        match *self {
            SourceRows::Packed(b) => &b[r * fmt.stride + fmt.meta_offset()..(r + 1) * fmt.stride],
            SourceRows::Gathered { metas, .. } => {
                &metas[r * fmt.meta_stride..(r + 1) * fmt.meta_stride]
            }
        }
    }

    /// Payload of row `r`, whose metadata named `token` (already checked below max_tokens).
    pub(crate) fn payload(&self, fmt: &A2eRow, r: usize, token: u32) -> &'a [u8] {
        match *self {
            SourceRows::Packed(b) => &b[r * fmt.stride..r * fmt.stride + fmt.payload],
            SourceRows::Gathered { input, .. } => {
                let t = token as usize;
                &input[t * fmt.payload..(t + 1) * fmt.payload]
            }
        }
    }
}

/// Encodes the rows of `entries` (payload from `x`, then metadata) into `dst`.
fn encode_rows(
    layout: &DispatchLayout,
    entries: std::ops::Range<usize>,
    x: &[u8],
    row: &super::wire::A2eRow,
    dst: &mut [u8],
) {
    let payload = row.payload;
    let meta_off = row.meta_offset();
    for (e, out) in entries.zip(dst.chunks_exact_mut(row.stride)) {
        let t = layout.token(e);
        out[..payload].copy_from_slice(&x[t * payload..(t + 1) * payload]);
        row.encode_meta(
            &mut out[meta_off..],
            t as u32,
            layout.mask(e),
            layout.weights(e),
        );
    }
}
