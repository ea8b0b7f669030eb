//! The in-process fabric: ranks are threads of one process.
//!
//! Windows and control areas are heap buffers shared through an `Arc`; put and get are memcpy,
//! signals use the same control-area layout and futex wait as the `shm` fabric. It exists for
//! tests and for scale runs (hundreds of ranks in one process). A rank whose endpoint is dropped
//! counts as dead: waits on it fail at once with [`Error::PeerFailed`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{
    AlignedBuf, Capabilities, ControlArea, Fabric, WaitCounters, WaitPolicy, WaitState, Waiting,
    Window,
};
use crate::{AbortNotice, Error, Result};

struct RankMemory {
    /// Owns the memory that `control` views.
    _control_mem: AlignedBuf,
    control: ControlArea,
    window: AlignedBuf,
    window_len: usize,
    alive: AtomicBool,
}

#[derive(Default)]
struct BarrierState {
    generation: u64,
    arrived: Vec<bool>,
    count: usize,
}

struct World {
    ranks: Vec<RankMemory>,
    num_slots: usize,
    barrier: Mutex<BarrierState>,
    barrier_cv: Condvar,
    caps: Capabilities,
}

/// One rank's endpoint of an in-process fabric.
pub struct LocalFabric {
    world: Arc<World>,
    rank: usize,
    wait_policy: WaitPolicy,
    wait_state: WaitState,
}

impl LocalFabric {
    /// Creates a world of `window_lens.len()` ranks, rank `r` with a window of `window_lens[r]`
    /// bytes and `num_slots` signal slots; returns one endpoint per rank (move each to its thread).
    /// [`crate::Communicator::local_group`] builds one for a job, safely.
    ///
    /// # Safety
    /// Every window of the world lives in this process, so a put and another access to the same
    /// bytes from two threads at once is a data race. Until the endpoints are dropped, every
    /// access to a window range (put, get, a borrow of a window) must be ordered after every
    /// earlier conflicting access from another thread by a signal the accessor waited for (the
    /// [`Fabric`] contract the protocol keeps), and no endpoint of the world may be handed to a
    /// communicator ([`crate::Communicator::new`]) while another is used outside one.
    pub unsafe fn create(window_lens: &[usize], num_slots: usize) -> Result<Vec<LocalFabric>> {
        Self::group(window_lens, num_slots)
    }

    /// Like [`LocalFabric::create`], advertising `caps`. Without `load_store`, peer windows are
    /// not handed out and the protocol takes the paths an RDMA fabric takes (stage then `put`,
    /// `get` into a landing buffer), so those paths are tested without a NIC.
    ///
    /// # Safety
    /// As [`LocalFabric::create`].
    pub unsafe fn create_with(
        window_lens: &[usize],
        num_slots: usize,
        caps: Capabilities,
    ) -> Result<Vec<LocalFabric>> {
        Self::group_with(window_lens, num_slots, caps)
    }

    /// [`LocalFabric::create`] for the crate, whose callers keep its contract (communicators,
    /// and tests that order their accesses by signals).
    pub(crate) fn group(window_lens: &[usize], num_slots: usize) -> Result<Vec<LocalFabric>> {
        Self::group_with(
            window_lens,
            num_slots,
            Capabilities {
                load_store: true,
                remote_read: true,
                chunk_floor: 0,
            },
        )
    }

    /// [`LocalFabric::create_with`] for the crate (as [`LocalFabric::group`]).
    pub(crate) fn group_with(
        window_lens: &[usize],
        num_slots: usize,
        caps: Capabilities,
    ) -> Result<Vec<LocalFabric>> {
        if window_lens.is_empty() {
            return Err(Error::invalid("a local fabric needs at least one rank"));
        }
        let pid = std::process::id();
        let mut ranks = Vec::with_capacity(window_lens.len());
        for (rank, &len) in window_lens.iter().enumerate() {
            let control_buf = AlignedBuf::zeroed(ControlArea::bytes_for(num_slots))?;
            // SAFETY: freshly zeroed, page-aligned, sized by `bytes_for`, and kept alive in
            // `RankMemory` next to the view for as long as the world exists.
            let control = unsafe {
                ControlArea::init(control_buf.ptr(), num_slots, rank, window_lens.len(), pid)
            };
            ranks.push(RankMemory {
                _control_mem: control_buf,
                control,
                window: AlignedBuf::zeroed(len)?,
                window_len: len,
                alive: AtomicBool::new(true),
            });
        }
        let n = ranks.len();
        let world = Arc::new(World {
            ranks,
            num_slots,
            barrier: Mutex::new(BarrierState {
                arrived: vec![false; n],
                ..Default::default()
            }),
            barrier_cv: Condvar::new(),
            caps,
        });
        let wait_policy = WaitPolicy::for_ranks_on_host(n);
        Ok((0..n)
            .map(|rank| LocalFabric {
                world: world.clone(),
                rank,
                wait_policy,
                wait_state: WaitState::for_ranks_on_host(n),
            })
            .collect())
    }

    /// Overrides how this rank's waits spin before sleeping.
    pub fn set_wait_policy(&mut self, policy: WaitPolicy) {
        self.wait_policy = policy;
    }

    fn peer(&self, peer: usize) -> Result<&RankMemory> {
        self.world.ranks.get(peer).ok_or_else(|| {
            Error::invalid(format!(
                "rank {peer} out of range: the job has {} ranks",
                self.world.ranks.len()
            ))
        })
    }

    fn window_of(&self, peer: usize) -> Result<Window<'_>> {
        let m = self.peer(peer)?;
        // SAFETY: the buffer lives in the world, which `self` keeps alive; `window_len` bytes
        // were allocated (at least that many).
        Ok(unsafe { Window::from_raw(m.window.ptr(), m.window_len, peer) })
    }
}

impl Drop for LocalFabric {
    fn drop(&mut self) {
        self.leave();
    }
}

// SAFETY: put, get and signal touch only the ranges they are given, bounds-checked, in windows
// that live as long as the world; nothing writes a window but a put addressed to it. Callers
// outside the crate are bound by `LocalFabric::create`'s contract.
unsafe impl Fabric for LocalFabric {
    fn name(&self) -> &'static str {
        "local"
    }

    fn leave(&self) {
        let me = &self.world.ranks[self.rank];
        me.control.set_departed();
        me.alive.store(false, Ordering::SeqCst);
        // Wake everyone so that waits on this rank notice at once.
        for r in &self.world.ranks {
            r.control.wake();
        }
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world.ranks.len()
    }

    fn capabilities(&self) -> Capabilities {
        self.world.caps
    }

    fn window_len(&self, rank: usize) -> usize {
        self.world.ranks.get(rank).map_or(0, |m| m.window_len)
    }

    fn num_signal_slots(&self) -> usize {
        self.world.num_slots
    }

    fn local_window(&self) -> Option<Window<'_>> {
        self.window_of(self.rank).ok()
    }

    fn peer_window(&self, peer: usize) -> Option<Window<'_>> {
        if self.world.caps.load_store {
            self.window_of(peer).ok()
        } else {
            None
        }
    }

    fn put(&self, peer: usize, offset: usize, data: &[u8]) -> Result<()> {
        self.window_of(peer)?.write(offset, data)
    }

    fn get(&self, peer: usize, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.window_of(peer)?.read(offset, buf)
    }

    fn signal(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        self.peer(peer)?.control.store(slot, value, peer)
    }

    fn signal_quiet(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        self.peer(peer)?.control.store_quiet(slot, value, peer)
    }

    fn signal_value(&self, slot: usize) -> u64 {
        self.world.ranks[self.rank].control.load(slot)
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn wait_counters(&self) -> WaitCounters {
        self.wait_state.counters()
    }

    fn wait_until(
        &self,
        deadline: Instant,
        poll: &mut dyn FnMut() -> Option<Waiting>,
    ) -> Result<()> {
        let liveness = |awaited: usize| {
            self.check_peer(awaited)?;
            self.check_peers()
        };
        self.world.ranks[self.rank].control.wait_with(
            self.wait_policy,
            &self.wait_state,
            deadline,
            poll,
            &liveness,
        )
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        let deadline = super::deadline_after(timeout);
        let n = self.world.ranks.len();
        let mut st = self.world.barrier.lock().unwrap_or_else(|e| e.into_inner());
        let generation = st.generation;
        st.arrived[self.rank] = true;
        st.count += 1;
        if st.count == n {
            st.count = 0;
            st.arrived.iter_mut().for_each(|a| *a = false);
            st.generation += 1;
            self.world.barrier_cv.notify_all();
            return Ok(());
        }
        while st.generation == generation {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..n).filter(|&r| !st.arrived[r]).collect();
                st.arrived[self.rank] = false;
                st.count -= 1;
                return Err(Error::Timeout {
                    peer: missing.first().copied().unwrap_or(self.rank),
                    what: format!("barrier: ranks {missing:?} have not arrived"),
                    waited: timeout,
                });
            }
            let (guard, _) = self
                .world
                .barrier_cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner());
            st = guard;
        }
        Ok(())
    }

    fn abort_reporting(&self, dead: Option<usize>, reason: &str) {
        for r in &self.world.ranks {
            r.control.set_abort(self.rank, dead, reason);
        }
    }

    fn forward_abort(&self, notice: &AbortNotice) {
        for r in &self.world.ranks {
            r.control.set_abort(notice.by, notice.dead, &notice.reason);
        }
    }

    fn aborted(&self) -> Option<AbortNotice> {
        self.world.ranks[self.rank].control.aborted_by()
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if self.peer(peer)?.alive.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(Error::PeerFailed {
                peer,
                detail: "its endpoint was dropped (it left the job)".into(),
            })
        }
    }

    fn check_peers(&self) -> Result<()> {
        // Ranks as threads: a dropped endpoint is a clean departure, never a crash of this
        // process, so only the awaited peer matters (`check_peer`).
        Ok(())
    }
}
