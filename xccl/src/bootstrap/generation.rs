//! [`Generation`]: the bootstrap of a job shrunk past dead ranks, a view of the job's own
//! bootstrap restricted to the survivors.
//!
//! A shrink ([`crate::Communicator::shrink`]) does not reconnect anything: the survivors keep
//! their connections to the root and hold **survivors' rounds**
//! ([`Exchange::gather_survivors`]), which complete without the ranks that left. A
//! [`Generation`] renumbers the members densely (new rank `i` is the `i`-th member in the
//! parent's rank order), requires every member in each of its rounds (a member missing from a
//! round fails it with [`Error::PeerFailed`] naming the member's new rank), derives a new job id
//! from the parent's and the generation number (so fabrics name their resources afresh, e.g.
//! new shared-memory segments), and ignores the aborts of the job it replaces (those received
//! before its horizon).

use std::sync::Arc;
use std::time::Duration;

use super::{Exchange, Survivors};
use crate::{Error, Result};

/// The survivors of a job after a shrink; implements [`Exchange`] on top of the job's own.
pub struct Generation {
    parent: Arc<dyn Exchange>,
    /// The parent rank of each member, in new-rank order (ascending).
    members: Vec<usize>,
    /// This rank's new number.
    rank: usize,
    job_id: u64,
    /// The parent's aborts before this index belong to the replaced job.
    horizon: usize,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("rank", &self.rank)
            .field("members", &self.members)
            .field("job_id", &format_args!("{:016x}", self.job_id))
            .field("horizon", &self.horizon)
            .finish_non_exhaustive()
    }
}

/// The job id of generation `generation` of the job `parent_job`: a SplitMix64 step over both,
/// so every generation names its resources apart from the others and from its parent.
pub(crate) fn generation_job_id(parent_job: u64, generation: u64) -> u64 {
    let mut z = parent_job ^ generation.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Generation {
    /// The generation `generation` of `parent`'s job made of `members` (parent ranks,
    /// ascending, this rank among them); the parent's aborts before index `horizon` are ignored.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `members` is not ascending, names a rank outside the
    /// parent's job, or leaves this rank out.
    pub fn new(
        parent: Arc<dyn Exchange>,
        members: Vec<usize>,
        generation: u64,
        horizon: usize,
    ) -> Result<Self> {
        if members.windows(2).any(|w| w[0] >= w[1])
            || members.last().is_some_and(|&m| m >= parent.size())
        {
            return Err(Error::invalid(format!(
                "generation members {members:?} must be ascending ranks below {}",
                parent.size()
            )));
        }
        let Some(rank) = members.iter().position(|&m| m == parent.rank()) else {
            return Err(Error::invalid(format!(
                "rank {} is not among the generation's members {members:?}",
                parent.rank()
            )));
        };
        let job_id = generation_job_id(parent.job_id(), generation);
        Ok(Generation {
            parent,
            members,
            rank,
            job_id,
            horizon,
        })
    }

    /// The parent rank of each member, in new-rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// A survivors' round of the parent, restricted to the members and renumbered.
    fn members_gather(&self, blob: &[u8], timeout: Duration, ignore: usize) -> Result<Survivors> {
        let ignore = self.horizon.saturating_add(ignore);
        let all = self
            .parent
            .gather_survivors(blob, timeout, ignore)
            .map_err(|e| self.renumbered(e))?;
        Ok(Survivors {
            blobs: self
                .members
                .iter()
                .map(|&m| all.blobs.get(m).cloned().flatten())
                .collect(),
            aborts_before: all.aborts_before.saturating_sub(self.horizon),
        })
    }

    /// A round every member must join: a member that left fails it, named by its new rank.
    fn members_round(&self, blob: &[u8], timeout: Duration, what: &str) -> Result<Vec<Vec<u8>>> {
        let round = self.members_gather(blob, timeout, 0)?;
        round
            .blobs
            .into_iter()
            .enumerate()
            .map(|(new, b)| {
                b.ok_or_else(|| Error::PeerFailed {
                    peer: new,
                    detail: format!(
                        "left the job (rank {} before the shrink); bootstrap {what} cannot complete",
                        self.members[new]
                    ),
                })
            })
            .collect()
    }

    /// `e` with a parent rank it names replaced by the member's new rank.
    fn renumbered(&self, e: Error) -> Error {
        let new = |old: usize| self.members.iter().position(|&m| m == old).unwrap_or(old);
        match e {
            Error::Aborted { by, reason } => Error::Aborted {
                by: new(by),
                reason,
            },
            Error::PeerFailed { peer, detail } => Error::PeerFailed {
                peer: new(peer),
                detail,
            },
            Error::Timeout { peer, what, waited } => Error::Timeout {
                peer: new(peer),
                what: format!("{what} (ranks before the shrink)"),
                waited,
            },
            other => other,
        }
    }
}

impl Exchange for Generation {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn job_id(&self) -> u64 {
        self.job_id
    }

    fn allgather(&self, blob: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.members_round(blob, timeout, "allgather")
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.members_round(&[], timeout, "barrier").map(|_| ())
    }

    fn broadcast_abort(&self, reason: &str) -> Result<()> {
        self.parent.broadcast_abort(reason)
    }

    fn poll_abort(&self) -> Option<(usize, String)> {
        self.poll_abort_since(0)
    }

    fn gather_survivors(
        &self,
        blob: &[u8],
        timeout: Duration,
        ignore_aborts: usize,
    ) -> Result<Survivors> {
        self.members_gather(blob, timeout, ignore_aborts)
    }

    /// The `first`-th abort raised since this generation began, its rank renumbered (an abort
    /// from a rank outside the generation keeps its parent rank).
    fn poll_abort_since(&self, first: usize) -> Option<(usize, String)> {
        let (by, reason) = self
            .parent
            .poll_abort_since(self.horizon.saturating_add(first))?;
        let by = self.members.iter().position(|&m| m == by).unwrap_or(by);
        Some((by, reason))
    }
}
