//! `--routing-out`: the routing of every iteration, so another program (the MPI baseline in
//! `benches/baselines/moe_alltoallv.c`) replays exactly the same traffic.
//!
//! Little-endian binary:
//!
//! | what | type |
//! |---|---|
//! | magic `XCCLRT01` | 8 bytes |
//! | M, N, E, K, H, dtype (0 f32, 1 f16, 2 bf16), S (token counts), warmup, iters, 0 | 10 x u32 |
//! | then per token count: T | u32 |
//! | then per iteration (warmup + iters), per attention rank (0..M): `topk_idx` | T x K x i32 |
//! | and `topk_weights` | T x K x f32 |
//!
//! Ranks `0..M` are attention ranks, `M..M+N` expert ranks; expert `e` lives on expert rank
//! `M + e * N / E`. `-1` means no expert; duplicate ids in a row travel once (weights summed).

use std::io::Write;
use std::path::Path;

use crate::cli::Args;
use crate::run::{round, topology, workload};

/// Magic at the start of a routing file.
pub const MAGIC: &[u8; 8] = b"XCCLRT01";

/// Writes the routing of the whole run to `path`.
pub fn write(args: &Args, path: &Path) -> std::io::Result<()> {
    let topo = topology(args).map_err(std::io::Error::other)?;
    let f = std::fs::File::create(path)?;
    let mut w = std::io::BufWriter::new(f);
    w.write_all(MAGIC)?;
    let header = [
        args.attention,
        args.experts,
        args.num_experts,
        args.topk,
        args.hidden,
        args.dtype as usize,
        args.tokens.len(),
        args.warmup,
        args.iters,
        0,
    ];
    for v in header {
        w.write_all(&(v as u32).to_le_bytes())?;
    }
    for (s, &tokens) in args.tokens.iter().enumerate() {
        w.write_all(&(tokens as u32).to_le_bytes())?;
        let wl = workload(args, tokens);
        for it in 0..args.rounds() {
            for &a in topo.attention_ranks() {
                let input = wl.input(&topo, args.topk, a, round(s, it, 0, 1));
                for id in &input.topk_idx {
                    w.write_all(&id.to_le_bytes())?;
                }
                for wt in &input.topk_weights {
                    w.write_all(&wt.to_le_bytes())?;
                }
            }
        }
    }
    w.flush()
}
