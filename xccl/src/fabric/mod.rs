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
//! tcp), [`ascend`] (processes on one host, one Ascend NPU each, through the CANN runtime
//! opened at run time) and [`cuda`] (processes on one host, windows in GPU memory shared by
//! CUDA IPC, the control area in host shared memory). The conformance suite in [`conformance`] runs against each.

use std::time::{Duration, Instant};

use crate::{AbortNotice, Result};

pub mod ascend;
pub mod conformance;
pub(crate) mod copy;
pub mod cuda;
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
///
/// # Safety
/// The protocol borrows ranges of the windows as Rust slices (`&mut [T]` handed to the caller by
/// [`crate::Communicator::a2e_input`] and a view's reply, `&[T]` of a view's rows) while a
/// step of the protocol says nobody else touches them. An implementation must keep that true:
/// - [`Fabric::put`], [`Fabric::get`] and the signals touch only the bytes they are given
///   (bounds-checked), and nothing writes a window at any other time: no write of the fabric's
///   own, no thread or handle outside the calls (a forwarding fabric that keeps a clone of its
///   inner fabric and writes through it breaks this);
/// - every [`Window`] returned by [`Fabric::local_window`] and [`Fabric::peer_window`] stays
///   mapped, readable and writable for as long as the fabric lives.
///
/// Keeping the contract of implementations is not enough: a fabric's methods are safe to
/// call, so whoever else holds the fabric (or another endpoint of the same in-process world)
/// could write a lent range. Hence [`crate::Communicator::new`], which takes any fabric, is
/// `unsafe` (its caller promises that nothing outside the job's communicators uses the
/// fabric's windows), and so are the public constructors of [`local::LocalFabric`], whose
/// windows are all in this process. The safe constructors (`Communicator::init_shm`,
/// `init_ofi`, `init_ascend`, `local_group`) build their fabric and hand out no handle to it.
/// The windows of the `shm`, `ofi` and `ascend` fabrics are written by other processes, a
/// NIC or a device, outside the Rust abstract machine; the protocol orders those writes.
///
/// Safe code can neither implement the trait, nor build a communicator on a fabric it keeps a
/// handle to, nor make an in-process world of endpoints:
///
/// ```compile_fail,E0200
/// use std::time::{Duration, Instant};
/// use xccl::fabric::{Capabilities, Fabric, Waiting, Window};
/// // A forwarding fabric whose owner keeps a clone of the inner one.
/// struct Forward(std::sync::Arc<dyn Fabric>);
/// impl Fabric for Forward {
/// #   fn name(&self) -> &'static str { self.0.name() }
/// #   fn rank(&self) -> usize { self.0.rank() }
/// #   fn world_size(&self) -> usize { self.0.world_size() }
/// #   fn capabilities(&self) -> Capabilities { self.0.capabilities() }
/// #   fn window_len(&self, r: usize) -> usize { self.0.window_len(r) }
/// #   fn num_signal_slots(&self) -> usize { self.0.num_signal_slots() }
/// #   fn local_window(&self) -> Option<Window<'_>> { self.0.local_window() }
/// #   fn peer_window(&self, p: usize) -> Option<Window<'_>> { self.0.peer_window(p) }
///     fn put(&self, p: usize, o: usize, d: &[u8]) -> xccl::Result<()> { self.0.put(p, o, d) }
/// #   fn get(&self, p: usize, o: usize, b: &mut [u8]) -> xccl::Result<()> { self.0.get(p, o, b) }
/// #   fn signal(&self, p: usize, s: usize, v: u64) -> xccl::Result<()> { self.0.signal(p, s, v) }
/// #   fn signal_value(&self, s: usize) -> u64 { self.0.signal_value(s) }
/// #   fn flush(&self) -> xccl::Result<()> { self.0.flush() }
/// #   fn wait_until(
/// #       &self,
/// #       d: Instant,
/// #       p: &mut dyn FnMut() -> Option<Waiting>,
/// #   ) -> xccl::Result<()> {
/// #       self.0.wait_until(d, p)
/// #   }
/// #   fn barrier(&self, t: Duration) -> xccl::Result<()> { self.0.barrier(t) }
/// #   fn abort_reporting(&self, d: Option<usize>, r: &str) { self.0.abort_reporting(d, r) }
/// #   fn forward_abort(&self, n: &xccl::AbortNotice) { self.0.forward_abort(n) }
/// #   fn check_peer(&self, p: usize) -> xccl::Result<()> { self.0.check_peer(p) }
/// }
/// ```
///
/// ```compile_fail,E0133
/// fn build(
///     fabric: Box<dyn xccl::fabric::Fabric>,
///     topo: std::sync::Arc<xccl::Topology>,
///     cfg: xccl::MoeConfig,
/// ) -> xccl::Result<xccl::Communicator> {
///     xccl::Communicator::new(fabric, topo, cfg)
/// }
/// ```
///
/// ```compile_fail,E0133
/// let world = xccl::fabric::local::LocalFabric::create(&[4096, 4096], 8);
/// ```
pub unsafe trait Fabric: Send + Sync {
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

    /// This fabric as the [`cuda::CudaFabric`] (its device windows and stream), for the data
    /// plane of the device-buffer calls; `None` (the default) on every other fabric.
    fn as_cuda(&self) -> Option<&cuda::CudaFabric> {
        None
    }

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

/// Tag of the first init round's blob of a rank whose local setup failed (its error follows).
const SETUP_FAILED: &[u8; 8] = b"XCCLFAIL";

/// The first round of a device fabric's init: allgathers this rank's advert, or, where its
/// local setup failed (no library, a driver error), that error, so that no peer waits for it
/// until the timeout. Every rank sees the same blobs, so every rank that gets the adverts stops
/// together at the first rank that failed, naming it ([`crate::Error::PeerFailed`]); a rank
/// whose own setup failed gets `Ok` here and returns its own error.
pub(crate) fn gather_adverts(
    exchange: &dyn crate::bootstrap::Exchange,
    mine: std::result::Result<Vec<u8>, &crate::Error>,
    timeout: Duration,
    fabric: &str,
) -> Result<Vec<Vec<u8>>> {
    let blob = match &mine {
        Ok(advert) => advert.clone(),
        Err(e) => {
            let mut b = SETUP_FAILED.to_vec();
            b.extend_from_slice(e.to_string().as_bytes());
            b
        }
    };
    let blobs = exchange.allgather(&blob, timeout)?;
    if blobs.len() != exchange.size() {
        return Err(crate::Error::Bootstrap(format!(
            "allgather returned {} blobs for {} ranks",
            blobs.len(),
            exchange.size()
        )));
    }
    if mine.is_ok() {
        for (peer, b) in blobs.iter().enumerate() {
            if b.get(..8) == Some(&SETUP_FAILED[..]) {
                return Err(crate::Error::PeerFailed {
                    peer,
                    detail: format!(
                        "could not set up the {fabric} fabric: {}",
                        String::from_utf8_lossy(&b[8..])
                    ),
                });
            }
        }
    }
    Ok(blobs)
}

/// Allgathers whether each rank's step succeeded; fails naming the first rank that did not (a
/// rank whose own step failed gets `Ok` and returns its own error).
pub(crate) fn gather_outcomes<T>(
    exchange: &dyn crate::bootstrap::Exchange,
    mine: &Result<T>,
    timeout: Duration,
    step: &str,
) -> Result<()> {
    let status = match mine {
        Ok(_) => vec![0u8],
        Err(e) => {
            let mut s = vec![1u8];
            s.extend_from_slice(e.to_string().as_bytes());
            s
        }
    };
    let outcomes = exchange.allgather(&status, timeout)?;
    if mine.is_err() {
        return Ok(());
    }
    for (peer, outcome) in outcomes.iter().enumerate() {
        if outcome.first() != Some(&0) {
            let why = String::from_utf8_lossy(outcome.get(1..).unwrap_or_default());
            return Err(crate::Error::PeerFailed {
                peer,
                detail: format!("could not {step}: {why}"),
            });
        }
    }
    Ok(())
}

/// The longest timeout a call, a communicator or a bootstrap accepts: 365 days.
/// [`deadline_after`] saturates at it, so a longer one never overflows a deadline.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(86_400 * 365);

/// Deadline `timeout` from now (saturating at [`MAX_TIMEOUT`] from now, so it never overflows).
pub fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout.min(MAX_TIMEOUT))
        .unwrap_or_else(|| now + Duration::from_secs(3600))
}
