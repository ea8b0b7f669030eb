//! [`TokenView`]: an A2E call's rows read where they landed, with no copy, until the E2A reply.
//!
//! The view borrows its communicator and replies through it (a call with the communicator's
//! failure state); where the rows are, how they are received and how the reply is written is
//! the protocol's (`crate::moe::view`).
//!
//! The view hands out each source's rows where they lie until it replies;
//! [`TokenView::e2a_send`] hands the caller each token's input row and the output row where the
//! reply goes, so an identity expert costs one copy for the whole E2A.
//!
//! A view dropped without a successful reply poisons its communicator and aborts the job with a
//! reason naming this rank and the epoch: the attention ranks wait for that reply, and a silent
//! drop would leave them to time out without knowing why.
//!
//! The reply is a call of the communicator, with its failure state: it is checked whole before
//! anything is written (with INT8 replies every row is computed and quantized first, so a
//! non-finite row fails with nothing sent and the view stays as it was), and a failure after the
//! first write poisons the communicator and aborts the job.

use crate::moe::batch::{SourceInfo, TokenBatch};
use crate::moe::config::TransferMode;
use crate::moe::dtype::Element;
use crate::moe::view::{row_of, send_reply, ViewParts, ViewRows};
use crate::{Communicator, Error, Result};

/// One A2E call's tokens, read in place; answered by [`TokenView::e2a_send`].
///
/// It borrows its communicator until it is dropped. Dropped without a successful reply, it
/// poisons the communicator and aborts the job at once, naming this rank and the epoch (every
/// peer's wait fails with [`Error::Aborted`]): the attention ranks wait for that reply.
pub struct TokenView<'c> {
    comm: &'c mut Communicator,
    epoch: u64,
    rows: ViewRows,
    /// Per token: metadata (source, token index, local experts, weights); no rows.
    meta: TokenBatch,
    replied: bool,
}
impl<'c> TokenView<'c> {
    /// The view of a call `comm` received.
    pub(crate) fn new(comm: &'c mut Communicator, parts: ViewParts) -> Self {
        TokenView {
            comm,
            epoch: parts.epoch,
            rows: parts.rows,
            meta: parts.meta,
            replied: false,
        }
    }

    /// Number of received tokens (source by source, in rank order).
    pub fn num_tokens(&self) -> usize {
        self.meta.num_tokens()
    }

    /// The A2E epoch of the call.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The user tag of the call: the tag its first source sent (the lowest attention rank
    /// taking part in the call; every source's is in [`TokenView::sources`]).
    pub fn tag(&self) -> u64 {
        self.meta.tag()
    }

    /// Per-token metadata: `src_rank`, `src_token`, [`TokenBatch::experts_of`], `sources`
    /// (its rows are empty: read them with [`TokenView::row`]).
    pub fn meta(&self) -> &TokenBatch {
        &self.meta
    }

    /// The sources of this call, in rank order.
    pub fn sources(&self) -> &[SourceInfo] {
        self.meta.sources()
    }

    /// Token `i`'s hidden state, where it landed.
    ///
    /// Only until the reply: once [`TokenView::e2a_send`] has returned the senders' buffers,
    /// they may be overwritten by the next call, so a view that has replied hands out no rows
    /// (an [`Error::InvalidArgument`]), and a row borrowed before the reply cannot be used after
    /// it (the reply borrows the view mutably):
    ///
    /// ```compile_fail
    /// # fn f(comm: &mut xccl::Communicator) -> xccl::Result<()> {
    /// let mut view = comm.a2e_recv_view()?;
    /// let row: &[f32] = view.row(0)?;
    /// view.e2a_send(xccl::TransferMode::Push, |_, x: &[f32], out: &mut [f32]| {
    ///     out.copy_from_slice(x)
    /// })?;
    /// let stale = row[0]; // error: `view` is borrowed mutably by the reply
    /// # let _ = stale;
    /// # Ok(())
    /// # }
    /// ```
    pub fn row<T: Element>(&self, i: usize) -> Result<&[T]> {
        if self.replied {
            return Err(Error::invalid(format!(
                "the view of A2E epoch {} has replied: its rows were handed back to the senders",
                self.epoch
            )));
        }
        row_of(self.comm.ctx(), &self.rows, &self.meta, i)
    }

    /// E2A reply: `fill(i, input, output)` writes token `i`'s reply (its local experts' outputs,
    /// weighted and summed) into `output`, which is where the reply goes; `input` is the token's
    /// hidden state in place. Then the records and signals go out, and the senders' A2E buffers
    /// are released. Replies go in A2E order, like every E2A send.
    ///
    /// The reply is checked whole before anything is written: a call rejected then (wrong
    /// dtype, an older batch not replied to yet, with INT8 replies a row with a NaN or an
    /// infinity, a timeout waiting for credits) leaves the view as it was and sends nothing:
    /// call again. A failure after the first write poisons the communicator and aborts the job.
    /// With INT8 replies `fill` writes into a private row, quantized before the first put.
    pub fn e2a_send<T: Element>(
        &mut self,
        mode: TransferMode,
        mut fill: impl FnMut(usize, &[T], &mut [T]),
    ) -> Result<()> {
        let TokenView {
            comm,
            epoch,
            rows,
            meta,
            replied,
        } = self;
        let epoch = *epoch;
        if *replied {
            return Err(Error::invalid(format!(
                "the view of A2E epoch {epoch} has already replied"
            )));
        }
        let (rows, meta) = (&*rows, &*meta);
        comm.expert("E2A send", |ctx, receiver, sender| {
            if T::DTYPE != ctx.cfg.dtype {
                return Err(Error::invalid(format!(
                    "reply dtype {} does not match the communicator's {}",
                    T::DTYPE.name(),
                    ctx.cfg.dtype.name()
                )));
            }
            receiver.check_reply(ctx, ctx.id, epoch)?;
            let deadline = ctx.call_deadline();
            // One reply row, lent by the sender (aligned for `T`): given back below, whatever
            // the outcome.
            let mut scratch_bytes = sender.take_scratch();
            scratch_bytes.resize(ctx.cfg.hidden * std::mem::size_of::<T>());
            let scratch: &mut [T] = bytemuck::cast_slice_mut(scratch_bytes.bytes_mut());
            let sent = send_reply(
                ctx,
                sender,
                rows,
                meta,
                (epoch, mode, deadline),
                scratch,
                &mut fill,
            );
            sender.give_scratch(scratch_bytes);
            sent?;
            *replied = true;
            meta.recv.answered();
            receiver.replied();
            receiver.credit(ctx, epoch)
        })
    }
}

impl Drop for TokenView<'_> {
    /// Unreplied (and the communicator not failed already): poisons the communicator and
    /// aborts the job, naming this rank and the epoch.
    fn drop(&mut self) {
        if !self.replied {
            if self.comm.poisoned().is_none() {
                let reason = format!(
                    "expert rank {} dropped its view of A2E epoch {} without replying",
                    self.comm.rank(),
                    self.epoch
                );
                self.comm.abort_given_up(&reason);
            }
            return;
        }
        // Replied: the buffers go back to the receiver for the next view.
        let parts = (
            std::mem::take(&mut self.rows),
            std::mem::take(&mut self.meta),
        );
        self.comm.keep_view_buffers(parts);
    }
}
