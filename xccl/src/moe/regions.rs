//! The protocol's only borrows of window memory as Rust slices.
//!
//! Everything else the protocol does to a window is a copy through [`super::context::Context::put`]
//! and [`super::context::Context::get`] (raw-pointer copies inside the fabric), so no reference
//! ever covers memory another rank may be writing. A slice is handed out only for a range the
//! protocol has made exclusive, and only for as long as it stays so; each caller's `SAFETY:`
//! comment names the protocol step that makes it so:
//! - rows a sender has finished (its progress signal covers them) and will not write again until
//!   this rank's credit for that call (read-only borrows: views, in-place reads);
//! - a buffer this rank owns and no peer reads until this rank signals it (the registered A2E
//!   input, the E2A output staging, the reply rows of a view), borrowed mutably under the
//!   communicator's `&mut` so no signal can go out while the borrow lives.
//!
//! `None` means the window is not mapped in this process (device memory, RDMA): the caller
//! copies through `get`/`put` instead.

use super::context::Context;
use crate::Result;

/// Borrows `len` bytes at `offset` of `rank`'s window, read-only.
///
/// # Safety
/// No rank may write the range while the slice lives: the protocol step that hands the range to
/// this reader (a progress signal covering it, whose credit has not been sent) must guarantee it.
pub(crate) unsafe fn landed(
    ctx: &Context,
    rank: usize,
    offset: usize,
    len: usize,
) -> Result<Option<&[u8]>> {
    let win = if rank == ctx.rank {
        ctx.fabric.local_window()
    } else {
        ctx.fabric.peer_window(rank)
    };
    match win {
        // SAFETY: the caller guarantees that nobody writes the range while the slice lives; the
        // window (and so the mapping) is borrowed from the fabric for the slice's lifetime.
        Some(w) => Ok(Some(unsafe { w.slice(offset, len)? })),
        None => Ok(None),
    }
}

/// Borrows `len` bytes at `offset` of `rank`'s window, exclusively.
///
/// # Safety
/// No rank may read or write the range while the slice lives, and no other borrow of it may
/// exist in this process: the range must be one this rank holds the write right to (the credit
/// for its previous use received, its next signal not yet sent), and the caller must keep the
/// slice from outliving that state (by holding `&mut` of the protocol state that would signal).
#[allow(clippy::mut_from_ref)] // window memory: exclusive by the protocol, per the contract above
pub(crate) unsafe fn exclusive(
    ctx: &Context,
    rank: usize,
    offset: usize,
    len: usize,
) -> Result<Option<&mut [u8]>> {
    let win = if rank == ctx.rank {
        ctx.fabric.local_window()
    } else {
        ctx.fabric.peer_window(rank)
    };
    match win {
        // SAFETY: exclusive by the caller's contract; mapped for the fabric borrow's lifetime.
        Some(mut w) => Ok(Some(unsafe { w.slice_mut(offset, len)? })),
        None => Ok(None),
    }
}
