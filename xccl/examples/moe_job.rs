//! A complete multi-process xccl job on one host: a launcher and its ranks, in one binary.
//!
//! ```sh
//! cargo run --release --example moe_job            # 2 attention + 2 expert ranks, 20 rounds
//! cargo run --release --example moe_job -- 3 1 50  # 3 attention + 1 expert rank, 50 rounds
//! ```
//!
//! Run without `RANK` in its environment, the binary is the launcher: it makes the job's
//! unique id (which starts the rendezvous root in this process: the launcher must outlive the
//! ranks' init, not their whole run), and starts one process per rank with `XCCL_UNIQUE_ID`,
//! `RANK` and `WORLD_SIZE` set (the id carries the job's key: it goes through the environment,
//! never on a command line, which every user of the host can read), then waits for all of them and fails if any failed. Run with `RANK`, it
//! is a rank: it joins the bootstrap, builds its communicator over shared memory, and runs the
//! MoE exchange for the given number of rounds. The experts compute `2 * x`; weights `0.75` and
//! `0.25` on two experts make every combined row exactly `2 * x` (small integers), so each
//! attention rank checks its results exactly. Every rank makes the same calls in the same
//! order; an expert's loop ends after the agreed number of rounds.

use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Duration;

use xccl::bootstrap::{TcpBootstrap, UniqueId, UNIQUE_ID_ENV};
use xccl::{Communicator, DType, MoeConfig, Role, TokenBatch, Topology};

const HIDDEN: usize = 256;
const TOKENS: usize = 32;
const EXPERTS_PER_RANK: usize = 4;

fn main() -> ExitCode {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("arguments: ATTENTION EXPERTS ROUNDS"))
        .collect();
    let (m, n, rounds) = match args[..] {
        [m, n, r] => (m, n, r),
        [] => (2, 2, 20),
        _ => panic!("arguments: ATTENTION EXPERTS ROUNDS"),
    };
    let result = match std::env::var("RANK") {
        Ok(rank) => rank_main(rank.parse().expect("RANK"), m, n, rounds),
        Err(_) => launch(m, n, rounds),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("moe_job: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Starts every rank as a process of this binary and waits for all of them.
fn launch(m: usize, n: usize, rounds: usize) -> Result<(), String> {
    let id = UniqueId::new().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let world = m + n;
    let mut children = Vec::new();
    for rank in 0..world {
        let child = Command::new(&exe)
            .args([m, n, rounds].map(|v| v.to_string()))
            .env(UNIQUE_ID_ENV, id.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .spawn()
            .map_err(|e| format!("starting rank {rank}: {e}"))?;
        children.push(child);
    }
    let mut failed = Vec::new();
    for (rank, mut child) in children.into_iter().enumerate() {
        match child.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("rank {rank}: {s}")),
            Err(e) => failed.push(format!("rank {rank}: {e}")),
        }
    }
    if failed.is_empty() {
        println!("moe_job: {m} attention + {n} expert ranks, {rounds} rounds: all ranks succeeded");
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

/// One rank of the job.
fn rank_main(rank: usize, m: usize, n: usize, rounds: usize) -> Result<(), String> {
    let e = |e: xccl::Error| format!("rank {rank}: {e}");
    let id = UniqueId::from_env()
        .map_err(e)?
        .ok_or_else(|| format!("{UNIQUE_ID_ENV} is not set"))?;
    let world: usize = std::env::var("WORLD_SIZE")
        .map_err(|_| "WORLD_SIZE is not set".to_string())?
        .parse()
        .map_err(|_| "WORLD_SIZE is not a number".to_string())?;
    let boot = TcpBootstrap::connect(&id, rank, world, Duration::from_secs(60)).map_err(e)?;
    let topo = Arc::new(Topology::contiguous(m, n, n * EXPERTS_PER_RANK).map_err(e)?);
    let cfg = MoeConfig::new(HIDDEN, DType::F32, 2, TOKENS);
    let mut comm = Communicator::init_shm(Arc::new(boot), topo.clone(), cfg).map_err(e)?;
    let experts = topo.num_experts() as i32;
    match comm.role() {
        Role::Attention => {
            for round in 0..rounds {
                // Token t goes to experts (t + round) and (t + round + 1), weights 0.75, 0.25.
                let x: Vec<f32> = (0..TOKENS * HIDDEN)
                    .map(|i| ((i + rank + round) % 17) as f32)
                    .collect();
                let mut idx = Vec::with_capacity(2 * TOKENS);
                for t in 0..TOKENS as i32 {
                    let first = (t + round as i32) % experts;
                    idx.extend([first, (first + 1) % experts]);
                }
                let w: Vec<f32> = [0.75, 0.25].repeat(TOKENS);
                let handle = comm.a2e_send(&x, &idx, &w).map_err(e)?;
                let mut out = vec![0f32; x.len()];
                comm.e2a_recv(&handle, &mut out).map_err(e)?;
                if let Some(i) = (0..x.len()).find(|&i| out[i] != 2.0 * x[i]) {
                    return Err(format!(
                        "rank {rank} round {round}: out[{i}] = {}, expected {}",
                        out[i],
                        2.0 * x[i]
                    ));
                }
            }
        }
        Role::Expert => {
            let mut batch = TokenBatch::new();
            for _ in 0..rounds {
                comm.a2e_recv_tokens(&mut batch, &mut |_, _| {})
                    .map_err(e)?;
                // Each token's reply: sum over its local experts of weight * (2 * x).
                let rows = batch.rows::<f32>().map_err(e)?;
                let mut reduced = vec![0f32; rows.len()];
                for i in 0..batch.num_tokens() {
                    let (_, weights) = batch.experts_of(i);
                    let x = &rows[i * HIDDEN..(i + 1) * HIDDEN];
                    for (o, v) in reduced[i * HIDDEN..(i + 1) * HIDDEN].iter_mut().zip(x) {
                        *o = weights.iter().fold(0.0, |acc, w| acc + w * (2.0 * v));
                    }
                }
                comm.e2a_send_tokens(&batch, &reduced).map_err(e)?;
            }
        }
    }
    Ok(())
}
