//! A2E + E2A between real processes over shared memory, every result checked against the
//! single-process reference, bit for bit: 1A:1E, 2A:2E, 3A:1E, 1A:3E, INT8 on the wire, 10,000
//! back-to-back rounds with a random token count per round, and an expert rank SIGKILLed
//! mid-run.
//!
//! Every test re-runs this binary as its ranks (see `xccl_tests::Job`).

use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use xccl::testing::harness::{
    attention_round, attention_round_with, expert_round, expert_round_tokens_with,
    expert_round_view, Buffers, Workload,
};
use xccl::{
    Communicator, DType, Error, ExpertBatch, MoeConfig, Quant, Role, TokenBatch, Topology,
    TransferMode,
};
use xccl_tests::{child_main, ChildCtx, Job};

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
        ["moe_kill"] => killed_expert(ctx),
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
    };
    let mut batch = ExpertBatch::new();
    let mut tokens = TokenBatch::new();
    for round in 0..rounds {
        // Alternate modes per call and per rank (receivers follow each record's mode), and the
        // expert-major and token-major receive paths.
        let mode = if (round + ctx.rank as u64).is_multiple_of(3) {
            TransferMode::Pull
        } else {
            TransferMode::Push
        };
        comm.set_mode(mode);
        // Registered buffers (gather-mode A2E, pulled E2A) every fourth round.
        let buffers = if (round + ctx.rank as u64) % 4 == 3 {
            Buffers::Registered
        } else {
            Buffers::Copy
        };
        let verdict = match comm.role() {
            Role::Attention => attention_round_with::<bf16>(&mut comm, &wl, round, buffers),
            Role::Expert if round.is_multiple_of(2) => {
                expert_round::<bf16>(&mut comm, &wl, round, &mut batch, true)
            }
            Role::Expert if round % 4 == 1 => {
                expert_round_view::<bf16>(&mut comm, &wl, round, true)
            }
            Role::Expert => {
                expert_round_tokens_with::<bf16>(&mut comm, &wl, round, &mut tokens, true, buffers)
            }
        };
        verdict.map_err(|e| e.to_string())??;
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
        // SAFETY: kill(2) on this process's own pid; takes no pointers.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let start = std::time::Instant::now();
    let r = match comm.role() {
        Role::Attention => attention_round::<bf16>(&mut comm, &wl, 5),
        Role::Expert => expert_round::<bf16>(&mut comm, &wl, 5, &mut batch, true),
    };
    match (ctx.rank, r) {
        // The other expert rank's round does not involve rank 1: it completes.
        (2, Ok(Ok(()))) => Ok(()),
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
