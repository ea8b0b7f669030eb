//! [`Context`]: what every protocol type of one rank shares — the fabric, the topology, the
//! config, the window layout and the slot numbering — plus the record of whether the current call
//! has published anything to a peer yet.
//!
//! Every write to a peer (or to this rank's own window, which peers read) goes through
//! [`Context::put`] and [`Context::signal`], which note that the call has published. The
//! communicator uses that to give a failed call its defined state: an error before anything was
//! published leaves everything as it was (retry the call), an error after it poisons the
//! communicator and aborts the job.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::Instant;

use super::config::MoeConfig;
use super::record::Record;
use super::slots::Slots;
use super::stats::Stats;
use super::window_layout::WindowLayout;
use crate::fabric::{Fabric, Waiting};
use crate::topology::Topology;
use crate::{Error, Result};

/// How often a protocol wait checks every peer it waits for (the fabric checks the first one
/// between sleeps).
pub(crate) const AWAITED_CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

/// When a wait next checks that the peers it awaits are alive ([`Context::check_awaited`]),
/// on the coarse clock ([`coarse_now_ns`]: the protocol's waits look at it on every look, so it
/// must cost next to nothing). Unset until the wait's first look that finds something
/// missing, which sets it one period later: a wait done at its first look reads no clock.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CheckDue(Option<u64>);

impl CheckDue {
    /// Due at once: the first miss checks.
    pub(crate) fn now() -> Self {
        CheckDue(Some(0))
    }

    /// Whether a check is due now; if so (or at the first miss), the next one is set a period
    /// from now.
    fn due(&mut self) -> bool {
        let now = coarse_now_ns();
        let period = AWAITED_CHECK_EVERY.as_nanos() as u64;
        match self.0 {
            Some(at) if now < at => false,
            Some(_) => {
                self.0 = Some(now + period);
                true
            }
            None => {
                self.0 = Some(now + period);
                false
            }
        }
    }
}

/// `CLOCK_MONOTONIC_COARSE` in nanoseconds: the time of the kernel's last tick (a few ms of
/// resolution), read without the timestamp counter, so several times cheaper than
/// [`Instant::now`] (every look of a protocol wait that finds something missing asks it whether
/// a liveness check is due; a check every 20 ms needs no finer clock).
fn coarse_now_ns() -> u64 {
    first_clock_ns(&[libc::CLOCK_MONOTONIC_COARSE, libc::CLOCK_MONOTONIC])
}

/// The first of `clocks` this kernel has, in nanoseconds (0 if none). A clock it lacks reads
/// 0, and a clock stuck at 0 would never make a check due: CLOCK_MONOTONIC_COARSE exists on
/// Linux since 2.6.32, CLOCK_MONOTONIC stands in for it before.
fn first_clock_ns(clocks: &[libc::clockid_t]) -> u64 {
    clocks
        .iter()
        .map(|&c| crate::fabric::clock_ns(c))
        .find(|&t| t != 0)
        .unwrap_or(0)
}

/// A communicator's last failed call that did not poison: its abort reason and the death it
/// reports (`Context::last_failure`), shared with what may abort for it later.
pub(crate) type LastFailure = Arc<std::sync::Mutex<Option<(String, Option<usize>)>>>;

/// The shared state of one rank's protocol.
pub(crate) struct Context {
    /// The device side of the device-buffer calls (cuda fabric), made by the first one.
    /// Declared before `fabric`: it borrows the fabric's stream, so it is dropped first.
    device_rows: RefCell<Option<super::device_rows::DeviceRows>>,
    /// Shared only weakly: with the handles and batches of live calls (their abort path when
    /// dropped) and with the communicator's [`crate::AbortHandle`]s.
    pub(crate) fabric: Arc<dyn Fabric>,
    pub(crate) topo: Arc<Topology>,
    pub(crate) cfg: MoeConfig,
    pub(crate) layout: WindowLayout,
    pub(crate) slots: Slots,
    pub(crate) rank: usize,
    /// A per-process unique id of this communicator, stamped on handles and batches.
    pub(crate) id: u64,
    published: Cell<bool>,
    /// The clock reading of the current look of a wait ([`Context::look_time`]).
    look: Cell<LookClock>,
    /// Counters of the current call.
    /// The failure of this rank's last call when it failed without poisoning (a timeout
    /// before publishing): its abort reason and the death it reports. An abort that follows
    /// from it (a live handle or batch dropped as the error unwinds) carries it, so the peers
    /// are told the cause, not the drop ([`super::batch::AbortLink`]). Cleared by a call that
    /// succeeds.
    pub(crate) last_failure: LastFailure,
    pub(crate) stats: RefCell<Stats>,
    /// The caller's interrupt check (`Communicator::set_interrupt_check`), polled by every
    /// wait at most every [`INTERRUPT_CHECK_EVERY`].
    pub(crate) interrupt: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
}

/// Where [`Context::look_time`] stands.
#[derive(Clone, Copy, Debug)]
enum LookClock {
    /// Not in a look of a wait: every ask reads the clock.
    Outside,
    /// In a look that has not read the clock yet.
    Unread,
    /// In a look that read it.
    Read(Instant),
}

/// Sets [`LookClock::Outside`] when dropped: the end of a wait's looks.
struct LookEnd<'a>(&'a Cell<LookClock>);

impl Drop for LookEnd<'_> {
    fn drop(&mut self) {
        self.0.set(LookClock::Outside);
    }
}

/// How often a wait asks the caller's interrupt check whether to stop (a sleeping wait wakes
/// at least every 20 ms, so an interrupt is seen within about 40 ms).
pub(crate) const INTERRUPT_CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

impl Context {
    /// Checks that `fabric` fits the topology and config (rank count, slots, window sizes).
    pub(crate) fn new(
        fabric: Box<dyn Fabric>,
        topo: Arc<Topology>,
        mut cfg: MoeConfig,
    ) -> Result<Self> {
        cfg.validate(&topo)?;
        // A local choice (peers follow the signals), raised to what the fabric's signals cost.
        cfg.chunk_bytes = cfg.chunk_bytes.max(fabric.capabilities().chunk_floor);
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
        let topo_world = topo.world_size();
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Context {
            device_rows: RefCell::new(None),
            rank: fabric.rank(),
            fabric: Arc::from(fabric),
            topo,
            cfg,
            layout,
            slots,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            published: Cell::new(false),
            look: Cell::new(LookClock::Outside),
            stats: RefCell::new(Stats::new(topo_world)),
            interrupt: None,
            last_failure: Arc::default(),
        })
    }

    /// The device side of the device-buffer calls, made on first use (an error on a fabric
    /// other than cuda, or naming NVRTC or the driver when the data plane cannot be built).
    pub(crate) fn device_rows(
        &self,
    ) -> Result<std::cell::RefMut<'_, super::device_rows::DeviceRows>> {
        let mut rows = self.device_rows.borrow_mut();
        if rows.is_none() {
            let fabric = self.fabric.as_cuda().ok_or_else(|| {
                Error::invalid(format!(
                    "device rows need the cuda fabric; this communicator is on {}",
                    self.fabric.name()
                ))
            })?;
            *rows = Some(super::device_rows::DeviceRows::new(
                fabric,
                self.cfg.timeout,
            )?);
        }
        Ok(std::cell::RefMut::map(rows, |r| {
            r.as_mut().expect("made above")
        }))
    }

    /// The deadline of a call starting now: every wait of the call shares it.
    pub(crate) fn call_deadline(&self) -> Instant {
        crate::fabric::deadline_after(self.cfg.timeout)
    }

    /// Starts a call: nothing published yet, counters of the call cleared.
    pub(crate) fn begin_call(&self) {
        self.published.set(false);
        let mut s = self.stats.borrow_mut();
        s.clear();
        s.calls = 1;
    }

    /// Whether the current call has written anything a peer may read.
    pub(crate) fn has_published(&self) -> bool {
        self.published.get()
    }

    /// Notes that the call has taken something it cannot give back (a received epoch, which
    /// no later receive will see again): from here a failure poisons, as after publishing.
    pub(crate) fn note_consumed(&self) {
        self.published.set(true);
    }

    /// `put` that notes the call has published.
    pub(crate) fn put(&self, peer: usize, offset: usize, data: &[u8]) -> Result<()> {
        self.published.set(true);
        if let Some(p) = self.stats.borrow_mut().peers.get_mut(peer) {
            p.bytes_put += data.len() as u64;
        }
        self.fabric.put(peer, offset, data)
    }

    /// Counts `bytes` this rank wrote into `peer`'s window in place (through a slice of
    /// `moe::regions`) as a `put` of them, and notes that the call has published.
    pub(crate) fn note_written(&self, peer: usize, bytes: usize) {
        self.published.set(true);
        if let Some(p) = self.stats.borrow_mut().peers.get_mut(peer) {
            p.bytes_put += bytes as u64;
        }
    }

    /// Puts `rec` at `offset` of `peer`'s window, counting a record written and its rows.
    pub(crate) fn put_record(&self, peer: usize, offset: usize, rec: &Record) -> Result<()> {
        {
            let mut s = self.stats.borrow_mut();
            s.records_written += 1;
            if let Some(p) = s.peers.get_mut(peer) {
                p.records += 1;
                p.rows_sent += u64::from(rec.count);
            }
        }
        self.put(peer, offset, bytemuck::bytes_of(rec))
    }

    /// Reads the record at `offset` of this rank's window, written by `peer`, counting a record
    /// polled (its rows are counted once it validates: [`Context::note_rows_received`]).
    pub(crate) fn read_record(&self, offset: usize) -> Result<Record> {
        let mut rec = Record::default();
        self.get(self.rank, offset, bytemuck::bytes_of_mut(&mut rec))?;
        self.stats.borrow_mut().records_polled += 1;
        Ok(rec)
    }

    /// Counts `rows` announced by `peer` in a validated record.
    pub(crate) fn note_rows_received(&self, peer: usize, rows: usize) {
        if let Some(p) = self.stats.borrow_mut().peers.get_mut(peer) {
            p.rows_received += rows as u64;
        }
    }

    /// `signal` that notes the call has published.
    pub(crate) fn signal(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        self.published.set(true);
        self.fabric.signal(peer, slot, value)
    }

    /// [`Context::signal`] that wakes no sleeping waiter ([`crate::fabric::Fabric::signal_quiet`]):
    /// a record's own signal, which the signal of its rows follows.
    pub(crate) fn signal_quiet(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        self.published.set(true);
        self.fabric.signal_quiet(peer, slot, value)
    }

    /// `get` from `rank`'s window (this rank's own included).
    pub(crate) fn get(&self, rank: usize, offset: usize, buf: &mut [u8]) -> Result<()> {
        if rank != self.rank {
            if let Some(p) = self.stats.borrow_mut().peers.get_mut(rank) {
                p.bytes_got += buf.len() as u64;
            }
        }
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

    /// Waits until `poll` returns `None`. The time between two looks is charged to the peer
    /// the earlier look was waiting for.
    pub(crate) fn wait(
        &self,
        deadline: Instant,
        poll: &mut dyn FnMut() -> Option<Waiting>,
    ) -> Result<()> {
        let mut last: Option<(usize, Instant)> = None;
        let charge = |last: &mut Option<(usize, Instant)>, now: Instant| {
            if let Some((peer, since)) = last.take() {
                if let Some(p) = self.stats.borrow_mut().peers.get_mut(peer) {
                    p.waited += now - since;
                }
            }
        };
        // An interrupt ends the fabric's wait by reporting it done; the error is returned below.
        let mut interrupted: Option<Waiting> = None;
        // The first interrupt check comes one period after the first look that found
        // something missing (the clock is not read before).
        let mut next_check: Option<Instant> = None;
        // Whatever ends the wait (its end, an error, a panic in `poll`), no reading of its
        // looks outlives it.
        let _outside = LookEnd(&self.look);
        let result = self.fabric.wait_until(deadline, &mut || {
            self.look.set(LookClock::Unread);
            let w = poll();
            // The clock is read only when the awaited peer changes (or the wait ends after
            // waiting), so a spinning poll, and a wait whose first look finds it done, costs no
            // clock read; and for the interrupt check, which only a binding installs.
            let same_peer = matches!((&w, &last), (Some(w), Some((p, _))) if w.peer == *p);
            if !same_peer && (w.is_some() || last.is_some()) {
                let now = self.look_time();
                charge(&mut last, now);
                last = w.as_ref().map(|w| (w.peer, now));
            }
            if let (Some(w), Some(check)) = (&w, &self.interrupt) {
                let now = self.look_time();
                match next_check {
                    None => next_check = Some(now + INTERRUPT_CHECK_EVERY),
                    Some(at) if now >= at => {
                        next_check = Some(now + INTERRUPT_CHECK_EVERY);
                        if check() {
                            interrupted = Some(*w);
                            return None;
                        }
                    }
                    Some(_) => {}
                }
            }
            w
        });
        if last.is_some() {
            charge(&mut last, Instant::now());
        }
        result?;
        match interrupted {
            Some(w) => Err(Error::Interrupted {
                peer: w.peer,
                what: w.what.to_string(),
            }),
            None => Ok(()),
        }
    }

    /// The time of the current look of a wait ([`Context::wait`]): the clock is read once per
    /// look, by its first asker, so the arrivals a look finds and the wait's accounting of it
    /// share one reading (a read costs about 30 ns in a VM, and the last look's come between
    /// the peer's signal and the caller's next step). Outside a wait it reads the clock.
    pub(crate) fn look_time(&self) -> Instant {
        match self.look.get() {
            LookClock::Read(t) => t,
            LookClock::Outside => Instant::now(),
            LookClock::Unread => {
                let t = Instant::now();
                self.look.set(LookClock::Read(t));
                t
            }
        }
    }

    /// Time from `start` to [`Context::look_time`].
    pub(crate) fn look_since(&self, start: Instant) -> std::time::Duration {
        self.look_time().saturating_duration_since(start)
    }

    /// Checks that every peer in `missing` (the peers a wait still waits for) is alive, at most
    /// once per [`AWAITED_CHECK_EVERY`] (tracked in `next`, first due a period after the wait's
    /// first miss): the fabric's wait loop checks only the first awaited peer, this catches a
    /// dead one further down the list.
    pub(crate) fn check_awaited(
        &self,
        missing: impl IntoIterator<Item = usize>,
        next: &mut CheckDue,
    ) -> Result<()> {
        if !next.due() {
            return Ok(());
        }
        missing
            .into_iter()
            .try_for_each(|p| self.fabric.check_peer(p))
            .map_err(|e| self.abort_first(e))
    }

    /// `failure`, unless an abort has reached this rank: then the abort's error. Peers leave
    /// the job once they see an abort, so a wait that finds one gone after the abort arrived
    /// (it slept through both) reports the abort, not the departure it caused.
    fn abort_first(&self, failure: Error) -> Error {
        match self.fabric.aborted() {
            Some(notice) => notice.to_error(self.topo.world_size()),
            None => failure,
        }
    }

    /// [`Context::check_awaited`] for waits on peers that may leave the job right after their
    /// last signal: a peer found gone is reported only if `still_missing(peer)`, asked after
    /// the liveness check, says its data has still not arrived (a rank marks itself departed
    /// after its last signal, so a second look sees everything it sent).
    pub(crate) fn check_awaited_again(
        &self,
        missing: impl IntoIterator<Item = usize>,
        next: &mut CheckDue,
        still_missing: &dyn Fn(usize) -> bool,
    ) -> Result<()> {
        if !next.due() {
            return Ok(());
        }
        missing
            .into_iter()
            .try_for_each(|p| match self.fabric.check_peer(p) {
                Err(e) if still_missing(p) => Err(self.abort_first(e)),
                _ => Ok(()),
            })
    }

    /// Whether every peer of `peers` is done, by `done(peer)`, without waiting: a non-blocking
    /// look for `e2a_ready` and `a2e_ready`. A peer not done is checked for liveness, and a dead
    /// one is an error only if a second look still finds it not done (it may have left right
    /// after its last signal).
    pub(crate) fn all_done(
        &self,
        peers: impl IntoIterator<Item = usize>,
        done: &dyn Fn(usize) -> Result<bool>,
    ) -> Result<bool> {
        let mut all = true;
        for p in peers {
            if done(p)? {
                continue;
            }
            if let Err(e) = self.fabric.check_peer(p) {
                if !done(p)? {
                    return Err(self.abort_first(e));
                }
                continue;
            }
            all = false;
        }
        if !all {
            self.fabric.check_peers()?;
        }
        Ok(all)
    }

    /// The call index of `epoch` (0 for the first call after `epoch_base`).
    pub(crate) fn call_of(&self, epoch: u64) -> u64 {
        epoch.wrapping_sub(self.cfg.epoch_base + 1)
    }

    /// The attention indices taking part in call `epoch` (every attention rank without DP
    /// domains).
    pub(crate) fn call_sources(&self, epoch: u64) -> &[usize] {
        self.topo.call_sources(self.call_of(epoch))
    }

    /// The global ranks of the attention ranks that took part in the call whose buffers call
    /// `epoch` reuses (`epoch - max_in_flight`): the ones whose credits free them.
    pub(crate) fn previous_sources(&self, epoch: u64) -> &[usize] {
        let prev = epoch.saturating_sub(self.cfg.max_in_flight as u64);
        self.topo.call_source_ranks(self.call_of(prev))
    }

    /// The attention ranks, in rank order.
    pub(crate) fn attention(&self) -> &[usize] {
        self.topo.attention_ranks()
    }

    /// The expert ranks, in rank order.
    pub(crate) fn experts(&self) -> &[usize] {
        self.topo.expert_ranks()
    }

    /// Whether credits are implied by the calls themselves, so none is signalled or awaited:
    /// without relays and DP domains. An attention rank's A2E of epoch `e` goes out only once
    /// its E2A of `e - max_in_flight` was received from every expert rank (at most
    /// `max_in_flight` calls wait for their E2A, and its epochs follow each other), and an
    /// expert rank replies to `e - max_in_flight` only after it took that call's rows out of its
    /// window (or, for a view, read them for the last time): the A2E credit. An expert rank
    /// sends the E2A of `e` only after it received the A2E of `e` from every attention rank,
    /// which each sent after receiving the E2A of `e - max_in_flight`: the E2A credit. With
    /// relays the relay's own buffers need their credits, and with DP domains an attention
    /// rank's next call waits for the previous domain's (the turn record).
    pub(crate) fn implied_credits(&self) -> bool {
        self.topo.relay_plan().is_none() && self.topo.num_domains() == 1
    }

    /// Whether a message's record gets a progress signal of its own (no rows yet) before its
    /// rows are written: where a signal is a store (fabrics with load/store access), so a
    /// spinning receiver checks the record and reserves the rows while they are written (0.1-0.2
    /// us of a 1A:1E T=1 round trip, `docs/performance.md`). The signal is quiet: a sleeping
    /// receiver is woken once, by the rows. Over a network each signal is one more operation on
    /// the wire, and the record's checks are small beside the rows' flight.
    pub(crate) fn record_signals(&self) -> bool {
        self.fabric.capabilities().load_store
    }

    /// How many landing buffers an A2E record may name ([`crate::moe::record::Record::landing`]):
    /// `max_in_flight` where credits are implied (the attention rank picks them), else 1 (it
    /// names none: its field is 0 and the call's buffer is `epoch % max_in_flight`).
    pub(crate) fn landing_buffers(&self) -> usize {
        if self.implied_credits() {
            self.cfg.max_in_flight
        } else {
            1
        }
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
        let Some(need) =
            super::progress::reuse_credit(epoch, self.cfg.epoch_base, self.cfg.max_in_flight)
        else {
            return Ok(());
        };
        if self.implied_credits() {
            return Ok(());
        }
        self.wait_credited(need, peers, base, what, deadline)
    }

    /// Waits until every rank of `peers` has credited at least `need` into its slot of the
    /// credit group at `base` (slot `base + peer`).
    pub(crate) fn wait_credited(
        &self,
        need: u64,
        peers: &[usize],
        base: usize,
        what: &'static str,
        deadline: Instant,
    ) -> Result<()> {
        let mut next = CheckDue::default();
        let mut failure = None;
        self.wait(deadline, &mut || {
            let lagging = || {
                peers
                    .iter()
                    .copied()
                    .filter(|&p| self.slot_value(base + p) < need)
            };
            let first = lagging().next()?;
            let still = |p: usize| self.slot_value(base + p) < need;
            if let Err(e) = self.check_awaited_again(lagging(), &mut next, &still) {
                failure = Some(e);
                return None;
            }
            Some(Waiting::on(first, what))
        })?;
        failure.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait's liveness checks: none at its first miss (which only sets the first one a period
    /// later), none before that, one once it has passed; a check due from the start (the
    /// barrier's) runs at the first miss.
    #[test]
    fn the_first_liveness_check_of_a_wait_is_due_a_period_after_its_first_miss() {
        let period = AWAITED_CHECK_EVERY.as_nanos() as u64;
        let mut due = CheckDue::default();
        assert!(!due.due(), "the first miss only starts the period");
        assert!(!due.due(), "within the period");
        let set = due.0.expect("set at the first miss");
        assert!(set >= coarse_now_ns() + period / 2);
        due.0 = Some(coarse_now_ns());
        assert!(due.due(), "once the period has passed");
        assert!(!due.due(), "and then a period later again");
        assert!(CheckDue::now().due());
    }

    /// Every ask of one look of a wait gets one clock reading (the arrivals a look finds and
    /// the wait's accounting share it: the last look's reads are on every call's critical
    /// path), each look reads anew, and outside a wait (also after a look that panicked) every
    /// ask reads the clock.
    #[test]
    fn a_look_of_a_wait_reads_the_clock_once_and_the_next_look_anew() {
        use crate::fabric::local::LocalFabric;
        use crate::DType;
        let topo = Arc::new(Topology::contiguous(1, 1, 2).unwrap());
        let cfg = MoeConfig::new(8, DType::F32, 1, 1);
        let lens = WindowLayout::new(&topo, &cfg).window_lens();
        let slots = Slots::new(topo.world_size()).count();
        let fabric = LocalFabric::group(&lens, slots).unwrap().remove(0);
        let ctx = Context::new(Box::new(fabric), topo, cfg).unwrap();
        let pause = || std::thread::sleep(std::time::Duration::from_millis(2));
        let mut looks: Vec<(Instant, Instant)> = Vec::new();
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        ctx.wait(deadline, &mut || {
            let first = ctx.look_time();
            pause();
            looks.push((first, ctx.look_time()));
            (looks.len() < 2).then(|| Waiting::on(1, "the second look"))
        })
        .unwrap();
        assert_eq!(looks.len(), 2);
        for (first, again) in &looks {
            assert_eq!(first, again, "one reading per look");
        }
        assert!(
            looks[1].0 > looks[0].0,
            "the second look read the clock anew"
        );
        let outside = ctx.look_time();
        pause();
        assert!(
            ctx.look_time() > outside,
            "outside a wait every ask reads the clock"
        );
        assert!(
            outside > looks[1].0,
            "the last look's reading does not outlive the wait"
        );
        // Nor does the reading of a look whose poll panics.
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ctx.wait(deadline, &mut || {
                ctx.look_time();
                panic!("a poll that panics after reading the clock")
            })
        }));
        assert!(unwound.is_err());
        let after = ctx.look_time();
        pause();
        assert!(
            ctx.look_time() > after,
            "after a panic in a look every ask reads the clock again"
        );
    }

    /// A kernel without the coarse clock: the checks' clock falls back to CLOCK_MONOTONIC,
    /// which advances, instead of reading 0 forever (no check would ever be due).
    #[test]
    fn a_missing_clock_falls_back_to_the_next_one() {
        let missing: libc::clockid_t = -1000;
        assert_eq!(crate::fabric::clock_ns(missing), 0, "no such clock");
        let t = first_clock_ns(&[missing, libc::CLOCK_MONOTONIC]);
        assert!(t > 0);
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(first_clock_ns(&[missing, libc::CLOCK_MONOTONIC]) > t);
    }
}
