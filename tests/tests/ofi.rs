//! The libfabric (`ofi`) fabric between real processes over the real tcp provider: the fabric
//! conformance suite with 2, 3 and 4 ranks on loopback, many puts in flight before a signal,
//! A2E/E2A checked against the reference, a SIGKILLed rank reported by rank, and a multi-host
//! job across network namespaces joined by veth pairs.
//!
//! Every test re-runs this binary as its ranks (see `xccl_tests::Job`); `child_rank_entry` is the
//! ranks' entry point and does nothing in the parent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use half::bf16;
use xccl::bootstrap::Exchange;
use xccl::fabric::conformance::{self, min_slots, MIN_WINDOW};
use xccl::fabric::ofi::{OfiFabric, OfiOptions, SignalOrdering};
use xccl::fabric::{deadline_after, Fabric};
use xccl::testing::harness::{attention_round_with, expert_round, Buffers, Workload};
use xccl::testing::netns::Hosts;
use xccl::{Communicator, DType, Error, ExpertBatch, MoeConfig, Quant, Role, TokenBatch, Topology};
use xccl_tests::{announce, child_main, mixed_round, ChildCtx, Job};

const ENTRY: &str = "child_rank_entry";
const CONNECT: Duration = Duration::from_secs(30);
/// Environment variable telling a child rank which local address to open its endpoint on.
const ADDR_ENV: &str = "XCCL_OFI_ADDR";

#[test]
fn child_rank_entry() {
    child_main(dispatch);
}

fn dispatch(scenario: &str, ctx: &ChildCtx) -> Result<(), String> {
    let parts: Vec<&str> = scenario.split(':').collect();
    let r = match parts.as_slice() {
        ["conformance"] => conformance_rank(ctx),
        ["puts_in_flight", ordering] => puts_in_flight(ctx, ordering),
        ["killed"] => killed(ctx),
        ["departure"] => departure(ctx),
        ["micro", fabric] => micro(ctx, fabric),
        ["moe_kill"] => return killed_expert(ctx),
        ["moe", m, n, rounds] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            return checked_rounds(ctx, p(m)?, p(n)?, p(rounds)? as u64, Quant::None);
        }
        ["moe_int8", m, n, rounds] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            return checked_rounds(ctx, p(m)?, p(n)?, p(rounds)? as u64, Quant::Int8);
        }
        _ => return Err(format!("unknown scenario {scenario:?}")),
    };
    r.map_err(|e| e.to_string())
}

fn options() -> OfiOptions {
    OfiOptions {
        provider: Some("tcp;ofi_rxm".into()),
        addr: Some(std::env::var(ADDR_ENV).unwrap_or_else(|_| "127.0.0.1".into())),
        timeout: Duration::from_secs(30),
        ordering: None,
    }
}

fn join(ctx: &ChildCtx, window: usize, slots: usize) -> xccl::Result<OfiFabric> {
    let ex: Arc<dyn Exchange> = ctx.connect(CONNECT)?;
    OfiFabric::with_options(ex, window, slots, &options())
}

fn fail(detail: String) -> Error {
    Error::Protocol {
        peer: usize::MAX,
        detail,
    }
}

fn conformance_rank(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx, MIN_WINDOW, min_slots(ctx.size))?;
    let start = Instant::now();
    conformance::run_all(&f)?;
    announce(&format!("conformance in {:?}", start.elapsed()));
    Ok(())
}

/// Every rank streams many puts (small and large, overlapping in flight) into every peer,
/// then signals once; the receiver checks every byte right after the signal, 50 rounds.
fn puts_in_flight(ctx: &ChildCtx, ordering: &str) -> xccl::Result<()> {
    const WINDOW: usize = 4 << 20;
    let ex: Arc<dyn Exchange> = ctx.connect(CONNECT)?;
    let mut opts = options();
    opts.ordering = Some(match ordering {
        "completion" => SignalOrdering::Completion,
        _ => SignalOrdering::Ordered { max: 0 },
    });
    let f = OfiFabric::with_options(ex, WINDOW, min_slots(ctx.size), &opts)?;
    let got = f.signal_ordering();
    if (ordering == "completion") != (got == SignalOrdering::Completion) {
        return Err(fail(format!("asked for {ordering} signals, got {got:?}")));
    }
    let (me, n) = (ctx.rank, ctx.size);
    let region = WINDOW / n;
    let piece = |round: u64, src: usize, i: usize, len: usize| -> Vec<u8> {
        (0..len)
            .map(|b| (b as u64 ^ round.wrapping_mul(131) ^ (src * 17 + i * 3) as u64) as u8)
            .collect()
    };
    let sizes = [8usize, 100, 4096, 65536, 200_000];
    for round in 1..=50u64 {
        for peer in (0..n).filter(|&p| p != me) {
            let mut off = me * region;
            for (i, &len) in sizes.iter().cycle().take(40).enumerate() {
                if off + len > (me + 1) * region {
                    break;
                }
                f.put(peer, off, &piece(round, me, i, len))?;
                off += len;
            }
            f.signal(peer, me, round)?;
        }
        for src in (0..n).filter(|&p| p != me) {
            f.wait_signal(
                src,
                src,
                "puts then signal",
                deadline_after(CONNECT),
                &|v| v >= round,
            )?;
            let win = f.local_window().expect("ofi windows are host memory");
            let mut off = src * region;
            for (i, &len) in sizes.iter().cycle().take(40).enumerate() {
                if off + len > (src + 1) * region {
                    break;
                }
                let mut got = vec![0u8; len];
                win.read(off, &mut got)?;
                if got != piece(round, src, i, len) {
                    return Err(fail(format!(
                        "rank {me}: put {i} ({len} bytes) from rank {src} not visible after its \
                         signal in round {round}"
                    )));
                }
                off += len;
            }
        }
        f.barrier(CONNECT)?;
    }
    announce(&format!("50 rounds of puts in flight checked ({got:?})"));
    Ok(())
}

/// Rank 1 is SIGKILLed after init; rank 0 waits on a signal from it and must get
/// `PeerFailed` naming rank 1 within the liveness bound; rank 2 (if any) does the same.
fn killed(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx, MIN_WINDOW, min_slots(ctx.size))?;
    f.barrier(CONNECT)?;
    if ctx.rank == 1 {
        xccl_tests::sigkill_self();
    }
    let start = Instant::now();
    let r = f.wait_signal(
        0,
        1,
        "a signal from a dying peer",
        deadline_after(Duration::from_secs(30)),
        &|v| v > 0,
    );
    let took = start.elapsed();
    match r {
        Err(Error::PeerFailed { peer: 1, detail })
            if took < xccl::fabric::ofi::LIVENESS_TIMEOUT + Duration::from_secs(2) =>
        {
            announce(&format!("noticed in {took:?}: {detail}"));
            Ok(())
        }
        other => Err(fail(format!(
            "expected PeerFailed naming rank 1, got {other:?} after {took:?}"
        ))),
    }
}

/// Fabric-level figures between ranks 0 and 1: signal ping-pong round trip (p50 of 2,000) and
/// put bandwidth (64 puts of 1 MiB, then a signal, acknowledged), on `ofi` or `shm`.
fn micro(ctx: &ChildCtx, fabric: &str) -> xccl::Result<()> {
    const MIB: usize = 1 << 20;
    let ex: Arc<dyn Exchange> = ctx.connect(CONNECT)?;
    let f: Box<dyn Fabric> = match fabric {
        "shm" => Box::new(xccl::fabric::shm::ShmFabric::new(ex, 4 * MIB, 4)?),
        _ => Box::new(OfiFabric::with_options(ex, 4 * MIB, 4, &options())?),
    };
    let peer = 1 - ctx.rank;
    let mut rtts = Vec::with_capacity(2000);
    for i in 1..=2200u64 {
        let t = Instant::now();
        if ctx.rank == 0 {
            f.signal(peer, 0, i)?;
            f.wait_signal(0, peer, "pong", deadline_after(CONNECT), &|v| v >= i)?;
        } else {
            f.wait_signal(0, peer, "ping", deadline_after(CONNECT), &|v| v >= i)?;
            f.signal(peer, 0, i)?;
        }
        if i > 200 {
            rtts.push(t.elapsed());
        }
    }
    rtts.sort();
    f.barrier(CONNECT)?;
    let chunk = vec![0x5au8; MIB];
    let rounds = 8u64;
    let t = Instant::now();
    for r in 1..=rounds {
        if ctx.rank == 0 {
            for i in 0..64 {
                f.put(peer, (i % 4) * MIB, &chunk)?;
            }
            f.signal(peer, 1, r)?;
            f.wait_signal(1, peer, "ack", deadline_after(CONNECT), &|v| v >= r)?;
        } else {
            f.wait_signal(1, peer, "data", deadline_after(CONNECT), &|v| v >= r)?;
            f.signal(peer, 1, r)?;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    if ctx.rank == 0 {
        announce(&format!(
            "MICRO {fabric}: ping-pong round trip p50 {:.1} us p99 {:.1} us; put bandwidth {:.2} GB/s \
             (64 x 1 MiB puts + signal, {rounds} rounds)",
            rtts[rtts.len() / 2].as_secs_f64() * 1e6,
            rtts[rtts.len() * 99 / 100].as_secs_f64() * 1e6,
            (rounds * 64 * MIB as u64) as f64 / secs / 1e9
        ));
    }
    f.barrier(CONNECT)
}

/// 1 attention rank, 2 expert ranks; expert rank 1 is SIGKILLed after 5 good rounds. The
/// attention rank's next round must fail with `PeerFailed` naming rank 1 within the liveness
/// bound; expert rank 2 completes its round (or, if the liveness check sees rank 1 first, fails
/// naming rank 1 too).
fn killed_expert(ctx: &ChildCtx) -> Result<(), String> {
    let mut cfg = MoeConfig::new(16, DType::BF16, 2, 8);
    cfg.timeout = Duration::from_secs(30);
    let ex = ctx.connect(CONNECT).map_err(|e| e.to_string())?;
    let topo = Arc::new(Topology::contiguous(1, 2, 8).map_err(|e| e.to_string())?);
    let mut comm =
        Communicator::init_ofi_with(ex, topo, cfg, &options()).map_err(|e| e.to_string())?;
    let wl = Workload {
        seed: 9,
        tokens: 8,
        vary: false,
        skew: None,
        shared_experts: 0,
    };
    let mut batch = ExpertBatch::new();
    let round = |comm: &mut Communicator, batch: &mut ExpertBatch, r: u64| match comm.role() {
        Role::Attention => attention_round_with::<bf16>(comm, &wl, r, Buffers::Copy),
        Role::Expert => expert_round::<bf16>(comm, &wl, r, batch, true),
    };
    for r in 0..5 {
        round(&mut comm, &mut batch, r).map_err(|e| e.to_string())??;
    }
    if ctx.rank == 1 {
        // Dies holding round 5's rows: only round 5 can fail.
        return Err(xccl_tests::sigkill_holding_the_next_a2e(&mut comm));
    }
    let start = Instant::now();
    let r = round(&mut comm, &mut batch, 5);
    let bound = xccl::fabric::ofi::LIVENESS_TIMEOUT + Duration::from_secs(2);
    match (ctx.rank, r) {
        (2, Ok(Ok(()))) => Ok(()),
        (0 | 2, Err(Error::PeerFailed { peer: 1, detail })) if start.elapsed() < bound => {
            announce(&format!(
                "rank {}: noticed in {:?}: {detail}",
                ctx.rank,
                start.elapsed()
            ));
            Ok(())
        }
        (_, other) => Err(format!(
            "rank {}: expected PeerFailed naming rank 1 within {bound:?}, got {other:?} after {:?}",
            ctx.rank,
            start.elapsed()
        )),
    }
}

/// Checked rounds; with `quant` INT8, A2E and E2A both quantize (bit-exact reference too).
/// Rank 2 leaves cleanly right after init; rank 1 signals rank 0 only after the liveness bound
/// has passed, so rank 0's wait must tell "left" from "died" to succeed; a wait on rank 2 itself
/// then fails at once, naming it.
fn departure(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx, MIN_WINDOW, min_slots(ctx.size))?;
    f.barrier(CONNECT)?;
    match ctx.rank {
        2 => return Ok(()),
        1 => {
            std::thread::sleep(xccl::fabric::ofi::LIVENESS_TIMEOUT + Duration::from_secs(1));
            f.signal(0, 0, 7)?;
        }
        _ => {
            f.wait_signal(0, 1, "a late signal", deadline_after(CONNECT), &|v| v == 7)?;
            let start = Instant::now();
            match f.wait_signal(1, 2, "a rank that left", deadline_after(CONNECT), &|v| {
                v > 0
            }) {
                Err(Error::PeerFailed { peer: 2, detail })
                    if start.elapsed() < Duration::from_secs(1) =>
                {
                    announce(&format!("rank 2: {detail}"));
                }
                other => {
                    return Err(fail(format!(
                        "expected PeerFailed naming rank 2 at once, got {other:?}"
                    )))
                }
            }
        }
    }
    Ok(())
}

fn checked_rounds(
    ctx: &ChildCtx,
    m: usize,
    n: usize,
    rounds: u64,
    quant: Quant,
) -> Result<(), String> {
    let mut cfg = MoeConfig::new(32, DType::BF16, 4, 24);
    cfg.a2e_quant = quant;
    cfg.e2a_quant = quant;
    cfg.timeout = Duration::from_secs(30);
    let ex = ctx.connect(CONNECT).map_err(|e| e.to_string())?;
    let topo = Arc::new(Topology::contiguous(m, n, 4 * n.max(2)).map_err(|e| e.to_string())?);
    let mut comm = Communicator::init_ofi_with(ex.clone(), topo, cfg, &options())
        .map_err(|e| e.to_string())?;
    let wl = Workload {
        seed: 0x0f1 + (m * 10 + n) as u64,
        tokens: 24,
        vary: true,
        skew: None,
        shared_experts: 0,
    };
    let mut batch = ExpertBatch::new();
    let mut tokens = TokenBatch::new();
    let start = Instant::now();
    for round in 0..rounds {
        // As in moe_shm.rs: push and pull per call and per rank, the caller's or registered
        // buffers, and the expert-major, view and token-major receive paths.
        let verdict = mixed_round(&mut comm, &wl, round, true, &mut batch, &mut tokens);
        verdict.map_err(|e| e.to_string())??;
    }
    announce(&format!("{rounds} checked rounds in {:?}", start.elapsed()));
    // Peers may still read this rank's window (pull mode) until every rank is done: unlike
    // shared memory, registered memory goes away with the process.
    ex.barrier(CONNECT).map_err(|e| e.to_string())
}

// ---- parent side ----

fn run_ok(scenario: &str, size: usize, timeout: Duration) -> Duration {
    let start = Instant::now();
    let mut job = Job::spawn(ENTRY, scenario, size);
    job.expect_success(timeout);
    let took = start.elapsed();
    println!(
        "{scenario} with {size} processes: {took:?}; rank 0 said: {}",
        job.output(0).trim()
    );
    took
}

#[test]
fn ofi_conformance_with_2_processes() {
    run_ok("conformance", 2, Duration::from_secs(60));
}

#[test]
fn ofi_conformance_with_3_processes() {
    run_ok("conformance", 3, Duration::from_secs(60));
}

#[test]
fn ofi_conformance_with_4_processes() {
    run_ok("conformance", 4, Duration::from_secs(90));
}

#[test]
fn ofi_signal_is_ordered_after_many_puts_in_flight_by_provider_ordering() {
    run_ok("puts_in_flight:ordered", 3, Duration::from_secs(90));
}

#[test]
fn ofi_signal_is_ordered_after_many_puts_in_flight_by_completion() {
    run_ok("puts_in_flight:completion", 3, Duration::from_secs(90));
}

#[test]
fn ofi_one_attention_one_expert_matches_reference() {
    run_ok("moe:1:1:100", 2, Duration::from_secs(60));
}

#[test]
fn ofi_two_attention_two_expert_matches_reference() {
    run_ok("moe:2:2:60", 4, Duration::from_secs(90));
}

#[test]
fn ofi_int8_on_the_wire_matches_reference() {
    run_ok("moe_int8:2:2:40", 4, Duration::from_secs(90));
}

#[test]
fn ofi_killed_expert_is_reported_by_the_survivors() {
    use std::os::unix::process::ExitStatusExt;
    let mut job = Job::spawn(ENTRY, "moe_kill", 3);
    let st = job.wait(Duration::from_secs(60));
    assert_eq!(
        st[1].signal(),
        Some(libc::SIGKILL),
        "rank 1: {}",
        job.output(1)
    );
    for r in [0, 2] {
        assert!(st[r].success(), "rank {r} failed: {}", job.output(r));
    }
    println!("attention rank: {}", job.output(0).trim());
}

#[test]
fn ofi_rank_that_left_cleanly_is_not_taken_for_dead() {
    run_ok("departure", 3, Duration::from_secs(60));
}

#[test]
fn ofi_sigkilled_rank_is_reported_by_rank() {
    let mut job = Job::spawn(ENTRY, "killed", 3);
    job.wait(Duration::from_secs(30));
    job.assert_killed(1);
    job.assert_succeeded(0);
    job.assert_succeeded(2);
    println!(
        "survivors: {} / {}",
        job.output(0).trim(),
        job.output(2).trim()
    );
}

// ---- multi-host: ranks in separate network namespaces (xccl::testing::netns) ----

/// Runs `scenario` with `size` ranks, rank `r` in host `r % 2`, the root in host 0.
fn run_across_netns(ns: &Hosts, scenario: &str, size: usize, timeout: Duration) {
    let start = Instant::now();
    let mut job = Job::spawn_with(
        ENTRY,
        scenario,
        size,
        &|job_id| ns.start_root(job_id),
        &|rank, cmd| {
            ns.place(ns.host_of(rank), cmd)
                .expect("placing the rank in its host")
        },
    );
    job.expect_success(timeout);
    println!(
        "{scenario} with {size} processes across namespaces {} ({}) and {} ({}): {:?}",
        ns.name(0),
        ns.addr(0),
        ns.name(1),
        ns.addr(1),
        start.elapsed()
    );
    // Rank 0 logs the provider and the interface it opened: the namespace's veth, not lo.
    let log = job.output(0);
    let line = log.lines().find(|l| l.contains("xccl ofi: provider"));
    println!("  rank 0: {}", line.unwrap_or("(no provider line)"));
    assert!(
        line.is_some_and(|l| l.contains(&format!("domain {}", ns.interface(0)))),
        "rank 0 did not open its endpoint on the namespace's veth:\n{log}"
    );
}

#[test]
fn ofi_across_network_namespaces_conformance_and_moe() {
    let ns = match Hosts::create(2) {
        Ok(ns) => ns,
        Err(why) => {
            eprintln!(
                "\n!!!!!!!! ofi_across_network_namespaces_conformance_and_moe NOT RUN !!!!!!!!\n\
                 cannot create network namespaces here ({why}); the multi-host ofi test needs \
                 root (CAP_NET_ADMIN) and iproute2.\n\
                 !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n"
            );
            return;
        }
    };
    // The namespaces really are separate hosts as far as the network goes: no route between
    // them but the veth pair.
    run_across_netns(&ns, "conformance", 4, Duration::from_secs(90));
    run_across_netns(&ns, "moe:2:2:40", 4, Duration::from_secs(90));
    run_across_netns(&ns, "moe:1:3:40", 4, Duration::from_secs(90));
    run_across_netns(&ns, "moe_int8:2:2:20", 4, Duration::from_secs(90));
}

/// Prints fabric-level latency and bandwidth of ofi (tcp provider, loopback) beside shm on this
/// machine (no assertion on the figures: they depend on the load).
#[test]
fn ofi_vs_shm_fabric_figures() {
    for fabric in ["shm", "ofi"] {
        let mut job = Job::spawn(ENTRY, &format!("micro:{fabric}"), 2);
        job.expect_success(Duration::from_secs(120));
        let out = job.output(0);
        let line = out
            .lines()
            .find(|l| l.contains("MICRO"))
            .unwrap_or("(no figures)");
        println!("{}", line.trim_start_matches("test child_rank_entry ... "));
    }
}

/// Asking for a provider libfabric does not have is an error naming it: no fallback to another.
/// (A core provider name may resolve to itself under a utility provider that adds RMA, as
/// `tcp` does to `tcp;ofi_rxm`; the provider actually opened is logged.)
#[test]
fn ofi_missing_provider_is_an_error_naming_it() {
    for provider in ["no-such-provider", "verbs-that-is-not-here"] {
        let ex: Arc<dyn Exchange> = Arc::new(
            xccl::bootstrap::ThreadExchange::group(1)
                .pop()
                .expect("one rank"),
        );
        match OfiFabric::new(ex, MIN_WINDOW, 4, Some(provider)) {
            Err(Error::FabricUnavailable { fabric, detail }) => {
                assert_eq!(fabric, "ofi");
                assert!(detail.contains(provider), "{detail}");
                println!("{detail}");
            }
            other => panic!("{provider}: expected FabricUnavailable, got {other:?}"),
        }
    }
}

/// One rank alone: puts, gets and signals to itself are local copies; the window is host memory.
#[test]
fn ofi_single_rank_addresses_itself() {
    let ex: Arc<dyn Exchange> = Arc::new(
        xccl::bootstrap::ThreadExchange::group(1)
            .pop()
            .expect("one rank"),
    );
    let f = OfiFabric::with_options(ex, MIN_WINDOW, 4, &options()).expect("ofi on loopback");
    assert_eq!(f.provider(), "tcp;ofi_rxm");
    f.put(0, 100, b"hello").unwrap();
    let mut buf = [0u8; 5];
    f.get(0, 100, &mut buf).unwrap();
    assert_eq!(&buf, b"hello");
    f.signal(0, 3, 42).unwrap();
    assert_eq!(f.signal_value(3), 42);
    assert!(f.local_window().is_some());
    assert!(matches!(
        f.put(0, MIN_WINDOW - 2, b"abc"),
        Err(Error::OutOfWindow { peer: 0, .. })
    ));
}
