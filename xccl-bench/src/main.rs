//! `xccl-bench`: A2E, E2A and round-trip latency and bandwidth between M attention and N expert
//! ranks, printed as an nccl-tests style table beside the machine's limits (memcpy, the
//! cross-process streaming limit or, with `--fabric cuda`, the device-to-device copy, the
//! one-row ping-pong floor), optionally written as JSON and an SVG plot.
//!
//! With no arguments it runs the DeepSeek-V3 decode shape scaled to one host (H=7168, bf16,
//! top-8 of 64 experts, 128 tokens per attention rank, 2A:2E) on shared memory, starting its own
//! rank processes. Under mpirun, srun or torchrun each launched process is one rank. See
//! `xccl-bench --help` and `xccl-bench/README.md` for the timing definition.
//!
//! Two subcommands start no ranks: `xccl-bench memory` prints the window bytes per rank at a
//! shape ([`memory`]), `xccl-bench model` fits the cost model ([`model`]) to measured runs and
//! projects the decode shape ([`projection`]).

mod cli;
mod launch;
mod limit;
mod memory;
mod model;
mod pingpong;
mod plan;
mod plot;
mod projection;
mod report;
mod routing;
mod run;
mod stats;

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use xccl::fabric::shm::ShmFabric;
use xccl::fabric::WaitPolicy;
use xccl::Communicator;

use cli::{Args, FabricKind};
use run::RankReport;

/// Installs a `tracing` subscriber writing to stderr at the level `XCCL_DEBUG` names
/// (`error`, `warn`, `info`, `debug`, `trace`, `off`; like `NCCL_DEBUG`), default `warn`.
fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::filter::LevelFilter;
    let var = std::env::var("XCCL_DEBUG").unwrap_or_default();
    let level = match var.trim().to_ascii_lowercase().as_str() {
        "off" | "none" => LevelFilter::OFF,
        "error" => LevelFilter::ERROR,
        "" | "warn" | "warning" => LevelFilter::WARN,
        "info" => LevelFilter::INFO,
        "debug" => LevelFilter::DEBUG,
        "trace" => LevelFilter::TRACE,
        _ => {
            eprintln!("xccl-bench: XCCL_DEBUG={var} is not one of off, error, warn, info, debug, trace; using warn");
            LevelFilter::WARN
        }
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// The wait policy of the ranks of this run: [`WaitPolicy::for_ranks_on_host`] with the world
/// size, decided before any pinning (a pinned rank may run on one CPU only, but the job has one
/// per rank).
fn wait_policy(args: &Args) -> WaitPolicy {
    WaitPolicy::for_ranks_on_host(args.world_size())
}

fn main() -> ExitCode {
    init_logging();
    let args = Args::parse();
    if let Some(cmd) = &args.command {
        let out = match cmd {
            cli::Command::Memory(m) => memory::report(m).map_err(|e| e.to_string()),
            cli::Command::Model(m) => projection::run(m),
        };
        return match out {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("xccl-bench: {e}");
                ExitCode::FAILURE
            }
        };
    }
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
    if args.routing_only {
        write_routing(args)?;
        return Ok(0);
    }
    let timeout = args.timeout();
    if let Some(env) = launch::child_rank(timeout)? {
        // Our own children: pinned as `--bind` says (an external launcher pins its own).
        let policy = wait_policy(args);
        let cpu = launch::bind_rank(args.bind, env.rank, args.world_size())?;
        tracing::info!(rank = env.rank, ?cpu, "rank pinning");
        return process_rank(args, env, policy);
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
        return process_rank(args, env, wait_policy(args));
    }
    let limit = launch::stall_limit(timeout);
    let hosts = match args.netns {
        Some(k) => {
            let h = xccl::testing::netns::Hosts::create(k)?;
            println!(
                "# netns: {k} hosts {} ({}) joined by veth pairs through a bridge; rank r in \
                 host r mod {k}",
                (0..k).map(|i| h.name(i)).collect::<Vec<_>>().join(", "),
                (0..k).map(|i| h.addr(i)).collect::<Vec<_>>().join(", ")
            );
            Some(h)
        }
        None => None,
    };
    launch::spawn_ranks(args.world_size(), limit, hosts.as_ref())
}

fn progress(args: &Args) -> ProgressBar {
    let per_point = args.rounds() * if args.check { 2 } else { 1 };
    let pb = ProgressBar::new((args.points() * per_point) as u64);
    if let Ok(style) = ProgressStyle::with_template("{prefix} [{bar:40}] {pos}/{len} {elapsed}") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_prefix("xccl-bench");
    pb
}

/// One rank of a multi-process job on shared memory.
fn process_rank(args: &Args, env: launch::RankEnv, policy: WaitPolicy) -> Result<i32, String> {
    let e = |e: xccl::Error| e.to_string();
    launch::start_heartbeat(env.rank)?;
    let topo = run::topology(args).map_err(e)?;
    let cfg = run::moe_config(args);
    let lens = Communicator::window_lens(&topo, &cfg).map_err(e)?;
    if env.rank == 0 {
        write_routing(args)?;
    }
    let slots = Communicator::signal_slots(&topo);
    // The cuda fabric's device: where this rank times the device-to-device copy limit.
    let mut device = None;
    let local_rank: Option<usize> = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok());
    let fabric: Box<dyn xccl::fabric::Fabric> = if args.fabric == FabricKind::Ascend {
        let device = local_rank.map_or(env.rank as i32, |d| d as i32);
        let ex = env.exchange.clone();
        Box::new(
            xccl::fabric::ascend::AscendFabric::new(ex, lens[env.rank], slots, device)
                .map_err(e)?,
        )
    } else if args.fabric == FabricKind::Cuda {
        let ex = env.exchange.clone();
        // Records in host memory, as `Communicator::init_cuda` keeps them.
        let prefix = Communicator::cuda_host_prefix(&topo, &cfg, env.rank);
        let f = xccl::fabric::cuda::CudaFabric::with_host_prefix(
            ex,
            (lens[env.rank], prefix),
            slots,
            local_rank,
            args.timeout(),
        )
        .map_err(e)?;
        device = Some(f.device().clone());
        Box::new(f)
    } else if args.fabric == FabricKind::Ofi {
        let opts = xccl::fabric::ofi::OfiOptions {
            timeout: args.timeout(),
            ..Default::default()
        };
        let ex = env.exchange.clone();
        Box::new(
            xccl::fabric::ofi::OfiFabric::with_options(ex, lens[env.rank], slots, &opts)
                .map_err(e)?,
        )
    } else {
        let ex = env.exchange.clone();
        let mut fabric =
            ShmFabric::with_timeout(ex, lens[env.rank], slots, args.timeout()).map_err(e)?;
        fabric.set_wait_policy(policy);
        tracing::info!(
            rank = env.rank,
            size = args.world_size(),
            ?policy,
            "xccl-bench rank joined the shm fabric"
        );
        Box::new(fabric)
    };
    // SAFETY: the fabric was built just above and is moved in: nothing else holds it, and this
    // process is one rank of the job (the limits run on a fabric of their own).
    let mut comm = unsafe { Communicator::new(fabric, Arc::new(topo), cfg) }.map_err(e)?;
    let records = comm.a2e_records_per_call();
    launch::beat();
    // The limits, on a fabric of their own over the same bootstrap, same processes, their
    // blocks alternating with the calls' (`--blocks`).
    let plan = limit::Plan::of(args).map_err(e)?;
    let mut limit_fabric = match ShmFabric::with_timeout(
        env.exchange.clone(),
        plan.window_len(),
        limit::slots(args.world_size()),
        args.timeout(),
    ) {
        Ok(f) => f,
        Err(err) => {
            comm.abort(&format!("xccl-bench limit: {err}"));
            return Err(format!("measuring the streaming limit: {err}"));
        }
    };
    limit_fabric.set_wait_policy(policy);
    let mut limit_run = limit::LimitRun::new(env.rank, args, &plan);
    if plan.copies_on_device(env.rank) {
        let copier = device
            .as_ref()
            .ok_or_else(|| {
                xccl::Error::invalid("the device-to-device copy limit needs --fabric cuda")
            })
            .and_then(|d| limit::DeviceCopy::new(d, plan.device_bytes(), env.rank));
        match copier {
            Ok(c) => limit_run.set_device(c),
            Err(err) => {
                comm.abort(&format!("xccl-bench limit: {err}"));
                return Err(format!("measuring the device-to-device copy limit: {err}"));
            }
        }
    }
    let pb = (env.rank == 0).then(|| progress(args));
    let mut limit_block = |b: usize| {
        limit_run.block(&mut limit_fabric, b).inspect_err(|err| {
            xccl::fabric::Fabric::abort(&limit_fabric, &format!("xccl-bench limit: {err}"));
        })
    };
    let report = match run::run_rank(&mut comm, args, pb.as_ref(), &mut limit_block) {
        Ok(r) => r,
        Err(err) => {
            comm.abort(&err.to_string());
            return Err(err.to_string());
        }
    };
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    let limit_words = match limit_run.finish(&mut limit_fabric) {
        Ok(w) => w,
        Err(err) => {
            let _ = env.exchange.broadcast_abort(&err.to_string());
            return Err(format!("measuring the streaming limit: {err}"));
        }
    };
    // Over ofi, libfabric's own ping-pong is the limit of the network path.
    let fi = (args.fabric == FabricKind::Ofi).then(|| {
        let mut sizes: Vec<usize> = vec![plan.row];
        let points = args.tokens.len();
        sizes.extend(plan.measurements[..points].iter().map(|m| m.bytes));
        sizes.push(1 << 20);
        sizes.sort_unstable();
        sizes.dedup();
        pingpong::run(
            env.exchange.as_ref(),
            env.rank,
            args.attention,
            &sizes,
            args.timeout(),
        )
    });
    let blobs = env
        .exchange
        .allgather(&report.encode(), args.timeout())
        .map_err(e)?;
    let mut stats_json = None;
    if args.stats {
        let all = env
            .exchange
            .allgather(&stats::encode(&comm, &report.phases), args.timeout())
            .map_err(e)?;
        if env.rank == 0 {
            stats_json = Some(report_stats(args, comm.topology(), &all, records)?);
        }
    }
    let limit_blobs = env
        .exchange
        .allgather(&encode_words(&limit_words), args.timeout())
        .map_err(e)?;
    let wait_blobs = env
        .exchange
        .allgather(&run::encode_waits(&report), args.timeout())
        .map_err(e)?;
    drop(comm);
    if env.rank != 0 {
        return Ok(0);
    }
    let mut reports = blobs
        .iter()
        .map(|b| RankReport::decode(b))
        .collect::<Result<Vec<_>, _>>()?;
    for (r, w) in reports.iter_mut().zip(&wait_blobs) {
        run::decode_waits(w, r);
    }
    let limit_words: Vec<Vec<u64>> = limit_blobs.iter().map(|b| decode_words(b)).collect();
    finish(
        args,
        &reports,
        records,
        &plan,
        &limit_words,
        policy,
        stats_json,
        fi,
    )
}

/// `--stats` on rank 0: prints every rank's counters and the sizes of each sweep point, and
/// returns them as the JSON report's `stats` object.
fn report_stats(
    args: &Args,
    topo: &xccl::Topology,
    blobs: &[Vec<u8>],
    records: usize,
) -> Result<serde_json::Value, String> {
    let ranks = blobs
        .iter()
        .map(|b| stats::decode(b))
        .collect::<Result<Vec<_>, _>>()?;
    let sizes = stats::sizes(args, topo, &ranks, records);
    let windows = stats::Windows::of(topo, &ranks);
    print!("{}", stats::table(&ranks, rounds_run(args), records));
    print!("{}", stats::sizes_table(&sizes, &windows));
    print!("{}", stats::relay_phases(args, topo, &ranks));
    if args.fabric == FabricKind::Ofi && args.domains == 1 {
        let (text, ok) = plan::check(args, topo, &ranks);
        print!("{text}");
        if !ok {
            return Err("the links' records, rows or bytes differ from the routing's plan".into());
        }
    }
    if let Some((by, peer)) = stats::job_straggler(&ranks) {
        println!("# straggler: rank {peer} (rank {by} waited on it longest)");
    }
    Ok(stats::to_json(topo, &ranks, &sizes, &windows))
}

/// The cost model's prediction of each sweep point's A2E and E2A (`--model-params`, every rank
/// sharing this machine's `cores`) from the traffic the ranks counted, beside the measured p50.
fn model_beside_measurement(
    args: &Args,
    doc: &serde_json::Value,
    cores: usize,
) -> Result<String, String> {
    use std::fmt::Write as _;
    let (samples, _) = model::samples_from_report(doc)?;
    let p = model::FabricParams {
        latency_us: args.model_params[0],
        link_gbps: args.model_params[1],
        copy_gbps: args.model_params[2],
        record_us: args.model_params[3],
        cores: Some(cores as f64),
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# model: latency {} us, link {} GB/s, copy {} GB/s, record {} us, {cores} cores shared by \
         the ranks (--model-params)",
        p.latency_us, p.link_gbps, p.copy_gbps, p.record_us
    );
    let _ = writeln!(
        out,
        "# model: {:>26} {:>13} {:>12} {:>9} {:>13}",
        "call", "predicted_us", "measured_us", "measured/predicted", "stages_us"
    );
    for smp in &samples {
        let pred = model::predict(&p, &smp.counts);
        let stages: Vec<String> = pred.stages_us.iter().map(|v| format!("{v:.1}")).collect();
        let _ = writeln!(
            out,
            "# model: {:>26} {:>13.1} {:>12.1} {:>18.2} {:>13} (cpu bound {:.1})",
            smp.label,
            pred.total_us,
            smp.measured_us,
            smp.measured_us / pred.total_us,
            stages.join("+"),
            pred.cpu_us
        );
    }
    Ok(out)
}

/// A2E+E2A round trips each rank ran: every sweep point's rounds, twice with `--check`.
fn rounds_run(args: &Args) -> u64 {
    let per_point = args.rounds() as u64 * if args.check { 2 } else { 1 };
    per_point * args.tokens.len() as u64
}

fn encode_words(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn decode_words(blob: &[u8]) -> Vec<u64> {
    blob.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

/// Every rank as a thread of this process on the `local` fabric.
fn run_local(args: &Args) -> Result<i32, String> {
    let e = |e: xccl::Error| e.to_string();
    let topo = run::topology(args).map_err(e)?;
    let cfg = run::moe_config(args);
    write_routing(args)?;
    let comms = Communicator::local_group(&topo, &cfg).map_err(e)?;
    let records = comms[0].a2e_records_per_call();
    // The limits on a local fabric of their own, each rank's blocks alternating with its calls'.
    let plan = limit::Plan::of(args).map_err(e)?;
    let size = args.world_size();
    // SAFETY: a world of its own, used only by the limit plan, whose ranks order every access
    // to a window range by a signal they waited for (`limit`'s module docs); no communicator
    // uses it.
    let limit_fabrics = unsafe {
        xccl::fabric::local::LocalFabric::create(&vec![plan.window_len(); size], limit::slots(size))
    }
    .map_err(e)?;
    let pb = progress(args);
    type RankResult = Result<(RankReport, Vec<u8>, Vec<u64>), String>;
    let results: Vec<RankResult> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(limit_fabrics)
            .map(|(mut comm, mut lf)| {
                let pb = (comm.rank() == 0).then(|| pb.clone());
                let plan = &plan;
                s.spawn(move || {
                    let mut limit_run = limit::LimitRun::new(comm.rank(), args, plan);
                    let mut limit_block = |b: usize| {
                        limit_run.block(&mut lf, b).inspect_err(|err| {
                            xccl::fabric::Fabric::abort(&lf, &format!("xccl-bench limit: {err}"));
                        })
                    };
                    let ran = run::run_rank(&mut comm, args, pb.as_ref(), &mut limit_block)
                        .and_then(|r| Ok((r, limit_run.finish(&mut lf)?)));
                    match ran {
                        Ok((r, words)) => {
                            let blob = stats::encode(&comm, &r.phases);
                            Ok((r, blob, words))
                        }
                        Err(err) => {
                            comm.abort(&err.to_string());
                            Err(format!("rank {}: {err}", comm.rank()))
                        }
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
    let mut reports = Vec::new();
    let mut blobs = Vec::new();
    let mut limit_words = Vec::new();
    for r in results {
        let (report, blob, words) = r?;
        reports.push(report);
        blobs.push(blob);
        limit_words.push(words);
    }
    let stats_json = if args.stats {
        Some(report_stats(args, &topo, &blobs, records)?)
    } else {
        None
    };
    finish(
        args,
        &reports,
        records,
        &plan,
        &limit_words,
        wait_policy(args),
        stats_json,
        None,
    )
}

/// The run's wait policy, and what ranks outnumbering cores change in it (shm and local
/// fabrics, whose ranks share this host: [`xccl::fabric::WaitState::for_ranks_on_host`]).
fn describe_wait(args: &Args, policy: WaitPolicy) -> String {
    let host = matches!(args.fabric, FabricKind::Shm | FabricKind::Local);
    let over = xccl::fabric::WaitState::for_ranks_on_host(args.world_size()).oversubscribed();
    if host && over {
        format!(
            "{}; {} ranks outnumber the cores: no spinning, yield >= one wake-up and twice the recent waits (<= 50 us)",
            policy.describe(),
            args.world_size()
        )
    } else {
        policy.describe()
    }
}

/// Per sweep point, each role's wait counters per call (means over its ranks).
fn wait_lines(args: &Args, reports: &[RankReport]) -> Vec<report::WaitLine> {
    let points = args.quants().into_iter().flat_map(|q| {
        args.tokens.iter().map(move |&t| {
            (
                t,
                if q == xccl::Quant::Int8 {
                    "int8"
                } else {
                    "none"
                },
            )
        })
    });
    points
        .enumerate()
        .map(|(i, (tokens, quant))| {
            let mut roles = [[0.0; 11]; 2];
            for (role, ranks) in [0..args.attention, args.attention..args.world_size()]
                .into_iter()
                .enumerate()
            {
                let n = ranks.len().max(1) as f64;
                let per_call = args.iters.max(1) as f64 * n;
                for r in ranks {
                    let Some(w) = reports.get(r).and_then(|rep| rep.waits.get(i)) else {
                        continue;
                    };
                    let v = &mut roles[role];
                    v[0] += w.waits as f64 / per_call;
                    v[1] += w.polls as f64 / per_call;
                    v[2] += w.yields as f64 / per_call;
                    v[3] += w.slow_yields as f64 / per_call;
                    v[4] += w.sleeps as f64 / per_call;
                    v[5] += w.wake_ns as f64 / 1e3 / n;
                    v[6] += w.spin_ns as f64 / 1e3 / n;
                    v[10] += w.restarts as f64 / per_call;
                    if let Some(c) = reports.get(r).and_then(|rep| rep.costs.get(i)) {
                        v[7] += c.cpu_ns as f64 / 1e3 / per_call;
                        v[8] += c.voluntary_switches as f64 / per_call;
                        v[9] += c.involuntary_switches as f64 / per_call;
                    }
                }
            }
            report::WaitLine {
                tokens,
                quant,
                roles,
            }
        })
        .collect()
}

fn write_routing(args: &Args) -> Result<(), String> {
    if let Some(path) = &args.routing_out {
        routing::write(args, path).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}

/// On rank 0 after the run: statistics, memcpy reference, limits, table, JSON, plot. Returns
/// the exit code.
#[allow(clippy::too_many_arguments)]
fn finish(
    args: &Args,
    reports: &[RankReport],
    records: usize,
    plan: &limit::Plan,
    limit_words: &[Vec<u64>],
    policy: WaitPolicy,
    stats_json: Option<serde_json::Value>,
    fi: Option<Result<Vec<pingpong::PingPong>, String>>,
) -> Result<i32, String> {
    let mut rows = report::aggregate(args, reports, records);
    report::measure_memcpy(args, &mut rows);
    let limits = limit::aggregate(args, plan, limit_words);
    report::attach_limits(args, &mut rows, &limits);
    let mpi = match &args.mpi_baseline {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("reading {}: {e}", path.display()))?;
            let mpi = report::MpiBaseline::parse(&text)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            report::attach_mpi(&mut rows, &mpi);
            Some(mpi)
        }
        None => None,
    };
    let extras = report::Extras {
        floors: limit::floors(plan, &limits),
        floor_shape: (args.attention, args.experts),
        floor_pairs: args.attention.min(args.experts),
        waits: wait_lines(args, reports),
        phases: report::phases(args, reports),
        mpi,
        wait_policy: describe_wait(args, policy),
        fi: fi.map(|r| report::FiLimit::of(r, args, plan)),
        limit: report::LimitPoints::of(args, plan, &limits),
    };
    let mismatches: Vec<&String> = reports.iter().flat_map(|r| &r.mismatches).collect();
    let check = match (args.check, mismatches.is_empty()) {
        (false, _) => "skipped",
        (true, true) => "passed",
        (true, false) => "failed",
    };
    let machine = report::Machine::detect();
    print!("{}", report::table(args, &machine, &rows, check, &extras));
    if args.quants().len() > 1 {
        print!("{}", report::quant_summary(&rows));
    }
    for m in mismatches.iter().take(10) {
        eprintln!("xccl-bench: check failed: {m}");
    }
    if let Some(st) = &stats_json {
        let mut doc = report::to_json(args, &machine, &rows, check, &extras);
        doc["stats"] = st.clone();
        print!("{}", model_beside_measurement(args, &doc, machine.cores)?);
    }
    if let Some(path) = &args.json {
        let mut doc = report::to_json(args, &machine, &rows, check, &extras);
        if let Some(st) = stats_json {
            doc["stats"] = st;
        }
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        let title = format!(
            "xccl-bench {}A:{}E H={} {} {}, {} layout, {} buffers",
            args.attention,
            args.experts,
            args.hidden,
            args.dtype.name(),
            args.fabric.name(),
            args.layout.name(),
            args.buffers.name(),
        );
        // One wire format per plot: the first of the run.
        let first = rows.first().map_or("none", |r| r.quant);
        let plotted: Vec<_> = rows.iter().filter(|r| r.quant == first).cloned().collect();
        plot::write(path, &plotted, &title)
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(if check == "failed" { 1 } else { 0 })
}
