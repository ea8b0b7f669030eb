//! [`TokenView`]: an A2E call's rows read where they landed, with no copy, until the E2A reply.
//!
//! [`Communicator::a2e_recv_view`] waits for every source and hands back a view over the rows
//! in place: this rank's receive area (push), the sender's staging (pull) or the sender's
//! registered input (gather). The senders' buffers stay reserved until the view is consumed by
//! [`TokenView::e2a_send`] — the credits that free them go out then — so the rows cannot change
//! under the caller. `e2a_send` hands the caller each token's input row and the output row
//! where the reply goes (the attention rank's window on load/store fabrics), so an identity
//! expert costs one copy for the whole E2A. A view dropped without replying releases the
//! senders' buffers; the attention ranks then time out waiting for the reply, naming this rank.
//!
//! One view at a time: it borrows the communicator, so two microbatches in flight use the
//! copying receive paths instead.

use super::batch::SourceInfo;
use super::dtype::Element;
use super::tokens::TokenBatch;
use super::wire::{Record, TransferMode, WireMode};
use crate::comm::Communicator;
use crate::topology::Role;
use crate::{Error, Result};

/// One A2E call's tokens, read in place; consumed by [`TokenView::e2a_send`].
pub struct TokenView<'c> {
    comm: &'c mut Communicator,
    epoch: u64,
    records: Vec<(Record, WireMode)>,
    /// Per token: metadata (source, token index, local experts, weights); no rows.
    meta: TokenBatch,
    /// Rows fetched with `get` on fabrics without load/store access (pull mode only).
    landing: Vec<u8>,
    /// Per source: where its rows start in `landing`, if fetched.
    fetched: Vec<Option<usize>>,
    replied: bool,
}

impl Communicator {
    /// A2E receive without a copy: waits for every attention rank's rows of this call and
    /// returns a view over them where they lie. Reply with [`TokenView::e2a_send`].
    pub fn a2e_recv_view(&mut self) -> Result<TokenView<'_>> {
        self.require_role(Role::Expert, "A2E receive")?;
        let epoch = self.a2e_epoch + 1;
        let parity = (epoch & 1) as usize;
        let mut meta = TokenBatch::new();
        let records = self.a2e_wait_complete(epoch, &mut meta.sources, &mut meta.arrival_order)?;
        let fmt = self.layout.a2e;
        let (topk, max_tokens) = (self.cfg.topk, self.cfg.max_tokens_per_rank);
        let local = self.topo.local_experts(self.rank).len();
        let total: usize = meta.sources.iter().map(|s| s.count).sum();
        meta.topk = topk;
        meta.elem = self.cfg.dtype.size();
        meta.src_rank.resize(total, 0);
        meta.src_token.resize(total, 0);
        meta.expert_count.resize(total, 0);
        meta.local_expert.resize(total * topk, 0);
        meta.weight.resize(total * topk, 0.0);

        // Fetch what cannot be read in place, then decode every row's metadata once.
        let mut landing = Vec::new();
        let mut fetched = vec![None; records.len()];
        for (i, (rec, mode)) in records.iter().enumerate() {
            let rows = 0..rec.count as usize;
            if self
                .a2e_rows_in_place(i, rec, *mode, parity, rows.clone())?
                .is_none()
            {
                fetched[i] = Some(landing.len());
                landing.resize(landing.len() + rows.len() * fmt.stride, 0);
                let at = fetched[i].expect("set above");
                self.a2e_fetch_rows(i, rec, parity, rows, &mut landing[at..])?;
            }
        }
        let mut experts = Vec::new();
        for (i, (rec, mode)) in records.iter().enumerate() {
            let info = meta.sources[i];
            let rows = match fetched[i] {
                Some(at) => {
                    super::a2e::SourceRows::Packed(&landing[at..at + info.count * fmt.stride])
                }
                None => self
                    .a2e_rows_in_place(i, rec, *mode, parity, 0..info.count)?
                    .expect("checked above"),
            };
            for r in 0..info.count {
                let t = info.first_token + r;
                let token = fmt.decode_row(
                    rows.meta(&fmt, r),
                    info.rank,
                    max_tokens,
                    local,
                    &mut experts,
                )?;
                meta.src_rank[t] = info.rank as u32;
                meta.src_token[t] = token;
                meta.expert_count[t] = experts.len() as u32;
                for (c, &(j, w)) in experts.iter().enumerate() {
                    meta.local_expert[t * topk + c] = j;
                    meta.weight[t * topk + c] = w;
                }
            }
        }
        meta.epoch = epoch;
        self.a2e_epoch = epoch;
        Ok(TokenView {
            comm: self,
            epoch,
            records,
            meta,
            landing,
            fetched,
            replied: false,
        })
    }
}

impl TokenView<'_> {
    /// Number of received tokens (source by source, in rank order).
    pub fn num_tokens(&self) -> usize {
        self.meta.num_tokens()
    }

    /// Per-token metadata: `src_rank`, `src_token`, [`TokenBatch::experts_of`], `sources`
    /// (its rows are empty: read them with [`TokenView::row`]).
    pub fn meta(&self) -> &TokenBatch {
        &self.meta
    }

    /// Token `i`'s hidden state, where it landed.
    pub fn row<T: Element>(&self, i: usize) -> Result<&[T]> {
        self.comm.require_dtype::<T>()?;
        let bytes = self.row_bytes(i)?;
        bytemuck::try_cast_slice(bytes).map_err(|e| {
            Error::invalid(format!(
                "row {i} is not aligned for {}: {e}",
                T::DTYPE.name()
            ))
        })
    }

    fn row_bytes(&self, i: usize) -> Result<&[u8]> {
        if i >= self.num_tokens() {
            return Err(Error::invalid(format!(
                "token {i} out of range: the view holds {}",
                self.num_tokens()
            )));
        }
        // Sources hold consecutive token ranges in rank order: the first not ending by `i`.
        let s = self
            .meta
            .sources
            .partition_point(|s| s.first_token + s.count <= i);
        let info = self.meta.sources[s];
        let r = i - info.first_token;
        let fmt = self.comm.layout.a2e;
        let (rec, mode) = &self.records[s];
        let rows = match self.fetched[s] {
            Some(at) => super::a2e::SourceRows::Packed(
                &self.landing[at + r * fmt.stride..at + (r + 1) * fmt.stride],
            ),
            None => self
                .comm
                .a2e_rows_in_place(s, rec, *mode, (self.epoch & 1) as usize, r..r + 1)?
                .expect("in place when not fetched"),
        };
        Ok(rows.payload(&fmt, 0, self.meta.src_token[i]))
    }

    /// E2A send: `fill(i, input, output)` writes token `i`'s reply (its local experts'
    /// outputs, weighted and summed) into `output`, which is where the reply goes; `input` is
    /// the token's hidden state in place. Then the records and signals go out, and the senders'
    /// A2E buffers are released.
    pub fn e2a_send<T: Element>(
        mut self,
        mode: TransferMode,
        mut fill: impl FnMut(usize, &[T], &mut [T]),
    ) -> Result<()> {
        self.comm.require_dtype::<T>()?;
        let view = &self;
        let mut failure = None;
        let mut acc = Vec::new();
        let sent = view.comm.e2a_transmit(
            &view.meta.sources,
            mode,
            Some(&mut |i, out, _| {
                let output = bytemuck::try_cast_slice_mut(out).map_err(|e| {
                    Error::invalid(format!(
                        "reply row is not aligned for {}: {e}",
                        T::DTYPE.name()
                    ))
                });
                match (view.row::<T>(i), output) {
                    (Ok(input), Ok(output)) => fill(i, input, output),
                    (Err(e), _) | (_, Err(e)) => {
                        failure.get_or_insert(e);
                    }
                }
            }),
            &mut acc,
        );
        sent?;
        if let Some(e) = failure {
            return Err(e);
        }
        self.replied = true;
        self.comm.e2a_epoch += 1;
        self.comm.a2e_credit_all(self.epoch)
    }

    /// The sources of this call, in rank order.
    pub fn sources(&self) -> &[SourceInfo] {
        &self.meta.sources
    }
}

impl Drop for TokenView<'_> {
    fn drop(&mut self) {
        if !self.replied {
            // Release the senders' buffers whatever happened; an error here has nowhere to go
            // and the attention ranks' E2A wait reports this rank anyway.
            let _ = self.comm.a2e_credit_all(self.epoch);
        }
    }
}
