//! The shm fabric between real processes: conformance with 2, 3 and 4 ranks, 100,000 signal
//! rounds, SIGKILLed peers, and nothing of the job left in `/dev/shm`.
//!
//! Every test re-runs this binary as its ranks (see `xccl_tests::Job`); `child_rank_entry` is the
//! ranks' entry point and does nothing in the parent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use xccl::bootstrap::Exchange;
use xccl::fabric::conformance::{self, min_slots, MIN_WINDOW};
use xccl::fabric::shm::{segment_prefix, ShmFabric};
use xccl::fabric::{deadline_after, Fabric};
use xccl::Error;
use xccl_tests::{announce, child_main, shm_entries, sigkill_self, ChildCtx, Job};

const ENTRY: &str = "child_rank_entry";
const CONNECT: Duration = Duration::from_secs(30);
/// Deadline of the survivor's wait in the SIGKILL tests...
const LONG_DEADLINE: Duration = Duration::from_secs(30);
/// ...and how much sooner it must notice the dead peer.
const NOTICE_WITHIN: Duration = Duration::from_secs(3);
/// Slot used by the scenarios below (not the conformance suite).
const SLOT: usize = 0;

#[test]
fn child_rank_entry() {
    child_main(dispatch);
}

fn dispatch(scenario: &str, ctx: &ChildCtx) -> Result<(), String> {
    let r = match scenario {
        "conformance" => conformance_rank(ctx),
        "pingpong_100k" => join(ctx).and_then(|f| {
            let start = Instant::now();
            conformance::signal_ping_pong(&f, 100_000)?;
            announce(&format!("100000 rounds in {:?}", start.elapsed()));
            Ok(())
        }),
        "pingpong_until_killed" => pingpong_until_killed(ctx),
        "killed_between_put_and_signal" => killed_between_put_and_signal(ctx),
        "killed_after_init" => killed_after_init(ctx),
        "third_rank_leaves" => third_rank_goes(ctx, false),
        "third_rank_dies" => third_rank_goes(ctx, true),
        "fail_on_rank_1" => {
            return if ctx.rank == 1 {
                Err("failing on purpose".into())
            } else {
                Ok(())
            }
        }
        "hang" => {
            std::thread::sleep(Duration::from_secs(120));
            Ok(())
        }
        other => return Err(format!("unknown scenario {other:?}")),
    };
    r.map_err(|e| e.to_string())
}

fn join(ctx: &ChildCtx) -> xccl::Result<ShmFabric> {
    let ex: Arc<dyn Exchange> = ctx.connect(CONNECT)?;
    ShmFabric::new(ex, MIN_WINDOW, min_slots(ctx.size))
}

fn check(cond: bool, what: impl FnOnce() -> String) -> xccl::Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::Protocol {
            peer: usize::MAX,
            detail: what(),
        })
    }
}

fn conformance_rank(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx)?;
    // Once `new` returned on every rank, no segment name of the job is left.
    f.barrier(CONNECT)?;
    let left = shm_entries(&segment_prefix(f.job_id()));
    check(left.is_empty(), || {
        format!("segments left after init: {left:?}")
    })?;
    conformance::run_all(&f)
}

/// Survivor side of the SIGKILL tests: waits on `SLOT` for a value from rank 1 that will never
/// come, and expects `PeerFailed` naming rank 1 long before the deadline.
fn expect_peer_failure(f: &ShmFabric, want: u64) -> xccl::Result<()> {
    let start = Instant::now();
    let r = f.wait_signal(
        SLOT,
        1,
        "a signal from a dying peer",
        deadline_after(LONG_DEADLINE),
        &|v| v >= want,
    );
    let took = start.elapsed();
    match r {
        Err(Error::PeerFailed { peer: 1, detail }) if took < NOTICE_WITHIN => {
            announce(&format!("noticed in {took:?}: {detail}"));
            Ok(())
        }
        other => Err(Error::Protocol {
            peer: 1,
            detail: format!("expected PeerFailed naming rank 1 within {NOTICE_WITHIN:?}, got {other:?} after {took:?}"),
        }),
    }
}

fn pingpong_until_killed(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx)?;
    f.barrier(CONNECT)?;
    let peer = 1 - ctx.rank;
    for i in 1u64.. {
        if ctx.rank == 0 {
            f.signal(peer, SLOT, i)?;
            match f.wait_signal(SLOT, peer, "pong", deadline_after(LONG_DEADLINE), &|v| {
                v >= i
            }) {
                Ok(got) => check(got == i, || format!("round {i}: pong {got}"))?,
                // The peer was killed while this rank waited for its pong.
                Err(_) => return expect_peer_failure(&f, i),
            }
        } else {
            f.wait_signal(SLOT, peer, "ping", deadline_after(LONG_DEADLINE), &|v| {
                v >= i
            })?;
            f.signal(peer, SLOT, i)?;
            if i == 1000 {
                announce("RUNNING");
            }
        }
    }
    unreachable!()
}

fn killed_between_put_and_signal(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx)?;
    f.barrier(CONNECT)?;
    if ctx.rank == 1 {
        f.put(0, 0, &[0xAB; 4096])?;
        sigkill_self();
    }
    expect_peer_failure(&f, 1)
}

fn killed_after_init(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx)?;
    if ctx.rank == 1 {
        sigkill_self();
    }
    expect_peer_failure(&f, 1)
}

/// Rank 2 leaves the job (its fabric dropped, the process exits) or is SIGKILLed while rank 0
/// waits for rank 1, which signals later: a clean exit must not fail the wait; a death must,
/// naming rank 2, even though rank 0 waits for rank 1.
fn third_rank_goes(ctx: &ChildCtx, dies: bool) -> xccl::Result<()> {
    let f = join(ctx)?;
    f.barrier(CONNECT)?;
    match ctx.rank {
        2 if dies => sigkill_self(),
        2 => {
            drop(f);
            Ok(())
        }
        1 => {
            // Long enough, when rank 2 dies, for rank 0 to notice first even on a loaded host.
            std::thread::sleep(Duration::from_millis(if dies { 3000 } else { 300 }));
            let _ = f.signal(0, SLOT, 1);
            // Stay until rank 0 has seen it (or given up), so rank 1 is never the one missing.
            std::thread::sleep(Duration::from_millis(500));
            Ok(())
        }
        _ => {
            let r = f.wait_signal(
                SLOT,
                1,
                "rank 1's signal",
                deadline_after(LONG_DEADLINE),
                &|v| v >= 1,
            );
            match (dies, r) {
                (false, Ok(_)) => Ok(()),
                (true, Err(Error::PeerFailed { peer: 2, .. })) => Ok(()),
                (_, other) => Err(Error::invalid(format!(
                    "rank 2 {}: expected {}, got {other:?}",
                    if dies { "died" } else { "left" },
                    if dies {
                        "PeerFailed naming rank 2"
                    } else {
                        "the signal"
                    }
                ))),
            }
        }
    }
}

// ---- parent side ----

fn run_ok(scenario: &str, size: usize, timeout: Duration) {
    let start = Instant::now();
    let mut job = Job::spawn(ENTRY, scenario, size);
    let prefix = segment_prefix(job.job_id());
    job.expect_success(timeout);
    println!(
        "{scenario} with {size} processes: {:?}; rank 0 said: {}",
        start.elapsed(),
        job.output(0).trim()
    );
    assert_eq!(
        shm_entries(&prefix),
        Vec::<String>::new(),
        "segments left in /dev/shm"
    );
}

#[test]
fn shm_conformance_with_2_processes() {
    run_ok("conformance", 2, Duration::from_secs(60));
}

#[test]
fn shm_conformance_with_3_processes() {
    run_ok("conformance", 3, Duration::from_secs(60));
}

#[test]
fn shm_conformance_with_4_processes_on_2_cores() {
    let start = Instant::now();
    run_ok("conformance", 4, Duration::from_secs(60));
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn shm_100k_signal_rounds_between_2_processes() {
    run_ok("pingpong_100k", 2, Duration::from_secs(120));
}

/// Kills rank 1 with SIGKILL from outside while the two ranks ping-pong.
#[test]
fn sigkill_during_ping_pong_is_reported_naming_the_peer() {
    let mut job = Job::spawn(ENTRY, "pingpong_until_killed", 2);
    let prefix = segment_prefix(job.job_id());
    job.wait_for_line(1, "RUNNING", Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(20));
    job.kill(1);
    job.wait(Duration::from_secs(10));
    job.assert_killed(1);
    job.assert_succeeded(0);
    println!("survivor: {}", job.output(0).trim());
    assert!(job.output(0).contains("noticed in"), "{}", job.output(0));
    assert_eq!(shm_entries(&prefix), Vec::<String>::new());
}

#[test]
fn sigkill_between_put_and_signal_is_reported_naming_the_peer() {
    let mut job = Job::spawn(ENTRY, "killed_between_put_and_signal", 2);
    job.wait(Duration::from_secs(30));
    job.assert_killed(1);
    job.assert_succeeded(0);
    println!("survivor: {}", job.output(0).trim());
}

#[test]
fn dev_shm_is_clean_after_a_rank_is_sigkilled_right_after_init() {
    let mut job = Job::spawn(ENTRY, "killed_after_init", 2);
    let prefix = segment_prefix(job.job_id());
    job.wait(Duration::from_secs(30));
    job.assert_killed(1);
    job.assert_succeeded(0);
    println!("survivor: {}", job.output(0).trim());
    assert_eq!(
        shm_entries(&prefix),
        Vec::<String>::new(),
        "segments left in /dev/shm"
    );
}

/// The harness itself: a rank that fails is reported with its exit status.
#[test]
fn harness_reports_a_failing_rank() {
    let mut job = Job::spawn(ENTRY, "fail_on_rank_1", 2);
    let st = job.wait(Duration::from_secs(30));
    assert!(st[0].success());
    assert_eq!(st[1].code(), Some(xccl_tests::EXIT_FAILED));
    assert!(job.output(1).contains("failing on purpose"));
}

/// The harness itself: a rank that overruns its timeout is killed and the test fails.
#[test]
#[should_panic(expected = "still running")]
fn harness_kills_ranks_that_overrun_their_timeout() {
    let mut job = Job::spawn(ENTRY, "hang", 2);
    job.wait(Duration::from_millis(500));
}

#[test]
fn a_rank_that_left_cleanly_does_not_fail_waits_on_other_peers() {
    run_ok("third_rank_leaves", 3, Duration::from_secs(30));
}

#[test]
fn a_rank_that_died_fails_waits_on_other_peers_naming_it() {
    let mut job = Job::spawn(ENTRY, "third_rank_dies", 3);
    let st = job.wait(Duration::from_secs(30));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        st[2].signal(),
        Some(libc::SIGKILL),
        "rank 2: {}",
        job.output(2)
    );
    assert!(st[0].success(), "rank 0: {}", job.output(0));
}
