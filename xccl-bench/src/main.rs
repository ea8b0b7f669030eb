//! `xccl-bench`: A2E, E2A and round-trip latency and bandwidth between M attention and N expert
//! ranks, printed as an nccl-tests style table and optionally written as JSON and a PNG.
//!
//! With no arguments it runs the DeepSeek-V3 decode shape scaled to one host (H=7168, bf16,
//! top-8 of 64 experts, 128 tokens per attention rank, 2A:2E) on shared memory, starting its own
//! rank processes. Under mpirun, srun or torchrun each launched process is one rank. See
//! `xccl-bench --help` and `xccl-bench/README.md` for the timing definition.

mod cli;
mod launch;
mod plot;
mod report;
mod routing;
mod run;

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use xccl::fabric::shm::ShmFabric;
use xccl::Communicator;

use cli::{Args, FabricKind};
use run::RankReport;

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = args.validate() {
        eprintln!("xccl-bench: {e}");
        return ExitCode::from(2);
    }
    match real_main(&args) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            let who = std::env::var(launch::RANK_ENV)
                .map(|r| format!(" (rank {r})"))
                .unwrap_or_default();
            eprintln!("xccl-bench{who}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn real_main(args: &Args) -> Result<i32, String> {
    let timeout = args.timeout();
    if let Some(env) = launch::child_rank(timeout)? {
        return process_rank(args, env);
    }
    if args.fabric == FabricKind::Local {
        return run_local(args);
    }
    if let Some(launched) = launch::launcher_env()? {
        if launched.size != args.world_size() {
            return Err(format!(
                "{:?} started {} processes; --attention {} --experts {} needs {}",
                launched.launcher,
                launched.size,
                args.attention,
                args.experts,
                args.world_size()
            ));
        }
        let env = launch::launcher_rank(&launched, timeout)?;
        return process_rank(args, env);
    }
    let limit = timeout.mul_f64(2.0 + args.tokens.len() as f64);
    launch::spawn_ranks(args.world_size(), limit)
}

fn progress(args: &Args) -> ProgressBar {
    let per_point = args.rounds() * if args.check { 2 } else { 1 };
    let pb = ProgressBar::new((args.tokens.len() * per_point) as u64);
    if let Ok(style) = ProgressStyle::with_template("{prefix} [{bar:40}] {pos}/{len} {elapsed}") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_prefix("xccl-bench");
    pb
}

/// One rank of a multi-process job on shared memory.
fn process_rank(args: &Args, env: launch::RankEnv) -> Result<i32, String> {
    let e = |e: xccl::Error| e.to_string();
    let topo = run::topology(args).map_err(e)?;
    let cfg = run::moe_config(args);
    let lens = Communicator::window_lens(&topo, &cfg).map_err(e)?;
    if env.rank == 0 {
        write_routing(args)?;
    }
    let fabric = ShmFabric::with_timeout(
        env.exchange.clone(),
        lens[env.rank],
        Communicator::signal_slots(&topo),
        args.timeout(),
    )
    .map_err(e)?;
    let mut comm = Communicator::new(Box::new(fabric), Arc::new(topo), cfg).map_err(e)?;
    let records = comm.a2e_records_per_call();
    let pb = (env.rank == 0).then(|| progress(args));
    let report = match run::run_rank(&mut comm, args, pb.as_ref()) {
        Ok(r) => r,
        Err(err) => {
            comm.abort(&err.to_string());
            return Err(err.to_string());
        }
    };
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    let blobs = env
        .exchange
        .allgather(&report.encode(), args.timeout())
        .map_err(e)?;
    drop(comm);
    if env.rank != 0 {
        return Ok(0);
    }
    let reports = blobs
        .iter()
        .map(|b| RankReport::decode(b))
        .collect::<Result<Vec<_>, _>>()?;
    finish(args, &reports, records)
}

/// Every rank as a thread of this process on the `local` fabric.
fn run_local(args: &Args) -> Result<i32, String> {
    let e = |e: xccl::Error| e.to_string();
    let topo = run::topology(args).map_err(e)?;
    let cfg = run::moe_config(args);
    write_routing(args)?;
    let comms = Communicator::local_group(&topo, &cfg).map_err(e)?;
    let records = comms[0].a2e_records_per_call();
    let pb = progress(args);
    let results: Vec<Result<RankReport, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                let pb = (comm.rank() == 0).then(|| pb.clone());
                s.spawn(move || match run::run_rank(&mut comm, args, pb.as_ref()) {
                    Ok(r) => Ok(r),
                    Err(err) => {
                        comm.abort(&err.to_string());
                        Err(format!("rank {}: {err}", comm.rank()))
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
            .collect()
    });
    pb.finish_and_clear();
    let reports = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    finish(args, &reports, records)
}

fn write_routing(args: &Args) -> Result<(), String> {
    if let Some(path) = &args.routing_out {
        routing::write(args, path).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}

/// On rank 0 after the run: statistics, memcpy reference, table, JSON, plot. Returns the exit code.
fn finish(args: &Args, reports: &[RankReport], records: usize) -> Result<i32, String> {
    let mut rows = report::aggregate(args, reports, records);
    report::measure_memcpy(args, &mut rows);
    let mismatches: Vec<&String> = reports.iter().flat_map(|r| &r.mismatches).collect();
    let check = match (args.check, mismatches.is_empty()) {
        (false, _) => "skipped",
        (true, true) => "passed",
        (true, false) => "failed",
    };
    let machine = report::Machine::detect();
    print!("{}", report::table(args, &machine, &rows, check));
    for m in mismatches.iter().take(10) {
        eprintln!("xccl-bench: check failed: {m}");
    }
    if let Some(path) = &args.json {
        let doc = report::to_json(args, &machine, &rows, check);
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        let subtitle = format!(
            "{}A:{}E H={} {} {}",
            args.attention,
            args.experts,
            args.hidden,
            args.dtype.name(),
            args.fabric.name()
        );
        plot::write(path, &rows, &subtitle)
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(if check == "failed" { 1 } else { 0 })
}
