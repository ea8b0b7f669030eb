//! Rendezvous of the ranks of one job.
//!
//! The [`Exchange`] trait is what the rest of xccl needs from a bootstrap: allgather of small
//! blobs, a barrier, a job id and an out-of-band abort channel. TCP rendezvous implements it for
//! ranks in separate processes; [`ThreadExchange`] for ranks that are threads of one process.
//!
//! TCP rendezvous, two ways in:
//! - **Unique id** (NCCL style): one process calls [`UniqueId::new`], which starts a root service
//!   ([`root`]) in that process, and distributes the id (bytes, or hex through an environment
//!   variable); every rank calls [`TcpBootstrap::connect`].
//! - **Launcher environment**: [`from_env`] reads torchrun / Open MPI / PMI / Slurm variables
//!   ([`env`](mod@env)); rank 0 hosts the root on the given port.
//!
//! Every rank keeps one connection to the root. A collective round is gathered at the root and
//! the concatenation is sent back to all; a round that times out names the ranks the root is
//! still waiting for. Aborts are relayed by the root to every other rank and noticed by a
//! background reader even when no collective is running.

use std::time::Duration;

use crate::{AbortNotice, Result};

pub mod env;
mod generation;
pub mod key;
mod roles;
pub mod root;
pub(crate) mod tcp;
mod thread;
mod unique_id;
pub(crate) mod wire;

pub use env::{from_env, LaunchEnv, Launcher, JOB_ID_ENV, ROOT_ENV};
pub use generation::{generation_job_id, Generation};
pub use key::{JobKey, INSECURE_ENV, KEY_ENV, KEY_FILE_ENV};
pub use roles::gather_roles;
pub use root::{RootConfig, RootHandle, RootReport};
#[cfg(any(test, feature = "testing"))]
pub(crate) use tcp::raw_handshake;
pub use tcp::{TcpBootstrap, QUERY_GRACE};
pub use thread::ThreadExchange;
pub use unique_id::{bind_addr_from, random_job_id, UniqueId, SOCKET_ADDR_ENV, UNIQUE_ID_ENV};
pub use wire::MAX_BLOB;

/// What the fabrics and the communicator need from a bootstrap.
pub trait Exchange: Send + Sync {
    /// This rank, in `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the job.
    fn size(&self) -> usize;
    /// A 64-bit id that is the same on every rank of this job and different between jobs. Not
    /// a secret: other users of the host may learn it.
    fn job_id(&self) -> u64;
    /// The job's secret key, the same on every rank and unknown outside the job: the fabrics
    /// derive names that outsiders must not predict from it (shared-memory segments).
    fn key(&self) -> &key::JobKey;
    /// Every rank contributes one blob; every rank gets all blobs, in rank order.
    ///
    /// Fails naming the ranks that did not arrive when `timeout` passes.
    fn allgather(&self, blob: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has entered the barrier; fails naming the missing ranks on timeout.
    fn barrier(&self, timeout: Duration) -> Result<()>;
    /// Tells every other rank, out of band, that this rank aborts the job (reporting no death,
    /// whatever `reason` says).
    fn broadcast_abort(&self, reason: &str) -> Result<()> {
        self.broadcast_abort_reporting(None, reason)
    }
    /// [`Exchange::broadcast_abort`] carrying the abort record `{by: this rank, dead, reason}`:
    /// `dead` (set only by the liveness machinery) is the rank whose death the abort reports,
    /// a field of its own on the wire, never read from the text.
    fn broadcast_abort_reporting(&self, dead: Option<usize>, reason: &str) -> Result<()>;
    /// The first abort raised by another rank, if one has arrived (the record as received:
    /// check it with [`AbortNotice::to_error`]).
    fn poll_abort(&self) -> Option<AbortNotice>;

    /// A **survivors' round**: like [`Exchange::allgather`], but it completes once every rank
    /// has either contributed or left the job (its process died or it said goodbye), and the
    /// aborts this rank received before the first `ignore_aborts` ones do not fail it (pass
    /// `usize::MAX` to ignore every abort). Every rank that gets the result gets the same one.
    /// Used to agree on the dead ranks when shrinking a job ([`crate::Communicator::shrink`]).
    ///
    /// The default fails: the bootstrap cannot tell a rank that left from one that is late.
    fn gather_survivors(
        &self,
        blob: &[u8],
        timeout: Duration,
        ignore_aborts: usize,
    ) -> Result<Survivors> {
        let _ = (blob, timeout, ignore_aborts);
        Err(crate::Error::Bootstrap(
            "this bootstrap cannot hold a survivors' round (shrinking needs the TCP bootstrap)"
                .into(),
        ))
    }

    /// The `first`-th abort (in arrival order, from 0) raised by another rank, if that many
    /// have arrived: a communicator built after a shrink ignores the aborts of the job it
    /// replaced. The default knows only the first abort.
    fn poll_abort_since(&self, first: usize) -> Option<AbortNotice> {
        if first == 0 {
            self.poll_abort()
        } else {
            None
        }
    }
}

/// The outcome of a survivors' round ([`Exchange::gather_survivors`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Survivors {
    /// Per rank: its blob, or `None` when it had left the job instead of contributing.
    pub blobs: Vec<Option<Vec<u8>>>,
    /// Aborts this rank had received when the result arrived; the root forwards every abort a
    /// contributor raised before contributing ahead of the result, so later ones are newer.
    pub aborts_before: usize,
}
