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
//! `WORLD_SIZE` in their environment, and waits for both. One communicator (room for 512
//! tokens per call) serves every token count T in turn: the attention rank sends T tokens to 8
//! distinct experts each (a fixed routing), the expert receives them expert-major (`a2e_recv`)
//! and replies with the rows it got (`e2a_send`, the identity expert), and the attention rank
//! receives the combined rows (`e2a_recv`). Each iteration is timed on the attention rank from
//! before `a2e_send` to after `e2a_recv` (CLOCK_MONOTONIC); after `warmup` unmeasured
//! iterations it prints `ROUNDTRIP_NS tokens=T p50=.. min=.. iters=N` (see [`iterations`]).
//!
//! With `--per-call` first (`roundtrip --per-call ITERS TOKENS...`) each call is timed on its
//! own, with no peer wait inside it: the attention rank times `a2e_send`, polls `e2a_ready`
//! (untimed) and times `e2a_recv`; the expert polls `a2e_ready` (untimed) and times
//! `a2e_recv` and `e2a_send` (polls sleep [`POLL_SLEEP`] apart). Each rank prints `PER_CALL_NS tokens=T call=NAME p50=.. min=..
//! iters=N` per call: the Rust cost of exactly the calls the Python benchmark times the same
//! way, so the difference is the binding's own cost per call.

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
pub const MAX_TOKENS: usize = 512;

/// Sleep between two untimed readiness polls of `--per-call` (a poller that spun would take
/// a core from the peer it waits for).
pub const POLL_SLEEP: Duration = Duration::from_micros(20);

/// `(warmup, measured)` iterations at `tokens` tokens, from ITERS (the count at T=1): fewer
/// for larger calls, at least 50.
pub fn iterations(iters: usize, tokens: usize) -> (usize, usize) {
    let n = (iters * 8 / (tokens + 7)).max(50);
    (n.min(100), n)
}

const USAGE: &str = "arguments: [--per-call | --one-thread] ITERS TOKENS...";

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let flag = args
        .first()
        .filter(|a| a.starts_with("--"))
        .cloned()
        .inspect(|_| {
            args.remove(0);
        });
    let (per_call, one_thread) = match flag.as_deref() {
        None => (false, false),
        Some("--per-call") => (true, false),
        Some("--one-thread") => (false, true),
        Some(_) => {
            eprintln!("{USAGE}");
            return ExitCode::FAILURE;
        }
    };
    let Ok(args) = args
        .iter()
        .map(|a| a.parse())
        .collect::<Result<Vec<usize>, _>>()
    else {
        eprintln!("{USAGE}");
        return ExitCode::FAILURE;
    };
    let [iters, ref tokens @ ..] = args[..] else {
        eprintln!("{USAGE}");
        return ExitCode::FAILURE;
    };
    if tokens.is_empty() || tokens.iter().any(|&t| t == 0 || t > MAX_TOKENS) {
        eprintln!("token counts must be 1..={MAX_TOKENS}");
        return ExitCode::FAILURE;
    }
    let result = match std::env::var("RANK") {
        _ if one_thread => one_thread_main(iters, tokens),
        Ok(rank) => rank_main(rank.parse().expect("RANK"), iters, tokens, per_call),
        Err(_) => launch(&args, per_call),
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
fn launch(args: &[usize], per_call: bool) -> Result<(), String> {
    let id = UniqueId::new().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let spawn = |rank: usize| {
        Command::new(&exe)
            .args(per_call.then(|| "--per-call".to_string()))
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

/// Joins the job named by `id` as `rank` of 2.
fn join(id: &UniqueId, rank: usize) -> xccl::Result<Communicator> {
    let boot = TcpBootstrap::connect(id, rank, 2, Duration::from_secs(60))?;
    let topo = Arc::new(Topology::contiguous(1, 1, EXPERTS)?);
    let cfg = MoeConfig::new(HIDDEN, DType::BF16, TOPK, MAX_TOKENS);
    Communicator::init_shm(Arc::new(boot), topo, cfg)
}

/// The attention rank's input, routing and weights for `tokens` tokens, and room for the
/// result.
fn workload(tokens: usize) -> (Vec<bf16>, Vec<i32>, Vec<f32>, Vec<bf16>) {
    let x: Vec<bf16> = (0..tokens * HIDDEN)
        .map(|i| bf16::from_f32((i % 251) as f32 / 251.0))
        .collect();
    let w = vec![1.0f32 / TOPK as f32; tokens * TOPK];
    let out = vec![bf16::ZERO; x.len()];
    (x, routing(tokens), w, out)
}

/// `--one-thread`: both ranks in this process, joined on two threads; then one thread makes
/// every call of both ranks in turn, so no call ever waits for a peer (each finds what the
/// previous one published), and times each: the cost of the calls themselves, hot in cache,
/// with no scheduling inside. Prints `PER_CALL_NS` lines as `--per-call`.
fn one_thread_main(iters: usize, counts: &[usize]) -> Result<(), String> {
    let id = UniqueId::new().map_err(|e| e.to_string())?;
    let joins: Vec<_> = (0..2)
        .map(|rank| std::thread::spawn(move || join(&id, rank)))
        .collect();
    let mut comms = Vec::new();
    for (rank, j) in joins.into_iter().enumerate() {
        let comm = j
            .join()
            .map_err(|_| format!("rank {rank}: init panicked"))?;
        comms.push(comm.map_err(|e| format!("rank {rank}: {e}"))?);
    }
    let (mut expert, mut attention) = (comms.pop().expect("2"), comms.pop().expect("2"));
    let e = |e: xccl::Error| e.to_string();
    let mut batch = ExpertBatch::new();
    for &tokens in counts {
        let (warmup, measured) = iterations(iters, tokens);
        let (x, idx, w, mut out) = workload(tokens);
        let mut times: [Vec<u64>; 4] = Default::default();
        for i in 0..warmup + measured {
            let t0 = Instant::now();
            let handle = attention.a2e_send(&x, &idx, &w).map_err(e)?;
            let t1 = Instant::now();
            expert.a2e_recv(&mut batch).map_err(e)?;
            let t2 = Instant::now();
            expert
                .e2a_send(&batch, batch.rows::<bf16>().map_err(e)?)
                .map_err(e)?;
            let t3 = Instant::now();
            attention.e2a_recv(&handle, &mut out).map_err(e)?;
            let t4 = Instant::now();
            if i >= warmup {
                for (k, (a, b)) in [(t0, t1), (t1, t2), (t2, t3), (t3, t4)]
                    .into_iter()
                    .enumerate()
                {
                    times[k].push((b - a).as_nanos() as u64);
                }
            }
        }
        let [send, recv, reply, combine] = times;
        report_calls(
            tokens,
            &mut [
                ("a2e_send", send),
                ("a2e_recv", recv),
                ("e2a_send", reply),
                ("e2a_recv", combine),
            ],
        );
    }
    Ok(())
}

/// One rank of the job.
fn rank_main(rank: usize, iters: usize, counts: &[usize], per_call: bool) -> Result<(), String> {
    let e = |e: xccl::Error| format!("rank {rank}: {e}");
    let id: UniqueId = std::env::var("XCCL_ID")
        .map_err(|_| "XCCL_ID is not set".to_string())?
        .parse()
        .map_err(e)?;
    let mut comm = join(&id, rank).map_err(e)?;
    let mut batch = ExpertBatch::new();
    for &tokens in counts {
        let (warmup, measured) = iterations(iters, tokens);
        match comm.role() {
            Role::Attention => {
                let (x, idx, w, mut out) = workload(tokens);
                if per_call {
                    let (mut send, mut recv) = (Vec::new(), Vec::new());
                    for i in 0..warmup + measured {
                        let start = Instant::now();
                        let handle = comm.a2e_send(&x, &idx, &w).map_err(e)?;
                        let sent = start.elapsed();
                        while !comm.e2a_ready(&handle).map_err(e)? {
                            std::thread::sleep(POLL_SLEEP);
                        }
                        let start = Instant::now();
                        comm.e2a_recv(&handle, &mut out).map_err(e)?;
                        if i >= warmup {
                            send.push(sent.as_nanos() as u64);
                            recv.push(start.elapsed().as_nanos() as u64);
                        }
                    }
                    report_calls(tokens, &mut [("a2e_send", send), ("e2a_recv", recv)]);
                    continue;
                }
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
            Role::Expert if per_call => {
                let (mut recv, mut send) = (Vec::new(), Vec::new());
                for i in 0..warmup + measured {
                    while !comm.a2e_ready().map_err(e)? {
                        std::thread::sleep(POLL_SLEEP);
                    }
                    let start = Instant::now();
                    comm.a2e_recv(&mut batch).map_err(e)?;
                    let received = start.elapsed();
                    let start = Instant::now();
                    comm.e2a_send(&batch, batch.rows::<bf16>().map_err(e)?)
                        .map_err(e)?;
                    if i >= warmup {
                        recv.push(received.as_nanos() as u64);
                        send.push(start.elapsed().as_nanos() as u64);
                    }
                }
                report_calls(tokens, &mut [("a2e_recv", recv), ("e2a_send", send)]);
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

/// Prints `PER_CALL_NS` lines: p50 and min of each call's times.
fn report_calls(tokens: usize, calls: &mut [(&str, Vec<u64>)]) {
    for (name, times) in calls {
        times.sort_unstable();
        println!(
            "PER_CALL_NS tokens={tokens} call={name} p50={} min={} iters={}",
            times[times.len() / 2],
            times[0],
            times.len()
        );
    }
}
