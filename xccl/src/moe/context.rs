//! [`Context`]: what every protocol type of one rank shares — the fabric, the topology, the
//! config, the window layout and the slot numbering — plus the record of whether the current call
//! has published anything to a peer yet.
//!
//! Every write to a peer (or to this rank's own window, which peers read) goes through
//! [`Context::put`] and [`Context::signal`], which note that the call has published. The
//! communicator uses that to give a failed call its defined state: an error before anything was
//! published leaves everything as it was (retry the call), an error after it poisons the
//! communicator and aborts the job.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Instant;

use super::config::MoeConfig;
use super::slots::Slots;
use super::window_layout::WindowLayout;
use crate::fabric::{Fabric, Waiting};
use crate::topology::Topology;
use crate::{Error, Result};

/// How often a protocol wait checks every peer it waits for (the fabric checks the first one
/// between sleeps).
pub(crate) const AWAITED_CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

/// The shared state of one rank's protocol.
pub(crate) struct Context {
    pub(crate) fabric: Box<dyn Fabric>,
    pub(crate) topo: Arc<Topology>,
    pub(crate) cfg: MoeConfig,
    pub(crate) layout: WindowLayout,
    pub(crate) slots: Slots,
    pub(crate) rank: usize,
    /// A per-process unique id of this communicator, stamped on handles and batches.
    pub(crate) id: u64,
    published: Cell<bool>,
}

impl Context {
    /// Checks that `fabric` fits the topology and config (rank count, slots, window sizes).
    pub(crate) fn new(
        fabric: Box<dyn Fabric>,
        topo: Arc<Topology>,
        cfg: MoeConfig,
    ) -> Result<Self> {
        cfg.validate(&topo)?;
        let layout = WindowLayout::new(&topo, &cfg);
        let slots = Slots::new(topo.world_size());
        if fabric.world_size() != topo.world_size() {
            return Err(Error::invalid(format!(
                "fabric has {} ranks, topology {}",
                fabric.world_size(),
                topo.world_size()
            )));
        }
        if fabric.num_signal_slots() < slots.count() {
            return Err(Error::invalid(format!(
                "fabric has {} signal slots per rank, the protocol needs {}",
                fabric.num_signal_slots(),
                slots.count()
            )));
        }
        for r in 0..topo.world_size() {
            if fabric.window_len(r) < layout.window_len(r) {
                return Err(Error::invalid(format!(
                    "rank {r}'s window is {} bytes, the protocol needs {}",
                    fabric.window_len(r),
                    layout.window_len(r)
                )));
            }
        }
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Context {
            rank: fabric.rank(),
            fabric,
            topo,
            cfg,
            layout,
            slots,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            published: Cell::new(false),
        })
    }

    /// The deadline of a call starting now: every wait of the call shares it.
    pub(crate) fn call_deadline(&self) -> Instant {
        crate::fabric::deadline_after(self.cfg.timeout)
    }

    /// Starts a call: nothing published yet.
    pub(crate) fn begin_call(&self) {
        self.published.set(false);
    }

    /// Whether the current call has written anything a peer may read.
    pub(crate) fn has_published(&self) -> bool {
        self.published.get()
    }

    /// `put` that notes the call has published.
    pub(crate) fn put(&self, peer: usize, offset: usize, data: &[u8]) -> Result<()> {
        self.published.set(true);
        self.fabric.put(peer, offset, data)
    }

    /// `signal` that notes the call has published.
    pub(crate) fn signal(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        self.published.set(true);
        self.fabric.signal(peer, slot, value)
    }

    /// `get` from `rank`'s window (this rank's own included).
    pub(crate) fn get(&self, rank: usize, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.fabric.get(rank, offset, buf)
    }

    /// Whether `rank`'s window is mapped in this process (loads and stores are cheap).
    pub(crate) fn mapped(&self, rank: usize) -> bool {
        if rank == self.rank {
            self.fabric.local_window().is_some()
        } else {
            self.fabric.capabilities().load_store
        }
    }

    /// Current value of this rank's slot.
    pub(crate) fn slot_value(&self, slot: usize) -> u64 {
        self.fabric.signal_value(slot)
    }

    /// Waits until `poll` returns `None`.
    pub(crate) fn wait(
        &self,
        deadline: Instant,
        poll: &mut dyn FnMut() -> Option<Waiting>,
    ) -> Result<()> {
        self.fabric.wait_until(deadline, poll)
    }

    /// Checks that every peer in `missing` (the peers a wait still waits for) is alive, at most
    /// once per [`AWAITED_CHECK_EVERY`] (tracked in `next`): the fabric's wait loop checks only
    /// the first awaited peer, this catches a dead one further down the list.
    pub(crate) fn check_awaited(
        &self,
        missing: impl IntoIterator<Item = usize>,
        next: &mut Instant,
    ) -> Result<()> {
        let now = Instant::now();
        if now < *next {
            return Ok(());
        }
        *next = now + AWAITED_CHECK_EVERY;
        missing
            .into_iter()
            .try_for_each(|p| self.fabric.check_peer(p))
    }

    /// The attention ranks, in rank order.
    pub(crate) fn attention(&self) -> &[usize] {
        self.topo.attention_ranks()
    }

    /// The expert ranks, in rank order.
    pub(crate) fn experts(&self) -> &[usize] {
        self.topo.expert_ranks()
    }

    /// Waits until every rank of `peers` has credited at least `epoch - max_in_flight` into its
    /// slot of the credit group at `base` (slot `base + peer`): the buffer `epoch` is about to
    /// reuse is free. Calls within the first `max_in_flight` after `epoch_base` need nothing.
    pub(crate) fn wait_credits(
        &self,
        epoch: u64,
        peers: &[usize],
        base: usize,
        what: &'static str,
        deadline: Instant,
    ) -> Result<()> {
        let depth = self.cfg.max_in_flight as u64;
        if epoch <= self.cfg.epoch_base + depth {
            return Ok(());
        }
        let need = epoch - depth;
        let mut next = Instant::now() + AWAITED_CHECK_EVERY;
        let mut failure = None;
        self.wait(deadline, &mut || {
            let lagging = || {
                peers
                    .iter()
                    .copied()
                    .filter(|&p| self.slot_value(base + p) < need)
            };
            let first = lagging().next()?;
            if let Err(e) = self.check_awaited(lagging(), &mut next) {
                failure = Some(e);
                return None;
            }
            Some(Waiting { peer: first, what })
        })?;
        failure.map_or(Ok(()), Err)
    }
}
