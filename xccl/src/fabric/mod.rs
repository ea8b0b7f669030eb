//! The fabric layer: one-sided, memory-semantic transport between ranks.
//!
//! Every rank registers one **window** at init, and every peer addresses it by `(rank, offset)`.
//! A fabric offers:
//! - [`Fabric::put`] / [`Fabric::get`]: write into / read from a peer's window;
//! - [`Fabric::signal`]: store a 64-bit value into a peer's signal slot, ordered after every
//!   earlier put from this rank to that peer (NVSHMEM's put-with-signal guarantee);
//! - [`Fabric::wait_until`]: wait on this rank's own slots with a deadline; spins briefly, then
//!   sleeps; fails naming the peer it waited for, early if any peer is dead or the job aborted
//!   (through the control area or the bootstrap's out-of-band channel);
//! - [`Capabilities`]: what is cheap (direct load/store of peer memory, remote read).
//!
//! Fabrics never fall back silently to another; a missing library is an error naming it.
//! Implementations: [`local`] (ranks as threads of one process), [`shm`] (processes on one
//! host, shared memory), [`ofi`] (processes on any hosts, libfabric RMA over verbs, EFA or
//! tcp) and [`ascend`] (processes on one host, one Ascend NPU each, through the CANN runtime
//! opened at run time). The conformance suite in [`conformance`] runs against each.

use std::time::{Duration, Instant};

use crate::{AbortNotice, Result};

pub mod ascend;
pub mod conformance;
pub(crate) mod copy;
pub mod local;
pub mod ofi;
pub mod shm;
mod signals;
mod window;

pub(crate) use signals::{clock_ns, AlignedBuf};
pub use signals::{ControlArea, WaitCounters, WaitPolicy, WaitState, Waiting};
pub use window::Window;

/// What a fabric can do cheaply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Peer windows are mapped in this process: [`Fabric::peer_window`] returns them and the
    /// protocol may load/store peer memory directly (zero staging copies).
    pub load_store: bool,
    /// [`Fabric::get`] is a true one-sided remote read (pull mode costs no peer CPU).
    pub remote_read: bool,
    /// Fewest bytes worth one progress signal: a communicator raises
    /// [`crate::MoeConfig::chunk_bytes`] to it. 0 where chunks of any size pay for their
    /// signal; 4 MiB over libfabric's tcp provider, where each write and each signal is a round
    /// through the kernel (1A:1E round trips with 64 KiB chunks: 3.2-5.1 ms at T=128 and
    /// 13.8-19.1 ms at T=512, against 2.1-2.3 and 9.3-9.9 ms with 4 MiB; `docs/performance.md`).
    pub chunk_floor: usize,
}

/// One-sided transport between the ranks of a job. See the module docs for the contract.
pub trait Fabric: Send + Sync {
    /// Short name of the fabric (`"shm"`, `"local"`, ...).
    fn name(&self) -> &'static str;

    /// This rank.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// What this fabric does cheaply.
    fn capabilities(&self) -> Capabilities;

    /// Size in bytes of `rank`'s window.
    fn window_len(&self, rank: usize) -> usize;

    /// Number of signal slots every rank has.
    fn num_signal_slots(&self) -> usize;

    /// This rank's own window, when this process can load and store it directly (host
    /// memory); `None` when it lives where the host cannot address it (device memory), and
    /// the protocol then reaches it with [`Fabric::put`] and [`Fabric::get`] to itself.
    fn local_window(&self) -> Option<Window<'_>>;

    /// A peer's window mapped in this process, when [`Capabilities::load_store`] holds.
    fn peer_window(&self, peer: usize) -> Option<Window<'_>>;

    /// Writes `data` into `peer`'s window at `offset` (`peer` may be this rank). Complete
    /// (visible to the peer after a later signal) when [`Fabric::signal`] to that peer or
    /// [`Fabric::flush`] returns.
    fn put(&self, peer: usize, offset: usize, data: &[u8]) -> Result<()>;

    /// Reads `buf.len()` bytes from `peer`'s window at `offset` (`peer` may be this rank);
    /// complete on return.
    fn get(&self, peer: usize, offset: usize, buf: &mut [u8]) -> Result<()>;

    /// Stores `value` into `peer`'s signal slot `slot`, after every earlier put to `peer`.
    fn signal(&self, peer: usize, slot: usize, value: u64) -> Result<()>;

    /// [`Fabric::signal`] that need not wake a waiter asleep on `peer`'s slots: for a value it may
    /// act on early but need not (a record ahead of its rows), always followed by a
    /// [`Fabric::signal`] that wakes it. A spinning waiter sees it as any other value. Fabrics
    /// without sleeping waiters signal as usual (the default).
    fn signal_quiet(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        self.signal(peer, slot, value)
    }

    /// Current value of this rank's slot `slot`; data signalled with it is visible.
    fn signal_value(&self, slot: usize) -> u64;

    /// Completes every outstanding put of this rank.
    fn flush(&self) -> Result<()>;

    /// Waits until `poll` returns `None` (done). `poll` returns what it still waits for; the
    /// error on timeout, abort or a dead peer names that peer.
    fn wait_until(
        &self,
        deadline: Instant,
        poll: &mut dyn FnMut() -> Option<Waiting>,
    ) -> Result<()>;

    /// Returns once every rank has called `barrier`; fails naming missing ranks on timeout.
    fn barrier(&self, timeout: Duration) -> Result<()>;

    /// Raises the abort flag on every rank, with `reason` and no death report: their current
    /// and later waits fail with [`crate::Error::Aborted`] naming this rank and carrying the
    /// reason. The first abort wins; the call returns promptly and never fails (a peer it cannot
    /// reach is dead anyway). Whatever the text says, no rank takes it for a death.
    fn abort(&self, reason: &str) {
        self.abort_reporting(None, reason)
    }

    /// [`Fabric::abort`] carrying the abort record `{by: this rank, dead, reason}`: with
    /// `dead = Some(d)` (set only by the liveness machinery, for a rank that poisons because it
    /// saw `d` die) every receiver reports [`crate::Error::PeerFailed`] naming `d`
    /// ([`crate::AbortNotice::to_error`]). Every fabric carries `dead` as its own field of the
    /// record, in its memory and on the bootstrap's out-of-band abort alike.
    fn abort_reporting(&self, dead: Option<usize>, reason: &str);

    /// Passes on another rank's abort record unchanged (its `by`, `dead` and reason) to every
    /// rank that holds no abort yet, through the fabric only (the bootstrap relays the
    /// original): a rank that poisons on an abort it received makes sure every rank hears of
    /// it, and, the first abort winning, no rank hears another account of it first.
    fn forward_abort(&self, notice: &AbortNotice);

    /// Ok if `peer` is believed alive; [`crate::Error::PeerFailed`] if it is known dead or has
    /// left the job (a wait for it can never end).
    fn check_peer(&self, peer: usize) -> Result<()>;

    /// Tells the peers that this rank left the job cleanly (its departure mark, which dropping
    /// the fabric sets), while this process keeps its windows mapped: for a binding whose
    /// buffers still point into them ([`crate::Communicator::leave`]). The default does
    /// nothing: such a fabric marks the departure when it is dropped.
    fn leave(&self) {}

    /// Counters of this rank's waits (spin polls, yields, sleeps) and the estimates its wait
    /// policy adapts to ([`WaitState`]); zeros on fabrics whose waits do not keep them.
    fn wait_counters(&self) -> WaitCounters {
        WaitCounters::default()
    }

    /// The abort record (the rank that aborted the job, the death it reports, its reason), if
    /// an abort has reached this rank (calls check it before they start, so a rank that never
    /// waits still learns of the abort).
    fn aborted(&self) -> Option<AbortNotice> {
        None
    }

    /// Ok if no peer died (peers that left the job cleanly after their last call do not count)
    /// and no abort arrived out of band; else the error naming the first dead peer or the
    /// aborting rank. Waits call it between sleeps, after checking the awaited peer with
    /// [`Fabric::check_peer`]. The default checks nothing beyond the awaited peer.
    fn check_peers(&self) -> Result<()> {
        Ok(())
    }

    /// Waits until slot `slot` holds a value satisfying `ready`, which `peer` is expected to
    /// signal; returns that value.
    fn wait_signal(
        &self,
        slot: usize,
        peer: usize,
        what: &'static str,
        deadline: Instant,
        ready: &dyn Fn(u64) -> bool,
    ) -> Result<u64> {
        let mut seen = 0;
        self.wait_until(deadline, &mut || {
            seen = self.signal_value(slot);
            if ready(seen) {
                None
            } else {
                Some(Waiting::on(peer, what))
            }
        })?;
        Ok(seen)
    }
}

/// The failure of a wait for `peer`, which left the job (destroyed its communicator): gone for
/// good whether its process still runs or not, so a wait for it can never end. `alive` is its
/// process liveness check, whose detail is kept when the process is gone too.
pub(crate) fn departed(peer: usize, alive: Result<()>) -> crate::Error {
    let since = match alive {
        Err(crate::Error::PeerFailed { detail, .. }) => format!("; {detail} since"),
        _ => String::new(),
    };
    crate::Error::PeerFailed {
        peer,
        detail: format!("left the job (its communicator was destroyed){since}"),
    }
}

/// Deadline `timeout` from now (saturating far in the future).
pub fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
}
