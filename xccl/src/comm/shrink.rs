//! Shrinking a job past dead ranks: [`Communicator::shrink`] and its options.
//!
//! This module owns the agreement on the dead set, the renumbering of the survivors and the
//! rebuilding of the fabric and protocol over them. A shrink is a fixed sequence of named steps
//! ([`ShrinkStep`]); [`ShrinkOptions::on_step`] is called as each one starts, which is where
//! fault injection hooks in.
//!
//! 1. **Poison**: the old communicator is poisoned and the old job aborted (if no failure did it
//!    already), so every rank stops using it; this rank's suspects are collected: the rank its
//!    failure named, and every peer its fabric's liveness check reports dead. No survivor has
//!    released its old fabric yet (that needs this rank's agreement first), so a peer that
//!    merely closed its endpoint is never taken for dead.
//! 2. **Agree**: a survivors' round through the bootstrap root
//!    ([`Exchange::gather_survivors`]): each survivor sends its suspects and the round completes
//!    once every rank has either contributed or lost its connection to the root (a killed
//!    process's connection closes at once). The dead set is the ranks that did not contribute
//!    plus every contributor's suspects. Every survivor computes it from the same result, so
//!    all get the same set; contributions that disagree (generation, topology, options) fail
//!    every survivor alike, naming the rank.
//! 3. **Plan**: the new topology ([`Topology::shrink`]): survivors renumbered densely in old
//!    rank order, experts of dead ranks served by their surviving replicas; an expert with none
//!    left is [`Error::ExpertLost`] (on every survivor), or with
//!    [`ShrinkOptions::drop_orphaned_experts`] its selections are dropped and counted.
//! 4. **Release**: the old communicator is dropped (its fabric endpoint and windows released;
//!    on shm its segments unmapped). Nothing of it is reused: only the bootstrap, the topology
//!    (as data) and the config go on.
//! 5. **Rebuild**: a new fabric of the same kind over a [`Generation`] of the bootstrap (new job
//!    id, so new shm segment names; the old job's aborts ignored) and a new communicator with the
//!    usual init handshake; its final barrier is the commit: a rank that passes it knows every
//!    survivor built the same topology and config.
//!
//! A rank dying **during** the rebuild fails every survivor's rebuild at the same bootstrap
//! round (survivors' rounds name the member that left), and the shrink goes back to step 2 with
//! a new generation, up to [`ShrinkOptions::attempts`] times. If the bootstrap root itself is
//! gone (the process that made the unique id died), no agreement is possible: every survivor's
//! shrink fails with [`Error::Bootstrap`] naming the root ("connection to the root lost"), and a
//! survivor that does not call shrink makes the others' agreement time out naming it.

use std::sync::Arc;
use std::time::Duration;

use super::Communicator;
use crate::bootstrap::{Exchange, Generation};
use crate::fabric::ofi::OfiOptions;
use crate::moe::config::MoeConfig;
use crate::topology::Topology;
use crate::{Error, Result};

/// How this communicator's fabric was built, so a shrink can build the next one alike.
#[derive(Clone)]
pub(crate) enum Origin {
    /// [`Communicator::init_shm`].
    Shm(Arc<dyn Exchange>),
    /// [`Communicator::init_ofi_with`].
    Ofi(Arc<dyn Exchange>, OfiOptions),
    /// [`Communicator::init_ascend`] on this device.
    Ascend(Arc<dyn Exchange>, i32),
    /// [`Communicator::init_cuda`] on this device (or the default one).
    Cuda(Arc<dyn Exchange>, Option<usize>),
    /// A fabric the caller built ([`Communicator::new`], [`Communicator::local_group`]).
    Fabric,
    /// Built by a crate-internal builder (the C ABI's), which a shrink calls again.
    Built(Arc<dyn Exchange>, Arc<Rebuild>),
}

/// How a crate-internal builder makes a communicator over a bootstrap (used again by a shrink).
pub(crate) type Rebuild =
    dyn Fn(Arc<dyn Exchange>, Arc<Topology>, MoeConfig) -> Result<Communicator> + Send + Sync;

impl Origin {
    fn exchange(&self) -> Option<Arc<dyn Exchange>> {
        match self {
            Origin::Shm(e)
            | Origin::Ofi(e, _)
            | Origin::Ascend(e, _)
            | Origin::Cuda(e, _)
            | Origin::Built(e, _) => Some(e.clone()),
            Origin::Fabric => None,
        }
    }

    /// A communicator of the same fabric kind over `exchange`.
    fn rebuild(
        &self,
        exchange: Arc<dyn Exchange>,
        topo: Arc<Topology>,
        cfg: MoeConfig,
    ) -> Result<Communicator> {
        match self {
            Origin::Shm(_) => Communicator::init_shm(exchange, topo, cfg),
            Origin::Ofi(_, opts) => Communicator::init_ofi_with(exchange, topo, cfg, opts),
            Origin::Ascend(_, device) => Communicator::init_ascend(exchange, topo, cfg, *device),
            Origin::Cuda(_, device) => Communicator::init_cuda(exchange, topo, cfg, *device),
            Origin::Built(_, build) => build(exchange, topo, cfg),
            Origin::Fabric => Err(not_shrinkable()),
        }
    }
}

fn not_shrinkable() -> Error {
    Error::invalid(
        "shrink needs a communicator made by init_shm, init_ofi, init_ascend or init_cuda over a \
         bootstrap (one built on a caller's fabric, e.g. local_group, has no bootstrap to agree \
         through)",
    )
}

/// What a communicator made by a shrink remembers of the one it replaced.
#[derive(Clone, Debug)]
pub(super) struct ShrinkInfo {
    /// Rank before the shrink -> rank after it (`None`: dead).
    new_rank: Vec<Option<usize>>,
    /// The dead ranks agreed on (ranks before the shrink), ascending.
    dead: Vec<usize>,
    /// Experts without a replica left, whose selections are dropped.
    orphaned: Vec<usize>,
    /// Generation of this communicator's bootstrap (1 after the first shrink of a job).
    generation: u64,
}

/// A step of [`Communicator::shrink`], in the order they run (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ShrinkStep {
    /// Poisoning the old communicator and collecting this rank's suspects.
    Poison,
    /// The survivors' round that agrees on the dead set (again after a failed rebuild).
    Agree,
    /// Computing the new topology.
    Plan,
    /// Dropping the old communicator's fabric and windows (once).
    Release,
    /// Building the new fabric and communicator.
    Rebuild,
}

/// Options of [`Communicator::shrink`]. Every survivor must pass the same
/// `drop_orphaned_experts` (checked during the agreement).
#[derive(Clone)]
pub struct ShrinkOptions {
    /// Drop (and count, in [`crate::Stats::dropped_slots`]) the selections of an expert whose
    /// every replica died, instead of failing with [`Error::ExpertLost`] naming it.
    pub drop_orphaned_experts: bool,
    /// Bound on each agreement round: how long a survivor waits for the others to call
    /// [`Communicator::shrink`] (default 60 s).
    pub timeout: Duration,
    /// Rounds of agreement and rebuilding tried when a survivor dies during the rebuild
    /// (default 3).
    pub attempts: usize,
    /// Called as each step starts (fault injection, logging).
    pub on_step: Option<Arc<dyn Fn(ShrinkStep) + Send + Sync>>,
}

impl Default for ShrinkOptions {
    fn default() -> Self {
        ShrinkOptions {
            drop_orphaned_experts: false,
            timeout: Duration::from_secs(60),
            attempts: 3,
            on_step: None,
        }
    }
}

impl std::fmt::Debug for ShrinkOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShrinkOptions")
            .field("drop_orphaned_experts", &self.drop_orphaned_experts)
            .field("timeout", &self.timeout)
            .field("attempts", &self.attempts)
            .field("on_step", &self.on_step.as_ref().map(|_| "hook"))
            .finish()
    }
}

impl ShrinkOptions {
    fn step(&self, step: ShrinkStep, rank: usize) {
        tracing::info!(rank, ?step, "xccl: shrink step");
        if let Some(hook) = &self.on_step {
            hook(step);
        }
    }
}

const AGREE_MAGIC: u64 = u64::from_le_bytes(*b"XCSHRNK1");

/// One survivor's contribution to the agreement round.
#[derive(Debug, PartialEq, Eq)]
struct Proposal {
    generation: u64,
    fingerprint: u64,
    drop_orphans: bool,
    suspects: Vec<usize>,
}

impl Proposal {
    fn encode(&self) -> Vec<u8> {
        let mut words = vec![
            AGREE_MAGIC,
            self.generation,
            self.fingerprint,
            u64::from(self.drop_orphans),
            self.suspects.len() as u64,
        ];
        words.extend(self.suspects.iter().map(|&r| r as u64));
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// Decodes rank `from`'s proposal, checking every suspect below `world`.
    fn decode(blob: &[u8], from: usize, world: usize) -> Result<Proposal> {
        let bad = |what: &str| Error::Protocol {
            peer: from,
            detail: format!("malformed shrink proposal: {what}"),
        };
        if !blob.len().is_multiple_of(8) || blob.len() < 40 {
            return Err(bad("wrong length"));
        }
        let words: Vec<u64> = blob
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunks")))
            .collect();
        if words[0] != AGREE_MAGIC {
            return Err(bad("wrong magic"));
        }
        if words[4] != (words.len() - 5) as u64 || words[3] > 1 {
            return Err(bad("wrong suspect count or flags"));
        }
        let suspects = words[5..]
            .iter()
            .map(|&r| usize::try_from(r).ok().filter(|&r| r < world))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| bad("a suspect outside the job"))?;
        Ok(Proposal {
            generation: words[1],
            fingerprint: words[2],
            drop_orphans: words[3] == 1,
            suspects,
        })
    }
}

/// What the agreement round settled.
struct Agreement {
    /// Dead ranks, ascending.
    dead: Vec<usize>,
    /// Aborts received before the result (the next generation's horizon).
    aborts_before: usize,
}

/// Step 3: the survivors' round. Every survivor derives the same dead set from the same result,
/// or the same error.
fn agree(exchange: &dyn Exchange, mine: &Proposal, timeout: Duration) -> Result<Agreement> {
    let world = exchange.size();
    let round = exchange.gather_survivors(&mine.encode(), timeout, usize::MAX)?;
    let mut dead = vec![false; world];
    for (r, blob) in round.blobs.iter().enumerate() {
        let Some(blob) = blob else {
            dead[r] = true;
            continue;
        };
        let theirs = Proposal::decode(blob, r, world)?;
        let differs = |what: String| Error::Protocol {
            peer: r,
            detail: format!("rank {r} shrinks with {what}"),
        };
        if theirs.generation != mine.generation || theirs.fingerprint != mine.fingerprint {
            return Err(differs(format!(
                "generation {} and topology {:016x}; this rank has generation {} and topology {:016x}",
                theirs.generation, theirs.fingerprint, mine.generation, mine.fingerprint
            )));
        }
        if theirs.drop_orphans != mine.drop_orphans {
            return Err(differs(format!(
                "drop_orphaned_experts = {}; this rank has {}",
                theirs.drop_orphans, mine.drop_orphans
            )));
        }
        for &s in &theirs.suspects {
            dead[s] = true;
        }
    }
    let dead: Vec<usize> = (0..world).filter(|&r| dead[r]).collect();
    let me = exchange.rank();
    if dead.contains(&me) {
        let accusers: Vec<usize> = round
            .blobs
            .iter()
            .enumerate()
            .filter_map(|(r, b)| {
                let p = Proposal::decode(b.as_deref()?, r, world).ok()?;
                p.suspects.contains(&me).then_some(r)
            })
            .collect();
        return Err(Error::Bootstrap(format!(
            "shrink: ranks {accusers:?} declared rank {me} dead; it is not part of the shrunk job"
        )));
    }
    Ok(Agreement {
        dead,
        aborts_before: round.aborts_before,
    })
}

impl Communicator {
    /// Replaces this communicator, after a peer failure, by one over the surviving ranks,
    /// without restarting any process. Collective over the survivors: every surviving rank calls
    /// it (typically after a call failed with [`Error::PeerFailed`]); dead ranks simply do not
    /// come.
    ///
    /// The survivors agree on the dead set through the bootstrap (every survivor gets the same
    /// set, or every survivor fails alike), then build a new fabric of the same kind (new
    /// windows; on shm new segments under a new name) and a new communicator, renumbered densely:
    /// survivors keep their order, so new rank = old rank minus the dead ranks below it
    /// ([`Communicator::rank_after_shrink`] maps them). Dead attention ranks simply leave;
    /// experts of dead expert ranks are served by their surviving replicas. The old
    /// communicator is consumed: poisoned (the old job aborted, if no failure had done it) and,
    /// once the survivors agree, released before the new one is built. Calls on the new communicator number their epochs
    /// afresh and use the new topology ([`Communicator::topology`]). Steps, failure while
    /// shrinking, and what happens when the bootstrap root is gone: see [`ShrinkStep`] and the
    /// module docs of [`crate::comm::shrink`].
    ///
    /// # Errors
    /// - [`Error::ExpertLost`] naming the first expert with no surviving replica, unless
    ///   `opts.drop_orphaned_experts` (then its selections are dropped and counted in
    ///   [`crate::Stats::dropped_slots`], and the combine leaves them out).
    /// - [`Error::Bootstrap`] when the bootstrap root is gone, or when the others declared
    ///   this rank dead; [`Error::Timeout`] naming a survivor that did not call `shrink`;
    ///   [`Error::Protocol`] naming a survivor that shrinks with other options;
    ///   [`Error::InvalidArgument`] for a communicator built on a caller's fabric
    ///   ([`Communicator::new`], [`Communicator::local_group`]), which has no bootstrap to agree
    ///   through, or when no attention or no expert rank survives.
    /// - Any init error of the new fabric.
    pub fn shrink(mut self, opts: &ShrinkOptions) -> Result<Communicator> {
        let Some(exchange) = self.origin.exchange() else {
            return Err(not_shrinkable());
        };
        let rank = self.ctx.rank;
        opts.step(ShrinkStep::Poison, rank);
        let suspects = self.poison_for_shrink();
        let generation = self.shrunk.as_ref().map_or(0, |s| s.generation);
        let topo = self.ctx.topo.clone();
        let cfg = self.ctx.cfg.clone();
        let origin = self.origin.clone();
        let mut old = Some(self);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let proposal = Proposal {
                generation: generation + attempt as u64,
                fingerprint: topo.fingerprint(),
                drop_orphans: opts.drop_orphaned_experts,
                suspects: suspects.clone(),
            };
            let outcome = rebuild(&exchange, &origin, &topo, &cfg, &proposal, opts, &mut old);
            match outcome {
                Err(Error::PeerFailed { peer, detail }) if attempt < opts.attempts.max(1) => {
                    tracing::warn!(
                        rank,
                        peer,
                        detail,
                        "xccl: a survivor failed during the shrink; agreeing again"
                    );
                }
                other => return other,
            }
        }
    }

    /// Step 1: poisons this communicator (aborting the old job if nothing did) and returns the
    /// ranks this rank believes dead: the one its failure named and every peer its fabric's
    /// liveness check reports dead.
    fn poison_for_shrink(&mut self) -> Vec<usize> {
        if self.poisoned.is_none() {
            let reason = format!("rank {} shrinks the job", self.ctx.rank);
            self.abort(&reason);
        }
        let mut suspects: Vec<usize> = (0..self.ctx.topo.world_size())
            .filter(|&p| p != self.ctx.rank)
            .filter(|&p| {
                matches!(
                    self.ctx.fabric.check_peer(p),
                    Err(Error::PeerFailed { peer, .. }) if peer == p
                )
            })
            .collect();
        if let Some(Error::PeerFailed { peer, .. }) = &self.poisoned {
            if *peer != self.ctx.rank && !suspects.contains(peer) {
                suspects.push(*peer);
            }
        }
        suspects.sort_unstable();
        suspects
    }

    /// This rank's number before the shrink that made this communicator (`None` for a
    /// communicator that was not made by [`Communicator::shrink`]).
    pub fn rank_before_shrink(&self) -> Option<usize> {
        let info = self.shrunk.as_ref()?;
        info.new_rank.iter().position(|&n| n == Some(self.ctx.rank))
    }

    /// The new rank of the rank numbered `old` before the shrink that made this communicator:
    /// `None` when it died (or is out of range, or this communicator was not made by a shrink).
    /// New ranks are dense: old rank minus the number of dead ranks below it.
    pub fn rank_after_shrink(&self, old: usize) -> Option<usize> {
        self.shrunk.as_ref()?.new_rank.get(old).copied().flatten()
    }

    /// The dead ranks (numbered before the shrink) the survivors agreed on when they made this
    /// communicator; empty for one not made by a shrink.
    pub fn shrunk_past(&self) -> &[usize] {
        self.shrunk.as_ref().map_or(&[], |s| &s.dead)
    }

    /// Experts without a replica on any rank of this communicator (after a shrink with
    /// [`ShrinkOptions::drop_orphaned_experts`]): their selections are dropped and counted in
    /// [`crate::Stats::dropped_slots`].
    pub fn orphaned_experts(&self) -> &[usize] {
        self.shrunk.as_ref().map_or(&[], |s| &s.orphaned)
    }
}

/// Steps 2 to 5 for one generation; `old` is released (once) before the rebuild.
fn rebuild(
    exchange: &Arc<dyn Exchange>,
    origin: &Origin,
    topo: &Topology,
    cfg: &MoeConfig,
    proposal: &Proposal,
    opts: &ShrinkOptions,
    old: &mut Option<Communicator>,
) -> Result<Communicator> {
    let rank = exchange.rank();
    opts.step(ShrinkStep::Agree, rank);
    let agreed = agree(exchange.as_ref(), proposal, opts.timeout)?;
    tracing::warn!(
        rank,
        dead = ?agreed.dead,
        generation = proposal.generation,
        "xccl: survivors agreed on the dead ranks; shrinking"
    );
    opts.step(ShrinkStep::Plan, rank);
    let shrunk = topo.shrink(&agreed.dead, proposal.drop_orphans)?;
    if let Some(old) = old.take() {
        opts.step(ShrinkStep::Release, rank);
        drop(old);
    }
    opts.step(ShrinkStep::Rebuild, rank);
    let members: Vec<usize> = (0..topo.world_size())
        .filter(|&r| shrunk.new_rank[r].is_some())
        .collect();
    let next = Generation::new(
        exchange.clone(),
        members,
        proposal.generation,
        agreed.aborts_before,
    )?;
    let mut comm = origin.rebuild(Arc::new(next), Arc::new(shrunk.topology), cfg.clone())?;
    comm.shrunk = Some(ShrinkInfo {
        new_rank: shrunk.new_rank,
        dead: agreed.dead,
        orphaned: shrunk.orphaned,
        generation: proposal.generation,
    });
    Ok(comm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Topology};

    #[test]
    fn a_proposal_round_trips_and_a_malformed_one_names_its_sender() {
        let p = Proposal {
            generation: 2,
            fingerprint: 0xfeed,
            drop_orphans: true,
            suspects: vec![1, 4],
        };
        assert_eq!(Proposal::decode(&p.encode(), 3, 5).unwrap(), p);
        let bad = [
            p.encode()[..39].to_vec(),
            [&[0u8; 8][..], &p.encode()[8..]].concat(),
            p.encode()[..48].to_vec(),
        ];
        for blob in bad {
            let err = Proposal::decode(&blob, 3, 5).unwrap_err();
            assert!(matches!(err, Error::Protocol { peer: 3, .. }), "{err}");
        }
        let err = Proposal::decode(&p.encode(), 3, 4).unwrap_err();
        assert!(err.to_string().contains("outside the job"), "{err}");
    }

    #[test]
    fn shrinking_a_communicator_without_a_bootstrap_is_an_invalid_argument() {
        let topo = Topology::contiguous(1, 1, 2).unwrap();
        let cfg = MoeConfig::new(8, DType::BF16, 1, 4);
        let mut group = Communicator::local_group(&topo, &cfg).unwrap();
        let steps = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = steps.clone();
        let opts = ShrinkOptions {
            on_step: Some(Arc::new(move |s| seen.lock().unwrap().push(s))),
            ..ShrinkOptions::default()
        };
        let err = group.pop().unwrap().shrink(&opts).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("local_group")),
            "{err}"
        );
        assert!(steps.lock().unwrap().is_empty(), "nothing ran");
    }
}
