//! A2E + E2A between real processes over shared memory, every result checked against the
//! single-process reference, bit for bit: 1A:1E, 2A:2E, 3A:1E, 1A:3E, INT8 on the wire, 10,000
//! back-to-back rounds with a random token count per round, an expert rank SIGKILLed mid-run,
//! relays (2A:3E with 1 relay; 3A:2E with 2 relays and 3 DP domains) and the 1A:2E round trip
//! with and without a relay.
//!
//! Every test re-runs this binary as its ranks (see `xccl_tests::Job`).

use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use xccl::testing::harness::{
    attention_round, expert_round, expert_round_tokens_with, Buffers, Workload,
};
use xccl::{Communicator, DType, Error, ExpertBatch, MoeConfig, Quant, Role, TokenBatch, Topology};
use xccl_tests::{announce, child_main, mixed_round, ChildCtx, Job};

const ENTRY: &str = "child_rank_entry";

#[test]
fn child_rank_entry() {
    child_main(dispatch);
}

/// Scenario `moe:<M>:<N>:<rounds>` runs checked rounds; `moe_kill` kills expert rank 1.
fn dispatch(scenario: &str, ctx: &ChildCtx) -> Result<(), String> {
    let parts: Vec<&str> = scenario.split(':').collect();
    match parts.as_slice() {
        ["moe", m, n, rounds] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            checked_rounds(ctx, p(m)?, p(n)?, p(rounds)? as u64, Quant::None)
        }
        ["moe_int8", m, n, rounds] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            checked_rounds(ctx, p(m)?, p(n)?, p(rounds)? as u64, Quant::Int8)
        }
        ["moe_relay", m, n, r, d, rounds] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            relayed_rounds(ctx, (p(m)?, p(n)?), p(r)?, p(d)?, p(rounds)? as u64)
        }
        ["rtt", relays, rounds] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            round_trip(ctx, p(relays)?, p(rounds)?)
        }
        ["moe_kill"] => killed_expert(ctx),
        ["tags_roles", rounds] => {
            tagged_explicit_roles(ctx, rounds.parse().map_err(|e| format!("{e}"))?)
        }
        _ => Err(format!("unknown scenario {scenario:?}")),
    }
}

fn join(ctx: &ChildCtx, m: usize, n: usize, cfg: MoeConfig) -> Result<Communicator, String> {
    let ex = ctx
        .connect(Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    let topo = Arc::new(Topology::contiguous(m, n, 4 * n.max(2)).map_err(|e| e.to_string())?);
    Communicator::init_shm(ex, topo, cfg).map_err(|e| e.to_string())
}

/// Checked rounds; with `quant` INT8, A2E and E2A both quantize (bit-exact reference too).
fn checked_rounds(
    ctx: &ChildCtx,
    m: usize,
    n: usize,
    rounds: u64,
    quant: Quant,
) -> Result<(), String> {
    let mut cfg = MoeConfig::new(32, DType::BF16, 4, 24);
    cfg.timeout = Duration::from_secs(30);
    cfg.a2e_quant = quant;
    cfg.e2a_quant = quant;
    let mut comm = join(ctx, m, n, cfg)?;
    let wl = Workload {
        seed: 0x5eed + (m * 10 + n) as u64,
        tokens: 24,
        vary: true,
        skew: None,
        shared_experts: 0,
    };
    let mut batch = ExpertBatch::new();
    let mut tokens = TokenBatch::new();
    for round in 0..rounds {
        // Modes per call and per rank (receivers follow each record), registered buffers every
        // fourth round, and every receive path.
        let verdict = mixed_round(&mut comm, &wl, round, true, &mut batch, &mut tokens);
        verdict.map_err(|e| e.to_string())??;
    }
    Ok(())
}

/// Checked rounds through `r` relays (none when 0) and `d` DP domains (attention ranks take part in their
/// domain's turns only): push, caller buffers, expert-major and token-major receives
/// alternating.
fn relayed_rounds(
    ctx: &ChildCtx,
    (m, n): (usize, usize),
    r: usize,
    d: usize,
    rounds: u64,
) -> Result<(), String> {
    let mut cfg = MoeConfig::new(32, DType::BF16, 4, 24);
    cfg.timeout = Duration::from_secs(30);
    if d > 1 {
        cfg.max_in_flight = 1;
    }
    let ex = ctx
        .connect(Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    let topo = Topology::contiguous(m, n, 4 * n.max(2))
        .and_then(|t| if r > 0 { t.with_relays(Some(r)) } else { Ok(t) })
        .and_then(|t| t.with_domains(d))
        .map_err(|e| e.to_string())?;
    let mut comm = Communicator::init_shm(ex, Arc::new(topo), cfg).map_err(|e| e.to_string())?;
    let wl = Workload {
        seed: 0x7e1a + (m * 10 + n) as u64,
        tokens: 24,
        vary: true,
        skew: None,
        shared_experts: 0,
    };
    let mut batch = ExpertBatch::new();
    let mut tokens = TokenBatch::new();
    for round in 0..rounds {
        // Every third round sends INT8 E2A replies (the relay requantizes its sums), the
        // next INT8 both ways; all ranks switch together.
        let (a2e, e2a) = match round % 3 {
            0 => (Quant::None, Quant::None),
            1 => (Quant::None, Quant::Int8),
            _ => (Quant::Int8, Quant::Int8),
        };
        comm.set_a2e_quant(a2e);
        comm.set_e2a_quant(e2a);
        let verdict = match comm.role() {
            Role::Attention if !comm.topology().in_call(ctx.rank, round) => continue,
            Role::Attention => attention_round::<bf16>(&mut comm, &wl, round),
            Role::Expert if round.is_multiple_of(2) => {
                expert_round::<bf16>(&mut comm, &wl, round, &mut batch, true)
            }
            Role::Expert => expert_round_tokens_with::<bf16>(
                &mut comm,
                &wl,
                round,
                &mut tokens,
                true,
                Buffers::Copy,
            ),
        };
        verdict.map_err(|e| e.to_string())??;
    }
    let records = comm.total_stats().records_written;
    xccl_tests::announce(&format!("rank {} wrote {records} records", ctx.rank));
    Ok(())
}

/// 1A:2E round trips (A2E + expert-major receive + E2A) of 128 tokens, H = 7168 bf16, K = 2,
/// unchecked after a checked warm-up; with `relays` = 1 expert rank 1 relays. The attention
/// rank prints the median round trip.
fn round_trip(ctx: &ChildCtx, relays: usize, rounds: usize) -> Result<(), String> {
    let mut cfg = MoeConfig::new(7168, DType::BF16, 2, 128);
    cfg.timeout = Duration::from_secs(60);
    let ex = ctx
        .connect(Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    let mut topo = Topology::contiguous(1, 2, 8).map_err(|e| e.to_string())?;
    if relays > 0 {
        topo = topo.with_relays(Some(relays)).map_err(|e| e.to_string())?;
    }
    let mut comm = Communicator::init_shm(ex, Arc::new(topo), cfg).map_err(|e| e.to_string())?;
    let wl = Workload {
        seed: 3,
        tokens: 128,
        vary: false,
        skew: None,
        shared_experts: 0,
    };
    let mut batch = ExpertBatch::new();
    let mut times = Vec::with_capacity(rounds);
    for round in 0..rounds as u64 {
        let check = round < 3;
        let start = std::time::Instant::now();
        let verdict = match comm.role() {
            Role::Attention if check => attention_round::<bf16>(&mut comm, &wl, round),
            Role::Attention => {
                let topo = comm.topology().clone();
                let input = wl.input(&topo, 2, 0, 0);
                let x: Vec<bf16> = wl.hidden_states(0, 0, input.num_tokens, 7168);
                let h = comm
                    .a2e_send(&x, &input.topk_idx, &input.topk_weights)
                    .map_err(|e| e.to_string())?;
                let mut out = vec![bf16::ZERO; x.len()];
                comm.e2a_recv(&h, &mut out).map_err(|e| e.to_string())?;
                Ok(Ok(()))
            }
            Role::Expert => expert_round::<bf16>(
                &mut comm,
                &wl,
                if check { round } else { 0 },
                &mut batch,
                check,
            ),
        };
        verdict.map_err(|e| e.to_string())??;
        times.push(start.elapsed());
    }
    if comm.role() == Role::Attention {
        times.sort_unstable();
        let median = times[times.len() / 2];
        let stats = comm.total_stats();
        xccl_tests::announce(&format!(
            "rtt relays={relays}: median {:.1} us over {rounds} round trips; records written {}",
            median.as_secs_f64() * 1e6,
            stats.records_written
        ));
    }
    Ok(())
}

fn killed_expert(ctx: &ChildCtx) -> Result<(), String> {
    let mut cfg = MoeConfig::new(16, DType::BF16, 2, 8);
    cfg.timeout = Duration::from_secs(30);
    let mut comm = join(ctx, 1, 2, cfg)?;
    let wl = Workload {
        seed: 9,
        tokens: 8,
        vary: false,
        skew: None,
        shared_experts: 0,
    };
    let mut batch = ExpertBatch::new();
    for round in 0..5 {
        match comm.role() {
            Role::Attention => attention_round::<bf16>(&mut comm, &wl, round),
            Role::Expert => expert_round::<bf16>(&mut comm, &wl, round, &mut batch, true),
        }
        .map_err(|e| e.to_string())??;
    }
    if ctx.rank == 1 {
        // Dies holding round 5's rows: only round 5 can fail.
        return Err(xccl_tests::sigkill_holding_the_next_a2e(&mut comm));
    }
    let start = std::time::Instant::now();
    let r = match comm.role() {
        Role::Attention => attention_round::<bf16>(&mut comm, &wl, 5),
        Role::Expert => expert_round::<bf16>(&mut comm, &wl, 5, &mut batch, true),
    };
    match (ctx.rank, r) {
        // The other expert rank's round does not wait for rank 1, but its liveness checks
        // may notice the death first (then rank 0 learns it through rank 2's abort).
        (2, Ok(Ok(()))) | (2, Err(Error::PeerFailed { peer: 1, .. })) => Ok(()),
        (0, Err(Error::PeerFailed { peer: 1, .. })) if start.elapsed() < Duration::from_secs(5) => {
            Ok(())
        }
        (_, other) => Err(format!(
            "rank {}: expected PeerFailed naming rank 1 within 5 s, got {other:?} after {:?}",
            ctx.rank,
            start.elapsed()
        )),
    }
}

/// The tag attention rank `rank` puts on round `round` (the last round: [`u64::MAX`], stop).
fn tag_of(round: u64, rounds: u64, rank: usize) -> u64 {
    if round + 1 == rounds {
        u64::MAX
    } else {
        (round + 1) << 32 | rank as u64
    }
}

/// Explicit roles gathered at init (odd ranks attention, even ranks experts: not "attention
/// first"), then tagged rounds: attention ranks poll `e2a_ready` before each E2A, expert ranks
/// poll `a2e_ready` before each receive, check every source's tag, and end their loop on the
/// stop tag. Experts echo their rows (topk 1, weight 1), so the E2A brings `x` back bit for bit.
fn tagged_explicit_roles(ctx: &ChildCtx, rounds: u64) -> Result<(), String> {
    let ex = ctx
        .connect(Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    let mine = if ctx.rank % 2 == 1 {
        Role::Attention
    } else {
        Role::Expert
    };
    let roles = xccl::bootstrap::gather_roles(&*ex, mine, Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    let topo = xccl::TopologyBuilder::new(roles, 4)
        .build()
        .map_err(|e| e.to_string())?;
    let (hidden, tokens) = (8, 5);
    let cfg = MoeConfig::new(hidden, DType::F32, 1, tokens);
    let base = cfg.epoch_base;
    let mut c = Communicator::init_shm(ex, Arc::new(topo), cfg).map_err(|e| e.to_string())?;
    let attention: Vec<usize> = c.topology().attention_ranks().to_vec();
    if c.role() != mine {
        return Err(format!(
            "rank {} has role {:?}, stated {mine:?}",
            ctx.rank,
            c.role()
        ));
    }
    let poll = |what: &str, ready: &mut dyn FnMut() -> xccl::Result<bool>| {
        let start = std::time::Instant::now();
        while !ready().map_err(|e| e.to_string())? {
            if start.elapsed() > Duration::from_secs(30) {
                return Err(format!("{what} never ready"));
            }
            std::thread::yield_now();
        }
        Ok::<(), String>(())
    };
    if mine == Role::Attention {
        for round in 0..rounds {
            let x: Vec<f32> = (0..tokens * hidden)
                .map(|i| (i as u64 * 7 + round * 131 + ctx.rank as u64) as f32)
                .collect();
            let idx: Vec<i32> = (0..tokens as i32).map(|t| (t + round as i32) % 4).collect();
            c.set_next_a2e_tag(tag_of(round, rounds, ctx.rank));
            let h = c
                .a2e_send(&x, &idx, &vec![1.0; tokens])
                .map_err(|e| e.to_string())?;
            poll("E2A", &mut || c.e2a_ready(&h))?;
            let mut out = vec![0f32; x.len()];
            c.e2a_recv(&h, &mut out).map_err(|e| e.to_string())?;
            if out.iter().zip(&x).any(|(a, b)| a.to_bits() != b.to_bits()) {
                return Err(format!("round {round}: the E2A is not the echo of the A2E"));
            }
        }
        return Ok(());
    }
    let mut batch = ExpertBatch::new();
    let mut seen = 0;
    loop {
        poll("A2E", &mut || c.a2e_ready())?;
        c.a2e_recv(&mut batch).map_err(|e| e.to_string())?;
        let round = batch.epoch() - base - 1;
        seen += 1;
        for s in batch.sources() {
            if s.tag() != tag_of(round, rounds, s.rank()) {
                return Err(format!(
                    "round {round}: source {} tag {:#x}",
                    s.rank(),
                    s.tag()
                ));
            }
        }
        if batch.tag() != tag_of(round, rounds, attention[0]) {
            return Err(format!("round {round}: call tag {:#x}", batch.tag()));
        }
        let rows = batch.rows::<f32>().map_err(|e| e.to_string())?.to_vec();
        c.e2a_send(&batch, &rows).map_err(|e| e.to_string())?;
        if batch.tag() == u64::MAX {
            break;
        }
    }
    if seen != rounds {
        return Err(format!(
            "the loop ended after {seen} calls, {rounds} were sent"
        ));
    }
    announce("tagged loop ended by the stop tag");
    Ok(())
}

fn run(m: usize, n: usize, rounds: usize, timeout_s: u64) {
    Job::spawn(ENTRY, &format!("moe:{m}:{n}:{rounds}"), m + n)
        .expect_success(Duration::from_secs(timeout_s));
}

#[test]
fn one_attention_one_expert_over_shm_matches_reference() {
    run(1, 1, 200, 60);
}

#[test]
fn two_attention_two_expert_over_shm_matches_reference() {
    run(2, 2, 200, 60);
}

#[test]
fn three_attention_one_expert_over_shm_matches_reference() {
    run(3, 1, 100, 60);
}

#[test]
fn one_attention_three_expert_over_shm_matches_reference() {
    run(1, 3, 100, 60);
}

#[test]
fn int8_on_the_wire_over_shm_matches_the_quantizing_reference() {
    Job::spawn(ENTRY, "moe_int8:2:2:200", 4).expect_success(Duration::from_secs(60));
}

#[test]
fn ten_thousand_back_to_back_rounds_with_random_token_counts() {
    run(2, 2, 10_000, 300);
}

#[test]
fn explicit_roles_gathered_at_init_tags_end_the_expert_loop_and_ready_tests_poll_over_shm() {
    let mut job = Job::spawn(ENTRY, "tags_roles:20", 4);
    job.expect_success(Duration::from_secs(60));
    assert!(job.output(0).contains("tagged loop ended by the stop tag"));
}

#[test]
fn killed_expert_is_reported_by_the_survivors() {
    let mut job = Job::spawn(ENTRY, "moe_kill", 3);
    let st = job.wait(Duration::from_secs(60));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        st[1].signal(),
        Some(libc::SIGKILL),
        "rank 1: {}",
        job.output(1)
    );
    for r in [0, 2] {
        assert!(st[r].success(), "rank {r} failed: {}", job.output(r));
    }
}

#[test]
fn relayed_two_attention_three_expert_over_shm_matches_reference() {
    Job::spawn(ENTRY, "moe_relay:2:3:1:1:60", 5).expect_success(Duration::from_secs(60));
}

#[test]
fn relayed_three_attention_two_expert_two_relays_three_domains_over_shm_matches_reference() {
    Job::spawn(ENTRY, "moe_relay:3:2:2:3:60", 5).expect_success(Duration::from_secs(60));
}

#[test]
fn dp_domains_over_shm_match_reference() {
    Job::spawn(ENTRY, "moe_relay:3:2:0:3:30", 5).expect_success(Duration::from_secs(60));
}

/// The relay's cost: 1A:2E round trips with and without a relay (run with `--nocapture` to see
/// the medians).
#[test]
fn round_trip_with_and_without_a_relay_over_shm() {
    for relays in [0, 1] {
        let mut job = Job::spawn(ENTRY, &format!("rtt:{relays}:300"), 3);
        job.expect_success(Duration::from_secs(120));
        let out = job.output(0);
        let line = out
            .lines()
            .find(|l| l.contains("rtt relays="))
            .unwrap_or("no rtt line");
        eprintln!("{line}");
    }
}
