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

use super::{Exchange, JobKey, Survivors};
use crate::{AbortNotice, Error, Result};

/// The survivors of a job after a shrink; implements [`Exchange`] on top of the job's own.
pub struct Generation {
    parent: Arc<dyn Exchange>,
    /// The parent rank of each member, in new-rank order (ascending).
    members: Vec<usize>,
    /// This rank's new number.
    rank: usize,
    job_id: u64,
    /// Derived from the parent's key and the generation number.
    key: JobKey,
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
pub fn generation_job_id(parent_job: u64, generation: u64) -> u64 {
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
        let key = parent.key().for_generation(parent.job_id(), generation);
        Ok(Generation {
            parent,
            members,
            rank,
            job_id,
            key,
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
            // A malformed abort record names its sender.
            Error::Protocol { peer, detail } => Error::Protocol {
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

    fn key(&self) -> &JobKey {
        &self.key
    }

    fn allgather(&self, blob: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.members_round(blob, timeout, "allgather")
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.members_round(&[], timeout, "barrier").map(|_| ())
    }

    /// The dead member is sent by its parent rank (a number outside the generation stays out
    /// of range, for the receivers' check to name this rank).
    fn broadcast_abort_reporting(&self, dead: Option<usize>, reason: &str) -> Result<()> {
        let dead = dead.map(|d| self.members.get(d).copied().unwrap_or(usize::MAX));
        self.parent.broadcast_abort_reporting(dead, reason)
    }

    fn poll_abort(&self) -> Option<AbortNotice> {
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

    /// The `first`-th abort raised since this generation began, its ranks renumbered (an abort
    /// from a rank outside the generation keeps its parent rank; a dead rank outside it becomes
    /// out of range, so the receiver's check names the sender).
    fn poll_abort_since(&self, first: usize) -> Option<AbortNotice> {
        let a = self
            .parent
            .poll_abort_since(self.horizon.saturating_add(first))?;
        let new = |old: usize| self.members.iter().position(|&m| m == old);
        Some(AbortNotice {
            by: new(a.by).unwrap_or(a.by),
            dead: a.dead.map(|d| new(d).unwrap_or(usize::MAX)),
            reason: a.reason,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::bootstrap::{random_job_id, RootConfig, TcpBootstrap, UniqueId};

    const LONG: Duration = Duration::from_secs(10);

    fn start_job() -> (UniqueId, crate::bootstrap::RootHandle) {
        let mut cfg = RootConfig::new(random_job_id());
        cfg.idle_timeout = Duration::from_secs(5);
        UniqueId::start_root("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
    }

    /// Connects ranks `0..size` of the job, each on its own thread.
    fn connect_all(id: &UniqueId, size: usize) -> Vec<Arc<dyn Exchange>> {
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..size)
                .map(|r| s.spawn(move || TcpBootstrap::connect(id, r, size, LONG).unwrap()))
                .collect();
            hs.into_iter()
                .map(|h| Arc::new(h.join().unwrap()) as Arc<dyn Exchange>)
                .collect()
        })
    }

    /// Runs `f` on each exchange on its own thread; results in order.
    fn on_each<T: Send>(
        ranks: &[Arc<dyn Exchange>],
        f: impl Fn(&Arc<dyn Exchange>) -> T + Sync,
    ) -> Vec<T> {
        std::thread::scope(|s| {
            let hs: Vec<_> = ranks.iter().map(|b| s.spawn(|| f(b))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn wait_for_abort(b: &dyn Exchange, index: usize) {
        let deadline = Instant::now() + LONG;
        while b.poll_abort_since(index).is_none() {
            assert!(Instant::now() < deadline, "abort {index} never arrived");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_survivors_round_completes_without_the_ranks_that_left_and_marks_them_absent() {
        let (id, _root) = start_job();
        let mut ranks = connect_all(&id, 4);
        drop(ranks.remove(2));
        let rounds = on_each(&ranks, |b| {
            let blob = vec![b.rank() as u8; b.rank()];
            b.gather_survivors(&blob, LONG, 0).unwrap()
        });
        for round in rounds {
            assert_eq!(
                round.blobs,
                vec![Some(vec![]), Some(vec![1]), None, Some(vec![3, 3, 3])]
            );
            assert_eq!(round.aborts_before, 0);
        }
    }

    #[test]
    fn a_survivors_round_ignores_aborts_before_its_horizon_and_fails_on_later_ones() {
        let (id, _root) = start_job();
        let ranks = connect_all(&id, 2);
        ranks[0].broadcast_abort("rank 7 died").unwrap();
        wait_for_abort(ranks[1].as_ref(), 0);
        // An ordinary round fails on the abort; a survivors' round ignoring it completes.
        let rounds = on_each(&ranks, |b| {
            b.gather_survivors(b"x", LONG, usize::MAX).unwrap()
        });
        assert_eq!(rounds[1].aborts_before, 1);
        assert_eq!(
            rounds[0].aborts_before, 0,
            "a rank's own abort is not sent back"
        );
        // A later abort fails a round whose horizon is before it.
        ranks[0].broadcast_abort("again").unwrap();
        let err = ranks[1].gather_survivors(b"y", LONG, 1).unwrap_err();
        assert!(
            matches!(&err, Error::Aborted { by: 0, reason } if reason == "again"),
            "{err}"
        );
    }

    #[test]
    fn a_survivors_round_fails_naming_the_root_when_the_root_is_gone() {
        let (id, root) = start_job();
        let ranks = connect_all(&id, 2);
        root.shutdown();
        let err = ranks[0].gather_survivors(b"x", LONG, 0).unwrap_err();
        assert!(
            matches!(&err, Error::Bootstrap(m) if m.contains("connection to the root") && m.contains("lost")),
            "{err}"
        );
    }

    #[test]
    fn a_survivors_round_times_out_naming_a_connected_rank_that_does_not_come() {
        let (id, _root) = start_job();
        let ranks = connect_all(&id, 3);
        let short = Duration::from_millis(300);
        let errs = on_each(&ranks[..2], |b| {
            b.gather_survivors(b"x", short, 0).unwrap_err()
        });
        for err in errs {
            assert!(matches!(err, Error::Timeout { peer: 2, .. }), "{err}");
        }
    }

    #[test]
    fn a_generation_renumbers_its_members_and_ignores_the_replaced_jobs_aborts() {
        let (id, _root) = start_job();
        let mut ranks = connect_all(&id, 4);
        ranks[3].broadcast_abort("old job").unwrap();
        for b in &ranks[..3] {
            wait_for_abort(b.as_ref(), 0);
        }
        drop(ranks.remove(1));
        let parent_job = ranks[0].job_id();
        let outcomes = on_each(&ranks, |b| {
            let horizon = usize::from(b.rank() != 3);
            let g = Generation::new(b.clone(), vec![0, 2, 3], 1, horizon).unwrap();
            assert_ne!(g.job_id(), parent_job);
            assert_eq!(g.poll_abort(), None, "the old job's abort is ignored");
            let all = g.allgather(&[g.rank() as u8 + 10], LONG).unwrap();
            g.barrier(LONG).unwrap();
            (g.rank(), g.size(), g.job_id(), all)
        });
        let job = outcomes[0].2;
        for (i, (rank, size, job_id, all)) in outcomes.into_iter().enumerate() {
            assert_eq!((rank, size, job_id), (i, 3, job));
            assert_eq!(all, vec![vec![10], vec![11], vec![12]]);
        }
    }

    #[test]
    fn a_generations_death_report_names_the_dead_member_by_its_new_rank() {
        let (id, _root) = start_job();
        let mut ranks = connect_all(&id, 4);
        drop(ranks.remove(1));
        let gens: Vec<Generation> = ranks
            .iter()
            .map(|b| Generation::new(b.clone(), vec![0, 2, 3], 1, 0).unwrap())
            .collect();
        // New rank 0 reports the death of new rank 2 (rank 3 before the shrink), then one of
        // new rank 7, which does not exist.
        gens[0]
            .broadcast_abort_reporting(Some(2), "process 42 exited")
            .unwrap();
        gens[0].broadcast_abort_reporting(Some(7), "x").unwrap();
        wait_for_abort(&gens[1], 1);
        let first = gens[1].poll_abort().unwrap();
        assert_eq!((first.by, first.dead), (0, Some(2)));
        let err = gens[1].barrier(LONG).unwrap_err();
        assert!(matches!(err, Error::PeerFailed { peer: 2, .. }), "{err}");
        let bad = gens[1]
            .poll_abort_since(1)
            .unwrap()
            .to_error(gens[1].size());
        assert!(matches!(bad, Error::Protocol { peer: 0, .. }), "{bad}");
    }

    #[test]
    fn a_generation_round_fails_naming_the_new_rank_of_a_member_that_left() {
        let (id, _root) = start_job();
        let mut ranks = connect_all(&id, 3);
        let leaver = ranks.remove(2);
        let gens: Vec<Generation> = ranks
            .iter()
            .map(|b| Generation::new(b.clone(), vec![0, 1, 2], 1, 0).unwrap())
            .collect();
        drop(leaver);
        let errs = std::thread::scope(|s| {
            let hs: Vec<_> = gens
                .iter()
                .map(|g| s.spawn(|| g.allgather(b"x", LONG).unwrap_err()))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for err in errs {
            assert!(matches!(err, Error::PeerFailed { peer: 2, .. }), "{err}");
        }
    }

    #[test]
    fn a_generation_rejects_members_that_leave_this_rank_out_or_are_unordered() {
        let (id, _root) = start_job();
        let b: Arc<dyn Exchange> = Arc::new(TcpBootstrap::connect(&id, 0, 3, LONG).unwrap());
        for members in [vec![1, 2], vec![2, 0], vec![0, 3]] {
            let err = Generation::new(b.clone(), members.clone(), 1, 0).unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument(_)),
                "{members:?}: {err}"
            );
        }
        assert_ne!(generation_job_id(7, 1), generation_job_id(7, 2));
        assert_ne!(generation_job_id(7, 1), 7);
    }
}
