//! Soak: many A2E + E2A calls on the local fabric (ranks as threads) with random token counts
//! per call, every result checked bit for bit against the reference, and the resident set
//! measured after warm-up and at the end (it must stay flat: no per-call growth).
//!
//! ```sh
//! cargo run --release --features testing --example soak -- 1000000   # the full soak
//! cargo run --release --features testing --example soak -- 2000      # what CI runs
//! ```
//!
//! Prints one line per progress step and a final summary: calls, time, and the resident set
//! at warm-up and at the end. Exits non-zero on any mismatch, error, or growth above 16 MiB.

use std::process::ExitCode;
use std::time::Instant;

use half::bf16;
use xccl::testing::harness::{
    attention_round_with, expert_round, expert_round_tokens_with, expert_round_view, Buffers,
    Workload,
};
use xccl::{Communicator, DType, ExpertBatch, MoeConfig, Role, TokenBatch, Topology, TransferMode};

/// Resident set of this process in bytes (from /proc/self/statm).
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn main() -> ExitCode {
    let calls: u64 = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("CALLS"))
        .unwrap_or(20_000);
    let warmup = (calls / 10).clamp(1, 1_000);
    let topo = Topology::contiguous(2, 3, 12).expect("topology");
    let mut cfg = MoeConfig::new(64, DType::BF16, 4, 32);
    cfg.timeout = std::time::Duration::from_secs(60);
    let comms = match Communicator::local_group(&topo, &cfg) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("soak: init: {e}");
            return ExitCode::FAILURE;
        }
    };
    let wl = Workload {
        seed: 0x50a4,
        tokens: 32,
        vary: true,
        skew: Some(1.1),
        shared_experts: 0,
    };
    let start = Instant::now();
    let rss_warm = std::sync::Mutex::new(0u64);
    let result: Result<(), String> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                let (wl, rss_warm) = (&wl, &rss_warm);
                s.spawn(move || -> Result<(), String> {
                    let mut batch = ExpertBatch::new();
                    let mut tokens = TokenBatch::new();
                    for round in 0..calls {
                        let r = round + c.rank() as u64;
                        c.set_mode(if r.is_multiple_of(3) {
                            TransferMode::Pull
                        } else {
                            TransferMode::Push
                        });
                        let buffers = if r % 4 == 3 {
                            Buffers::Registered
                        } else {
                            Buffers::Copy
                        };
                        let verdict = match c.role() {
                            Role::Attention => {
                                attention_round_with::<bf16>(&mut c, wl, round, buffers)
                            }
                            Role::Expert if r.is_multiple_of(3) => {
                                expert_round::<bf16>(&mut c, wl, round, &mut batch, true)
                            }
                            Role::Expert if r % 3 == 1 => {
                                expert_round_view::<bf16>(&mut c, wl, round, true)
                            }
                            Role::Expert => expert_round_tokens_with::<bf16>(
                                &mut c,
                                wl,
                                round,
                                &mut tokens,
                                true,
                                buffers,
                            ),
                        };
                        verdict
                            .map_err(|e| format!("rank {} call {round}: {e}", c.rank()))?
                            .map_err(|e| format!("rank {} call {round}: {e}", c.rank()))?;
                        if c.rank() == 0 && round + 1 == warmup {
                            *rss_warm.lock().expect("lock") = rss();
                        }
                        if c.rank() == 0 && (round + 1) % (calls / 10).max(1) == 0 {
                            println!(
                                "soak: {} calls, {:.1} s, resident {} MiB",
                                round + 1,
                                start.elapsed().as_secs_f64(),
                                rss() >> 20
                            );
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| "a rank panicked".to_string())?)
    });
    let (warm, end) = (*rss_warm.lock().expect("lock"), rss());
    println!(
        "soak: {calls} A2E+E2A calls checked in {:.1} s; resident {} KiB after {warmup} calls, {} KiB at the end",
        start.elapsed().as_secs_f64(),
        warm >> 10,
        end >> 10
    );
    if let Err(e) = result {
        eprintln!("soak: {e}");
        return ExitCode::FAILURE;
    }
    if end > warm + (16 << 20) {
        eprintln!("soak: the resident set grew by {} KiB", (end - warm) >> 10);
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
