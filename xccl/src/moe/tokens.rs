//! The token-major receive path: one row per received token, exactly what crossed the wire,
//! handed to the caller source by source as each arrives.
//!
//! [`Communicator::a2e_recv`] expands rows expert-major (a token for three local experts becomes
//! three rows), which costs one copy per (token, local expert). Callers whose expert kernels
//! gather rows by index (grouped GEMM with an index list) need no expansion:
//! [`Communicator::a2e_recv_tokens`] copies each token once, in arrival order, calls back as each
//! source lands (so compute starts before the slowest sender), and [`TokenBatch`] lists each
//! token's local experts and weights. [`Communicator::e2a_send_tokens`] then takes one
//! already-reduced row per token. Results on the attention side are identical either way.

use std::ops::Range;
use std::time::Instant;

use super::a2e::SourceRows;
use super::batch::{AlignedBytes, SourceInfo};
use super::dtype::Element;
use super::wire::{Progress, Record, TransferMode, WireMode};
use crate::comm::Communicator;
use crate::fabric::Waiting;
use crate::topology::Role;
use crate::{Error, Result};

/// The tokens an expert rank received in one A2E call, one row each, in arrival order.
#[derive(Clone, Debug, Default)]
pub struct TokenBatch {
    pub(crate) epoch: u64,
    pub(crate) elem: usize,
    pub(crate) rows: AlignedBytes,
    /// Per token: the attention rank it came from.
    pub src_rank: Vec<u32>,
    /// Per token: its index at that attention rank.
    pub src_token: Vec<u32>,
    /// Per token: how many local experts it goes to (at most `topk`).
    pub expert_count: Vec<u32>,
    /// Per token, `topk` slots: its local expert indices (ascending), the first
    /// `expert_count[i]` valid.
    pub local_expert: Vec<u32>,
    /// Per token, `topk` slots parallel to `local_expert`: the gating weights.
    pub weight: Vec<f32>,
    /// Slots per token in `local_expert` and `weight` (the communicator's `topk`).
    pub topk: usize,
    /// Per source attention rank, in rank order; `first_token` indexes this batch.
    pub sources: Vec<SourceInfo>,
    /// Order in which sources arrived (indices into `sources`).
    pub arrival_order: Vec<u32>,
}

impl TokenBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of received tokens.
    pub fn num_tokens(&self) -> usize {
        self.src_rank.len()
    }

    /// The A2E epoch this batch came from.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Local experts and weights of token `i`.
    pub fn experts_of(&self, i: usize) -> (&[u32], &[f32]) {
        let r = i * self.topk..i * self.topk + self.expert_count[i] as usize;
        (&self.local_expert[r.clone()], &self.weight[r])
    }

    /// All rows as raw bytes (`num_tokens * hidden * dtype size`).
    pub fn row_bytes(&self) -> &[u8] {
        self.rows.bytes()
    }

    /// All rows as elements of `T` (`num_tokens * hidden`).
    pub fn rows<T: Element>(&self) -> Result<&[T]> {
        if std::mem::size_of::<T>() != self.elem && self.num_tokens() > 0 {
            return Err(Error::invalid(format!(
                "batch holds {}-byte elements, asked for {}",
                self.elem,
                T::DTYPE.name()
            )));
        }
        Ok(bytemuck::cast_slice(self.rows.bytes()))
    }
}

impl Communicator {
    /// A2E receive, token-major: fills `batch` with one row per received token, source by
    /// source as they arrive, calling `on_arrival(batch, tokens)` with the new tokens' range
    /// after each source lands. Collective with every attention rank's A2E send.
    pub fn a2e_recv_tokens(
        &mut self,
        batch: &mut TokenBatch,
        on_arrival: &mut dyn FnMut(&TokenBatch, Range<usize>),
    ) -> Result<()> {
        self.require_role(Role::Expert, "A2E receive")?;
        let epoch = self.a2e_epoch + 1;
        let topo = self.topo.clone();
        let sources = topo.attention_ranks();
        let topk = self.cfg.topk;
        batch.epoch = 0;
        batch.elem = self.cfg.dtype.size();
        batch.topk = topk;
        batch.rows.resize(0);
        batch.src_rank.clear();
        batch.src_token.clear();
        batch.expert_count.clear();
        batch.local_expert.clear();
        batch.weight.clear();
        batch.sources.clear();
        batch.sources.resize(sources.len(), SourceInfo::default());
        batch.arrival_order.clear();

        let mut landing = std::mem::take(&mut self.pull_buf);
        let mut experts = std::mem::take(&mut self.experts_scratch);
        let result = self.a2e_recv_tokens_into(batch, on_arrival, &mut landing, &mut experts);
        self.pull_buf = landing;
        self.experts_scratch = experts;
        result?;
        self.a2e_credit_all(epoch)?;
        self.a2e_epoch = epoch;
        batch.epoch = epoch;
        Ok(())
    }

    /// The receive loop of [`Communicator::a2e_recv_tokens`] (no credits, no epoch update).
    fn a2e_recv_tokens_into(
        &self,
        batch: &mut TokenBatch,
        on_arrival: &mut dyn FnMut(&TokenBatch, Range<usize>),
        landing: &mut Vec<u8>,
        experts: &mut Vec<(u32, f32)>,
    ) -> Result<()> {
        let epoch = self.a2e_epoch + 1;
        let parity = (epoch & 1) as usize;
        let start = Instant::now();
        let deadline = self.deadline();
        let sources = self.topo.attention_ranks();
        let max_tokens = self.cfg.max_tokens_per_rank;
        let row = self.layout.a2e;
        let payload = row.payload;
        let local = self.topo.local_experts(self.rank).len();
        let topk = self.cfg.topk;
        let f = &*self.fabric;
        let (slots, layout) = (self.slots, &self.layout);
        let own = f.local_window().expect("host window");
        // Per source: its validated record and mode, and how many rows are copied.
        let mut state: Vec<Option<(Record, WireMode, usize)>> = vec![None; sources.len()];
        let mut done = vec![false; sources.len()];
        let mut missing = sources.len();
        let mut failure: Option<Error> = None;
        // Copies rows `rows` of source `i` into their reserved place in the batch.
        let mut copy_rows = |i: usize,
                             rec: &Record,
                             mode: WireMode,
                             rows: Range<usize>,
                             batch: &mut TokenBatch|
         -> Result<()> {
            let src = sources[i];
            let view = match self.a2e_rows_in_place(i, rec, mode, parity, rows.clone())? {
                Some(v) => v,
                None => {
                    landing.resize(rows.len() * row.stride, 0);
                    self.a2e_fetch_rows(i, rec, parity, rows.clone(), landing)?;
                    SourceRows::Packed(landing)
                }
            };
            let base = batch.sources[i].first_token + rows.start;
            let dst = &mut batch.rows.bytes_mut()[base * payload..(base + rows.len()) * payload];
            for (n, out) in dst.chunks_exact_mut(payload).enumerate() {
                let token = row.decode_row(view.meta(&row, n), src, max_tokens, local, experts)?;
                out.copy_from_slice(view.payload(&row, n, token));
                let t = base + n;
                batch.src_rank[t] = src as u32;
                batch.src_token[t] = token;
                for (c, &(j, w)) in experts.iter().enumerate() {
                    batch.local_expert[t * topk + c] = j;
                    batch.weight[t * topk + c] = w;
                }
                batch.expert_count[t] = experts.len() as u32;
            }
            Ok(())
        };
        f.wait_until(deadline, &mut || {
            let mut first_missing = None;
            for (i, &src) in sources.iter().enumerate() {
                if done[i] {
                    continue;
                }
                let progress = Progress::of(f.signal_value(slots.a2e_ready(src)), epoch);
                if progress == Progress::NotYet {
                    first_missing.get_or_insert(src);
                    continue;
                }
                if state[i].is_none() {
                    // First sight: validate the record and reserve the source's rows.
                    let mut rec = Record::default();
                    let checked = own
                        .read(layout.record(i, parity), bytemuck::bytes_of_mut(&mut rec))
                        .and_then(|_| rec.validate(src, epoch, max_tokens));
                    let mode = match checked {
                        Ok(m) => m,
                        Err(e) => {
                            failure = Some(e);
                            return None;
                        }
                    };
                    let first = batch.src_rank.len();
                    let total = first + rec.count as usize;
                    batch.rows.resize(total * payload);
                    batch.src_rank.resize(total, 0);
                    batch.src_token.resize(total, 0);
                    batch.expert_count.resize(total, 0);
                    batch.local_expert.resize(total * topk, 0);
                    batch.weight.resize(total * topk, 0.0);
                    batch.sources[i].first_token = first;
                    batch.sources[i].count = rec.count as usize;
                    batch.sources[i].reply_offset = rec.offset as usize;
                    state[i] = Some((rec, mode, 0));
                }
                let (rec, mode, copied) = state[i].expect("set above");
                let count = rec.count as usize;
                let ready = progress.rows(count);
                if ready > copied {
                    if let Err(e) = copy_rows(i, &rec, mode, copied..ready, batch) {
                        failure = Some(e);
                        return None;
                    }
                    state[i] = Some((rec, mode, ready));
                }
                if ready < count {
                    first_missing.get_or_insert(src);
                    continue;
                }
                done[i] = true;
                batch.sources[i].rank = src;
                batch.sources[i].arrived_after = start.elapsed();
                batch.arrival_order.push(i as u32);
                missing -= 1;
                let first = batch.sources[i].first_token;
                on_arrival(batch, first..first + count);
            }
            if missing == 0 {
                return None;
            }
            first_missing.map(|peer| Waiting {
                peer,
                what: "A2E rows",
            })
        })?;
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// E2A send, token-major: `reduced` holds one row per token of `batch` (`[num_tokens,
    /// hidden]`), each already the gating-weighted sum over the token's local experts.
    pub fn e2a_send_tokens<T: Element>(&mut self, batch: &TokenBatch, reduced: &[T]) -> Result<()> {
        self.require_dtype::<T>()?;
        let mode = self.cfg.mode;
        self.e2a_send_tokens_bytes(batch, bytemuck::cast_slice(reduced), mode)
    }

    /// [`Communicator::e2a_send_tokens`] on raw bytes with an explicit transfer mode.
    pub fn e2a_send_tokens_bytes(
        &mut self,
        batch: &TokenBatch,
        reduced: &[u8],
        mode: TransferMode,
    ) -> Result<()> {
        let payload = self.check_e2a_input(batch.epoch, reduced.len(), batch.num_tokens())?;
        self.e2a_send_rows(
            &batch.sources,
            mode,
            Some(&mut |t, out, _| out.copy_from_slice(&reduced[t * payload..(t + 1) * payload])),
        )
    }

    /// The registered E2A output of the next call: `[batch.num_tokens(), hidden]` rows in this
    /// rank's window, row `i` for the batch's token `i`. Compute each token's reduced expert
    /// output straight into it, then call [`Communicator::e2a_send_output`]: attention ranks
    /// read the rows from here, so the combine costs one copy in all instead of two.
    ///
    /// Waits until the buffer's previous use (two calls back) has been consumed everywhere.
    pub fn e2a_output<T: Element>(&mut self, batch: &TokenBatch) -> Result<&mut [T]> {
        self.require_dtype::<T>()?;
        let payload = self.check_e2a_input(batch.epoch, 0, 0)?;
        let epoch = self.e2a_epoch + 1;
        self.wait_e2a_credits(epoch)?;
        self.output_epoch = Some((epoch, batch.epoch));
        let at = self.layout.e2a_stage((epoch & 1) as usize);
        let len = batch.num_tokens() * payload;
        // SAFETY: peers read this parity's staging only between our signal of an epoch with this
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
                "registered output is not aligned for {}: {e}",
                T::DTYPE.name()
            ))
        })
    }

    /// E2A send of the rows written into [`Communicator::e2a_output`] (which must have been
    /// called for this call, with this batch): only records and signals go out; attention ranks
    /// pull the rows.
    pub fn e2a_send_output(&mut self, batch: &TokenBatch) -> Result<()> {
        self.check_e2a_input(batch.epoch, 0, 0)?;
        if self.output_epoch.take() != Some((self.e2a_epoch + 1, batch.epoch)) {
            return Err(Error::invalid(
                "e2a_send_output needs e2a_output first, for this call and this batch",
            ));
        }
        self.e2a_send_rows(&batch.sources, TransferMode::Pull, None)
    }
}
