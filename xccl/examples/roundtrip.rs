//! The round trip (A2E + E2A) of one attention and one expert rank, timed from Rust: the
//! baseline of the Python layer's benchmark (`python/bench/overhead.py`), which runs exactly
//! this loop through the `xccl` Python package in the same run.
//!
//! ```sh
//! cargo run --release --example roundtrip -- ITERS TOKENS...  # H=7168 bf16, top-8 of 64 experts
//! ```
//!
//! Without `RANK` set the binary is the launcher: it makes the unique id, starts rank 0
//! (attention) and rank 1 (expert, hosting all 64 experts) with `XCCL_ID`, `RANK` and
//! `WORLD_SIZE` in their environment, and waits for both. One communicator (room for 128
//! tokens per call) serves every token count T in turn: the attention rank sends T tokens to 8
//! distinct experts each (a fixed routing), the expert receives them expert-major (`a2e_recv`)
//! and replies with the rows it got (`e2a_send`, the identity expert), and the attention rank
//! receives the combined rows (`e2a_recv`). Each iteration is timed on the attention rank from
//! before `a2e_send` to after `e2a_recv` (CLOCK_MONOTONIC); after `warmup` unmeasured
//! iterations it prints `ROUNDTRIP_NS tokens=T p50=.. min=.. iters=N` (see [`iterations`]).

use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use half::bf16;
use xccl::bootstrap::{TcpBootstrap, UniqueId};
use xccl::{Communicator, DType, ExpertBatch, MoeConfig, Role, Topology};

/// Hidden size (DeepSeek-V3).
pub const HIDDEN: usize = 7168;
/// Experts per token.
pub const TOPK: usize = 8;
/// Routed experts, all on the one expert rank.
pub const EXPERTS: usize = 64;
/// Tokens per call the communicator has room for.
pub const MAX_TOKENS: usize = 128;

/// `(warmup, measured)` iterations at `tokens` tokens, from ITERS (the count at T=1): fewer
/// for larger calls, at least 50.
pub fn iterations(iters: usize, tokens: usize) -> (usize, usize) {
    let n = (iters * 8 / (tokens + 7)).max(50);
    (n.min(100), n)
}

fn main() -> ExitCode {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("arguments: TOKENS ITERS"))
        .collect();
    let [iters, ref tokens @ ..] = args[..] else {
        eprintln!("arguments: ITERS TOKENS...");
        return ExitCode::FAILURE;
    };
    if tokens.is_empty() || tokens.iter().any(|&t| t == 0 || t > MAX_TOKENS) {
        eprintln!("token counts must be 1..={MAX_TOKENS}");
        return ExitCode::FAILURE;
    }
    let result = match std::env::var("RANK") {
        Ok(rank) => rank_main(rank.parse().expect("RANK"), iters, tokens),
        Err(_) => launch(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("roundtrip: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Starts both ranks as processes of this binary and waits for them.
fn launch(args: &[usize]) -> Result<(), String> {
    let id = UniqueId::new().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let spawn = |rank: usize| {
        Command::new(&exe)
            .args(args.iter().map(|v| v.to_string()))
            .env("XCCL_ID", id.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .spawn()
            .map_err(|e| format!("starting rank {rank}: {e}"))
    };
    let (mut attention, mut expert) = (spawn(0)?, spawn(1)?);
    let failed: Vec<String> = [(0, attention.wait()), (1, expert.wait())]
        .into_iter()
        .filter_map(|(rank, status)| match status {
            Ok(s) if s.success() => None,
            Ok(s) => Some(format!("rank {rank}: {s}")),
            Err(e) => Some(format!("rank {rank}: {e}")),
        })
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

/// Token `t`'s experts: 8 distinct ones from a fixed pseudo-random start and stride.
pub fn routing(tokens: usize) -> Vec<i32> {
    let mut idx = Vec::with_capacity(tokens * TOPK);
    for t in 0..tokens {
        let start = (t * 37 + 11) % EXPERTS;
        idx.extend((0..TOPK).map(|j| ((start + j * 5) % EXPERTS) as i32));
    }
    idx
}

/// One rank of the job.
fn rank_main(rank: usize, iters: usize, counts: &[usize]) -> Result<(), String> {
    let e = |e: xccl::Error| format!("rank {rank}: {e}");
    let id: UniqueId = std::env::var("XCCL_ID")
        .map_err(|_| "XCCL_ID is not set".to_string())?
        .parse()
        .map_err(e)?;
    let boot = TcpBootstrap::connect(&id, rank, 2, Duration::from_secs(60)).map_err(e)?;
    let topo = Arc::new(Topology::contiguous(1, 1, EXPERTS).map_err(e)?);
    let cfg = MoeConfig::new(HIDDEN, DType::BF16, TOPK, MAX_TOKENS);
    let mut comm = Communicator::init_shm(Arc::new(boot), topo, cfg).map_err(e)?;
    let mut batch = ExpertBatch::new();
    for &tokens in counts {
        let (warmup, measured) = iterations(iters, tokens);
        match comm.role() {
            Role::Attention => {
                let x: Vec<bf16> = (0..tokens * HIDDEN)
                    .map(|i| bf16::from_f32((i % 251) as f32 / 251.0))
                    .collect();
                let idx = routing(tokens);
                let w = vec![1.0f32 / TOPK as f32; tokens * TOPK];
                let mut out = vec![bf16::ZERO; x.len()];
                let mut times = Vec::with_capacity(measured);
                for i in 0..warmup + measured {
                    let start = Instant::now();
                    let handle = comm.a2e_send(&x, &idx, &w).map_err(e)?;
                    comm.e2a_recv(&handle, &mut out).map_err(e)?;
                    if i >= warmup {
                        times.push(start.elapsed().as_nanos() as u64);
                    }
                }
                times.sort_unstable();
                println!(
                    "ROUNDTRIP_NS tokens={tokens} p50={} min={} iters={measured}",
                    times[times.len() / 2],
                    times[0]
                );
            }
            Role::Expert => {
                for _ in 0..warmup + measured {
                    comm.a2e_recv(&mut batch).map_err(e)?;
                    comm.e2a_send(&batch, batch.rows::<bf16>().map_err(e)?)
                        .map_err(e)?;
                }
            }
        }
    }
    Ok(())
}
