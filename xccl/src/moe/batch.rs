//! What the calls hand back: [`ExpertBatch`] and [`TokenBatch`] on expert ranks, [`A2eHandle`] on
//! attention ranks, and [`SourceInfo`] per source of a batch.
//!
//! Every field that steers where the protocol writes (a source's reply offset, the epoch a batch
//! answers) is private: callers read them through accessors, and only the protocol fills them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::context::Context;
use super::dtype::{DType, Element};
use crate::fabric::Fabric;
use crate::{Error, Result};

/// A byte buffer aligned for any element type xccl moves (backed by `u64`s).
#[derive(Clone, Debug, Default)]
pub(crate) struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    /// Resizes to `len` bytes. The backing store only grows (new bytes zeroed once), so
    /// steady-state calls neither allocate nor clear.
    pub(crate) fn resize(&mut self, len: usize) {
        let words = len.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        self.len = len;
    }

    /// The bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, mutable.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

/// Typed view of `bytes` holding elements of `dtype`: `T` must be that dtype, not merely one of
/// the same size (bf16 read as f16 would reinterpret the bits).
fn typed<T: Element>(bytes: &[u8], dtype: DType) -> Result<&[T]> {
    if T::DTYPE != dtype {
        return Err(Error::invalid(format!(
            "batch holds {} elements, asked for {}",
            dtype.name(),
            T::DTYPE.name()
        )));
    }
    bytemuck::try_cast_slice(bytes)
        .map_err(|e| Error::invalid(format!("batch rows as {}: {e}", T::DTYPE.name())))
}

/// What one attention rank sent to this expert rank in one A2E call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceInfo {
    pub(crate) rank: usize,
    pub(crate) count: usize,
    /// Where its E2A replies go (row offset in its E2A receive area), from its record.
    pub(crate) reply_offset: usize,
    /// The buffer of its E2A receive area they go to (its record's landing buffer).
    pub(crate) reply_buffer: usize,
    pub(crate) first_token: usize,
    pub(crate) arrived_after: Duration,
    pub(crate) tag: u64,
}

impl SourceInfo {
    /// Global rank of the attention rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Tokens received from it.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Index of its first token in the batch (its tokens are consecutive).
    pub fn first_token(&self) -> usize {
        self.first_token
    }

    /// Time from the start of the receive call until all of its rows had arrived.
    pub fn arrived_after(&self) -> Duration {
        self.arrived_after
    }

    /// The user tag this attention rank's A2E call carried
    /// (`Communicator::set_next_a2e_tag`; 0 when it set none, and for a source outside the
    /// call's DP domain, which sent nothing).
    pub fn tag(&self) -> u64 {
        self.tag
    }
}

/// Fields every received batch has: which call it answers and where its tokens came from.
#[derive(Clone, Debug, Default)]
pub(crate) struct Received {
    /// The communicator that filled it (its instance id).
    pub(crate) comm: u64,
    /// The A2E epoch; 0 while empty.
    pub(crate) epoch: u64,
    pub(crate) dtype: Option<DType>,
    pub(crate) hidden: usize,
    pub(crate) sources: Vec<SourceInfo>,
    pub(crate) arrival_order: Vec<u32>,
    /// Rows are kept as INT8 plus scales (`MoeConfig::keep_int8`), not in the dtype.
    pub(crate) int8: bool,
    /// The call's tag: (attention index, tag) of its lowest source seen so far.
    pub(crate) tag: Option<(usize, u64)>,
    /// The received call, shared by the batch's clones: the last of them gone before the
    /// reply aborts the job ([`LiveCall`]).
    pub(crate) live: Option<Arc<LiveCall>>,
}

/// A received call waiting for its E2A reply, as the batches that can reply to it hold it
/// (clones share it). When the last of them is dropped or refilled by another receive before
/// the reply went out, the call can no longer be answered: the communicator is poisoned and
/// the job aborted at once, naming this rank and the epoch (otherwise every later reply would
/// fail, "the next reply is for epoch N", and the attention ranks would wait until their
/// deadline).
pub(crate) struct LiveCall {
    epoch: u64,
    answered: AtomicBool,
    link: AbortLink,
}

impl LiveCall {
    /// Replied to (or handed to the C ABI, which refuses to free a live batch): dropping it
    /// does nothing.
    pub(crate) fn answered(&self) {
        self.answered.store(true, Ordering::Release);
    }
}

impl Drop for LiveCall {
    fn drop(&mut self) {
        if !self.answered.load(Ordering::Acquire) {
            self.link.abort(|| {
                format!(
                    "expert rank {} dropped (or refilled) its batch of A2E epoch {} without \
                     replying",
                    self.link.rank, self.epoch
                )
            });
        }
    }
}

impl std::fmt::Debug for LiveCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveCall")
            .field("epoch", &self.epoch)
            .field("answered", &self.answered.load(Ordering::Relaxed))
            .finish()
    }
}

impl Received {
    /// The batch now holds call `epoch` of `ctx`, waiting for its reply.
    pub(crate) fn received(&mut self, ctx: &Context, epoch: u64) {
        self.epoch = epoch;
        if let Some(live) = self.live.as_mut().and_then(Arc::get_mut) {
            // The last call's, answered and shared with no clone ([`Received::release_live`]):
            // reused, so a receive allocates nothing for it.
            live.epoch = epoch;
            *live.answered.get_mut() = false;
            live.link = AbortLink::of(ctx);
            return;
        }
        self.live = Some(Arc::new(LiveCall {
            epoch,
            answered: AtomicBool::new(false),
            link: AbortLink::of(ctx),
        }));
    }

    /// Lets go of the call the batch held, before a receive refills it: kept for
    /// [`Received::received`] to reuse when it was answered and no clone of the batch shares
    /// it, else dropped here (which aborts the job when it was not answered and this was its
    /// last holder, as any drop of it does).
    pub(crate) fn release_live(&mut self) {
        let Some(mut live) = self.live.take() else {
            return;
        };
        if Arc::get_mut(&mut live).is_some_and(|l| *l.answered.get_mut()) {
            self.live = Some(live);
        }
    }

    /// The call was replied to (or the batch handed to the C ABI): no batch holding it aborts
    /// the job when dropped.
    pub(crate) fn answered(&self) {
        if let Some(live) = &self.live {
            live.answered();
        }
    }

    /// The tag of the call's first source (lowest attention rank taking part); 0 while empty.
    pub(crate) fn call_tag(&self) -> u64 {
        self.tag.map_or(0, |(_, t)| t)
    }
}

/// The rows an expert rank received in one A2E call, grouped by local expert (expert-major).
///
/// Within a local expert, rows are ordered by source rank, then by source token index. Reuse one
/// batch across calls: its buffers keep their capacity.
///
/// # A batch dropped before its reply aborts the job
/// The reply ([`crate::Communicator::e2a_send`]) needs the batch. When the last batch holding
/// a received call (the batch and its clones) is dropped, or refilled by another receive,
/// before the reply went out, on a communicator that has not failed, the communicator is
/// poisoned and the job aborted at once, naming this rank and the epoch: every peer's waits
/// fail with [`crate::Error::Aborted`], and this rank's next call returns that error. The
/// same holds for [`TokenBatch`].
#[derive(Clone, Debug, Default)]
pub struct ExpertBatch {
    pub(crate) recv: Received,
    pub(crate) rows: AlignedBytes,
    /// `expert_offsets[j]..expert_offsets[j+1]` are the rows of local expert `j`.
    pub(crate) expert_offsets: Vec<usize>,
    pub(crate) src_rank: Vec<u32>,
    pub(crate) src_token: Vec<u32>,
    pub(crate) weight: Vec<f32>,
    /// Per received token (grouped by source, in wire order): its rows are
    /// `token_rows[token_row_start[i]..token_row_start[i+1]]`, ascending local expert.
    pub(crate) token_row_start: Vec<u32>,
    pub(crate) token_rows: Vec<u32>,
    /// Scratch: next free row per local expert while rows are placed.
    pub(crate) cursors: Vec<usize>,
    /// With `keep_int8`: `hidden` bytes of INT8 per row, and one scale per row.
    pub(crate) qrows: Vec<u8>,
    pub(crate) scales: Vec<f32>,
}

impl ExpertBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of rows (received (token, local expert) pairs).
    pub fn num_rows(&self) -> usize {
        self.src_rank.len()
    }

    /// Number of received tokens (one per (source, token)).
    pub fn num_tokens(&self) -> usize {
        self.token_row_start.len().saturating_sub(1)
    }

    /// Number of local experts.
    pub fn num_local_experts(&self) -> usize {
        self.expert_offsets.len().saturating_sub(1)
    }

    /// Rows of local expert `j`, as a range of row indices.
    pub fn expert_rows(&self, j: usize) -> std::ops::Range<usize> {
        self.expert_offsets[j]..self.expert_offsets[j + 1]
    }

    /// Row indices of received token `i` (one per local expert it selected, ascending).
    pub fn token_rows(&self, i: usize) -> &[u32] {
        &self.token_rows[self.token_row_start[i] as usize..self.token_row_start[i + 1] as usize]
    }

    /// The A2E epoch this batch came from (0 while empty).
    pub fn epoch(&self) -> u64 {
        self.recv.epoch
    }

    /// The user tag of the call: the tag its first source sent (the lowest attention rank
    /// taking part in the call; see [`SourceInfo::tag`] for every source's). 0 while empty.
    pub fn tag(&self) -> u64 {
        self.recv.call_tag()
    }

    /// Hidden size of the rows.
    pub fn hidden(&self) -> usize {
        self.recv.hidden
    }

    /// Per row: the attention rank it came from.
    pub fn src_rank(&self) -> &[u32] {
        &self.src_rank
    }

    /// Per row: the token index at that attention rank.
    pub fn src_token(&self) -> &[u32] {
        &self.src_token
    }

    /// Per row: the gating weight of this (token, expert).
    pub fn weight(&self) -> &[f32] {
        &self.weight
    }

    /// Per source attention rank, in rank order: what came and when.
    pub fn sources(&self) -> &[SourceInfo] {
        &self.recv.sources
    }

    /// Order in which sources completed (indices into [`ExpertBatch::sources`]).
    pub fn arrival_order(&self) -> &[u32] {
        &self.recv.arrival_order
    }

    /// All rows as raw bytes (`num_rows * hidden * dtype size`).
    pub fn row_bytes(&self) -> &[u8] {
        self.rows.bytes()
    }

    /// All rows as elements of `T` (`num_rows * hidden`); `T` must be the communicator's dtype.
    /// Empty when rows are kept as INT8 ([`Self::int8_rows`]).
    pub fn rows<T: Element>(&self) -> Result<&[T]> {
        match self.recv.dtype {
            Some(dt) => typed(self.rows.bytes(), dt),
            None => Ok(&[]),
        }
    }

    /// With `MoeConfig::keep_int8`: every row as `hidden` INT8 values (row-major) and its f32
    /// scale (a value is `q * scale`); `None` when rows are kept in the dtype ([`Self::rows`]).
    pub fn int8_rows(&self) -> Option<(&[i8], &[f32])> {
        self.recv
            .int8
            .then(|| (bytemuck::cast_slice(&self.qrows[..]), &self.scales[..]))
    }
}

/// The tokens an expert rank received in one A2E call, one row each, in arrival order of their
/// sources (each source's tokens consecutive, in wire order).
///
/// Dropped (with its clones) or refilled before its reply, on a communicator that has not
/// failed, it aborts the job naming this rank and the epoch, as [`ExpertBatch`] does.
#[derive(Clone, Debug, Default)]
pub struct TokenBatch {
    pub(crate) recv: Received,
    pub(crate) rows: AlignedBytes,
    pub(crate) src_rank: Vec<u32>,
    pub(crate) src_token: Vec<u32>,
    pub(crate) expert_count: Vec<u32>,
    pub(crate) local_expert: Vec<u32>,
    pub(crate) weight: Vec<f32>,
    pub(crate) topk: usize,
    /// With `keep_int8`: `hidden` bytes of INT8 per token, and one scale per token.
    pub(crate) qrows: Vec<u8>,
    pub(crate) scales: Vec<f32>,
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

    /// The A2E epoch this batch came from (0 while empty).
    pub fn epoch(&self) -> u64 {
        self.recv.epoch
    }

    /// The user tag of the call: the tag its first source sent (the lowest attention rank
    /// taking part in the call; see [`SourceInfo::tag`] for every source's). 0 while empty.
    pub fn tag(&self) -> u64 {
        self.recv.call_tag()
    }

    /// Per token: the attention rank it came from.
    pub fn src_rank(&self) -> &[u32] {
        &self.src_rank
    }

    /// Per token: its index at that attention rank.
    pub fn src_token(&self) -> &[u32] {
        &self.src_token
    }

    /// Local experts (ascending) and gating weights of token `i`.
    pub fn experts_of(&self, i: usize) -> (&[u32], &[f32]) {
        let r = i * self.topk..i * self.topk + self.expert_count[i] as usize;
        (&self.local_expert[r.clone()], &self.weight[r])
    }

    /// Per source attention rank, in rank order; `first_token` indexes this batch.
    pub fn sources(&self) -> &[SourceInfo] {
        &self.recv.sources
    }

    /// Order in which sources completed (indices into [`TokenBatch::sources`]).
    pub fn arrival_order(&self) -> &[u32] {
        &self.recv.arrival_order
    }

    /// All rows as raw bytes (`num_tokens * hidden * dtype size`; empty for a view's metadata).
    pub fn row_bytes(&self) -> &[u8] {
        self.rows.bytes()
    }

    /// All rows as elements of `T` (`num_tokens * hidden`); `T` must be the communicator's dtype.
    /// Empty when rows are kept as INT8 ([`Self::int8_rows`]).
    pub fn rows<T: Element>(&self) -> Result<&[T]> {
        match self.recv.dtype {
            Some(dt) => typed(self.rows.bytes(), dt),
            None => Ok(&[]),
        }
    }

    /// With `MoeConfig::keep_int8`: every row as `hidden` INT8 values (row-major) and its f32
    /// scale (a value is `q * scale`); `None` when rows are kept in the dtype ([`Self::rows`]).
    pub fn int8_rows(&self) -> Option<(&[i8], &[f32])> {
        self.recv
            .int8
            .then(|| (bytemuck::cast_slice(&self.qrows[..]), &self.scales[..]))
    }

    /// Clears everything and reserves per-source bookkeeping for `sources` sources.
    pub(crate) fn reset(&mut self, comm: u64, dtype: DType, hidden: usize, topk: usize) {
        self.recv.release_live();
        self.recv = Received {
            comm,
            epoch: 0,
            dtype: Some(dtype),
            hidden,
            sources: std::mem::take(&mut self.recv.sources),
            arrival_order: std::mem::take(&mut self.recv.arrival_order),
            int8: false,
            tag: None,
            live: self.recv.live.take(),
        };
        self.recv.sources.clear();
        self.recv.arrival_order.clear();
        self.topk = topk;
        self.rows.resize(0);
        self.qrows.clear();
        self.scales.clear();
        self.src_rank.clear();
        self.src_token.clear();
        self.expert_count.clear();
        self.local_expert.clear();
        self.weight.clear();
    }

    /// Reserves room for `total` tokens in every per-token array [`TokenBatch::grow`] grows
    /// (address space only: nothing is touched), so growing up to `total` moves nothing and a
    /// pointer handed out during the receive (a C arrival callback may keep them) stays valid
    /// for the whole receive.
    pub(crate) fn reserve(&mut self, total: usize, payload: usize, with_rows: bool) {
        fn room<T>(v: &mut Vec<T>, len: usize) {
            v.reserve(len.saturating_sub(v.len()));
        }
        if with_rows {
            room(&mut self.rows.words, (total * payload).div_ceil(8));
        } else if self.recv.int8 {
            room(&mut self.qrows, total * self.recv.hidden);
            room(&mut self.scales, total);
        }
        room(&mut self.src_rank, total);
        room(&mut self.src_token, total);
        room(&mut self.expert_count, total);
        room(&mut self.local_expert, total * self.topk);
        room(&mut self.weight, total * self.topk);
    }

    /// Grows the per-token arrays to `total` tokens (rows only when `with_rows`).
    pub(crate) fn grow(&mut self, total: usize, payload: usize, with_rows: bool) {
        if with_rows {
            self.rows.resize(total * payload);
        } else if self.recv.int8 {
            self.qrows.resize(total * self.recv.hidden, 0);
            self.scales.resize(total, 0.0);
        }
        self.src_rank.resize(total, 0);
        self.src_token.resize(total, 0);
        self.expert_count.resize(total, 0);
        self.local_expert.resize(total * self.topk, 0);
        self.weight.resize(total * self.topk, 0.0);
    }

    /// Records token `t`'s origin and local experts.
    pub(crate) fn set_token(&mut self, t: usize, src: usize, token: u32, experts: &[(u32, f32)]) {
        self.src_rank[t] = src as u32;
        self.src_token[t] = token;
        self.expert_count[t] = experts.len() as u32;
        for (c, &(j, w)) in experts.iter().enumerate() {
            self.local_expert[t * self.topk + c] = j;
            self.weight[t * self.topk + c] = w;
        }
    }
}

/// What an attention rank keeps between an A2E call and its E2A: the call's epoch.
///
/// Pass it to `e2a_recv` once; the E2A calls of a communicator complete in A2E order, and a
/// handle of another call, of another communicator or one already used is rejected with an
/// error naming both epochs (the handle stays valid for a retry after a rejected call).
///
/// # Dropping a live handle aborts the job
/// A handle dropped before its E2A was received, on a communicator that has not failed, poisons
/// the communicator and aborts the job at once, with a reason naming this rank and the epoch:
/// every peer's waits fail with [`crate::Error::Aborted`] within milliseconds, and this rank's
/// next call returns that error. Without it, every later E2A of this communicator would fail
/// ("the next E2A is for epoch N") and the expert ranks would wait for its credits until their
/// deadline. Dropping it after its E2A, after the communicator failed, or after the
/// communicator itself was dropped does nothing.
#[must_use = "every A2E call must be matched by its E2A receive (a live handle dropped aborts the job)"]
pub struct A2eHandle {
    pub(crate) comm: u64,
    pub(crate) epoch: u64,
    pub(crate) num_tokens: usize,
    pub(crate) total_rows: usize,
    /// Set once the call's E2A was received (or the handle was detached): dropping it then
    /// does nothing.
    answered: AtomicBool,
    /// The abort path of the communicator's job.
    link: AbortLink,
}

impl std::fmt::Debug for A2eHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("A2eHandle")
            .field("epoch", &self.epoch)
            .field("num_tokens", &self.num_tokens)
            .field("total_rows", &self.total_rows)
            .field("answered", &self.answered.load(Ordering::Relaxed))
            .finish()
    }
}

/// How something a call handed out aborts its communicator's job when it is dropped on a live
/// call: the fabric's abort path (which any thread may take, also while a call of the
/// communicator blocks), held weakly, so a communicator dropped first is not kept alive and
/// needs nothing.
#[derive(Clone)]
pub(crate) struct AbortLink {
    fabric: Weak<dyn Fabric>,
    /// This rank.
    pub(crate) rank: usize,
    /// The communicator's last failed call (`Context::last_failure`).
    last_failure: super::context::LastFailure,
}

impl AbortLink {
    /// The abort path of `ctx`'s job.
    pub(crate) fn of(ctx: &Context) -> Self {
        AbortLink {
            fabric: Arc::downgrade(&ctx.fabric),
            rank: ctx.rank,
            last_failure: ctx.last_failure.clone(),
        }
    }

    /// Aborts the job with `reason()`, unless the communicator is gone or its job has already
    /// been aborted (by this rank's failure or by a peer's). When the communicator's last call
    /// failed (the drop follows from that error as it unwinds), the abort carries that error
    /// first, and the death it reports: the peers are told the cause.
    pub(crate) fn abort(&self, reason: impl FnOnce() -> String) {
        let Some(fabric) = self.fabric.upgrade() else {
            return;
        };
        if fabric.aborted().is_some() {
            return;
        }
        let cause = self
            .last_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let (reason, dead) = match cause {
            Some((cause, dead)) => (format!("{cause}; then {}", reason()), dead),
            None => (reason(), None),
        };
        tracing::error!(reason, "xccl: aborting the job");
        fabric.abort_reporting(dead, &reason);
    }
}

impl A2eHandle {
    /// The handle of this rank's A2E call `epoch` on `ctx`.
    pub(crate) fn new(ctx: &Context, epoch: u64, num_tokens: usize, total_rows: usize) -> Self {
        A2eHandle {
            comm: ctx.id,
            epoch,
            num_tokens,
            total_rows,
            answered: AtomicBool::new(false),
            link: AbortLink::of(ctx),
        }
    }

    /// The call's E2A was received: dropping the handle now does nothing.
    pub(crate) fn answered(&self) {
        self.answered.store(true, Ordering::Release);
    }

    /// Dropping the handle will not abort the job (for the C ABI, which refuses to free a live
    /// handle instead and releases the handles of a destroyed communicator quietly).
    pub(crate) fn detach(&self) {
        self.answered();
    }

    /// Tokens sent in that A2E call.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// The A2E epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Rows sent (one per (token, destination rank)).
    pub fn total_rows(&self) -> usize {
        self.total_rows
    }
}

impl Drop for A2eHandle {
    /// Live (its E2A not received): poisons the communicator and aborts the job, naming this
    /// rank and the epoch (see the type's docs).
    fn drop(&mut self) {
        if self.answered.load(Ordering::Acquire) {
            return;
        }
        self.link.abort(|| {
            format!(
                "rank {} dropped its A2E handle of epoch {} before receiving its E2A",
                self.link.rank, self.epoch
            )
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn typed_access_checks_the_dtype_not_the_element_size() {
        let mut b = TokenBatch::new();
        b.reset(1, DType::BF16, 2, 1);
        b.grow(1, 4, true);
        b.rows
            .bytes_mut()
            .copy_from_slice(&[0x80, 0x3f, 0x80, 0x3f]); // bf16 1.0, 1.0
        assert_eq!(b.rows::<bf16>().unwrap(), &[bf16::ONE, bf16::ONE]);
        let err = b.rows::<f16>().unwrap_err().to_string();
        assert!(err.contains("bf16") && err.contains("f16"), "{err}");
        assert!(b.rows::<f32>().is_err());
    }
}
