//! Shrinking past dead ranks over shared memory, with real processes: in the middle of a stream
//! of checked A2E/E2A rounds (2 attention ranks, 3 expert ranks, 6 experts) one or two ranks
//! SIGKILL themselves inside a call; every survivor must see `PeerFailed` naming a victim, call
//! `Communicator::shrink`, and run more rounds on the shrunk communicator whose results equal the
//! bit-exact reference for the new placement (the harness checks every batch and every combined
//! output). The renumbering and the new placement are checked against an independent
//! computation here. Without replicas, the lost expert is an error naming it on every survivor;
//! with `drop_orphaned_experts` its selections are dropped, counted, and left out of the
//! reference.
//!
//! Every test re-runs this binary as its ranks (see `xccl_tests::Job`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use half::bf16;
use xccl::bootstrap::generation_job_id;
use xccl::fabric::ofi::OfiOptions;
use xccl::fabric::shm::segment_prefix;
use xccl::testing::harness::Workload;
use xccl::{
    Communicator, DType, Error, ExpertBatch, MoeConfig, Role, ShrinkOptions, ShrinkStep,
    TokenBatch, Topology, TopologyBuilder,
};
use xccl_tests::{announce, child_main, mixed_round, shm_entries, sigkill_self, ChildCtx, Job};

const ENTRY: &str = "child_rank_entry";
/// Attention ranks `0..M`, expert ranks `M..M + N`.
const M: usize = 2;
const N: usize = 3;
const EXPERTS: usize = 6;
/// The round in which the victims die (inside their call).
const KILL_ROUND: u64 = 3;
/// Checked rounds on the shrunk communicator.
const AFTER: u64 = 6;

#[test]
fn child_rank_entry() {
    child_main(dispatch);
}

/// Scenario `shrink:<victims, '+'-separated>:<rep|norep>:<keep|drop>[:<rank>@<when>]` (over
/// shm; `shrink_ofi:...` over libfabric's tcp provider, `shrink_cuda:...` over the cuda fabric,
/// `shrink_cuda_device:...` over the cuda fabric with the device-buffer calls in every round);
/// with the last part, `rank` also dies
/// when its shrink reaches step `when` (`poison`, `agree`, `plan`, `release` or `rebuild`), or
/// (`again`) inside a call on the shrunk communicator.
fn dispatch(scenario: &str, ctx: &ChildCtx) -> Result<(), String> {
    match scenario {
        "user_abort" => return user_abort_scenario(ctx, false),
        "user_abort_oob" => return user_abort_scenario(ctx, true),
        _ => {}
    }
    let parts: Vec<&str> = scenario.split(':').collect();
    let ofi = parts.first() == Some(&"shrink_ofi");
    let device = parts.first() == Some(&"shrink_cuda_device");
    let cuda = device || parts.first() == Some(&"shrink_cuda");
    let (victims, replicas, orphans, late) = match parts.as_slice() {
        ["shrink" | "shrink_ofi" | "shrink_cuda" | "shrink_cuda_device", v, r, o] => {
            (v, r, o, None)
        }
        ["shrink" | "shrink_ofi" | "shrink_cuda" | "shrink_cuda_device", v, r, o, late] => {
            (v, r, o, Some(*late))
        }
        _ => return Err(format!("unknown scenario {scenario:?}")),
    };
    let victims = victims
        .split('+')
        .map(|v| v.parse::<usize>().map_err(|e| e.to_string()))
        .collect::<Result<Vec<usize>, String>>()?;
    let (late, again) = match late.map(|l| l.split_once('@')) {
        None => (None, None),
        Some(Some((rank, "poison"))) => (Some((rank, ShrinkStep::Poison)), None),
        Some(Some((rank, "agree"))) => (Some((rank, ShrinkStep::Agree)), None),
        Some(Some((rank, "plan"))) => (Some((rank, ShrinkStep::Plan)), None),
        Some(Some((rank, "release"))) => (Some((rank, ShrinkStep::Release)), None),
        Some(Some((rank, "rebuild"))) => (Some((rank, ShrinkStep::Rebuild)), None),
        Some(Some((rank, "again"))) => (None, Some(rank)),
        Some(_) => return Err(format!("bad late victim in {scenario:?}")),
    };
    let rank = |r: &str| r.parse::<usize>().map_err(|e| e.to_string());
    let setup = Setup {
        victims,
        replicated: *replicas == "rep",
        drop_orphans: *orphans == "drop",
        late: late
            .map(|(r, step)| rank(r).map(|r| (r, step)))
            .transpose()?,
        again: again.map(rank).transpose()?,
        ofi,
        cuda,
        device,
    };
    shrink_scenario(ctx, &setup)
}

/// What a scenario does.
struct Setup {
    /// Ranks that die inside a call of round [`KILL_ROUND`].
    victims: Vec<usize>,
    /// Every expert has a second replica.
    replicated: bool,
    /// Shrink with `drop_orphaned_experts`.
    drop_orphans: bool,
    /// A survivor of the first failure that dies when its shrink reaches this step.
    late: Option<(usize, ShrinkStep)>,
    /// A survivor of the first failure (old rank) that dies inside a call on the shrunk
    /// communicator, which the others then shrink again.
    again: Option<usize>,
    /// Over libfabric's tcp provider instead of shared memory.
    ofi: bool,
    /// Over the cuda fabric (the stand-in driver the parent names in `XCCL_CUDA_LIBRARY`).
    cuda: bool,
    /// Every round through the device-buffer calls (on the cuda fabric), before and after the
    /// shrink.
    device: bool,
}

/// One checked round: the device-buffer calls when `device`, else [`mixed_round`] (registered
/// buffers where the host addresses the windows: over shm).
fn checked_round(
    comm: &mut Communicator,
    wl: &Workload,
    round: u64,
    device: bool,
    batch: &mut ExpertBatch,
    tokens: &mut TokenBatch,
) -> xccl::Result<Result<(), String>> {
    if device {
        return xccl_tests::cuda_support::device_round::<bf16>(comm, wl, round, batch);
    }
    let registered = comm.fabric_name() == "shm";
    mixed_round(comm, wl, round, registered, batch, tokens)
}

/// Runs checked rounds from `first` until a call fails, dying inside round `first +
/// KILL_ROUND` when `victim`; device-buffer calls when `device`. Returns the round that failed
/// and the error.
fn stream_until_failure(
    comm: &mut Communicator,
    wl: &Workload,
    first: u64,
    victim: bool,
    device: bool,
) -> Result<(u64, Error), String> {
    let mut batch = ExpertBatch::new();
    let mut tokens = TokenBatch::new();
    for round in first..first + KILL_ROUND + 20 {
        if victim && round == first + KILL_ROUND {
            die_mid_call(comm, wl, round, &mut batch);
        }
        match checked_round(comm, wl, round, device, &mut batch, &mut tokens) {
            Ok(Ok(())) => {}
            Ok(Err(mismatch)) => return Err(mismatch),
            Err(e) => return Ok((round, e)),
        }
    }
    Err("no failure noticed 20 rounds after the kill".into())
}

/// 2A:3E, experts 0..6 placed contiguously (two per expert rank); with `replicated` every
/// expert gets one more replica on another expert rank.
fn topology(replicated: bool) -> xccl::Result<Topology> {
    let builder = TopologyBuilder::contiguous(M, N, EXPERTS);
    if replicated {
        let extra: Vec<(usize, usize)> = (0..EXPERTS).map(|e| (e, 1)).collect();
        builder.replicas(&extra).build()
    } else {
        builder.build()
    }
}

/// The new rank of `old` once `victims` are gone, computed independently of the library.
fn expected_new_rank(victims: &[usize], old: usize) -> Option<usize> {
    (!victims.contains(&old)).then(|| old - victims.iter().filter(|&&v| v < old).count())
}

/// A victim's last act: starts its call of `round` and dies inside it (an attention rank after
/// its A2E send, an expert rank after its A2E receive, so its peers are waiting for it).
fn die_mid_call(comm: &mut Communicator, wl: &Workload, round: u64, batch: &mut ExpertBatch) {
    match comm.role() {
        Role::Attention => {
            let topo = comm.topology().clone();
            let (k, hidden) = (comm.config().topk, comm.config().hidden);
            let input = wl.input(&topo, k, comm.rank(), round);
            let x: Vec<bf16> = wl.hidden_states(comm.rank(), round, input.num_tokens, hidden);
            // It dies holding the live handle: dropping it first would abort the job (the
            // survivors are to see a death, not an abort).
            if let Ok(live) = comm.a2e_send(&x, &input.topk_idx, &input.topk_weights) {
                std::mem::forget(live);
            }
        }
        Role::Expert => {
            let _ = comm.a2e_recv(batch);
        }
    }
    sigkill_self();
}

fn shrink_scenario(ctx: &ChildCtx, setup: &Setup) -> Result<(), String> {
    let (victims, replicated, drop_orphans) =
        (&setup.victims[..], setup.replicated, setup.drop_orphans);
    let s = |e: Error| e.to_string();
    let mut cfg = MoeConfig::new(32, DType::BF16, 4, 24);
    cfg.timeout = Duration::from_secs(30);
    let ex = ctx.connect(Duration::from_secs(30)).map_err(s)?;
    let topo = topology(replicated).map_err(s)?;
    let mut comm = if setup.ofi {
        let opts = OfiOptions {
            provider: Some("tcp;ofi_rxm".into()),
            addr: Some("127.0.0.1".into()),
            timeout: Duration::from_secs(30),
            ordering: None,
        };
        Communicator::init_ofi_with(ex, Arc::new(topo.clone()), cfg, &opts)
    } else if setup.cuda {
        Communicator::init_cuda(ex, Arc::new(topo.clone()), cfg, None)
    } else {
        Communicator::init_shm(ex, Arc::new(topo.clone()), cfg)
    }
    .map_err(s)?;
    let wl = Workload {
        seed: 0x5421,
        tokens: 24,
        vary: true,
        skew: None,
        shared_experts: 0,
    };
    let mut batch = ExpertBatch::new();
    let mut tokens = TokenBatch::new();
    let me = ctx.rank;

    // The stream, until the failure reaches this rank.
    let (failed_in, failure) =
        stream_until_failure(&mut comm, &wl, 0, victims.contains(&me), setup.device)?;
    // A survivor slow to notice the first failure may hear of the late victim first (it may
    // already have released the old job and died).
    let named = |peer: &usize| victims.contains(peer) || setup.late.is_some_and(|l| l.0 == *peer);
    match &failure {
        Error::PeerFailed { peer, .. } if named(peer) && failed_in >= KILL_ROUND => {}
        other => {
            return Err(format!(
                "round {failed_in}: expected PeerFailed naming one of {victims:?} (or the late \
                 victim {:?}), got {other}",
                setup.late
            ))
        }
    }

    let steps = Arc::new(Mutex::new(Vec::new()));
    let seen = steps.clone();
    let late = setup.late;
    let opts = ShrinkOptions {
        drop_orphaned_experts: drop_orphans,
        timeout: Duration::from_secs(30),
        on_step: Some(Arc::new(move |step| {
            if late == Some((me, step)) {
                sigkill_self();
            }
            seen.lock().unwrap().push(step);
        })),
        ..ShrinkOptions::default()
    };
    let start = std::time::Instant::now();
    let shrunk = comm.shrink(&opts);
    let took = start.elapsed();
    let ran = steps.lock().unwrap().clone();
    use ShrinkStep::{Agree, Plan, Poison, Rebuild, Release};
    let mut expected = if replicated || drop_orphans {
        vec![Poison, Agree, Plan, Release, Rebuild]
    } else {
        vec![Poison, Agree, Plan] // the plan fails
    };
    if let Some((_, Plan | Release | Rebuild)) = setup.late {
        // The late victim took part in the agreement and died after it: the first rebuild
        // fails on its death, and the others agree again, without it.
        expected.extend_from_slice(&[Agree, Plan, Rebuild]);
    }
    if ran != expected {
        return Err(format!(
            "shrink ran the steps {ran:?} and returned {:?}",
            shrunk.as_ref().map(|c| c.rank())
        ));
    }
    if !replicated && !drop_orphans {
        return match shrunk {
            Err(Error::ExpertLost {
                expert: 2, ranks, ..
            }) if ranks == [3] => {
                announce(&format!("rank {me}: expert 2 lost, named"));
                Ok(())
            }
            other => Err(format!(
                "expected ExpertLost naming expert 2 on rank 3, got {:?}",
                other.map(|c| c.rank())
            )),
        };
    }
    let mut comm = shrunk.map_err(s)?;

    // Renumbering and placement, against an independent computation.
    // Every rank that died: the victims and the late victim.
    let all_dead: Vec<usize> = victims
        .iter()
        .copied()
        .chain(setup.late.map(|l| l.0))
        .collect();
    let victims = &all_dead[..];
    let mut dead = victims.to_vec();
    dead.sort_unstable();
    if comm.shrunk_past() != dead.as_slice() {
        return Err(format!("agreed dead set {:?}", comm.shrunk_past()));
    }
    for old in 0..M + N {
        if comm.rank_after_shrink(old) != expected_new_rank(victims, old) {
            return Err(format!(
                "old rank {old} maps to {:?}",
                comm.rank_after_shrink(old)
            ));
        }
    }
    if Some(comm.rank()) != expected_new_rank(victims, me) || comm.rank_before_shrink() != Some(me)
    {
        return Err(format!("rank {me} became rank {}", comm.rank()));
    }
    let new_topo = comm.topology().clone();
    if new_topo.world_size() != M + N - victims.len() {
        return Err(format!("new world size {}", new_topo.world_size()));
    }
    for e in 0..EXPERTS {
        let want: Vec<usize> = topo
            .replicas(e)
            .iter()
            .filter_map(|&r| expected_new_rank(victims, r))
            .collect();
        if new_topo.replicas(e) != want.as_slice() || new_topo.is_orphaned(e) != want.is_empty() {
            return Err(format!(
                "expert {e} now on {:?}, expected {want:?}",
                new_topo.replicas(e)
            ));
        }
    }
    let orphaned: Vec<usize> = (0..EXPERTS).filter(|&e| new_topo.is_orphaned(e)).collect();
    if comm.orphaned_experts() != orphaned.as_slice() || drop_orphans == orphaned.is_empty() {
        return Err(format!("orphaned experts {:?}", comm.orphaned_experts()));
    }

    // Go on: every round checked against the reference for the new placement. The attention
    // ranks start late, so the expert ranks' first wait sleeps and looks at the bootstrap's
    // aborts, where the old job's must not count.
    let mut dropped = 0u64;
    for round in 0..AFTER {
        if round == 0 && comm.role() == Role::Attention {
            std::thread::sleep(Duration::from_millis(100));
        }
        checked_round(&mut comm, &wl, round, setup.device, &mut batch, &mut tokens)
            .map_err(s)?
            .map_err(|m| format!("after the shrink: {m}"))?;
        if comm.role() == Role::Attention {
            let input = wl.input(&new_topo, comm.config().topk, comm.rank(), round);
            dropped += input
                .topk_idx
                .iter()
                .filter(|&&id| id >= 0 && new_topo.is_orphaned(id as usize))
                .count() as u64;
        }
    }
    let counted = comm.total_stats().dropped_slots;
    // Peers may still pull from this rank's window until every rank is done (over ofi,
    // registered memory goes away with the process).
    comm.barrier().map_err(s)?;
    if counted != dropped || (drop_orphans && comm.role() == Role::Attention && dropped == 0) {
        return Err(format!(
            "dropped selections counted {counted}, expected {dropped}"
        ));
    }
    announce(&format!(
        "rank {me} shrank to rank {} in {:.1} ms and ran {AFTER} checked rounds; {dropped} \
         selections dropped",
        comm.rank(),
        took.as_secs_f64() * 1e3
    ));
    match setup.again {
        Some(victim) => shrink_again(comm, &wl, me, victim),
        None => Ok(()),
    }
}

/// What rank 1's user abort says: it reads like a death report of rank 0, which is alive.
const DEATH_LIKE: &str = "rank 0 died: process 4242 exited (noticed by rank 1)";

/// Scenario `user_abort` (shm, replicated): rank 1 calls `Communicator::abort` with
/// [`DEATH_LIKE`] instead of its call of round [`KILL_ROUND`]. Every rank's failure is
/// `Aborted` by rank 1 with that reason (rank 0 included), and the shrink that follows drops no
/// rank: every rank keeps its number and the job runs [`AFTER`] checked rounds.
///
/// `user_abort_oob`: rank 1 sends the same text only through the bootstrap's out-of-band abort
/// (as a launcher's error path does, `Exchange::broadcast_abort`), not through the fabric. The
/// ranks that hear it there report `Aborted` by rank 1; a rank may hear first of the abort of a
/// rank that poisoned on it, which names rank 1's abort in its reason. No rank reports a failure
/// of rank 0, and the shrink drops no one.
fn user_abort_scenario(ctx: &ChildCtx, out_of_band: bool) -> Result<(), String> {
    let s = |e: Error| e.to_string();
    let mut cfg = MoeConfig::new(32, DType::BF16, 4, 24);
    cfg.timeout = Duration::from_secs(30);
    let ex = ctx.connect(Duration::from_secs(30)).map_err(s)?;
    let topo = topology(true).map_err(s)?;
    let mut comm = Communicator::init_shm(ex.clone(), Arc::new(topo), cfg).map_err(s)?;
    let wl = Workload {
        seed: 0x5422,
        tokens: 24,
        vary: true,
        skew: None,
        shared_experts: 0,
    };
    let (mut batch, mut tokens) = (ExpertBatch::new(), TokenBatch::new());
    let me = ctx.rank;
    let mut failure = None;
    for round in 0..KILL_ROUND + 3 {
        if me == 1 && round == KILL_ROUND {
            if out_of_band {
                // Then it waits in a barrier the others never enter: their waits for its rows
                // sleep and hear the abort from the bootstrap; they poison and abort through
                // the fabric, which ends its barrier.
                ex.broadcast_abort(DEATH_LIKE).map_err(s)?;
                failure = comm.barrier().err();
                break;
            }
            comm.abort(DEATH_LIKE);
        }
        match mixed_round(&mut comm, &wl, round, true, &mut batch, &mut tokens) {
            Ok(Ok(())) => {}
            Ok(Err(mismatch)) => return Err(mismatch),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    match failure {
        Some(Error::Aborted { by: 1, reason }) if reason.starts_with(DEATH_LIKE) => {}
        Some(Error::Aborted { by, reason })
            if out_of_band && reason.contains(&format!("aborted by rank 1: {DEATH_LIKE}")) =>
        {
            announce(&format!(
                "rank {me} heard of rank 1's abort through rank {by}'s"
            ));
        }
        other => {
            return Err(format!(
                "expected Aborted by rank 1 with its text, got {other:?}"
            ))
        }
    }
    let opts = ShrinkOptions {
        timeout: Duration::from_secs(30),
        ..ShrinkOptions::default()
    };
    let mut comm = comm.shrink(&opts).map_err(s)?;
    if !comm.shrunk_past().is_empty() || comm.rank() != me || comm.rank_after_shrink(0) != Some(0) {
        return Err(format!(
            "the shrink after a user abort dropped {:?}; rank {me} became rank {}",
            comm.shrunk_past(),
            comm.rank()
        ));
    }
    for round in 0..AFTER {
        mixed_round(&mut comm, &wl, round, true, &mut batch, &mut tokens)
            .map_err(s)?
            .map_err(|m| format!("after the shrink: {m}"))?;
    }
    comm.barrier().map_err(s)?;
    announce(&format!("rank {me} kept every rank after rank 1's abort"));
    Ok(())
}

/// A second failure on the shrunk communicator: `victim` (old rank) dies inside a call, the
/// others see it named by its new rank, shrink again and go on.
fn shrink_again(
    mut comm: Communicator,
    wl: &Workload,
    me: usize,
    victim: usize,
) -> Result<(), String> {
    let s = |e: Error| e.to_string();
    let new_victim = comm
        .rank_after_shrink(victim)
        .ok_or("the second victim did not survive the first shrink")?;
    let (failed_in, failure) = stream_until_failure(&mut comm, wl, AFTER, me == victim, false)?;
    match failure {
        Error::PeerFailed { peer, .. } if peer == new_victim => {}
        other => {
            return Err(format!(
                "round {failed_in}: expected PeerFailed naming rank {new_victim}, got {other}"
            ))
        }
    }
    let before = comm.rank();
    let opts = ShrinkOptions {
        timeout: Duration::from_secs(30),
        ..ShrinkOptions::default()
    };
    let mut comm = comm.shrink(&opts).map_err(s)?;
    if comm.shrunk_past() != [new_victim]
        || comm.rank_before_shrink() != Some(before)
        || comm.rank_after_shrink(new_victim).is_some()
    {
        return Err(format!(
            "second shrink: dead {:?}, rank {before} became {}",
            comm.shrunk_past(),
            comm.rank()
        ));
    }
    let (mut batch, mut tokens) = (ExpertBatch::new(), TokenBatch::new());
    for round in 0..AFTER {
        checked_round(&mut comm, wl, round, false, &mut batch, &mut tokens)
            .map_err(s)?
            .map_err(|m| format!("after the second shrink: {m}"))?;
    }
    comm.barrier().map_err(s)?;
    announce(&format!(
        "rank {me} shrank twice to rank {} and ran {AFTER} checked rounds",
        comm.rank()
    ));
    Ok(())
}

/// Runs a scenario; the victims must have died by SIGKILL, every survivor succeeded, and no
/// shared-memory segment of the job or of its generations is left in `/dev/shm`.
fn run(scenario: &str, victims: &[usize]) -> Job {
    run_with(scenario, victims, &|_| {})
}

/// [`run`] with each rank's command adjusted by `customize` (environment).
fn run_with(
    scenario: &str,
    victims: &[usize],
    customize: &dyn Fn(&mut std::process::Command),
) -> Job {
    let bind = std::net::SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), 0);
    let mut job = Job::spawn_with(
        ENTRY,
        scenario,
        M + N,
        &|job_id| {
            xccl::bootstrap::UniqueId::start_root(bind, xccl::bootstrap::RootConfig::new(job_id))
        },
        &|_, cmd| customize(cmd),
    );
    job.wait(Duration::from_secs(120));
    for r in 0..M + N {
        if victims.contains(&r) {
            job.assert_killed(r);
        } else {
            job.assert_succeeded(r);
        }
    }
    // Generation 1 and 2 of the job, and generation 1 and 2 of those (a second shrink).
    let mut jobs = vec![job.job_id()];
    for _ in 0..2 {
        let next: Vec<u64> = jobs
            .iter()
            .flat_map(|&j| (1..=2).map(move |g| generation_job_id(j, g)))
            .collect();
        jobs.extend(next);
    }
    for j in jobs {
        let left = shm_entries(&segment_prefix(j));
        assert!(left.is_empty(), "{scenario}: left in /dev/shm: {left:?}");
    }
    job
}

#[test]
fn survivors_shrink_past_a_killed_expert_rank_and_match_the_reference_for_the_new_placement() {
    let job = run("shrink:3:rep:keep", &[3]);
    assert!(job.output(0).contains("rank 0 shrank to rank 0 in"));
    assert!(job.output(4).contains("rank 4 shrank to rank 3 in"));
    // How long the shrink took (run with --nocapture to see it).
    for r in [0, 4] {
        let out = job.output(r);
        eprintln!(
            "{}",
            out.lines().find(|l| l.contains("shrank")).unwrap_or("")
        );
    }
}

#[test]
fn survivors_shrink_past_a_killed_expert_rank_over_ofi_and_match_the_reference() {
    let job = run("shrink_ofi:3:rep:keep", &[3]);
    assert!(job.output(4).contains("rank 4 shrank to rank 3 in"));
    let out = job.output(0);
    eprintln!(
        "{}",
        out.lines().find(|l| l.contains("shrank")).unwrap_or("")
    );
}

/// Runs a shrink scenario over the cuda fabric (the stand-in driver) in which expert rank 3
/// dies; only the victim's stand-in segments may be left. Returns the job.
fn shrink_over_cuda(scenario: &str) -> Job {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-standin-shrink");
    let lib = xccl::testing::build_cuda_standin(&dir).unwrap_or_else(|e| panic!("{e}"));
    let segs = xccl_tests::StandinSegments::new("xccl-cu-shrink");
    let job = run_with(scenario, &[3], &|cmd| {
        cmd.env("XCCL_CUDA_LIBRARY", &lib)
            .env("CUDA_STANDIN_SHM_PREFIX", &segs.0)
            .env_remove("CUDA_STANDIN_FAIL");
    });
    assert!(job.output(4).contains("rank 4 shrank to rank 3 in"));
    let out = job.output(0);
    eprintln!(
        "{}",
        out.lines().find(|l| l.contains("shrank")).unwrap_or("")
    );
    let victim = format!("{}-{}-", segs.0, job.pid(3));
    assert!(
        segs.left().iter().all(|n| n.starts_with(&victim)),
        "survivors' stand-in segments left: {:?}",
        segs.left()
    );
    job
}

#[test]
fn survivors_shrink_past_a_killed_expert_rank_over_cuda_and_match_the_reference() {
    shrink_over_cuda("shrink_cuda:3:rep:keep");
}

#[test]
fn survivors_shrink_past_a_killed_expert_rank_over_cuda_and_go_on_with_device_calls_bit_for_bit() {
    shrink_over_cuda("shrink_cuda_device:3:rep:keep");
}

#[test]
fn a_user_abort_whose_text_names_a_dead_rank_is_an_abort_at_every_rank_and_a_shrink_drops_no_one() {
    for scenario in ["user_abort", "user_abort_oob"] {
        let job = run(scenario, &[]);
        for r in 0..M + N {
            assert!(
                job.output(r)
                    .contains(&format!("rank {r} kept every rank after rank 1's abort")),
                "{scenario}: rank {r}"
            );
        }
    }
}

#[test]
fn survivors_shrink_past_a_killed_attention_rank_and_go_on() {
    let job = run("shrink:1:rep:keep", &[1]);
    assert!(job.output(2).contains("rank 2 shrank to rank 1 in"));
}

#[test]
fn survivors_shrink_past_two_ranks_killed_at_once() {
    let job = run("shrink:0+3:rep:keep", &[0, 3]);
    assert!(job.output(4).contains("rank 4 shrank to rank 2 in"));
}

#[test]
fn a_survivor_dying_before_the_agreement_is_left_out_of_the_shrunk_job() {
    let job = run("shrink:3:rep:keep:1@agree", &[3, 1]);
    assert!(job.output(4).contains("rank 4 shrank to rank 2 in"));
}

#[test]
fn a_survivor_dying_during_the_rebuild_makes_the_others_agree_again_without_it() {
    let job = run("shrink:3:rep:keep:1@rebuild", &[3, 1]);
    assert!(job.output(2).contains("rank 2 shrank to rank 1 in"));
}

#[test]
fn survivors_shrink_a_second_time_past_a_rank_that_dies_on_the_shrunk_communicator() {
    let job = run("shrink:3:rep:keep:0@again", &[3, 0]);
    assert!(job.output(4).contains("rank 4 shrank twice to rank 2"));
    assert!(job.output(1).contains("rank 1 shrank twice to rank 0"));
}

#[test]
fn an_expert_with_no_replica_left_fails_the_shrink_naming_it_on_every_survivor() {
    let job = run("shrink:3:norep:keep", &[3]);
    for r in [0, 1, 2, 4] {
        assert!(job.output(r).contains("expert 2 lost, named"), "rank {r}");
    }
}

#[test]
fn dropping_an_orphaned_expert_counts_its_selections_and_matches_the_reference_without_it() {
    let job = run("shrink:3:norep:drop", &[3]);
    for r in [0, 1] {
        let out = job.output(r);
        assert!(out.contains("checked rounds;"), "rank {r}: {out}");
        assert!(!out.contains("; 0 selections dropped"), "rank {r}: {out}");
    }
}

/// Kills at random points of the shrink: each run SIGKILLs one rank inside a call, and a second
/// rank when its own shrink reaches a random step (poison, agree, plan, release or rebuild).
/// One of the two is an attention rank and one an expert rank, so every expert keeps a replica
/// and an attention rank survives. Every survivor must name a victim, shrink past both and match
/// the reference for the new placement; nothing is left in `/dev/shm`. The draws come from
/// `XCCL_SHRINK_FAULT_SEED` (printed) and `XCCL_SHRINK_FAULT_RUNS` runs (8 by default; the
/// fault-injection script runs more).
#[test]
fn random_kills_during_the_shrink_are_survived_by_every_other_rank() {
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => v.parse().ok(),
            })
            .unwrap_or(default)
    };
    let seed = env("XCCL_SHRINK_FAULT_SEED", 0x5417_2026);
    let runs = env("XCCL_SHRINK_FAULT_RUNS", 8);
    let steps = ["poison", "agree", "plan", "release", "rebuild"];
    let mut state = seed;
    let mut next = |n: u64| {
        // SplitMix64.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    };
    eprintln!("shrink fault runs: {runs}, seed {seed:#x}");
    let mut per_step = [0u32; 5];
    for _ in 0..runs {
        let attention = next(M as u64) as usize;
        let expert = M + next(N as u64) as usize;
        let (first, late) = if next(2) == 0 {
            (attention, expert)
        } else {
            (expert, attention)
        };
        let step = next(steps.len() as u64) as usize;
        per_step[step] += 1;
        let scenario = format!("shrink:{first}:rep:keep:{late}@{}", steps[step]);
        run(&scenario, &[first, late]);
    }
    let counts: Vec<String> = (steps.iter().zip(per_step))
        .map(|(s, n)| format!("{s}={n}"))
        .collect();
    eprintln!(
        "shrink fault runs passed, second kill at: {}",
        counts.join(" ")
    );
}
