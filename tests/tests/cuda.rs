//! The cuda fabric between real processes, through the real `dlopen` and FFI path, against a
//! **stand-in** of the CUDA driver (`tests/cuda_standin/`, built here with gcc as
//! `libcuda.so.1` and found through `XCCL_CUDA_LIBRARY`; no GPU is involved):
//! - the conformance suite with 2 and 3 processes, on one device each and with ranks sharing a
//!   device;
//! - A2E/E2A (1A:1E, 2A:2E) through `Communicator::init_cuda`, checked bit for bit against the
//!   reference, the windows in "device memory" reached through `put`/`get`;
//! - the errors at init, each naming the driver call and the rank, every rank failing together:
//!   no driver (on every rank, on one rank), no device, an injected driver error, out of device
//!   memory, an IPC handle the driver refuses (nothing of a failed init stays mapped); a driver error after init (a signal) naming call and rank;
//! - a SIGKILLed peer named by the survivor.
//!
//! Every job's stand-in segments are checked to be gone from `/dev/shm`.
//!
//! Every test re-runs this binary as its ranks (see `xccl_tests::Job`).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use xccl::bootstrap::Exchange;
use xccl::fabric::conformance::{self, min_slots, MIN_WINDOW};
use xccl::fabric::cuda::CudaFabric;
use xccl::fabric::Fabric;
use xccl::{Communicator, DType, Error, MoeConfig, Quant, Topology};
use xccl_tests::cuda_support::{DEVICES_ENV, FAIL_ENV, LIBRARY_ENV, LIMIT_ENV, PREFIX_ENV};
use xccl_tests::{announce, child_main, ChildCtx, Job, StandinSegments};

const ENTRY: &str = "child_rank_entry";
const CONNECT: Duration = Duration::from_secs(30);
#[test]
fn child_rank_entry() {
    child_main(dispatch);
}

fn dispatch(scenario: &str, ctx: &ChildCtx) -> Result<(), String> {
    let parts: Vec<&str> = scenario.split(':').collect();
    let r = match parts.as_slice() {
        ["conformance", devices] => {
            let p = devices.parse::<usize>().map_err(|e| e.to_string())?;
            conformance_rank(ctx, p)
        }
        ["moe", m, n, rounds] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            return checked_rounds(ctx, p(m)?, p(n)?, p(rounds)? as u64);
        }
        ["device", m, n, rounds, quant, relays] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            let quant = match *quant {
                "int8" => Quant::Int8,
                _ => Quant::None,
            };
            let shape = (p(m)?, p(n)?, p(relays)?);
            return device_rounds(ctx, shape, p(rounds)? as u64, quant);
        }
        ["threads_conformance", size] => {
            let size = size.parse::<usize>().map_err(|e| e.to_string())?;
            threads_conformance(size)
        }
        ["threads_chunks", m, n, rounds, chunk] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            return threads_chunks((p(m)?, p(n)?), p(rounds)? as u64, p(chunk)?);
        }
        ["threads", m, n, rounds] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            return threads_rounds((p(m)?, p(n)?), p(rounds)? as u64);
        }
        ["missing_library"] => missing_library(ctx),
        ["no_nvrtc_on_rank_1"] => no_nvrtc_on_rank_1(ctx),
        ["init_fails_on_rank_1", call, code] => {
            let code = code.parse::<i64>().map_err(|e| e.to_string())?;
            init_fails_on_rank_1(ctx, call, code)
        }
        ["signal_fails"] => signal_fails(ctx),
        ["plane"] => plane_between_windows(ctx),
        ["plane_without_nvrtc"] => plane_without_nvrtc(ctx),
        ["killed_after_init"] => killed_after_init(ctx),
        _ => return Err(format!("unknown scenario {scenario:?}")),
    };
    r.map_err(|e| e.to_string())
}

fn join(ctx: &ChildCtx) -> xccl::Result<CudaFabric> {
    let ex: Arc<dyn Exchange> = ctx.connect(CONNECT)?;
    CudaFabric::new(ex, MIN_WINDOW, min_slots(ctx.size), None)
}

fn fail(detail: String) -> Error {
    Error::Protocol {
        peer: usize::MAX,
        detail,
    }
}

/// The conformance suite; with `devices` stand-in devices, rank r is on device r % devices.
fn conformance_rank(ctx: &ChildCtx, devices: usize) -> xccl::Result<()> {
    let f = join(ctx)?;
    let caps = f.capabilities();
    if caps.load_store || !caps.remote_read || f.peer_window(0).is_some() {
        return Err(fail(format!("unexpected capabilities {caps:?}")));
    }
    if f.local_window().is_some() {
        return Err(fail("the host got a view of device memory".into()));
    }
    for r in 0..ctx.size {
        if f.device_of(r) != Some(r % devices) || f.device_window(r).is_none() {
            return Err(fail(format!(
                "rank {r}: device {:?}, window {:?}",
                f.device_of(r),
                f.device_window(r)
            )));
        }
    }
    if f.device_window(ctx.size).is_some() {
        return Err(fail("a window for a rank out of range".into()));
    }
    conformance::run_all(&f)?;
    announce(&format!(
        "device {} ({}, sm {:?}) via {}",
        f.device().ordinal(),
        f.device().name(),
        f.device().compute_capability(),
        f.driver().path().display()
    ));
    Ok(())
}

/// Checked rounds over `init_cuda` (see `xccl_tests::checked_device_rounds`).
fn checked_rounds(ctx: &ChildCtx, m: usize, n: usize, rounds: u64) -> Result<(), String> {
    xccl_tests::checked_device_rounds(
        ctx,
        (m, n),
        rounds,
        Quant::None,
        "cuda",
        &|ex, topo, cfg| Communicator::init_cuda(ex, topo, cfg, None),
    )
}

/// The cuda fabric's threads mode (`Communicator::local_group_cuda`, every rank a thread of
/// this one process): rounds of the device-buffer calls checked bit for bit as in
/// [`device_rounds`].
fn threads_rounds((m, n): (usize, usize), rounds: u64) -> Result<(), String> {
    let cfg = device_config(Quant::None);
    let topo = Topology::contiguous(m, n, 4 * n.max(2)).map_err(|e| e.to_string())?;
    let comms = Communicator::local_group_cuda(&topo, &cfg, None).map_err(|e| e.to_string())?;
    let wl = device_workload(m, n);
    std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                let wl = wl.clone();
                s.spawn(move || device_rank_rounds(&mut comm, &wl, rounds))
            })
            .collect();
        join_ranks(ranks)
    })?;
    announce(&format!(
        "{rounds} rounds of device-buffer calls checked on {} threads",
        m + n
    ));
    Ok(())
}

/// The conformance suite on the cuda fabric's threads mode: `size` ranks as threads.
fn threads_conformance(size: usize) -> xccl::Result<()> {
    // A host prefix that ends inside the conformance suite's puts and gets: both sides and the
    // split between them are exercised.
    let prefixes = vec![6000; size];
    let fabrics =
        CudaFabric::local_group(&vec![MIN_WINDOW; size], &prefixes, min_slots(size), None)?;
    if !fabrics.iter().all(CudaFabric::threads) {
        return Err(fail(
            "a local group's fabric is not in the threads mode".into(),
        ));
    }
    std::thread::scope(|s| {
        let ranks: Vec<_> = fabrics
            .iter()
            .map(|f| s.spawn(move || conformance::run_all(f)))
            .collect();
        ranks
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| fail("a rank panicked".into()))?)
    })?;
    announce(&format!("conformance on {size} threads"));
    Ok(())
}

/// [`threads_rounds`] with chunks of `chunk` bytes between progress signals (the fabric's
/// floor lowered to it): every message of the device-buffer calls in several chunks, A2E and E2A
/// (at hidden 32 bf16 a row is about 100 bytes).
fn threads_chunks((m, n): (usize, usize), rounds: u64, chunk: usize) -> Result<(), String> {
    let mut cfg = device_config(Quant::None);
    cfg.chunk_bytes = chunk;
    let topo = Topology::contiguous(m, n, 4 * n.max(2)).map_err(|e| e.to_string())?;
    let lens = Communicator::window_lens(&topo, &cfg).map_err(|e| e.to_string())?;
    let prefixes: Vec<usize> = (0..lens.len())
        .map(|r| Communicator::cuda_host_prefix(&topo, &cfg, r))
        .collect();
    let slots = Communicator::signal_slots(&topo);
    let mut fabrics =
        CudaFabric::local_group(&lens, &prefixes, slots, None).map_err(|e| e.to_string())?;
    for f in &mut fabrics {
        f.set_chunk_floor(chunk);
    }
    let (topo, wl) = (Arc::new(topo), device_workload(m, n));
    std::thread::scope(|s| {
        let ranks: Vec<_> = fabrics
            .into_iter()
            .map(|f| {
                let (topo, cfg, wl) = (topo.clone(), cfg.clone(), wl.clone());
                s.spawn(move || {
                    // SAFETY: the fabric is moved in; nothing else in this process uses its
                    // windows but the job's communicators.
                    let mut comm = unsafe { Communicator::new(Box::new(f), topo, cfg) }
                        .map_err(|e| e.to_string())?;
                    if comm.config().chunk_bytes != chunk {
                        return Err(format!("chunk_bytes {}", comm.config().chunk_bytes));
                    }
                    device_rank_rounds(&mut comm, &wl, rounds)
                })
            })
            .collect();
        join_ranks(ranks)
    })?;
    announce(&format!(
        "{rounds} rounds in chunks of {chunk} bytes checked"
    ));
    Ok(())
}

/// Waits for every rank thread; the first error (or panic) of them.
fn join_ranks(
    ranks: Vec<std::thread::ScopedJoinHandle<'_, Result<(), String>>>,
) -> Result<(), String> {
    ranks
        .into_iter()
        .try_for_each(|h| h.join().map_err(|_| "a rank panicked".to_string())?)
}

/// The config of the device-buffer tests.
fn device_config(quant: Quant) -> MoeConfig {
    let mut cfg = MoeConfig::new(32, DType::BF16, 4, 16);
    cfg.timeout = Duration::from_secs(30);
    cfg.a2e_quant = quant;
    cfg.e2a_quant = quant;
    cfg
}

/// The workload of the device-buffer tests.
fn device_workload(m: usize, n: usize) -> xccl::testing::harness::Workload {
    xccl::testing::harness::Workload {
        seed: 0xd1ce + (m * 10 + n) as u64,
        tokens: 16,
        vary: true,
        skew: None,
        shared_experts: 0,
    }
}

/// `rounds` rounds of one rank: the device-buffer calls (an expert rank's receives and replies
/// expert-major and token-major in turn), every third round the host calls on the same
/// communicator, each checked bit for bit against the reference.
fn device_rank_rounds(
    comm: &mut Communicator,
    wl: &xccl::testing::harness::Workload,
    rounds: u64,
) -> Result<(), String> {
    use half::bf16;
    use xccl::testing::harness::{attention_round_with, expert_round, expert_round_device};
    use xccl::testing::harness::{expert_round_tokens_with, Buffers};
    let mut batch = xccl::ExpertBatch::new();
    let mut tokens = xccl::TokenBatch::new();
    for round in 0..rounds {
        let host = round % 3 == 2;
        let verdict = match comm.role() {
            xccl::Role::Attention if host => {
                attention_round_with::<bf16>(comm, wl, round, Buffers::Copy)
            }
            xccl::Role::Attention => attention_round_with::<bf16>(comm, wl, round, Buffers::Device),
            xccl::Role::Expert if host => expert_round::<bf16>(comm, wl, round, &mut batch, true),
            xccl::Role::Expert if round % 3 == 1 => {
                let b = Buffers::Device;
                expert_round_tokens_with::<bf16>(comm, wl, round, &mut tokens, true, b)
            }
            xccl::Role::Expert => expert_round_device::<bf16>(comm, wl, round, &mut batch, true),
        };
        verdict
            .map_err(|e| format!("round {round}: {e}"))?
            .map_err(|e| format!("round {round}: {e}"))?;
    }
    Ok(())
}

/// Rounds of the device-buffer calls (`a2e_send_device`, `e2a_recv_device`, `a2e_recv_device`,
/// `e2a_send_device`), every third round the host calls on the same communicator, each checked
/// bit for bit against the reference (`xccl::testing::harness`).
fn device_rounds(
    ctx: &ChildCtx,
    (m, n, relays): (usize, usize, usize),
    rounds: u64,
    quant: Quant,
) -> Result<(), String> {
    let ex = ctx.connect(CONNECT).map_err(|e| e.to_string())?;
    let mut topo = Topology::contiguous(m, n, 4 * n.max(2)).map_err(|e| e.to_string())?;
    if relays > 0 {
        topo = topo.with_relays(Some(relays)).map_err(|e| e.to_string())?;
    }
    let cfg = device_config(quant);
    let mut comm =
        Communicator::init_cuda(ex, Arc::new(topo), cfg, None).map_err(|e| e.to_string())?;
    device_rank_rounds(&mut comm, &device_workload(m, n), rounds)?;
    announce(&format!("{rounds} rounds of device-buffer calls checked"));
    Ok(())
}

/// Rank 1 has no NVRTC: `init_cuda` fails on both ranks, rank 1 naming the library and
/// itself, rank 0 naming rank 1 and its data plane.
fn no_nvrtc_on_rank_1(ctx: &ChildCtx) -> xccl::Result<()> {
    let ex = ctx.connect(CONNECT)?;
    let topo = Topology::contiguous(1, 1, 4)?;
    let cfg = MoeConfig::new(32, DType::BF16, 2, 8);
    let r = Communicator::init_cuda(ex, Arc::new(topo), cfg, None);
    match (ctx.rank, r) {
        (1, Err(e @ Error::FabricUnavailable { .. }))
            if e.to_string().contains("libnvrtc") && e.to_string().contains("rank 1") =>
        {
            Ok(())
        }
        (0, Err(Error::PeerFailed { peer: 1, detail })) if detail.contains("data plane") => {
            announce(&format!("rank 1 failed: {detail}"));
            Ok(())
        }
        (rank, Err(e)) => Err(fail(format!("rank {rank}: unexpected error: {e}"))),
        (rank, Ok(_)) => Err(fail(format!("rank {rank}: init succeeded"))),
    }
}

/// No driver anywhere: `init_cuda` fails with FabricUnavailable naming the library.
fn missing_library(ctx: &ChildCtx) -> xccl::Result<()> {
    let ex: Arc<dyn Exchange> = ctx.connect(CONNECT)?;
    let topo = Arc::new(Topology::contiguous(1, 1, 4)?);
    let cfg = MoeConfig::new(8, DType::F32, 2, 4);
    match Communicator::init_cuda(ex, topo, cfg, None) {
        Err(Error::FabricUnavailable { fabric, detail })
            if fabric == "cuda"
                && detail.contains("libcuda.so.1")
                && detail.contains(LIBRARY_ENV)
                && detail.contains(&format!("rank {}", ctx.rank)) =>
        {
            announce(&format!("unavailable: {detail}"));
            Ok(())
        }
        Err(other) => Err(fail(format!("expected FabricUnavailable, got {other}"))),
        Ok(_) => Err(fail("the cuda fabric came up without a driver".into())),
    }
}

/// Rank 1's init fails in driver call `call` (the parent sets the stand-in up so, or takes its
/// driver away for `call` "libcuda.so.1"): rank 1 reports the call, the code and itself; rank 0
/// fails promptly naming rank 1 and the call.
fn init_fails_on_rank_1(ctx: &ChildCtx, call: &str, code: i64) -> xccl::Result<()> {
    let start = Instant::now();
    let r = join(ctx);
    let took = start.elapsed();
    // Whatever init made is released by now: no stand-in segment (own or a peer's) is still
    // mapped in this process, and none of its own is left in /dev/shm.
    if r.is_err() {
        let prefix = std::env::var(PREFIX_ENV).unwrap_or_default();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        if let Some(line) = maps.lines().find(|l| l.contains(&prefix)) {
            return Err(fail(format!("still mapped after the failed init: {line}")));
        }
        let own = xccl_tests::shm_entries(&format!("{prefix}-{}-", std::process::id()));
        if !own.is_empty() {
            return Err(fail(format!(
                "left in /dev/shm after the failed init: {own:?}"
            )));
        }
    }
    match (ctx.rank, r) {
        (1, Err(e @ Error::Native { .. })) => {
            let Error::Native {
                call: c,
                code: k,
                context,
                ..
            } = &e
            else {
                unreachable!()
            };
            if *c != call || *k != code || !context.starts_with("rank 1:") {
                return Err(fail(format!("wrong error: {e}")));
            }
            announce(&format!("error: {e}"));
            Ok(())
        }
        (1, Err(e @ Error::FabricUnavailable { .. })) if call == "libcuda.so.1" => {
            let s = e.to_string();
            if !s.contains("libcuda.so.1") || !s.contains("rank 1") {
                return Err(fail(format!("wrong error: {s}")));
            }
            Ok(())
        }
        (0, Err(Error::PeerFailed { peer: 1, detail }))
            if detail.contains(call) && took < Duration::from_secs(10) =>
        {
            announce(&format!("rank 1 failed: {detail}"));
            Ok(())
        }
        (_, Err(other)) => Err(fail(format!(
            "rank {}: unexpected error after {took:?}: {other}",
            ctx.rank
        ))),
        (_, Ok(_)) => Err(fail(format!("rank {}: init succeeded", ctx.rank))),
    }
}

/// With `CUDA_STANDIN_FAIL=cuStreamQuery:999:1` init succeeds (its one stream query) and the
/// first signal's stream synchronize fails naming the call, the peer and this rank.
fn signal_fails(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx)?;
    let peer = 1 - ctx.rank;
    match f.signal(peer, 0, 1) {
        Err(
            e @ Error::Native {
                call: "cuStreamQuery",
                code: 999,
                ..
            },
        ) => {
            let s = e.to_string();
            if !s.contains(&format!("rank {}", ctx.rank))
                || !s.contains(&format!("signal to rank {peer}"))
                || !s.contains("CUDA_ERROR_UNKNOWN")
            {
                return Err(fail(format!("wrong error: {s}")));
            }
            announce(&format!("error: {s}"));
        }
        other => return Err(fail(format!("expected a driver error, got {other:?}"))),
    }
    f.barrier(CONNECT)
}

fn killed_after_init(ctx: &ChildCtx) -> xccl::Result<()> {
    xccl_tests::rank_1_killed_after_init(&join(ctx)?)
}

/// Rows of `PLANE_HIDDEN` bf16 elements that rank 0 writes into its window for
/// [`plane_between_windows`].
const PLANE_ROWS: usize = 4;
const PLANE_HIDDEN: usize = 96;
/// Where rank 1's kernels write their two sums in rank 0's window.
const PLANE_SUMS_AT: usize = 4096;

/// Rank 0's rows: finite bf16 values, varied in sign and magnitude.
fn plane_pattern() -> Vec<u8> {
    (0..PLANE_ROWS * PLANE_HIDDEN)
        .flat_map(|i| {
            let v = ((i * 37 % 113) as f32 - 56.0) / 7.0 * (1 << (i % 9)) as f32;
            half::bf16::from_f32(v).to_le_bytes()
        })
        .collect()
}

/// The two sums rank 1 plans over rows at `base` (a row is `stride` bytes): rows 0, 1 and 2
/// added as the attention side adds contributions, and rows 3 and 1 weighted (0.5, -2.0) as
/// the expert side sums its experts' outputs; written at `dst` and `dst + stride`.
fn plane_sums(
    base: u64,
    dst: u64,
    stride: u64,
) -> (
    Vec<xccl::moe::dataplane::SumRow>,
    Vec<xccl::moe::dataplane::SumTerm>,
) {
    use xccl::moe::dataplane::{SumRow, SumTerm};
    let term = |r: u64, weight: f32| SumTerm {
        src: base + r * stride,
        weight,
        int8: 0,
    };
    let rows = vec![
        SumRow {
            dst,
            first_term: 0,
            num_terms: 3,
            init_first: 1,
            reserved: 0,
        },
        SumRow {
            dst: dst + stride,
            first_term: 3,
            num_terms: 2,
            init_first: 0,
            reserved: 0,
        },
    ];
    let terms = vec![
        term(0, 1.0),
        term(1, 1.0),
        term(2, 1.0),
        term(3, 0.5),
        term(1, -2.0),
    ];
    (rows, terms)
}

/// The data plane moving and summing rows between two processes' device windows: rank 0 writes
/// rows into its window; rank 1's `CudaPlane` copies them into its own window and writes two
/// sums of them back into rank 0's, through the IPC mapping, then signals. Rank 0 checks both
/// against the host plane bit for bit. The rows never pass through rank 1's host memory.
fn plane_between_windows(ctx: &ChildCtx) -> xccl::Result<()> {
    use xccl::moe::dataplane::cuda::CudaPlane;
    use xccl::moe::dataplane::host::HostPlane;
    use xccl::moe::dataplane::{CopyRun, DataPlane};
    let f = join(ctx)?;
    let timeout = Duration::from_secs(30);
    let deadline = || Instant::now() + timeout;
    let stride = (PLANE_HIDDEN * 2) as u64;
    let pattern = plane_pattern();
    if ctx.rank == 0 {
        f.put(0, 0, &pattern)?;
        f.signal(1, 0, 1)?;
        f.wait_signal(0, 1, "rank 1's kernels", deadline(), &|v| v == 2)?;
        let mut sums = vec![0u8; 2 * stride as usize];
        f.get(0, PLANE_SUMS_AT, &mut sums)?;
        let mut copied = vec![0u8; pattern.len()];
        f.get(1, 0, &mut copied)?;
        if copied != pattern {
            return Err(fail("rank 1's copy of the rows differs".into()));
        }
        let mut want = vec![0u8; sums.len()];
        let (rows, terms) = plane_sums(pattern.as_ptr() as u64, want.as_mut_ptr() as u64, stride);
        // SAFETY: every address lies in `pattern` or `want`, alive for the call.
        unsafe { HostPlane::new().sum_rows(DType::BF16, PLANE_HIDDEN, &rows, &terms) }?;
        if sums != want {
            return Err(fail(format!(
                "the device sums differ from the host plane's: {:02x?} against {:02x?}",
                &sums[..8],
                &want[..8]
            )));
        }
        announce("the device plane's copies and sums match the host plane bit for bit");
    } else {
        f.wait_signal(0, 0, "rank 0's rows", deadline(), &|v| v == 1)?;
        let stream = xccl::cuda::Stream::new(f.device())?;
        let mut plane = CudaPlane::new(f.device(), stream, ctx.rank, timeout)?;
        let (from, mine) = (f.device_window(0).unwrap(), f.device_window(1).unwrap());
        let runs = [CopyRun {
            src: from.addr(),
            dst: mine.addr(),
            len: pattern.len() as u64,
        }];
        let (rows, terms) = plane_sums(from.addr(), from.addr() + PLANE_SUMS_AT as u64, stride);
        // SAFETY: every range lies in a window (rank 0's mapped here, this rank's own) well
        // inside its length, and nobody else writes them until the signal below.
        unsafe {
            plane.copy_runs(&runs)?;
            plane.sum_rows(DType::BF16, PLANE_HIDDEN, &rows, &terms)?;
        }
        plane.complete(deadline())?;
        f.signal(0, 0, 2)?;
    }
    f.barrier(timeout)
}

/// With no NVRTC to be found, a data plane cannot be made: FabricUnavailable naming the
/// library and this rank, after a fabric that works.
fn plane_without_nvrtc(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx)?;
    let stream = xccl::cuda::Stream::new(f.device())?;
    match xccl::moe::dataplane::cuda::CudaPlane::new(f.device(), stream, ctx.rank, CONNECT) {
        Err(Error::FabricUnavailable { fabric, detail })
            if fabric == "cuda"
                && detail.contains("libnvrtc")
                && detail.contains(&format!("rank {}", ctx.rank)) =>
        {
            announce(&format!("unavailable: {detail}"));
            f.barrier(CONNECT)
        }
        Err(e) => Err(fail(format!("unexpected error: {e}"))),
        Ok(_) => Err(fail("a data plane without NVRTC".into())),
    }
}

// ---- parent side ----

/// Spawns the job with the stand-in as driver; `per_rank(rank)` adds environment to a rank.
fn spawn(
    scenario: &str,
    size: usize,
    devices: usize,
    per_rank: &dyn Fn(usize) -> Vec<(&'static str, Option<String>)>,
) -> (Job, StandinSegments) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-standin");
    xccl_tests::cuda_support::spawn(ENTRY, scenario, (size, devices), &dir, per_rank)
}

fn run_ok(scenario: &str, size: usize, devices: usize, timeout: Duration) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-standin");
    xccl_tests::cuda_support::run_ok(ENTRY, scenario, (size, devices), &dir, timeout);
}

/// Runs `scenario` with rank 1 given `env`, expecting every rank to succeed (each checks its
/// own error) and nothing left in `/dev/shm`.
fn run_with_rank_1_env(scenario: &str, env: Vec<(&'static str, Option<String>)>) {
    let (mut job, segs) = spawn(scenario, 2, 1, &|rank| {
        if rank == 1 {
            env.clone()
        } else {
            Vec::new()
        }
    });
    job.expect_success(Duration::from_secs(30));
    println!("rank 0: {}", job.output(0).trim());
    println!("rank 1: {}", job.output(1).trim());
    assert_eq!(segs.left(), Vec::<String>::new(), "stand-in segments left");
}

#[test]
fn cuda_conformance_with_2_processes_on_2_devices() {
    run_ok("conformance:2", 2, 2, Duration::from_secs(60));
}

#[test]
fn cuda_conformance_with_2_processes_sharing_one_device() {
    run_ok("conformance:1", 2, 1, Duration::from_secs(60));
}

#[test]
fn cuda_conformance_with_3_processes_on_2_devices() {
    run_ok("conformance:2", 3, 2, Duration::from_secs(60));
}

#[test]
fn cuda_plane_copies_and_sums_rows_between_device_windows_of_two_processes() {
    run_ok("plane", 2, 1, Duration::from_secs(60));
}

#[test]
fn a_data_plane_without_nvrtc_is_unavailable_naming_the_library_and_the_rank() {
    let missing = Some("/nonexistent/libnvrtc.so.13".to_string());
    let (mut job, segs) = spawn("plane_without_nvrtc", 2, 1, &|_| {
        vec![("XCCL_NVRTC_LIBRARY", missing.clone())]
    });
    job.expect_success(Duration::from_secs(30));
    println!("rank 1: {}", job.output(1).trim());
    assert_eq!(segs.left(), Vec::<String>::new(), "stand-in segments left");
}

#[test]
fn cuda_one_attention_one_expert_matches_reference() {
    run_ok("moe:1:1:100", 2, 1, Duration::from_secs(60));
}

#[test]
fn device_buffer_calls_match_the_reference_bit_for_bit_1a_1e() {
    run_ok("device:1:1:12:none:0", 2, 1, Duration::from_secs(60));
}

#[test]
fn cuda_conformance_with_3_threads_on_2_devices() {
    run_ok("threads_conformance:3", 1, 2, Duration::from_secs(60));
}

#[test]
fn device_buffer_calls_in_many_chunks_match_the_reference_bit_for_bit_2a_3e() {
    run_ok("threads_chunks:2:3:9:512", 1, 2, Duration::from_secs(90));
}

#[test]
fn device_buffer_calls_in_the_threads_mode_match_the_reference_bit_for_bit_2a_3e() {
    run_ok("threads:2:3:9", 1, 2, Duration::from_secs(90));
}

#[test]
fn device_buffer_calls_through_relays_match_the_reference_bit_for_bit_4a_2e() {
    run_ok("device:4:2:9:none:2", 6, 2, Duration::from_secs(90));
}

#[test]
fn device_buffer_calls_through_relays_with_int8_match_the_reference_bit_for_bit_4a_3e() {
    run_ok("device:4:3:9:int8:2", 7, 2, Duration::from_secs(90));
}

#[test]
fn device_buffer_calls_with_int8_on_the_wire_match_the_reference_bit_for_bit_3a_2e() {
    run_ok("device:3:2:9:int8:0", 5, 2, Duration::from_secs(90));
}

#[test]
fn device_buffer_calls_match_the_reference_bit_for_bit_2a_3e_on_2_devices() {
    run_ok("device:2:3:9:none:0", 5, 2, Duration::from_secs(90));
}

#[test]
fn cuda_two_attention_two_expert_matches_reference() {
    run_ok("moe:2:2:60", 4, 2, Duration::from_secs(90));
}

#[test]
fn missing_driver_is_fabric_unavailable_naming_the_library() {
    let (mut job, segs) = spawn("missing_library", 1, 1, &|_| {
        vec![
            (LIBRARY_ENV, Some("/nonexistent/libcuda.so.1".into())),
            ("LD_LIBRARY_PATH", None),
        ]
    });
    job.expect_success(Duration::from_secs(30));
    let out = job.output(0);
    println!("{}", out.trim());
    assert!(
        out.contains("/nonexistent/libcuda.so.1"),
        "the tried path is named: {out}"
    );
    assert_eq!(segs.left(), Vec::<String>::new());
}

#[test]
fn a_rank_without_the_driver_fails_every_rank_promptly() {
    run_with_rank_1_env(
        "init_fails_on_rank_1:libcuda.so.1:0",
        vec![
            (LIBRARY_ENV, Some("/nonexistent/libcuda.so.1".into())),
            ("LD_LIBRARY_PATH", None),
        ],
    );
}

#[test]
fn a_rank_without_a_device_fails_every_rank_naming_cuinit() {
    run_with_rank_1_env(
        "init_fails_on_rank_1:cuInit:100",
        vec![(DEVICES_ENV, Some("0".into()))],
    );
}

#[test]
fn an_injected_driver_error_at_init_names_the_call_and_the_rank_on_every_rank() {
    // The device is open, then its stream cannot be made (a call whose own context does not
    // name the rank: the fabric adds it).
    run_with_rank_1_env(
        "init_fails_on_rank_1:cuStreamCreate:999",
        vec![(FAIL_ENV, Some("cuStreamCreate:999".into()))],
    );
}

#[test]
fn a_rank_without_nvrtc_fails_init_cuda_on_every_rank_naming_it() {
    let missing = Some("/nonexistent/libnvrtc.so.13".to_string());
    run_with_rank_1_env("no_nvrtc_on_rank_1", vec![("XCCL_NVRTC_LIBRARY", missing)]);
}

#[test]
fn out_of_device_memory_at_init_names_the_call_and_the_rank_on_every_rank() {
    run_with_rank_1_env(
        "init_fails_on_rank_1:cuMemAlloc_v2:2",
        vec![(LIMIT_ENV, Some("4096".into()))],
    );
}

#[test]
fn an_ipc_handle_the_driver_refuses_fails_every_rank_and_leaves_nothing_mapped() {
    run_with_rank_1_env(
        "init_fails_on_rank_1:cuIpcOpenMemHandle_v2:201",
        vec![(FAIL_ENV, Some("cuIpcOpenMemHandle_v2:201".into()))],
    );
}

#[test]
fn a_driver_error_in_a_signal_names_the_call_the_peer_and_the_rank() {
    let (mut job, segs) = spawn("signal_fails", 2, 1, &|_| {
        vec![(FAIL_ENV, Some("cuStreamQuery:999:1".into()))]
    });
    job.expect_success(Duration::from_secs(30));
    println!("{}", job.output(0).trim());
    assert_eq!(segs.left(), Vec::<String>::new(), "stand-in segments left");
}

#[test]
fn sigkilled_peer_is_reported_naming_its_rank() {
    let (mut job, _segs) = spawn("killed_after_init", 2, 1, &|_| Vec::new());
    job.wait(Duration::from_secs(30));
    job.assert_killed(1);
    job.assert_succeeded(0);
    println!("survivor: {}", job.output(0).trim());
}
