//! The conformance suite every [`Fabric`] must pass, written once.
//!
//! Each check is a function that every rank of a job calls at the same time with its own
//! endpoint; it returns `Err` with a description on any deviation from the contract. The local
//! fabric runs them with ranks as threads, the shm fabric with ranks as processes (see the
//! `xccl-tests` crate); a new fabric adds one instantiation and inherits the whole suite.

use std::time::{Duration, Instant};

use super::{deadline_after, Fabric, Waiting};
use crate::{Error, Result};

/// Window size the suite needs on every rank.
pub const MIN_WINDOW: usize = 1 << 16;
/// Signal slots the suite needs on every rank (at least `world_size + 2`).
pub fn min_slots(world: usize) -> usize {
    world + 2
}

const TIMEOUT: Duration = Duration::from_secs(20);
/// Slot used for ping-pong.
fn pingpong_slot(world: usize) -> usize {
    world
}

fn fail(what: String) -> Error {
    Error::Protocol {
        peer: usize::MAX,
        detail: format!("conformance: {what}"),
    }
}

fn pattern(src: usize, dst: usize, len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ (src as u8).wrapping_mul(7) ^ (dst as u8) ^ salt)
        .collect()
}

/// Every rank puts a distinct pattern into every peer's window, then signals; every rank waits
/// for all signals and finds every pattern intact (put-with-signal ordering).
pub fn put_then_signal_is_visible(f: &dyn Fabric, round: u64) -> Result<()> {
    put_then_signal(f, round, false)
}

/// [`put_then_signal_is_visible`] with [`Fabric::signal_quiet`]: a quiet signal orders the
/// puts before it as a signal does, and a waiter sees it (one that slept through it, within
/// its next look).
pub fn put_then_quiet_signal_is_visible(f: &dyn Fabric, round: u64) -> Result<()> {
    put_then_signal(f, round, true)
}

fn put_then_signal(f: &dyn Fabric, round: u64, quiet: bool) -> Result<()> {
    let (me, n) = (f.rank(), f.world_size());
    let chunk = (MIN_WINDOW / n.max(1)).min(4096);
    for peer in 0..n {
        f.put(peer, me * chunk, &pattern(me, peer, chunk, round as u8))?;
        if quiet {
            f.signal_quiet(peer, me, round)?;
        } else {
            f.signal(peer, me, round)?;
        }
    }
    f.flush()?;
    let deadline = deadline_after(TIMEOUT);
    f.wait_until(deadline, &mut || {
        (0..n)
            .find(|&src| f.signal_value(src) < round)
            .map(|peer| Waiting::on(peer, "conformance put+signal"))
    })?;
    let mut buf = vec![0u8; chunk];
    for src in 0..n {
        f.get(me, src * chunk, &mut buf)?;
        if buf != pattern(src, me, chunk, round as u8) {
            return Err(fail(format!(
                "rank {me}: bytes put by rank {src} differ after its signal (round {round})"
            )));
        }
    }
    f.barrier(TIMEOUT)
}

/// Every rank fills its own window, then reads every peer's window with `get`.
pub fn get_reads_peer_window(f: &dyn Fabric) -> Result<()> {
    let (me, n) = (f.rank(), f.world_size());
    let len = 8192;
    f.put(me, 0, &pattern(me, me, len, 0xA5))?;
    f.barrier(TIMEOUT)?;
    let mut buf = vec![0u8; len];
    for peer in 0..n {
        f.get(peer, 0, &mut buf)?;
        if buf != pattern(peer, peer, len, 0xA5) {
            return Err(fail(format!(
                "rank {me}: get from rank {peer} returned wrong bytes"
            )));
        }
    }
    f.barrier(TIMEOUT)
}

/// Ranks 0 and 1 bounce a counter `rounds` times; every value arrives, none is lost or stale.
/// Other ranks only join the barriers.
pub fn signal_ping_pong(f: &dyn Fabric, rounds: u64) -> Result<()> {
    let (me, n) = (f.rank(), f.world_size());
    let slot = pingpong_slot(n);
    let base = f.signal_value(slot);
    f.barrier(TIMEOUT)?;
    if n >= 2 && me < 2 {
        let peer = 1 - me;
        for i in 1..=rounds {
            let want = base + i;
            if me == 0 {
                f.signal(peer, slot, want)?;
            }
            let got = f.wait_signal(
                slot,
                peer,
                "conformance ping-pong",
                deadline_after(TIMEOUT),
                &|v| v >= want,
            )?;
            if got != want {
                return Err(fail(format!(
                    "rank {me}: ping-pong round {i} saw {got}, expected {want}"
                )));
            }
            if me == 1 {
                f.signal(peer, slot, want)?;
            }
        }
    }
    f.barrier(TIMEOUT)
}

/// A wait on a slot nobody signals fails with a timeout that names the awaited peer, close to
/// the deadline.
pub fn wait_times_out_naming_peer(f: &dyn Fabric) -> Result<()> {
    let (me, n) = (f.rank(), f.world_size());
    let peer = (me + 1) % n;
    let slot = n + 1;
    let start = Instant::now();
    let timeout = Duration::from_millis(150);
    match f.wait_signal(
        slot,
        peer,
        "a signal nobody sends",
        deadline_after(timeout),
        &|v| v == u64::MAX,
    ) {
        Err(Error::Timeout { peer: p, .. }) if p == peer => {}
        other => {
            return Err(fail(format!(
                "rank {me}: expected a timeout naming rank {peer}, got {other:?}"
            )))
        }
    }
    let took = start.elapsed();
    if took < timeout || took > timeout + Duration::from_secs(2) {
        return Err(fail(format!("rank {me}: a {timeout:?} wait took {took:?}")));
    }
    f.barrier(TIMEOUT)
}

/// Accesses outside a window and slots out of range are errors that change nothing.
pub fn bad_access_is_rejected(f: &dyn Fabric) -> Result<()> {
    let (me, n) = (f.rank(), f.world_size());
    let peer = (me + 1) % n;
    let len = f.window_len(peer);
    let before = f.window_len(me);
    match f.put(peer, len - 4, &[1u8; 8]) {
        Err(Error::OutOfWindow { peer: p, .. }) if p == peer => {}
        other => return Err(fail(format!("put past the end: {other:?}"))),
    }
    let mut buf = [0u8; 8];
    match f.get(peer, usize::MAX - 2, &mut buf) {
        Err(Error::OutOfWindow { .. }) => {}
        other => return Err(fail(format!("get at overflowing offset: {other:?}"))),
    }
    if f.signal(peer, f.num_signal_slots(), 1).is_ok() {
        return Err(fail("signal to a slot out of range succeeded".into()));
    }
    if f.put(n, 0, &[0u8; 1]).is_ok() {
        return Err(fail("put to a rank out of range succeeded".into()));
    }
    if before != f.window_len(me) {
        return Err(fail("window size changed".into()));
    }
    f.barrier(TIMEOUT)
}

/// Rank 0 aborts while every other rank waits. With 2 ranks its abort is a plain one whose text
/// reads like a death report ("rank 1 died: ..."): rank 1 fails with `Aborted` naming rank 0 and
/// carrying the text, never with a failure of its own. With 3 or more, the abort record reports
/// the death of the last rank ([`Fabric::abort_reporting`]): every waiter fails with
/// `PeerFailed` naming it, through rank 0's abort and with its reason. Leaves the fabric aborted:
/// run it last.
pub fn abort_wakes_every_waiter(f: &dyn Fabric) -> Result<()> {
    let (me, n) = (f.rank(), f.world_size());
    let dead = (n >= 3).then_some(n - 1);
    f.barrier(TIMEOUT)?;
    if me == 0 {
        std::thread::sleep(Duration::from_millis(50));
        match dead {
            Some(d) => f.abort_reporting(Some(d), "conformance: rank 0 gives up"),
            None => f.abort("rank 1 died: conformance: rank 0 gives up"),
        }
        return Ok(());
    }
    let start = Instant::now();
    let got = f.wait_signal(n + 1, 0, "an abort", deadline_after(TIMEOUT), &|v| {
        v == u64::MAX
    });
    let prompt = start.elapsed() < Duration::from_secs(5);
    let reason_of = |text: &str| text.contains("conformance: rank 0 gives up");
    match (got, dead) {
        (Err(Error::Aborted { by: 0, reason }), None)
            if prompt && reason.starts_with("rank 1 died: ") && reason_of(&reason) =>
        {
            Ok(())
        }
        (Err(Error::PeerFailed { peer, detail }), Some(d))
            if prompt && peer == d && reason_of(&detail) && detail.contains("rank 0's abort") =>
        {
            Ok(())
        }
        (other, _) => Err(fail(format!(
            "rank {me}: expected {} through rank 0's abort, got {other:?}",
            match dead {
                Some(d) => format!("PeerFailed naming rank {d}"),
                None => "Aborted by rank 0".into(),
            }
        ))),
    }
}

/// Runs every check above in order (abort last).
pub fn run_all(f: &dyn Fabric) -> Result<()> {
    for round in 1..=3 {
        put_then_signal_is_visible(f, round)?;
    }
    put_then_quiet_signal_is_visible(f, 4)?;
    get_reads_peer_window(f)?;
    signal_ping_pong(f, 2_000)?;
    wait_times_out_naming_peer(f)?;
    bad_access_is_rejected(f)?;
    abort_wakes_every_waiter(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::local::LocalFabric;

    fn on_local(n: usize, check: fn(&dyn Fabric) -> Result<()>) {
        let fabrics = LocalFabric::group(&vec![MIN_WINDOW; n], min_slots(n)).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = fabrics.iter().map(|f| s.spawn(move || check(f))).collect();
            for (rank, h) in handles.into_iter().enumerate() {
                h.join()
                    .expect("rank thread panicked")
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            }
        });
    }

    #[test]
    fn local_fabric_passes_conformance_with_2_ranks() {
        on_local(2, run_all);
    }

    #[test]
    fn local_fabric_passes_conformance_with_3_ranks() {
        on_local(3, run_all);
    }

    #[test]
    fn local_fabric_passes_conformance_with_more_ranks_than_cores() {
        on_local(6, run_all);
    }

    #[test]
    fn local_fabric_survives_100k_signal_rounds() {
        on_local(2, |f| signal_ping_pong(f, 100_000));
    }

    #[test]
    fn sleeping_waiters_miss_no_wakeup_in_100k_rounds() {
        // Waiters that sleep almost at once: every round crosses the futex path, and a lost
        // wake-up would cost a 20 ms sleep chunk (2,000 s for 100k rounds).
        let mut fabrics = LocalFabric::group(&[MIN_WINDOW; 2], min_slots(2)).unwrap();
        for f in &mut fabrics {
            f.set_wait_policy(crate::fabric::WaitPolicy {
                spin_iters: 1,
                yield_for: Duration::ZERO,
            });
        }
        let start = Instant::now();
        let budget = Duration::from_secs(30);
        std::thread::scope(|s| {
            let hs: Vec<_> = fabrics
                .iter()
                .map(|f| {
                    s.spawn(move || -> Result<()> {
                        for _ in 0..100 {
                            signal_ping_pong(f, 1_000)?;
                            if start.elapsed() > budget {
                                return Err(fail(format!("lost wake-ups: over {budget:?}")));
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap().unwrap();
            }
        });
    }

    #[test]
    fn local_wait_on_dropped_peer_fails_fast_naming_it() {
        let mut fabrics = LocalFabric::group(&[MIN_WINDOW; 2], 4).unwrap();
        let f1 = fabrics.pop().unwrap();
        let f0 = fabrics.pop().unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            drop(f1);
        });
        let start = Instant::now();
        let f: &dyn Fabric = &f0;
        let r = f.wait_signal(
            0,
            1,
            "a signal",
            deadline_after(Duration::from_secs(10)),
            &|v| v > 0,
        );
        t.join().unwrap();
        assert!(
            matches!(r, Err(Error::PeerFailed { peer: 1, .. })),
            "got {r:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(2));
    }
}
