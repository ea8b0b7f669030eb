//! Signal slots, the doorbell and the wait loop that every fabric with mapped control memory
//! shares.
//!
//! A rank's **control area** is a `#[repr(C)]` block of fixed-width atomics with no pointers, so it
//! can live in shared memory (the `shm` fabric) or on the heap (the `local` fabric) unchanged:
//!
//! | offset | what |
//! |---|---|
//! | 0 | header: magic, layout version, slot count, owner pid; at 64 the departed word |
//! | 128 | doorbell: a 32-bit futex word bumped by every signal, a count of sleepers, and at 136 the `CLOCK_MONOTONIC` time (ns) at which a signaller last woke a sleeper |
//! | 256 | abort: the abort word (0, or 1 + the rank that aborted), the claim word, the reason length, the dead word (0, or 1 + the rank whose death the abort reports) |
//! | 384 | abort reason: up to [`ABORT_REASON_BYTES`] bytes of UTF-8 |
//! | 640 + 128*i | signal slot `i`, a 64-bit value alone on a 128-byte line pair |
//!
//! Slots are 128 bytes apart, as `crossbeam_utils::CachePadded` pads on x86_64: the adjacent-line
//! prefetcher fetches cache lines in pairs, so two slots written by different ranks never share
//! a pair.
//!
//! Waiting spins briefly, then yields for a bounded time, then sleeps on the doorbell with a futex
//! that is *shared* between processes (no `FUTEX_PRIVATE_FLAG`) ([`WaitPolicy`]); how long each
//! phase lasts adapts to what this rank's waits observed ([`WaitState`]). Sleeps are cut into
//! short chunks so that a dead peer or an abort is noticed long before the caller's deadline.
//!
//! Every atomic, fence and futex call goes through [`crate::sync`], so the protocol here is
//! model-checked with loom (`ci/loom.sh`, tests in `signals_loom.rs`).

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use crate::sync::{self, fence, AtomicU32, AtomicU64, Mutant, Ordering};
use crate::{AbortNotice, Error, Result};

/// Magic at the start of every control area ("XCCLCTRL").
pub const CONTROL_MAGIC: u64 = u64::from_le_bytes(*b"XCCLCTRL");
/// Layout version of the control area; bumped on any change of the table above.
pub const CONTROL_VERSION: u32 = 4;
/// Longest abort reason a control area carries (longer ones are cut at a character boundary).
pub const ABORT_REASON_BYTES: usize = 256;

/// Spacing of independently written words: a pair of 64-byte lines (see the module docs).
const LINE: usize = 128;
/// Header words: magic (u64), then version, slot count, owner pid and rank (u32 each).
const MAGIC_OFF: usize = 0;
const VERSION_OFF: usize = 8;
const NUM_SLOTS_OFF: usize = 12;
const PID_OFF: usize = 16;
const RANK_OFF: usize = 20;
/// Set by the owner when it leaves the job cleanly (its endpoint dropped after its last call).
const DEPARTED_OFF: usize = 64;
const DOORBELL_OFF: usize = LINE;
const SLEEPERS_OFF: usize = DOORBELL_OFF + 4;
/// When a signaller last woke a sleeper (`CLOCK_MONOTONIC` ns): the sleeper's wake latency.
const WOKEN_AT_OFF: usize = DOORBELL_OFF + 8;
const ABORT_OFF: usize = 2 * LINE;
const ABORT_CLAIM_OFF: usize = ABORT_OFF + 8;
const ABORT_LEN_OFF: usize = ABORT_OFF + 16;
/// The dead rank of the abort record (0: it reports no death), written with the reason.
const ABORT_DEAD_OFF: usize = ABORT_OFF + 24;
const REASON_OFF: usize = 3 * LINE;
const SLOTS_OFF: usize = REASON_OFF + ABORT_REASON_BYTES;

/// What a wait is still waiting for: the peer that owes the next step and a description.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiting {
    /// The rank whose signal has not arrived.
    pub peer: usize,
    /// What that signal is (shown in timeout errors).
    pub what: &'static str,
    /// How far a wait for something that lands in parts has come (rows or chunks handled so
    /// far; 0 for a wait without parts). A poll that reports a different value than the last
    /// one restarts the wait's spin and yield phases: the peer is streaming, and its next part
    /// comes about as soon as the last one did, so the waiter must not fall asleep between
    /// parts (each sleep costs the signaller a futex wake-up per part).
    pub progress: u64,
}

impl Waiting {
    /// A wait for `what` from `peer`, without parts.
    pub const fn on(peer: usize, what: &'static str) -> Self {
        Waiting {
            peer,
            what,
            progress: 0,
        }
    }

    /// The same wait, `progress` parts in (see [`Waiting::progress`]).
    pub const fn at(self, progress: u64) -> Self {
        Waiting { progress, ..self }
    }
}

/// A view of one rank's control area.
#[derive(Clone, Copy, Debug)]
pub struct ControlArea {
    base: NonNull<u8>,
    num_slots: usize,
    /// Ranks of the job (not read from the area: abort records are checked against it).
    world: usize,
}

// SAFETY: the area holds only atomics; all access goes through atomic operations.
unsafe impl Send for ControlArea {}
// SAFETY: see `Send`.
unsafe impl Sync for ControlArea {}

impl ControlArea {
    /// Bytes needed for a control area with `num_slots` slots (a multiple of 64).
    pub fn bytes_for(num_slots: usize) -> usize {
        SLOTS_OFF + LINE * num_slots
    }

    /// Formats zeroed memory as a control area owned by `rank` (process `pid`) of a job of
    /// `world` ranks.
    ///
    /// # Safety
    /// `base` must be 64-byte aligned, zeroed, and `bytes_for(num_slots)` bytes long, and stay
    /// mapped while any returned view is used.
    pub unsafe fn init(
        base: NonNull<u8>,
        num_slots: usize,
        rank: usize,
        world: usize,
        pid: u32,
    ) -> Self {
        let area = ControlArea {
            base,
            num_slots,
            world,
        };
        area.atomic_u32(VERSION_OFF)
            .store(CONTROL_VERSION, Ordering::Relaxed);
        area.atomic_u32(NUM_SLOTS_OFF)
            .store(num_slots as u32, Ordering::Relaxed);
        area.atomic_u32(PID_OFF).store(pid, Ordering::Relaxed);
        area.atomic_u32(RANK_OFF)
            .store(rank as u32, Ordering::Relaxed);
        // SYNC POINT: publishes the fields above to `attach` (Acquire load of magic).
        area.atomic_u64(MAGIC_OFF)
            .store(CONTROL_MAGIC, Ordering::Release);
        area
    }

    /// Views an area that rank `peer` of a job of `world` ranks formatted, checking magic,
    /// version and size.
    ///
    /// # Safety
    /// `base` must be 64-byte aligned and `len` bytes long, and stay mapped while the view is used.
    pub unsafe fn attach(base: NonNull<u8>, len: usize, peer: usize, world: usize) -> Result<Self> {
        if len < SLOTS_OFF {
            return Err(Error::Protocol {
                peer,
                detail: format!("control area of {len} bytes is too small"),
            });
        }
        let probe = ControlArea {
            base,
            num_slots: 0,
            world,
        };
        // SYNC POINT: pairs with the Release store of magic in `init`.
        let magic = probe.atomic_u64(MAGIC_OFF).load(Ordering::Acquire);
        if magic != CONTROL_MAGIC {
            return Err(Error::Protocol {
                peer,
                detail: format!("control area magic {magic:#x}, expected {CONTROL_MAGIC:#x}"),
            });
        }
        let version = probe.atomic_u32(VERSION_OFF).load(Ordering::Relaxed);
        if version != CONTROL_VERSION {
            return Err(Error::Protocol {
                peer,
                detail: format!(
                    "control layout version {version}, this build speaks {CONTROL_VERSION}"
                ),
            });
        }
        let num_slots = probe.atomic_u32(NUM_SLOTS_OFF).load(Ordering::Relaxed) as usize;
        if Self::bytes_for(num_slots) > len {
            return Err(Error::Protocol {
                peer,
                detail: format!("control area claims {num_slots} slots but is only {len} bytes"),
            });
        }
        Ok(ControlArea {
            base,
            num_slots,
            world,
        })
    }

    fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: every offset passed here is 8-aligned inside the area, which stays mapped
        // while `self` is used (constructor contracts), and the memory is only ever accessed
        // atomically.
        unsafe { sync::word_u64(self.base, off) }
    }

    fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as in `atomic_u64`, with 4-byte alignment.
        unsafe { sync::word_u32(self.base, off) }
    }

    /// Number of signal slots.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// The pid recorded by the owner.
    pub fn owner_pid(&self) -> u32 {
        self.atomic_u32(PID_OFF).load(Ordering::Relaxed)
    }

    fn doorbell(&self) -> &AtomicU32 {
        self.atomic_u32(DOORBELL_OFF)
    }

    fn sleepers(&self) -> &AtomicU32 {
        self.atomic_u32(SLEEPERS_OFF)
    }

    fn slot(&self, slot: usize, peer: usize) -> Result<&AtomicU64> {
        if slot >= self.num_slots {
            return Err(Error::invalid(format!(
                "signal slot {slot} out of range: rank {peer} has {} slots",
                self.num_slots
            )));
        }
        Ok(self.atomic_u64(SLOTS_OFF + LINE * slot))
    }

    /// Stores `value` in slot `slot` and wakes sleepers. `owner` names this area's rank in errors.
    pub fn store(&self, slot: usize, value: u64, owner: usize) -> Result<()> {
        let slot = self.slot(slot, owner)?;
        // SYNC POINT: Release orders every earlier put of the signalling rank before the value
        // (pairs with the Acquire load in `load`).
        slot.store(
            value,
            sync::weakened(Ordering::Release, Mutant::SignalStore),
        );
        // SYNC POINT: the Dekker pair with a waiter going to sleep (`wait_with`): this SeqCst
        // fence sits between our slot store and our look at the sleeper count, the waiter's
        // SeqCst fence between its count increment and its last poll of the slot. Whichever
        // fence comes second sees the other side's write: the waiter's poll sees the value, or
        // we see the sleeper and bump the doorbell it sleeps on. (A fence rather than SeqCst
        // accesses, which loom treats as AcqRel: loom checks this form, and on x86 it costs
        // what a SeqCst store does: `mov; lock or` against `xchg`, one full barrier, about
        // 2.2 ns a signal either way, measured.)
        // A waiter that only spins costs no read-modify-write on its doorbell line.
        fence(sync::weakened(Ordering::SeqCst, Mutant::SignallerFence));
        if self.sleepers().load(Ordering::Relaxed) > 0 {
            // Not a sync point: the time only tells the sleeper how long its wake-up took.
            self.atomic_u64(WOKEN_AT_OFF)
                .store(now_ns(), Ordering::Relaxed);
            self.doorbell().fetch_add(1, Ordering::SeqCst);
            sync::futex_wake(self.doorbell());
        }
        Ok(())
    }

    /// [`ControlArea::store`] without the wake-up: the Release store alone, for a value a later
    /// `store` to the area follows ([`crate::fabric::Fabric::signal_quiet`]). A sleeper sleeps
    /// on through it, and that later store wakes it.
    pub fn store_quiet(&self, slot: usize, value: u64, owner: usize) -> Result<()> {
        // SYNC POINT: Release, as in `store` (pairs with the Acquire load in `load`).
        self.slot(slot, owner)?.store(
            value,
            sync::weakened(Ordering::Release, Mutant::SignalStore),
        );
        Ok(())
    }

    /// Current value of slot `slot` (Acquire: data put before the signal is visible after).
    pub fn load(&self, slot: usize) -> u64 {
        match self.slot(slot, 0) {
            // SYNC POINT: pairs with the Release store in `store`.
            Ok(s) => s.load(sync::weakened(Ordering::Acquire, Mutant::SignalLoad)),
            Err(_) => 0,
        }
    }

    /// Records that the owner left the job cleanly: peers then tell "finished" from "died".
    pub fn set_departed(&self) {
        // SYNC POINT: Release pairs with the Acquire load in `departed`.
        self.atomic_u64(DEPARTED_OFF).store(1, Ordering::Release);
        self.wake();
    }

    /// Whether the owner left the job cleanly.
    pub fn departed(&self) -> bool {
        // SYNC POINT: pairs with the Release store in `set_departed`.
        self.atomic_u64(DEPARTED_OFF).load(Ordering::Acquire) != 0
    }

    /// Marks the area aborted by `by` for `reason`, reporting the death of `dead` if set, and
    /// wakes sleepers. The first abort wins: later ones (from any rank) change nothing.
    pub fn set_abort(&self, by: usize, dead: Option<usize>, reason: &str) {
        // SYNC POINT: the claim serialises aborters; only the winner writes the reason.
        let won = self
            .atomic_u64(ABORT_CLAIM_OFF)
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if won {
            let mut cut = reason.len().min(ABORT_REASON_BYTES);
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            let bytes = &reason.as_bytes()[..cut];
            for (i, chunk) in bytes.chunks(8).enumerate() {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                self.atomic_u64(REASON_OFF + 8 * i)
                    .store(u64::from_le_bytes(word), Ordering::Relaxed);
            }
            self.atomic_u64(ABORT_LEN_OFF)
                .store(cut as u64, Ordering::Relaxed);
            let dead = dead.map_or(0, |d| (d as u64).saturating_add(1));
            self.atomic_u64(ABORT_DEAD_OFF)
                .store(dead, Ordering::Relaxed);
            // SYNC POINT: Release publishes the reason and dead words above to `aborted_by`
            // (Acquire).
            self.atomic_u64(ABORT_OFF).store(
                by as u64 + 1,
                sync::weakened(Ordering::Release, Mutant::AbortStore),
            );
        }
        self.wake();
    }

    /// The abort record of this area (the rank that aborted it, the death it reports, the
    /// reason), if any. Peers wrote it: check it with [`AbortNotice::to_error`].
    pub fn aborted_by(&self) -> Option<AbortNotice> {
        // SYNC POINT: pairs with the Release store of the abort word in `set_abort`.
        let by = match self.atomic_u64(ABORT_OFF).load(Ordering::Acquire) {
            0 => return None,
            v => v as usize - 1,
        };
        let len = (self.atomic_u64(ABORT_LEN_OFF).load(Ordering::Relaxed) as usize)
            .min(ABORT_REASON_BYTES);
        let mut bytes = Vec::with_capacity(len.next_multiple_of(8));
        for i in 0..len.div_ceil(8) {
            let w = self.atomic_u64(REASON_OFF + 8 * i).load(Ordering::Relaxed);
            bytes.extend_from_slice(&w.to_le_bytes());
        }
        bytes.truncate(len);
        let dead = match self.atomic_u64(ABORT_DEAD_OFF).load(Ordering::Relaxed) {
            0 => None,
            d => Some(usize::try_from(d - 1).unwrap_or(usize::MAX)),
        };
        Some(AbortNotice {
            by,
            dead,
            reason: String::from_utf8_lossy(&bytes).into_owned(),
        })
    }

    /// Wakes every sleeper on this area's doorbell (they re-poll).
    pub fn wake(&self) {
        // SYNC POINT (Dekker pair with the sleeper in `wait_with`, as in `store`): the caller's
        // earlier stores (the abort word, the departed word) and this bump come before the
        // SeqCst fence, our look at the sleeper count after it; the sleeper counts itself, then
        // fences, then re-reads the abort word and polls. So it sees what we wrote, or we see it
        // and wake it; and a bump after its doorbell read makes its futex wait return at once.
        self.doorbell().fetch_add(1, Ordering::SeqCst);
        fence(sync::weakened(Ordering::SeqCst, Mutant::WakerFence));
        if self.sleepers().load(Ordering::Relaxed) > 0 {
            sync::futex_wake(self.doorbell());
        }
    }

    /// Waits until `poll` reports nothing pending, the deadline passes, the area is aborted, or
    /// `liveness` fails.
    ///
    /// `poll` returns `None` when done, or what it still waits for. `liveness` is called with
    /// the awaited peer between sleeps and once more before a timeout is reported; it checks
    /// that peer and every other peer that has not left the job, and any out-of-band abort, and
    /// its error ends the wait.
    pub fn wait_until(
        &self,
        deadline: Instant,
        poll: &mut dyn FnMut() -> Option<Waiting>,
        liveness: &dyn Fn(usize) -> Result<()>,
    ) -> Result<()> {
        self.wait_with(
            WaitPolicy::DEDICATED,
            &WaitState::default(),
            deadline,
            poll,
            liveness,
        )
    }

    /// After the liveness check of `peer` failed with `e`: a peer may have signalled and then
    /// left (or died) between the last poll and the check, so poll once more. The wait is over
    /// (`Some(Ok)`), or fails with `e` if it still waits for `peer` (`Some(Err)`), or goes on
    /// (`None`) when `peer` has delivered and the wait is now for another rank (whose own
    /// liveness is checked in turn).
    pub(crate) fn settle(
        poll: &mut dyn FnMut() -> Option<Waiting>,
        peer: usize,
        e: Error,
    ) -> Option<Result<()>> {
        match poll() {
            None => Some(Ok(())),
            Some(w) if w.peer == peer => Some(Err(e)),
            Some(_) => None,
        }
    }

    /// [`ControlArea::wait_until`] with an explicit policy and the adaptive state of the
    /// waiting rank (see [`WaitPolicy`] for the phases and how `state` bounds each).
    pub fn wait_with(
        &self,
        policy: WaitPolicy,
        state: &WaitState,
        deadline: Instant,
        poll: &mut dyn FnMut() -> Option<Waiting>,
        liveness: &dyn Fn(usize) -> Result<()>,
    ) -> Result<()> {
        // A wait whose first look finds it done reads no clock and plans no phases.
        if poll().is_none() {
            state.finish_at_first_look();
            return Ok(());
        }
        let start = Instant::now();
        let plan = state.plan(policy);
        let mut tally = Tally::default();
        let spins = plan.spin_iters > 0 && !plan.spin_for.is_zero();
        let mut spinning = spins;
        let mut yielding = plan.yield_allowed;
        let yield_for = plan.yield_for;
        // The phases run from `phase_start`: the wait's start, or the last poll that saw the
        // peer's progress change (`Waiting::progress`), which restarts them.
        let mut phase_start = start;
        let mut phase_polls = 0u32;
        let mut progress: Option<u64> = None;
        // When the spin phase ended (the yield phase's clock starts there).
        let mut spun_until: Option<Instant> = None;
        let mut last_check = start;
        let result = loop {
            // Spinning reads only the awaited slots (through `poll`), never the doorbell, so a
            // signaller's doorbell bump does not bounce a line the waiter keeps reading.
            let waiting = match poll() {
                None => break Ok(()),
                Some(w) => w,
            };
            if progress != Some(waiting.progress) {
                if progress.is_some() && plan.restart_on_progress {
                    // A part landed: wait for the next one from the first phase again (a slow
                    // yield stays in force: it said yielding hands the core away for long).
                    phase_start = Instant::now();
                    phase_polls = 0;
                    spinning = spins;
                    spun_until = None;
                    tally.restarts += 1;
                }
                progress = Some(waiting.progress);
            }
            if let Some(mut notice) = self.aborted_by() {
                notice.reason = format!(
                    "{} (seen while waiting for rank {})",
                    notice.reason, waiting.peer
                );
                break Err(notice.to_error(self.world));
            }
            if spinning {
                tally.polls += 1;
                phase_polls += 1;
                // The clock is read every 32 polls: a poll and a `pause` cost far less.
                let over = phase_polls >= plan.spin_iters
                    || (phase_polls.is_multiple_of(32) && phase_start.elapsed() >= plan.spin_for);
                if !over {
                    sync::spin_loop();
                    continue;
                }
                spinning = false;
            }
            let now = Instant::now();
            let spun = *spun_until.get_or_insert(now);
            if now >= deadline {
                // A dead peer or an abort explains the silence better than a timeout does.
                if let Err(e) = liveness(waiting.peer) {
                    if let Some(end) = Self::settle(poll, waiting.peer, e) {
                        break end;
                    }
                    continue;
                }
                break Err(Error::Timeout {
                    peer: waiting.peer,
                    what: waiting.what.to_string(),
                    waited: now - start,
                });
            }
            if yielding && now - spun < yield_for {
                sync::yield_now();
                tally.yields += 1;
                // A yield that kept the core away longer than a sleep and its wake-up would
                // have cost went to a task that ran a time slice (or to a peer whose work is
                // long, where sleeping costs no more): sleep from here on, and skip yielding for
                // a while (`WaitState`). Whether the wait is over after it says nothing: a peer
                // on the other core may have finished while this rank was kept off its own.
                if now.elapsed() > plan.slow_yield {
                    tally.slow_yields += 1;
                    yielding = false;
                }
                continue;
            }
            if now - last_check >= LIVENESS_EVERY {
                last_check = now;
                if let Err(e) = liveness(waiting.peer) {
                    if let Some(end) = Self::settle(poll, waiting.peer, e) {
                        break end;
                    }
                    continue;
                }
            }
            // SYNC POINT: Acquire pairs with the SeqCst doorbell bumps in `store` and `wake`. A
            // signal whose bump this load saw is visible to the polls below; a later bump changes
            // the value the futex compares against, so it cannot be slept through.
            let seq = self.doorbell().load(Ordering::Acquire);
            if poll().is_none() {
                break Ok(());
            }
            // SYNC POINT: count ourselves, then the SeqCst fence that pairs with the fences in
            // `store` and `wake` (see `store`), then look again at the slots and the abort word:
            // a signal or an abort that came after the looks above is seen here, or its sender
            // sees us and rings the doorbell.
            self.sleepers().fetch_add(1, Ordering::SeqCst);
            fence(sync::weakened(Ordering::SeqCst, Mutant::SleeperFence));
            if poll().is_none() {
                self.sleepers().fetch_sub(1, Ordering::SeqCst);
                break Ok(());
            }
            if self.atomic_u64(ABORT_OFF).load(Ordering::Relaxed) == 0 {
                let nap = (deadline - now).min(SLEEP_CHUNK);
                let slept_at = now_ns();
                sync::futex_wait(self.doorbell(), seq, nap);
                tally.sleeps += 1;
                // Woken by a signaller (not by the timeout): how long the wake-up took.
                let woken_at = self.atomic_u64(WOKEN_AT_OFF).load(Ordering::Relaxed);
                if woken_at > slept_at {
                    tally.wake_ns = Some(now_ns().saturating_sub(woken_at));
                }
            }
            self.sleepers().fetch_sub(1, Ordering::SeqCst);
        };
        // Here the first look found it missing: the wait waited. How long is kept only where
        // it bounds a phase (the yield phase of ranks outnumbering cores): with a core per rank
        // the clock read would sit between the signal and the caller's next step, on every
        // round trip's critical path, for nothing.
        if result.is_ok() && state.oversubscribed {
            tally.took_ns = Some(start.elapsed().as_nanos() as u64);
        }
        state.finish(&plan, &tally);
        result
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the host, so a signaller's
/// time and its sleeper's can be compared.
fn now_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// Clock `clock` in nanoseconds (0 if the clock does not exist).
pub(crate) fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; an unknown clock leaves it 0 (EINVAL).
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// What one wait did (folded into [`WaitState`] when it ends).
#[derive(Default)]
struct Tally {
    polls: u32,
    yields: u32,
    slow_yields: u32,
    sleeps: u32,
    /// Times the phases restarted because a part landed (`Waiting::progress`).
    restarts: u32,
    /// The wake-up latency of the last sleep that a signaller ended, if any.
    wake_ns: Option<u64>,
    /// How long the wait took, when it ended with what it waited for after at least one look
    /// that found it missing.
    took_ns: Option<u64>,
}

/// How the next wait runs, from the policy and what earlier waits observed.
struct Plan {
    /// Spin for at most this long and at most this many polls.
    spin_for: Duration,
    spin_iters: u32,
    /// Yield for at most this long after the spin phase.
    yield_for: Duration,
    /// A yield that took longer ends the yield phase.
    slow_yield: Duration,
    /// Whether this wait may yield at all (not while backing off after slow yields).
    yield_allowed: bool,
    /// Whether a part that lands restarts the phases ([`Waiting::progress`]): with a core per
    /// rank only.
    restart_on_progress: bool,
}

/// Shortest and longest wake-up latency estimate; shortest time a slow yield is measured
/// against.
const MIN_WAKE_NS: u64 = 500;
const MAX_WAKE_NS: u64 = 1_000_000;
const MIN_SLOW_YIELD_NS: u64 = 500_000;
/// The wake-up latency assumed before any sleep was measured.
const FIRST_WAKE_NS: u64 = 20_000;
/// Polls of the spin phase that a rank with a core of its own gives a policy without one (at
/// most the spin budget, one wake-up latency, as every spin phase; enough polls for it: a poll
/// takes 60 to 300 ns). None in the loom models, which check the protocol, not the phases (each
/// poll multiplies their interleavings).
const OWN_CORE_POLLS: u32 = if cfg!(loom) { 0 } else { 4096 };
/// Longest yield phase that ranks outnumbering cores add to a policy without one (or with a
/// shorter one): one wake-up latency, at most this.
const MAX_HANDOFF_YIELD_NS: u64 = 50_000;
/// Shortest and longest time without a yield phase after a slow yield.
const MIN_YIELD_BACKOFF_NS: u64 = 10_000_000;
const MAX_YIELD_BACKOFF_NS: u64 = 1_000_000_000;

/// The adaptive part of one rank's waits, and their counters ([`WaitCounters`]).
///
/// It keeps what the rank's waits observed: the latency of a futex wake-up (the signaller
/// stamps the time it woke the sleeper into the sleeper's doorbell line), which bounds the spin
/// phase, and whether yields handed the core away for long. From that each wait's phases are
/// bounded ([`WaitPolicy`]). Private to the rank (plain atomics, never in shared
/// memory); one per fabric endpoint.
#[derive(Debug)]
pub struct WaitState {
    /// Smoothed wake-up latency of a futex sleep, ns.
    wake_ns: std::sync::atomic::AtomicU64,
    /// Smoothed length of the waits that waited (did not end at their first look), ns; kept
    /// only when `oversubscribed`, whose yield phase it bounds.
    wait_ns: std::sync::atomic::AtomicU64,
    /// No yield phase before this time (`CLOCK_MONOTONIC` ns), and the next back-off, ns.
    yield_off_until: std::sync::atomic::AtomicU64,
    yield_backoff: std::sync::atomic::AtomicU64,
    counts: [std::sync::atomic::AtomicU64; 7],
    /// More ranks on this host than cores this process may run on.
    oversubscribed: bool,
}

impl Default for WaitState {
    /// The state of a rank with a core of its own.
    fn default() -> Self {
        WaitState {
            wake_ns: std::sync::atomic::AtomicU64::new(FIRST_WAKE_NS),
            wait_ns: Default::default(),
            yield_off_until: Default::default(),
            yield_backoff: Default::default(),
            counts: Default::default(),
            oversubscribed: false,
        }
    }
}

/// Counters of one rank's waits since its fabric endpoint was made ([`WaitState::counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WaitCounters {
    /// Waits (calls of the wait loop).
    pub waits: u64,
    /// Busy polls of the spin phases.
    pub polls: u64,
    /// `sched_yield` calls of the yield phases.
    pub yields: u64,
    /// Yields that kept the core away longer than a sleep would have (each ended its phase).
    pub slow_yields: u64,
    /// Futex sleeps.
    pub sleeps: u64,
    /// Sleeps a signaller ended whose wake-up latency was measured.
    pub timed_wakes: u64,
    /// Times a wait restarted its phases because a part of what it awaited landed
    /// ([`Waiting::progress`]).
    pub restarts: u64,
    /// The current wake-up latency estimate, ns.
    pub wake_ns: u64,
    /// The current spin budget, ns.
    pub spin_ns: u64,
}

impl WaitCounters {
    /// `self - earlier`, counter by counter (the estimates are `self`'s).
    pub fn since(&self, earlier: &WaitCounters) -> WaitCounters {
        WaitCounters {
            waits: self.waits.saturating_sub(earlier.waits),
            polls: self.polls.saturating_sub(earlier.polls),
            yields: self.yields.saturating_sub(earlier.yields),
            slow_yields: self.slow_yields.saturating_sub(earlier.slow_yields),
            sleeps: self.sleeps.saturating_sub(earlier.sleeps),
            timed_wakes: self.timed_wakes.saturating_sub(earlier.timed_wakes),
            restarts: self.restarts.saturating_sub(earlier.restarts),
            wake_ns: self.wake_ns,
            spin_ns: self.spin_ns,
        }
    }
}

impl WaitState {
    /// The state of a rank of a job with `ranks` ranks on this host: oversubscribed when they
    /// outnumber the cores this process may run on (`sched_getaffinity`, as
    /// [`std::thread::available_parallelism`] counts them; a rank pinned to one CPU counts the
    /// host's online CPUs, as its launcher gave each rank a core).
    pub fn for_ranks_on_host(ranks: usize) -> Self {
        WaitState {
            oversubscribed: ranks > cores_available(),
            ..WaitState::default()
        }
    }

    /// Whether this rank's host runs more ranks than it has cores for them (see
    /// [`WaitPolicy`] for what that changes).
    pub fn oversubscribed(&self) -> bool {
        self.oversubscribed
    }

    /// What the waits counted so far, and the current estimates.
    pub fn counters(&self) -> WaitCounters {
        use std::sync::atomic::Ordering::Relaxed;
        let c = |i: usize| self.counts[i].load(Relaxed);
        WaitCounters {
            waits: c(0),
            polls: c(1),
            yields: c(2),
            slow_yields: c(3),
            sleeps: c(4),
            timed_wakes: c(5),
            restarts: c(6),
            wake_ns: self.wake_ns.load(Relaxed),
            spin_ns: self.spin_budget(),
        }
    }

    /// The spin budget of the next wait, ns: one wake-up latency (spin then sleep is then
    /// 2-competitive: a wait costs at most twice what it must, the spin and then the wake-up a
    /// sleep pays anyway); none when ranks outnumber cores.
    ///
    /// It does not adapt to how long earlier waits took. It did (halved after a wait that
    /// outlasted a wake-up, doubled after one just past the budget, as an adaptive mutex), and
    /// two ranks settled into sleeping: a wait whose peer slept lasts its peer's wake-up, which
    /// halved the waiter's budget, so the waiter slept too and its own peer's next wait was
    /// long in turn. Under `XCCL_WAIT=sleep` the budget sat at 0.5 to 8 us and a 4 us T=1
    /// round trip took 40 to 120 us (`docs/performance.md`).
    fn spin_budget(&self) -> u64 {
        if self.oversubscribed {
            0
        } else {
            self.wake_ns.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    /// The bounds of the next wait under `policy`.
    fn plan(&self, policy: WaitPolicy) -> Plan {
        use std::sync::atomic::Ordering::Relaxed;
        let wake = self.wake_ns.load(Relaxed);
        // Ranks outnumbering cores: a busy poll keeps the core from the rank that owes the
        // signal (no spin phase, `spin_budget`: even the shortest one, the 32 polls between two
        // looks at the clock, took about 9 us of a shared core a wait, measured), a yield hands
        // it over, so yield for at least one wake-up latency (what a futex hand-off costs)
        // before sleeping, and for twice as long as this rank's waits have lately taken: a
        // sleep costs the signaller a futex wake on its own critical path as well as the
        // sleeper's wake-up, and with the phase shorter than a typical wait every wait paid
        // both (`XCCL_WAIT=sleep` at 2A:2E T=1: 40-58 us round trips with 0.4-1.1 sleeps per
        // call, against 19 us without sleeps; `docs/performance.md`). At most 50 us.
        let yield_for = if self.oversubscribed {
            let waits = 2 * self.wait_ns.load(Relaxed);
            policy.yield_for.max(Duration::from_nanos(
                wake.max(waits).min(MAX_HANDOFF_YIELD_NS),
            ))
        } else {
            policy.yield_for
        };
        let yield_allowed = !yield_for.is_zero()
            && match self.yield_off_until.load(Relaxed) {
                0 => true,
                until => now_ns() >= until,
            };
        // A core per rank: a short spin takes the core from nobody, and a signal that comes
        // within it is seen without a yield or a wake-up (a policy without a spin phase, such
        // as `yield`, gets one of `OWN_CORE_POLLS`, bounded by the budget as every spin is).
        let spin_iters = if !self.oversubscribed && policy.spin_iters == 0 {
            OWN_CORE_POLLS
        } else {
            policy.spin_iters
        };
        Plan {
            spin_for: Duration::from_nanos(self.spin_budget()),
            spin_iters,
            yield_for,
            slow_yield: Duration::from_nanos((16 * wake).max(MIN_SLOW_YIELD_NS)),
            yield_allowed,
            // Ranks outnumbering cores keep one run of the phases per wait (the policy tuned
            // for them): a 3-run A/B at 2A:2E T=1 (four ranks, two cores) with restarts there
            // showed no gain above the noise (`docs/performance.md`).
            restart_on_progress: !self.oversubscribed,
        }
    }

    /// Counts a wait that found what it waited for at its first look.
    fn finish_at_first_look(&self) {
        self.counts[0].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Folds one finished wait (`tally`) into the estimates and counters.
    fn finish(&self, plan: &Plan, tally: &Tally) {
        use std::sync::atomic::Ordering::Relaxed;
        let add = |i: usize, v: u32| {
            if v > 0 {
                self.counts[i].fetch_add(u64::from(v), Relaxed);
            }
        };
        self.counts[0].fetch_add(1, Relaxed);
        add(1, tally.polls);
        add(2, tally.yields);
        add(3, tally.slow_yields);
        add(4, tally.sleeps);
        add(6, tally.restarts);
        if let Some(took) = tally.took_ns {
            // Smoothed over about 8 waits, as the wake-up latency.
            let old = self.wait_ns.load(Relaxed);
            let new = (old * 7 + took.min(MAX_WAKE_NS)) / 8;
            self.wait_ns.store(new, Relaxed);
        }
        if let Some(w) = tally.wake_ns {
            self.counts[5].fetch_add(1, Relaxed);
            // Smoothed over about 8 wake-ups, bounded so one stall cannot stop spinning.
            let old = self.wake_ns.load(Relaxed);
            let new = (old * 7 + w.clamp(MIN_WAKE_NS, MAX_WAKE_NS)) / 8;
            self.wake_ns.store(new, Relaxed);
        }
        // A slow yield (a slice of milliseconds given away) costs far more than the few
        // microseconds a quick one saves: no yield phase for the next 10 ms, doubling up to 1 s
        // while the probes that follow find yields slow; a wait whose yields were all quick
        // halves the back-off.
        if plan.yield_allowed {
            let b = self.yield_backoff.load(Relaxed);
            if tally.slow_yields > 0 {
                let b = (2 * b).clamp(MIN_YIELD_BACKOFF_NS, MAX_YIELD_BACKOFF_NS);
                self.yield_backoff.store(b, Relaxed);
                self.yield_off_until.store(now_ns() + b, Relaxed);
            } else if tally.yields > 0 && b > 0 {
                self.yield_backoff.store(b / 2, Relaxed);
            }
        }
    }
}

/// Loom tests only: control memory for one area.
#[cfg(all(test, loom))]
impl ControlArea {
    /// Model memory holding every word a control area of `num_slots` slots uses.
    pub(crate) fn model_memory(num_slots: usize) -> sync::ModelMemory {
        let mut u64s = vec![
            MAGIC_OFF,
            DEPARTED_OFF,
            ABORT_OFF,
            ABORT_CLAIM_OFF,
            ABORT_LEN_OFF,
            ABORT_DEAD_OFF,
        ];
        u64s.extend((0..ABORT_REASON_BYTES / 8).map(|i| REASON_OFF + 8 * i));
        u64s.extend((0..num_slots).map(|i| SLOTS_OFF + LINE * i));
        let u32s = [
            VERSION_OFF,
            NUM_SLOTS_OFF,
            PID_OFF,
            RANK_OFF,
            DOORBELL_OFF,
            SLEEPERS_OFF,
        ];
        u64s.push(WOKEN_AT_OFF);
        sync::ModelMemory::new(&u64s, &u32s)
    }
}

#[cfg(all(test, loom))]
#[path = "signals_loom.rs"]
mod loom_tests;

/// How long a wait busy-polls and yields before it sleeps on the futex: the caps of each phase;
/// within them every wait adapts to what the rank's earlier waits observed ([`WaitState`]).
///
/// Every wait goes through up to three phases and always ends in the third:
/// 1. **Spin**: busy-poll (a `pause` each) for at most `spin_iters` polls and at most the spin
///    budget: the measured latency of a futex wake-up (the signaller stamps the time it wakes
///    a sleeper), so a wait that ends up sleeping costs at most twice what it had to (the rule
///    of ski rental). The budget does not shrink after long waits: a wait whose peer slept lasts
///    a wake-up, and shrinking on that made both ranks sleep ([`WaitState`]). Where ranks
///    outnumber cores there is no spin phase (see below).
/// 2. **Yield**: `sched_yield` between polls for up to `yield_for`, which hands the core to a
///    runnable peer on it at once. A yield that kept the core away for longer than 16 wake-ups
///    (at least 500 us: another task ran its time slice) ends the phase, and waits skip it for the next 10 ms, doubling up to 1 s while later probes find
///    yields slow (a wait with only quick yields halves the back-off): with busy processes
///    competing for the cores, yielding would hand them a slice of milliseconds per wait.
/// 3. **Sleep** on the futex doorbell, in chunks of at most 20 ms (liveness and the deadline are
///    checked between them); a signaller wakes the sleeper (it sees the sleeper count).
///
/// With a core per rank, a wait for something that lands in parts (a receive whose rows stream
/// in chunk by chunk) goes back to phase 1 whenever a part lands ([`Waiting::progress`]): the
/// peer is streaming, and a waiter that fell asleep between parts would cost the signaller a
/// futex wake-up per chunk (a 1A:1E T=512 receive slept 22 to 29 times per call before). Where
/// ranks outnumber cores the phases run once per wait, as before.
///
/// With a core per rank, spinning gives the lowest latency. With more ranks than cores, a
/// spinning waiter takes the core the rank it waits for needs; yielding hands the core over at
/// once while staying runnable, so the signal is seen without a futex wake-up (a syscall for the
/// signaller and a scheduler wake-up for the waiter). So when the ranks on the host outnumber
/// the cores this process may run on ([`WaitState::for_ranks_on_host`]), every policy, the ones
/// a user picks included, does not spin, and yields for at least one wake-up latency and twice
/// the length of the rank's recent waits (at most 50 us; the policy's own cap when longer)
/// before it sleeps: a policy without a yield phase (`sleep`) then sleeps only in waits longer
/// than its usual ones, paying at most the hand-off's cost and 50 us before its sleep, and the
/// yields stop as soon as one is slow (another task ran a slice), as above. With a core per
/// rank, a policy without a spin phase (`yield`) spins for up to the spin budget (one wake-up
/// latency) first, as every policy does: such a spin takes the core from nobody, and a reply
/// that comes within it is seen without a yield or a wake-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitPolicy {
    /// Busy-poll iterations (each a `pause`) before yielding.
    pub spin_iters: u32,
    /// How long to yield the core (re-polling) before sleeping.
    pub yield_for: Duration,
}

impl WaitPolicy {
    /// A core per rank: spin up to 4096 polls (and the spin budget), yield up to 200 us, then
    /// sleep.
    pub const DEDICATED: WaitPolicy = WaitPolicy {
        spin_iters: 4096,
        yield_for: Duration::from_micros(200),
    };
    /// Spin for at most one wake-up latency (what the sleep costs anyway), then sleep on the
    /// futex, with no yield phase (`XCCL_WAIT=sleep`).
    pub const SHARED: WaitPolicy = WaitPolicy {
        spin_iters: 4096,
        yield_for: Duration::ZERO,
    };
    /// More ranks than cores: no busy-polling (a spinning waiter keeps the core from the peer
    /// it waits for); `sched_yield` between polls (as Open MPI's `mpi_yield_when_idle`) for up
    /// to 200 us, then sleep on the futex (`XCCL_WAIT=yield`). The measured best when ranks
    /// outnumber cores (`xccl-bench/README.md`, "Wait policy").
    pub const OVERSUBSCRIBED: WaitPolicy = WaitPolicy {
        spin_iters: 0,
        yield_for: Duration::from_micros(200),
    };

    /// A one-line description: the `XCCL_WAIT` name (or `SPINS:YIELD_US`) and the caps.
    pub fn describe(&self) -> String {
        let name = match *self {
            WaitPolicy::DEDICATED => "spin".to_string(),
            WaitPolicy::SHARED => "sleep".to_string(),
            WaitPolicy::OVERSUBSCRIBED => "yield".to_string(),
            p => format!("{}:{}", p.spin_iters, p.yield_for.as_micros()),
        };
        format!(
            "{name} (adaptive; spin <= {} polls, yield <= {} us, then sleep)",
            self.spin_iters,
            self.yield_for.as_micros()
        )
    }

    /// Parses an `XCCL_WAIT` value: `spin` ([`WaitPolicy::DEDICATED`]), `sleep`
    /// ([`WaitPolicy::SHARED`]), `yield` ([`WaitPolicy::OVERSUBSCRIBED`]), or `SPINS:YIELD_US`
    /// (for example `64:500`: 64 polls, then yield for 500 us, then sleep). `None` if it is none
    /// of these.
    pub fn parse(value: &str) -> Option<WaitPolicy> {
        match value.trim() {
            "spin" => Some(WaitPolicy::DEDICATED),
            "sleep" => Some(WaitPolicy::SHARED),
            "yield" => Some(WaitPolicy::OVERSUBSCRIBED),
            custom => {
                let (spins, yield_us) = custom.split_once(':')?;
                Some(WaitPolicy {
                    spin_iters: spins.trim().parse().ok()?,
                    yield_for: Duration::from_micros(yield_us.trim().parse().ok()?),
                })
            }
        }
    }

    /// The policy for `ranks` ranks on this host: [`WaitPolicy::OVERSUBSCRIBED`] when they
    /// outnumber the cores this process may run on, else [`WaitPolicy::DEDICATED`].
    /// `XCCL_WAIT` ([`WaitPolicy::parse`]) overrides the choice; a value it does not parse is
    /// ignored.
    pub fn for_ranks_on_host(ranks: usize) -> Self {
        if let Some(p) = std::env::var("XCCL_WAIT")
            .ok()
            .and_then(|v| WaitPolicy::parse(&v))
        {
            return p;
        }
        if ranks > cores_available() {
            WaitPolicy::OVERSUBSCRIBED
        } else {
            WaitPolicy::DEDICATED
        }
    }
}

/// Cores the ranks of this host may run on: this process's `sched_getaffinity` mask, unless it
/// holds a single CPU, where a launcher pinned each rank to a core of its own (`mpirun
/// --bind-to core`, `xccl-bench --bind`), and the host's online CPUs count instead.
fn cores_available() -> usize {
    let mask = std::thread::available_parallelism().map_or(1, |n| n.get());
    if mask > 1 {
        return mask;
    }
    // SAFETY: sysconf only reads a system value.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(online).unwrap_or(1).max(1)
}

/// Longest single futex sleep; bounds how late an abort or a dead peer is noticed.
const SLEEP_CHUNK: Duration = Duration::from_millis(20);
/// How often a sleeping wait checks that every peer is alive and nobody aborted out of band.
const LIVENESS_EVERY: Duration = Duration::from_millis(20);

/// Heap memory for control areas and windows of in-process ranks: zeroed, 4096-byte aligned.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: the buffer is plain memory owned by this value; all shared access goes through atomics
// or the `Window` protocol.
unsafe impl Send for AlignedBuf {}
// SAFETY: see `Send`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes (at least one page).
    pub(crate) fn zeroed(len: usize) -> Result<Self> {
        let layout = std::alloc::Layout::from_size_align(len.max(4096), 4096)
            .map_err(|e| Error::invalid(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::os(
                format!("allocating {len} bytes"),
                std::io::Error::from(std::io::ErrorKind::OutOfMemory),
            )
        })?;
        Ok(AlignedBuf { ptr, layout })
    }

    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

#[cfg(all(test, not(loom)))]
mod policy_tests {
    use super::*;

    #[test]
    fn xccl_wait_values_parse() {
        assert_eq!(WaitPolicy::parse("spin"), Some(WaitPolicy::DEDICATED));
        assert_eq!(WaitPolicy::parse("sleep"), Some(WaitPolicy::SHARED));
        assert_eq!(
            WaitPolicy::parse(" yield "),
            Some(WaitPolicy::OVERSUBSCRIBED)
        );
        assert_eq!(
            WaitPolicy::parse("100:50"),
            Some(WaitPolicy {
                spin_iters: 100,
                yield_for: Duration::from_micros(50)
            })
        );
        for bad in ["", "fast", "1:", ":2", "x:1", "1:-2"] {
            assert_eq!(WaitPolicy::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn every_policy_ends_in_a_bounded_sleep_and_keeps_its_deadline() {
        // A wait whose signal never comes returns Timeout near its deadline under every policy.
        let buf = AlignedBuf::zeroed(ControlArea::bytes_for(1)).unwrap();
        // SAFETY: zeroed, page-aligned, sized by `bytes_for`, outlives `area`.
        let area = unsafe { ControlArea::init(buf.ptr(), 1, 0, 1, std::process::id()) };
        for policy in [
            WaitPolicy::DEDICATED,
            WaitPolicy::SHARED,
            WaitPolicy::OVERSUBSCRIBED,
        ] {
            let start = Instant::now();
            let r = area.wait_with(
                policy,
                &WaitState::default(),
                start + Duration::from_millis(30),
                &mut || Some(Waiting::on(1, "never")),
                &|_| Ok(()),
            );
            assert!(
                matches!(r, Err(Error::Timeout { peer: 1, .. })),
                "{policy:?}: {r:?}"
            );
            assert!(start.elapsed() < Duration::from_secs(2), "{policy:?}");
        }
    }

    /// A wait whose first look finds what it waits for is counted and returns before any clock
    /// read or phase plan, so it leaves the wait-length estimate alone; a wait that waited moves
    /// it where ranks outnumber cores (their yield phase follows it), and only there: with a
    /// core per rank the estimate bounds nothing, and the clock read it took came right after
    /// the signal, on the critical path of every call.
    #[test]
    fn only_waits_that_waited_are_timed_and_only_where_ranks_outnumber_cores() {
        use std::sync::atomic::Ordering::Relaxed;
        let buf = AlignedBuf::zeroed(ControlArea::bytes_for(1)).unwrap();
        // SAFETY: zeroed, page-aligned, sized by `bytes_for`, outlives `area`.
        let area = unsafe { ControlArea::init(buf.ptr(), 1, 0, 1, std::process::id()) };
        let deadline = Instant::now() + Duration::from_secs(10);
        for oversubscribed in [true, false] {
            let state = WaitState {
                oversubscribed,
                ..WaitState::default()
            };
            let wait = |poll: &mut dyn FnMut() -> Option<Waiting>| {
                area.wait_with(WaitPolicy::SHARED, &state, deadline, poll, &|_| Ok(()))
            };
            let mut looks = 0;
            let done_at_once = wait(&mut || {
                looks += 1;
                None
            });
            assert!(done_at_once.is_ok() && looks == 1);
            assert_eq!(state.counters().waits, 1);
            assert_eq!(
                state.wait_ns.load(Relaxed),
                0,
                "an immediate wait is not timed"
            );
            let mut looks = 0;
            let start = Instant::now();
            let waited = wait(&mut || {
                looks += 1;
                (start.elapsed() < Duration::from_micros(200)).then(|| Waiting::on(1, "later"))
            });
            assert!(waited.is_ok() && looks > 1);
            assert_eq!(state.counters().waits, 2);
            if oversubscribed {
                assert!(
                    state.wait_ns.load(Relaxed) >= 200_000 / 8,
                    "a wait that waited is timed where ranks outnumber cores"
                );
            } else {
                assert_eq!(
                    state.wait_ns.load(Relaxed),
                    0,
                    "with a core per rank no wait is timed"
                );
            }
        }
    }

    /// A wait for parts that land one by one (rows streaming in) restarts its phases at every
    /// part: while the parts come faster than the yield phase lasts it never sleeps, so the
    /// signaller pays no futex wake-up per part. Before, the phases ran from the wait's start
    /// and a long streaming receive slept between parts (22 sleeps per 1A:1E T=512 call).
    ///
    /// The streaming parts land every 8 polls, not every few milliseconds: a wait polls at most
    /// three times per round of its loop, so every part is seen by the poll that restarts the
    /// phases however slowly a loaded machine runs the test (a clock-driven version saw only
    /// 2 of 11 parts in CI once a slow yield had sent the wait to sleep for 20 ms at a time).
    /// The restarts are counted exactly, and a mutation that drops them fails; the no-sleep
    /// check is the weaker one, since eight fast yields are far inside the yield phase anyway.
    #[test]
    fn a_wait_for_streaming_parts_restarts_its_phases_at_each_part_and_does_not_sleep() {
        let buf = AlignedBuf::zeroed(ControlArea::bytes_for(1)).unwrap();
        // SAFETY: zeroed, page-aligned, sized by `bytes_for`, outlives `area`.
        let area = unsafe { ControlArea::init(buf.ptr(), 1, 0, 1, std::process::id()) };
        // Yield for 200 ms, then sleep.
        let yield_for = Duration::from_millis(200);
        let policy = WaitPolicy {
            spin_iters: 0,
            yield_for,
        };
        let wait = |poll: &mut dyn FnMut() -> Option<Waiting>| {
            let state = WaitState::default();
            area.wait_with(
                policy,
                &state,
                Instant::now() + Duration::from_secs(10),
                poll,
                &|_| Ok(()),
            )
            .unwrap();
            state.counters()
        };
        // Twelve parts, one every 8 polls.
        let mut polls = 0u64;
        let c = wait(&mut || {
            polls += 1;
            let part = (polls - 1) / 8;
            (part < 12).then_some(Waiting::on(1, "parts").at(part))
        });
        assert_eq!(c.restarts, 11, "{c:?}");
        // A yield that kept the core away for long (a loaded machine) turns yielding off, and
        // then a wait sleeps between parts: only then may it sleep.
        assert!(c.sleeps == 0 || c.slow_yields > 0, "{c:?}");
        // Without progress the phases run once: yield for 200 ms, then sleep until the wait
        // ends 30 ms later.
        let start = Instant::now();
        let c = wait(&mut || {
            (start.elapsed() < yield_for + Duration::from_millis(30))
                .then_some(Waiting::on(1, "parts").at(0))
        });
        assert_eq!(c.restarts, 0, "{c:?}");
        assert!(c.sleeps >= 1, "{c:?}");
    }
}

#[cfg(all(test, not(loom)))]
mod plan_tests {
    use super::*;

    #[test]
    fn ranks_outnumbering_cores_end_spinning_and_give_every_policy_a_bounded_yield_phase() {
        let over = WaitState {
            oversubscribed: true,
            ..WaitState::default()
        };
        let own = WaitState::default();
        assert!(over.oversubscribed() && !own.oversubscribed());
        let first_wake = Duration::from_nanos(FIRST_WAKE_NS);
        for policy in [
            WaitPolicy::DEDICATED,
            WaitPolicy::SHARED,
            WaitPolicy::OVERSUBSCRIBED,
        ] {
            let p = over.plan(policy);
            assert_eq!(p.spin_for, Duration::ZERO, "{policy:?}");
            // One wake-up latency of yielding, or the policy's longer cap.
            assert_eq!(p.yield_for, policy.yield_for.max(first_wake), "{policy:?}");
            assert!(p.yield_allowed, "{policy:?}");
            // With a core per rank every policy spins for up to one wake-up latency (a policy
            // without a spin phase gets enough polls for it), then its own caps stand.
            let q = own.plan(policy);
            assert_eq!(q.spin_for, first_wake, "{policy:?}");
            assert_eq!(q.spin_iters, policy.spin_iters.max(4096), "{policy:?}");
            assert_eq!(q.yield_for, policy.yield_for, "{policy:?}");
            assert_eq!(q.yield_allowed, !policy.yield_for.is_zero(), "{policy:?}");
        }
        // The added yield phase is one wake-up latency, never more than 50 us.
        over.wake_ns
            .store(400_000, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            over.plan(WaitPolicy::SHARED).yield_for,
            Duration::from_nanos(MAX_HANDOFF_YIELD_NS)
        );
        assert_eq!(over.counters().spin_ns, 0);
    }

    /// Where ranks outnumber the cores, the yield phase before a sleep covers twice the
    /// length of the rank's recent waits (at most 50 us). With one wake-up latency of yielding
    /// (5-14 us measured) and waits of 15-20 us, `XCCL_WAIT=sleep` at 2A:2E T=1 slept in up to
    /// every wait (0.4-1.1 sleeps per call, round trips 40-67 us against 19 us).
    #[test]
    fn the_yield_phase_of_ranks_outnumbering_cores_covers_their_recent_waits() {
        let over = WaitState {
            oversubscribed: true,
            ..WaitState::default()
        };
        let first_wake = Duration::from_nanos(FIRST_WAKE_NS);
        let plan = over.plan(WaitPolicy::SHARED);
        assert_eq!(plan.yield_for, first_wake, "no wait seen yet");
        let waited = |ns: u64| Tally {
            yields: 3,
            took_ns: Some(ns),
            ..Tally::default()
        };
        for _ in 0..32 {
            over.finish(&plan, &waited(18_000));
        }
        let y = over.plan(WaitPolicy::SHARED).yield_for;
        assert!(y > first_wake && y <= Duration::from_micros(36), "{y:?}");
        // Long waits (a peer computing) lengthen it to 50 us, no more.
        for _ in 0..32 {
            over.finish(&plan, &waited(5_000_000));
        }
        let cap = Duration::from_nanos(MAX_HANDOFF_YIELD_NS);
        assert_eq!(over.plan(WaitPolicy::SHARED).yield_for, cap);
        // A policy with a longer phase keeps it; with a core per rank the policy's own stands.
        let longer = WaitPolicy::OVERSUBSCRIBED;
        assert_eq!(over.plan(longer).yield_for, longer.yield_for);
        let own = WaitState::default();
        for _ in 0..32 {
            own.finish(&plan, &waited(18_000));
        }
        assert_eq!(own.plan(WaitPolicy::SHARED).yield_for, Duration::ZERO);
    }

    #[test]
    fn a_rank_pinned_to_one_cpu_counts_the_hosts_cores() {
        // As a launcher pins ranks (`--bind-to core`): one CPU in the mask, a core per rank.
        std::thread::spawn(|| {
            // SAFETY: plain libc calls on a zeroed cpu_set_t owned by this thread.
            let pinned = unsafe {
                let cpu = libc::sched_getcpu().max(0) as usize;
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
            };
            assert!(pinned);
            assert_eq!(std::thread::available_parallelism().unwrap().get(), 1);
            // SAFETY: sysconf only reads a system value.
            let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) } as usize;
            assert_eq!(cores_available(), online.max(1));
            assert_eq!(WaitState::for_ranks_on_host(2).oversubscribed(), 2 > online);
            assert!(WaitState::for_ranks_on_host(online + 1).oversubscribed());
        })
        .join()
        .unwrap();
    }

    /// The spin budget is one wake-up latency and stays there after waits that slept: it used
    /// to halve after a wait that outlasted a wake-up, and a wait whose peer slept always does,
    /// so two ranks under `XCCL_WAIT=sleep` settled at a 0.5 us budget and slept every call.
    #[test]
    fn the_spin_budget_is_one_wake_up_and_sleeping_does_not_shrink_it() {
        use std::sync::atomic::Ordering::Relaxed;
        let state = WaitState::default();
        let plan = state.plan(WaitPolicy::SHARED);
        assert_eq!(plan.spin_for, Duration::from_nanos(FIRST_WAKE_NS));
        // Waits that slept, their peers late by more than a wake-up.
        for _ in 0..8 {
            let slept = Tally {
                polls: 4096,
                sleeps: 1,
                wake_ns: Some(40_000),
                ..Tally::default()
            };
            state.finish(&plan, &slept);
        }
        let wake = state.wake_ns.load(Relaxed);
        assert!((FIRST_WAKE_NS..=40_000).contains(&wake), "{wake}");
        assert_eq!(
            state.plan(WaitPolicy::SHARED).spin_for,
            Duration::from_nanos(wake)
        );
        assert_eq!(state.counters().spin_ns, wake);
    }

    #[test]
    fn slow_yields_turn_the_yield_phase_off_even_where_ranks_outnumber_cores() {
        let over = WaitState {
            oversubscribed: true,
            ..WaitState::default()
        };
        let plan = over.plan(WaitPolicy::SHARED);
        let tally = Tally {
            yields: 1,
            slow_yields: 1,
            ..Tally::default()
        };
        let before = now_ns();
        over.finish(&plan, &tally);
        // No yield phase for the shortest back-off from the slow yield on (read from the state,
        // not from the clock: the test holds however long it is descheduled).
        use std::sync::atomic::Ordering::Relaxed;
        assert_eq!(over.yield_backoff.load(Relaxed), MIN_YIELD_BACKOFF_NS);
        assert!(over.yield_off_until.load(Relaxed) >= before + MIN_YIELD_BACKOFF_NS);
    }
}

#[cfg(all(test, not(loom)))]
mod liveness_tests {
    use super::*;

    /// Waits that reach their liveness checks at once.
    const SLEEP_AT_ONCE: WaitPolicy = WaitPolicy {
        spin_iters: 1,
        yield_for: Duration::ZERO,
    };

    /// A control area with one slot over its own buffer (keep the buffer while the area is used).
    fn one_slot_area() -> (AlignedBuf, ControlArea) {
        let buf = AlignedBuf::zeroed(ControlArea::bytes_for(1)).unwrap();
        // SAFETY: zeroed, page-aligned, sized by `bytes_for`; the caller keeps `buf` alive
        // with the area (the buffer's heap block does not move when the tuple does).
        let area = unsafe { ControlArea::init(buf.ptr(), 1, 0, 1, std::process::id()) };
        (buf, area)
    }

    #[test]
    fn a_peer_that_signalled_then_left_between_poll_and_check_is_not_reported() {
        let (_buf, area) = one_slot_area();
        let policy = SLEEP_AT_ONCE;
        // The peer's last signal lands just after the poll that still waited for it, and the
        // peer leaves at once: the liveness check that follows finds it gone.
        let left = std::cell::Cell::new(false);
        let mut poll = || (!left.get()).then_some(Waiting::on(1, "a signal"));
        let gone = |peer: usize| {
            left.set(true);
            Err(Error::PeerFailed {
                peer,
                detail: "left".into(),
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        area.wait_with(policy, &WaitState::default(), deadline, &mut poll, &gone)
            .expect("its data arrived: not a failure");
        // Still missing after the check: reported.
        let mut never = || Some(Waiting::on(1, "a signal"));
        assert!(matches!(
            area.wait_with(policy, &WaitState::default(), deadline, &mut never, &gone),
            Err(Error::PeerFailed { peer: 1, .. })
        ));
    }

    /// The bug behind the flaky 160 x 288 run: the awaited peer delivered and left, the re-poll
    /// then waited for another (live) peer, and the departed one was reported as failed.
    #[test]
    fn a_peer_that_delivered_and_left_is_not_blamed_while_the_wait_goes_on_for_another() {
        let (_buf, area) = one_slot_area();
        let policy = SLEEP_AT_ONCE;
        // Rank 1 delivers and leaves just after a poll that still waited for it; rank 2 (alive)
        // delivers a little later.
        let left = std::cell::Cell::new(false);
        let polls_after = std::cell::Cell::new(0u32);
        let mut poll = || {
            if !left.get() {
                return Some(Waiting::on(1, "rank 1's rows"));
            }
            polls_after.set(polls_after.get() + 1);
            (polls_after.get() < 50).then_some(Waiting::on(2, "rank 2's rows"))
        };
        let liveness = |peer: usize| match peer {
            1 => {
                left.set(true);
                Err(Error::PeerFailed {
                    peer,
                    detail: "its endpoint was dropped".into(),
                })
            }
            _ => Ok(()),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        area.wait_with(
            policy,
            &WaitState::default(),
            deadline,
            &mut poll,
            &liveness,
        )
        .expect("rank 1 delivered before it left and rank 2 delivered: not a failure");
        assert!(polls_after.get() >= 50);
    }
}
