//! The ascend fabric between real processes, through the real `dlopen` and FFI path, against a
//! **stand-in** of the Ascend runtime (`tests/ascend_standin/acl_standin.c`, built here with gcc
//! as `libascendcl.so`; no NPU is involved):
//! - the conformance suite with 2 and 3 ranks, the library found through `ASCEND_HOME_PATH` and
//!   through `LD_LIBRARY_PATH`;
//! - A2E/E2A (1A:1E, 2A:2E, 1A:3E, INT8 on the wire; push and pull; every receive path, as in
//!   `moe_shm.rs`) checked bit for bit against the reference, the window in "device memory"
//!   reached only through `put`/`get`;
//! - puts and gets larger than the staging buffer from threads that did not make the fabric, and
//!   a collective close;
//! - a SIGKILLed peer, and an expert SIGKILLed mid-run, named by the survivors; a rank that left
//!   cleanly not taken for a crash, a dead one failing waits on other peers;
//! - the missing-library error (on every rank, and on one rank only), runtime error codes
//!   surfacing with the call's name and the runtime's message, mismatched slot counts;
//! - the stand-in's own enforcement of the documented IPC rules.
//!
//! Every job's stand-in segments are checked to be gone from `/dev/shm`.
//!
//! Every test re-runs this binary as its ranks (see `xccl_tests::Job`).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use half::bf16;
use xccl::bootstrap::{Exchange, RootConfig, UniqueId};
use xccl::fabric::ascend::AscendFabric;
use xccl::fabric::conformance::{self, min_slots, MIN_WINDOW};
use xccl::fabric::{deadline_after, Fabric};
use xccl::testing::harness::{attention_round_with, expert_round, Buffers, Workload};
use xccl::{Communicator, DType, Error, ExpertBatch, MoeConfig, Quant, Role, Topology};
use xccl_tests::{announce, child_main, ChildCtx, Job, StandinSegments};

const ENTRY: &str = "child_rank_entry";
const CONNECT: Duration = Duration::from_secs(30);
/// The stand-in's failure-injection variable (`<function>:<code>[:<skip>]`).
const FAIL_ENV: &str = "ACL_STANDIN_FAIL";
/// Prefix of the stand-in's shared-memory segments.
const PREFIX_ENV: &str = "ACL_STANDIN_SHM_PREFIX";

#[test]
fn child_rank_entry() {
    child_main(dispatch);
}

fn dispatch(scenario: &str, ctx: &ChildCtx) -> Result<(), String> {
    let parts: Vec<&str> = scenario.split(':').collect();
    let r = match parts.as_slice() {
        ["conformance"] => conformance_rank(ctx),
        ["moe", m, n, rounds] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            return checked_rounds(ctx, p(m)?, p(n)?, p(rounds)? as u64, Quant::None);
        }
        ["moe_int8", m, n, rounds] => {
            let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
            return checked_rounds(ctx, p(m)?, p(n)?, p(rounds)? as u64, Quant::Int8);
        }
        ["missing_library"] => missing_library(ctx),
        ["unbounded_sync"] => unbounded_sync(ctx),
        ["missing_on_rank_1"] => missing_on_rank_1(ctx),
        ["signal_fails"] => signal_fails(ctx),
        ["init_fails"] => init_fails(ctx),
        ["killed_after_init"] => killed_after_init(ctx),
        ["slot_mismatch"] => slot_mismatch(ctx),
        ["threads_and_close"] => threads_and_close(ctx),
        ["standin_rules"] => standin_rules(ctx),
        ["moe_kill"] => return killed_expert(ctx),
        ["departed"] => departed(ctx),
        ["third_dies"] => third_dies(ctx),
        _ => return Err(format!("unknown scenario {scenario:?}")),
    };
    r.map_err(|e| e.to_string())
}

fn join(ctx: &ChildCtx) -> xccl::Result<AscendFabric> {
    let ex: Arc<dyn Exchange> = ctx.connect(CONNECT)?;
    // One device per rank: ranks on different devices go through peer access.
    AscendFabric::new(ex, MIN_WINDOW, min_slots(ctx.size), ctx.rank as i32)
}

fn fail(detail: String) -> Error {
    Error::Protocol {
        peer: usize::MAX,
        detail,
    }
}

fn conformance_rank(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx)?;
    // The stand-in exports every declared function: the loader must have resolved them all.
    let acl = xccl_sys::acl::load().map_err(|e| fail(e.to_string()))?;
    for name in xccl_sys::acl::REQUIRED
        .iter()
        .chain(xccl_sys::acl::OPTIONAL)
    {
        if !acl.has(name) {
            return Err(fail(format!(
                "{name} did not resolve in {}",
                acl.path().display()
            )));
        }
    }
    let caps = f.capabilities();
    if caps.load_store || !caps.remote_read || f.peer_window(0).is_some() {
        return Err(fail(format!("unexpected capabilities {caps:?}")));
    }
    conformance::run_all(&f)?;
    announce(&format!(
        "device {} via {}",
        f.device(),
        acl.path().display()
    ));
    Ok(())
}

/// Checked rounds; with `quant` INT8, A2E and E2A both quantize (bit-exact reference too).
fn checked_rounds(
    ctx: &ChildCtx,
    m: usize,
    n: usize,
    rounds: u64,
    quant: Quant,
) -> Result<(), String> {
    let device = ctx.rank as i32;
    xccl_tests::checked_device_rounds(ctx, (m, n), rounds, quant, "ascend", &|ex, topo, cfg| {
        Communicator::init_ascend(ex, topo, cfg, device)
    })
}

/// Rank 2 drops its fabric and exits cleanly; rank 0's wait for rank 1 (which signals later)
/// must not take that for a crash, while a check of rank 2 itself reports it gone (left the
/// job, whether its process still runs or not).
fn departed(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx)?;
    f.barrier(CONNECT)?;
    match ctx.rank {
        2 => Ok(()),
        1 => {
            std::thread::sleep(Duration::from_millis(300));
            f.signal(0, 0, 7)
        }
        _ => {
            f.wait_signal(
                0,
                1,
                "rank 1's late signal",
                deadline_after(CONNECT),
                &|v| v == 7,
            )?;
            let start = Instant::now();
            loop {
                match f.check_peer(2) {
                    Err(Error::PeerFailed { peer: 2, detail })
                        if detail.contains("left the job") =>
                    {
                        announce(&format!("rank 2: {detail}"));
                        return Ok(());
                    }
                    Ok(()) if start.elapsed() < Duration::from_secs(5) => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    other => return Err(fail(format!("check of rank 2: {other:?}"))),
                }
            }
        }
    }
}

/// Rank 2 is SIGKILLed while rank 0 waits for rank 1 (which signals only 3 s later): the wait
/// fails promptly naming rank 2, although it awaits rank 1.
fn third_dies(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx)?;
    f.barrier(CONNECT)?;
    match ctx.rank {
        2 => xccl_tests::sigkill_self(),
        1 => {
            std::thread::sleep(Duration::from_millis(3000));
            let _ = f.signal(0, 0, 1);
            std::thread::sleep(Duration::from_millis(500));
            Ok(())
        }
        _ => {
            let start = Instant::now();
            let r = f.wait_signal(0, 1, "rank 1's signal", deadline_after(CONNECT), &|v| {
                v >= 1
            });
            match r {
                Err(Error::PeerFailed { peer: 2, detail })
                    if start.elapsed() < Duration::from_millis(2500) =>
                {
                    announce(&format!("noticed in {:?}: {detail}", start.elapsed()));
                    Ok(())
                }
                other => Err(fail(format!(
                    "expected PeerFailed naming rank 2, got {other:?} after {:?}",
                    start.elapsed()
                ))),
            }
        }
    }
}

/// 1A:2E; expert rank 1 is SIGKILLed after 5 rounds: the attention rank's next round fails
/// naming it, the other expert's completes.
fn killed_expert(ctx: &ChildCtx) -> Result<(), String> {
    let mut cfg = MoeConfig::new(16, DType::BF16, 2, 8);
    cfg.timeout = Duration::from_secs(30);
    let ex = ctx.connect(CONNECT).map_err(|e| e.to_string())?;
    let topo = Arc::new(Topology::contiguous(1, 2, 8).map_err(|e| e.to_string())?);
    let mut comm =
        Communicator::init_ascend(ex, topo, cfg, ctx.rank as i32).map_err(|e| e.to_string())?;
    let wl = Workload {
        seed: 9,
        tokens: 8,
        vary: false,
        skew: None,
        shared_experts: 0,
    };
    let mut batch = ExpertBatch::new();
    let mut round = |comm: &mut Communicator, r: u64| match comm.role() {
        Role::Attention => attention_round_with::<bf16>(comm, &wl, r, Buffers::Copy),
        Role::Expert => expert_round::<bf16>(comm, &wl, r, &mut batch, true),
    };
    for r in 0..5 {
        round(&mut comm, r).map_err(|e| e.to_string())??;
    }
    if ctx.rank == 1 {
        // Dies holding round 5's rows: only round 5 can fail.
        return Err(xccl_tests::sigkill_holding_the_next_a2e(&mut comm));
    }
    let start = Instant::now();
    match (ctx.rank, round(&mut comm, 5)) {
        // The other expert rank's round does not wait for rank 1, but its liveness checks
        // may notice the death first (then rank 0 learns it through rank 2's abort).
        (2, Ok(Ok(()))) | (2, Err(Error::PeerFailed { peer: 1, .. })) => Ok(()),
        (0, Err(Error::PeerFailed { peer: 1, .. })) if start.elapsed() < Duration::from_secs(5) => {
            announce(&format!("noticed in {:?}", start.elapsed()));
            Ok(())
        }
        (_, other) => Err(format!(
            "rank {}: expected PeerFailed naming rank 1 within 5 s, got {other:?} after {:?}",
            ctx.rank,
            start.elapsed()
        )),
    }
}

/// A 1A:1E communicator (4 experts) of this rank on the ascend fabric (the init scenarios).
fn init_small(ctx: &ChildCtx) -> xccl::Result<Communicator> {
    let ex: Arc<dyn Exchange> = ctx.connect(CONNECT)?;
    let topo = Arc::new(Topology::contiguous(1, 1, 4)?);
    let cfg = MoeConfig::new(8, DType::F32, 2, 4);
    Communicator::init_ascend(ex, topo, cfg, 0)
}

fn missing_library(ctx: &ChildCtx) -> xccl::Result<()> {
    match init_small(ctx) {
        Err(Error::FabricUnavailable { fabric, detail })
            if fabric == "ascend"
                && detail.contains("libascendcl.so")
                && detail.contains("ASCEND_HOME_PATH") =>
        {
            announce(&format!("unavailable: {detail}"));
            Ok(())
        }
        Err(other) => Err(fail(format!("expected FabricUnavailable, got {other}"))),
        Ok(_) => Err(fail("the ascend fabric came up without a runtime".into())),
    }
}

/// A runtime without `aclrtSynchronizeStreamWithTimeout` (its stream synchronize has no bound)
/// is refused at init, naming the function.
fn unbounded_sync(ctx: &ChildCtx) -> xccl::Result<()> {
    match init_small(ctx) {
        Err(Error::FabricUnavailable { fabric, detail })
            if fabric == "ascend" && detail.contains("aclrtSynchronizeStreamWithTimeout") =>
        {
            announce(&format!("unavailable: {detail}"));
            Ok(())
        }
        Err(other) => Err(fail(format!("expected FabricUnavailable, got {other}"))),
        Ok(_) => Err(fail(
            "the ascend fabric came up on a runtime whose synchronize has no bound".into(),
        )),
    }
}

/// Rank 1 cannot find the runtime; rank 0 has it and must fail promptly, naming rank 1.
fn missing_on_rank_1(ctx: &ChildCtx) -> xccl::Result<()> {
    if ctx.rank == 1 {
        // This child is the only thread touching the environment at this point.
        std::env::set_var("ASCEND_HOME_PATH", "/nonexistent-ascend-home");
        std::env::remove_var("LD_LIBRARY_PATH");
    }
    let start = Instant::now();
    match (ctx.rank, join(ctx)) {
        (1, Err(Error::FabricUnavailable { detail, .. })) if detail.contains("libascendcl.so") => {
            Ok(())
        }
        (0, Err(Error::PeerFailed { peer: 1, detail }))
            if detail.contains("libascendcl.so") && start.elapsed() < Duration::from_secs(10) =>
        {
            announce(&format!("rank 1 failed: {detail}"));
            Ok(())
        }
        (_, other) => Err(fail(format!(
            "rank {}: unexpected outcome {other:?} after {:?}",
            ctx.rank,
            start.elapsed()
        ))),
    }
}

/// With `ACL_STANDIN_FAIL=aclrtValueWrite:<code>` init succeeds and the first signal fails.
fn signal_fails(ctx: &ChildCtx) -> xccl::Result<()> {
    let f = join(ctx)?;
    f.put(1 - ctx.rank, 0, &[7u8; 256])?;
    match f.signal(1 - ctx.rank, 0, 1) {
        Err(e @ Error::Native { .. }) => {
            let Error::Native {
                call,
                code,
                message,
                context,
                ..
            } = &e
            else {
                unreachable!()
            };
            if *call != "aclrtValueWrite"
                || *code != 507_899
                || !message.contains("injected failure of aclrtValueWrite")
                || !context.contains(&format!("rank {}", 1 - ctx.rank))
            {
                return Err(fail(format!("wrong error: {e}")));
            }
            announce(&format!("error: {e}"));
        }
        other => return Err(fail(format!("expected a runtime error, got {other:?}"))),
    }
    f.barrier(CONNECT)
}

/// With `ACL_STANDIN_FAIL=aclrtMalloc:207001` every rank fails in `new`, naming the call.
fn init_fails(ctx: &ChildCtx) -> xccl::Result<()> {
    match join(ctx) {
        Err(
            e @ Error::Native {
                call: "aclrtMalloc",
                code: 207_001,
                ..
            },
        ) if e.to_string().contains("injected failure of aclrtMalloc") => {
            announce(&format!("error: {e}"));
            Ok(())
        }
        Err(other) => Err(fail(format!("expected aclrtMalloc's error, got {other}"))),
        Ok(_) => Err(fail("init succeeded despite the injected failure".into())),
    }
}

fn killed_after_init(ctx: &ChildCtx) -> xccl::Result<()> {
    xccl_tests::rank_1_killed_after_init(&join(ctx)?)
}

/// The fabric used from a thread that did not create it (ACL binds devices per thread), then
/// closed collectively.
fn threads_and_close(ctx: &ChildCtx) -> xccl::Result<()> {
    // Larger than the staging buffer, so puts wrap around it and must wait for queued copies.
    const WINDOW: usize = 3 * xccl::fabric::ascend::STAGING_BYTES;
    let ex: Arc<dyn Exchange> = ctx.connect(CONNECT)?;
    let f = AscendFabric::new(ex, WINDOW, min_slots(ctx.size), ctx.rank as i32)?;
    let next = (ctx.rank + 1) % ctx.size;
    let prev = (ctx.rank + ctx.size - 1) % ctx.size;
    let byte = |i: usize, r: usize| (i * 7 + r) as u8;
    let data: Vec<u8> = (0..WINDOW).map(|i| byte(i, ctx.rank)).collect();
    let big = 2 * xccl::fabric::ascend::STAGING_BYTES + 12_345;
    std::thread::scope(|s| {
        s.spawn(|| -> xccl::Result<()> {
            // One put larger than staging, at an unaligned offset...
            f.put(next, 13, &data[13..13 + big])?;
            // ...then many small ones that add up to more than staging, before one signal.
            let mut at = 13 + big;
            while at < WINDOW {
                let n = (WINDOW - at).min(4_000);
                f.put(next, at, &data[at..at + n])?;
                at += n;
            }
            f.signal(next, 0, 1)
        })
        .join()
        .expect("putter thread")
    })?;
    f.wait_signal(
        0,
        prev,
        "the neighbour's put",
        deadline_after(CONNECT),
        &|v| v == 1,
    )?;
    let mut got = vec![0u8; WINDOW - 13];
    f.get(ctx.rank, 13, &mut got)?;
    if let Some(i) = (0..got.len()).find(|&i| got[i] != byte(i + 13, prev)) {
        return Err(fail(format!(
            "byte {} put from another thread differs",
            i + 13
        )));
    }
    // Read the neighbour's window remotely from yet another thread.
    // (Its window holds what this rank put: larger than staging, so the get is chunked.)
    let mut theirs = vec![0u8; WINDOW - 13];
    std::thread::scope(|s| {
        s.spawn(|| f.get(next, 13, &mut theirs))
            .join()
            .expect("getter")
    })?;
    if theirs[..] != data[13..] {
        return Err(fail("get from the neighbour returned wrong bytes".into()));
    }
    f.close(CONNECT)?;
    // xccl initialised ACL in this process, so it may finalize it (once).
    xccl::fabric::ascend::finalize_runtime()?;
    xccl::fabric::ascend::finalize_runtime()
}

/// The stand-in enforces the documented IPC rules that the fabric must respect (else the
/// conformance runs would prove little): no import before the exporter whitelisted the
/// importer's pid, no host<->device copy of imported memory. Raw calls, two processes.
fn standin_rules(ctx: &ChildCtx) -> xccl::Result<()> {
    use std::ffi::{c_void, CStr};
    use xccl_sys::acl;
    let ex: Arc<dyn Exchange> = ctx.connect(CONNECT)?;
    let lib = acl::load().map_err(|e| fail(e.to_string()))?;
    let rt = lib.runtime();
    let expect = |what: &str, got: acl::aclError, want: u32| {
        if got as u32 == want {
            Ok(())
        } else {
            Err(fail(format!("{what}: code {got}, expected {want}")))
        }
    };
    // Every raw call below: arguments are valid pointers to live locals or device addresses
    // returned by the stand-in, keys are NUL-terminated, lengths match the buffers.
    // SAFETY: as said above; aclInit accepts NULL.
    unsafe {
        expect("aclInit", rt.aclInit(std::ptr::null()), acl::ACL_SUCCESS)?;
        expect(
            "aclrtSetDevice",
            rt.aclrtSetDevice(ctx.rank as i32),
            acl::ACL_SUCCESS,
        )?;
    }
    let mut key = [0u8; acl::ACL_IPC_MEM_KEY_LEN as usize];
    let mut mem: *mut c_void = std::ptr::null_mut();
    if ctx.rank == 0 {
        // SAFETY: see above.
        unsafe {
            expect(
                "aclrtMalloc",
                rt.aclrtMalloc(&mut mem, 4096, acl::ACL_MEM_MALLOC_HUGE_FIRST),
                acl::ACL_SUCCESS,
            )?;
            expect(
                "aclrtIpcMemGetExportKey",
                rt.aclrtIpcMemGetExportKey(mem, 4096, key.as_mut_ptr().cast(), key.len(), 0),
                acl::ACL_SUCCESS,
            )?;
        }
    }
    let keys = ex.allgather(&key, CONNECT)?;
    let pids = ex.allgather(&std::process::id().to_le_bytes(), CONNECT)?;
    let key0 = CStr::from_bytes_until_nul(&keys[0]).map_err(|e| fail(e.to_string()))?;
    if ctx.rank == 1 {
        let mut peer_mem: *mut c_void = std::ptr::null_mut();
        // SAFETY: see above.
        unsafe {
            expect(
                "import before whitelisting",
                rt.aclrtIpcMemImportByKey(&mut peer_mem, key0.as_ptr(), 0),
                acl::ACL_ERROR_RT_NO_PERMISSION,
            )?;
            let msg = CStr::from_ptr(rt.aclGetRecentErrMsg())
                .to_string_lossy()
                .into_owned();
            if !msg.contains("whitelist") {
                return Err(fail(format!("message {msg:?}")));
            }
        }
    }
    ex.barrier(CONNECT)?;
    if ctx.rank == 0 {
        let mut pid = i32::from_le_bytes(pids[1][..4].try_into().expect("4 bytes"));
        // SAFETY: see above.
        unsafe {
            expect(
                "aclrtIpcMemSetImportPid",
                rt.aclrtIpcMemSetImportPid(key0.as_ptr(), &mut pid, 1),
                acl::ACL_SUCCESS,
            )?;
        }
    }
    ex.barrier(CONNECT)?;
    if ctx.rank == 1 {
        let mut peer_mem: *mut c_void = std::ptr::null_mut();
        let host = [1u8; 64];
        // SAFETY: see above.
        unsafe {
            expect(
                "import after whitelisting",
                rt.aclrtIpcMemImportByKey(&mut peer_mem, key0.as_ptr(), 0),
                acl::ACL_SUCCESS,
            )?;
            expect(
                "host-to-device copy into imported memory",
                rt.aclrtMemcpy(
                    peer_mem,
                    64,
                    host.as_ptr().cast(),
                    64,
                    acl::ACL_MEMCPY_HOST_TO_DEVICE,
                ),
                acl::ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
            )?;
            expect(
                "aclrtIpcMemClose (importer)",
                rt.aclrtIpcMemClose(key0.as_ptr()),
                acl::ACL_SUCCESS,
            )?;
        }
    }
    ex.barrier(CONNECT)?;
    if ctx.rank == 0 {
        // SAFETY: see above.
        unsafe {
            expect(
                "aclrtIpcMemClose (exporter)",
                rt.aclrtIpcMemClose(key0.as_ptr()),
                acl::ACL_SUCCESS,
            )?;
            expect("aclrtFree", rt.aclrtFree(mem), acl::ACL_SUCCESS)?;
        }
    }
    Ok(())
}

/// Rank `r` asks for `min_slots + r` slots: every rank fails at init, at once, naming a peer.
fn slot_mismatch(ctx: &ChildCtx) -> xccl::Result<()> {
    let ex: Arc<dyn Exchange> = ctx.connect(CONNECT)?;
    let start = Instant::now();
    let slots = min_slots(ctx.size) + ctx.rank;
    match AscendFabric::new(ex, MIN_WINDOW, slots, ctx.rank as i32) {
        Err(Error::Protocol { peer, detail })
            if peer == 1 - ctx.rank
                && detail.contains("signal slots")
                && start.elapsed() < Duration::from_secs(10) =>
        {
            announce(&format!("rejected: {detail}"));
            Ok(())
        }
        Err(other) => Err(fail(format!("expected a protocol error, got {other}"))),
        Ok(_) => Err(fail("ranks with different slot counts joined".into())),
    }
}

// ---- parent side ----

/// Builds the stand-in once per test process: `<dir>/lib64/libascendcl.so`; returns `<dir>`.
fn standin_home() -> &'static Path {
    static HOME: OnceLock<PathBuf> = OnceLock::new();
    HOME.get_or_init(|| {
        let home = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ascend-standin");
        xccl::testing::build_ascend_standin(&home).unwrap_or_else(|e| panic!("{e}"));
        home
    })
}

enum Via {
    /// `ASCEND_HOME_PATH` names the stand-in's root.
    Home,
    /// `LD_LIBRARY_PATH` holds its `lib64`, `ASCEND_HOME_PATH` is unset.
    LibraryPath,
}

fn spawn(
    scenario: &str,
    size: usize,
    via: Via,
    extra: &[(&str, Option<&str>)],
) -> (Job, StandinSegments) {
    let home = standin_home();
    let segs = StandinSegments::new("xccl-acl");
    let home_s = home.to_string_lossy().into_owned();
    let lib64 = home.join("lib64").to_string_lossy().into_owned();
    let mut env: Vec<(&str, Option<&str>)> = vec![(PREFIX_ENV, Some(&segs.0)), (FAIL_ENV, None)];
    match via {
        Via::Home => env.push(("ASCEND_HOME_PATH", Some(&home_s))),
        Via::LibraryPath => {
            env.push(("ASCEND_HOME_PATH", None));
            env.push(("LD_LIBRARY_PATH", Some(&lib64)));
        }
    }
    env.extend_from_slice(extra);
    let bind = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0);
    let job = Job::spawn_with(
        ENTRY,
        scenario,
        size,
        &|job_id| UniqueId::start_root(bind, RootConfig::new(job_id)),
        &|_, cmd| {
            for (k, v) in &env {
                match v {
                    Some(v) => cmd.env(k, v),
                    None => cmd.env_remove(k),
                };
            }
        },
    );
    (job, segs)
}

fn run_ok(scenario: &str, size: usize, via: Via, timeout: Duration) {
    let start = Instant::now();
    let (mut job, segs) = spawn(scenario, size, via, &[]);
    job.expect_success(timeout);
    println!(
        "{scenario} with {size} processes: {:?}; rank 0 said: {}",
        start.elapsed(),
        job.output(0).trim()
    );
    assert_eq!(segs.left(), Vec::<String>::new(), "stand-in segments left");
}

#[test]
fn ascend_conformance_with_2_processes() {
    run_ok("conformance", 2, Via::Home, Duration::from_secs(60));
}

#[test]
fn ascend_conformance_with_3_processes_found_through_ld_library_path() {
    run_ok("conformance", 3, Via::LibraryPath, Duration::from_secs(60));
}

#[test]
fn ascend_one_attention_one_expert_matches_reference() {
    run_ok("moe:1:1:200", 2, Via::Home, Duration::from_secs(60));
}

#[test]
fn ascend_two_attention_two_expert_matches_reference() {
    run_ok("moe:2:2:100", 4, Via::Home, Duration::from_secs(90));
}

#[test]
fn ascend_one_attention_three_expert_matches_reference() {
    run_ok("moe:1:3:60", 4, Via::LibraryPath, Duration::from_secs(90));
}

#[test]
fn ascend_int8_on_the_wire_matches_reference() {
    run_ok("moe_int8:2:2:60", 4, Via::Home, Duration::from_secs(90));
}

#[test]
fn a_rank_that_left_cleanly_is_not_taken_for_a_crash() {
    run_ok("departed", 3, Via::Home, Duration::from_secs(30));
}

#[test]
fn a_dead_rank_fails_waits_on_other_peers_naming_it() {
    let (mut job, _segs) = spawn("third_dies", 3, Via::Home, &[]);
    job.wait(Duration::from_secs(30));
    job.assert_killed(2);
    job.assert_succeeded(0);
    job.assert_succeeded(1);
    println!("rank 0: {}", job.output(0).trim());
}

#[test]
fn ascend_killed_expert_is_reported_by_the_survivors() {
    let (mut job, _segs) = spawn("moe_kill", 3, Via::Home, &[]);
    job.wait(Duration::from_secs(60));
    job.assert_killed(1);
    job.assert_succeeded(0);
    job.assert_succeeded(2);
    println!("attention rank: {}", job.output(0).trim());
}

#[test]
fn missing_runtime_is_fabric_unavailable_naming_library_and_variable() {
    let empty = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ascend-nowhere");
    std::fs::create_dir_all(&empty).unwrap();
    let empty = empty.to_string_lossy().into_owned();
    let (mut job, _segs) = spawn(
        "missing_library",
        1,
        Via::Home,
        &[
            ("ASCEND_HOME_PATH", Some(&empty)),
            ("LD_LIBRARY_PATH", None),
        ],
    );
    job.expect_success(Duration::from_secs(30));
    let out = job.output(0);
    println!("{}", out.trim());
    assert!(out.contains(&empty), "the tried path is named: {out}");
}

/// Found by review: without `aclrtSynchronizeStreamWithTimeout` the fabric fell back to
/// `aclrtSynchronizeStream`, a wait with no deadline; such a runtime is refused now.
#[test]
fn a_runtime_without_a_bounded_stream_synchronize_is_refused_naming_the_call() {
    let home = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ascend-standin-unbounded-sync");
    xccl::testing::build_ascend_standin_with(&home, &["STANDIN_NO_SYNC_TIMEOUT"])
        .unwrap_or_else(|e| panic!("{e}"));
    let home = home.to_string_lossy().into_owned();
    let (mut job, _segs) = spawn(
        "unbounded_sync",
        1,
        Via::Home,
        &[("ASCEND_HOME_PATH", Some(&home)), ("LD_LIBRARY_PATH", None)],
    );
    job.expect_success(Duration::from_secs(30));
    println!("{}", job.output(0).trim());
}

#[test]
fn a_rank_without_the_runtime_fails_every_rank_promptly() {
    let (mut job, segs) = spawn("missing_on_rank_1", 2, Via::Home, &[]);
    job.expect_success(Duration::from_secs(30));
    println!("{}", job.output(0).trim());
    assert_eq!(segs.left(), Vec::<String>::new(), "stand-in segments left");
}

#[test]
fn runtime_error_surfaces_with_code_call_and_message() {
    let (mut job, segs) = spawn(
        "signal_fails",
        2,
        Via::Home,
        &[(FAIL_ENV, Some("aclrtValueWrite:507899"))],
    );
    job.expect_success(Duration::from_secs(30));
    println!("{}", job.output(0).trim());
    assert_eq!(segs.left(), Vec::<String>::new(), "stand-in segments left");
}

#[test]
fn runtime_error_during_init_names_the_call_and_frees_what_was_made() {
    let (mut job, segs) = spawn(
        "init_fails",
        2,
        Via::Home,
        // The first allocation (the window) succeeds, the second (staging) fails.
        &[(FAIL_ENV, Some("aclrtMalloc:207001:1"))],
    );
    job.expect_success(Duration::from_secs(30));
    println!("{}", job.output(0).trim());
    assert_eq!(segs.left(), Vec::<String>::new(), "stand-in segments left");
}

#[test]
fn fabric_works_from_other_threads_and_closes_collectively() {
    run_ok("threads_and_close", 3, Via::Home, Duration::from_secs(60));
}

#[test]
fn standin_enforces_the_documented_ipc_rules() {
    run_ok("standin_rules", 2, Via::Home, Duration::from_secs(30));
}

#[test]
fn different_slot_counts_fail_every_rank_promptly() {
    let (mut job, segs) = spawn("slot_mismatch", 2, Via::Home, &[]);
    job.expect_success(Duration::from_secs(30));
    println!("{}", job.output(0).trim());
    assert_eq!(segs.left(), Vec::<String>::new(), "stand-in segments left");
}

#[test]
fn sigkilled_peer_is_reported_naming_its_rank() {
    let (mut job, _segs) = spawn("killed_after_init", 2, Via::Home, &[]);
    job.wait(Duration::from_secs(30));
    job.assert_killed(1);
    job.assert_succeeded(0);
    println!("survivor: {}", job.output(0).trim());
}
