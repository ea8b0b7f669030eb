//! Fault injection over shared memory between real processes.
//!
//! **SIGKILL at random points.** Each run draws, from a seed, a job shape (3 or 4 ranks, direct
//! or through a relay, rows in bf16 or INT8), a victim rank, one of the fault points that rank reaches
//! (`xccl::testing::fault::POINTS`: during init, inside an A2E or an E2A after some but not all
//! of its puts and signals, inside a relay, or between calls) and the hit of that point at which
//! the victim SIGKILLs itself (`XCCL_FAULT=point:hit`). Which points a rank reaches and how often
//! comes from one census run per shape (`XCCL_FAULT=census`). Every run must end with every
//! survivor reporting `PeerFailed` naming the victim within [`DETECTION_BOUND`] of the kill, every
//! process exited, and nothing of the job in `/dev/shm`; a drawn hit that the victim does not
//! reach (possible only at a point whose count depends on timing) must leave a job that
//! completes with every result checked. The test prints the seed, the counts per point and
//! outcome, and the detection times (min, median, p99, max). `XCCL_FAULT_RUNS` (default 100) and
//! `XCCL_FAULT_SEED` override the run count and the seed; `ci/fault-injection.sh` runs 10,000.
//!
//! **During shrink**: kills at random shrink steps have their own campaign,
//! `random_kills_during_the_shrink_are_survived_by_every_other_rank` in `tests/tests/shrink.rs`
//! (a first victim dies inside a call, a second when its shrink reaches a random step;
//! `ci/fault-injection.sh` runs both campaigns).
//!
//! **SIGSTOP.** A stopped rank is slow, not dead: the ranks that wait for it time out naming it
//! and, after `SIGCONT`, retry and complete with checked results; a stop shorter than the
//! timeout goes unnoticed and the job completes.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use half::bf16;
use xccl::testing::fault::{self, FAULT_ENV, FIRED_MARK};
use xccl::testing::harness::{
    attention_round, expert_round, expert_round_tokens, expert_round_tokens_with, first_difference,
    token_replies, Buffers, Workload,
};
use xccl::testing::reference::{expected_combine_quant, test_expert, SplitMix64};
use xccl::{Communicator, DType, Error, ExpertBatch, MoeConfig, Quant, Role, TokenBatch, Topology};
use xccl_tests::{announce, child_main, mixed_round, shm_entries, ChildCtx, Job};

const ENTRY: &str = "child_rank_entry";

/// How long after a kill every survivor must have reported it: the liveness check runs every
/// 20 ms in every wait and an abort reaches the other ranks' waits at once, so this leaves room
/// for an oversubscribed 2-core CI machine that does not schedule a rank for a while.
const DETECTION_BOUND: Duration = Duration::from_secs(2);

/// Harness-level point between two calls of a rank (and before its closing barrier).
const BETWEEN: &str = fault::BETWEEN_CALLS;

/// The line each rank of a fault run prints with its outcome.
const REPORT: &str = "FAULT-REPORT";
/// The line each rank of a census run prints with its hit counts.
const CENSUS: &str = "FAULT-CENSUS";

#[test]
fn child_rank_entry() {
    child_main(dispatch);
}

/// `run:<M>:<N>:<relays>` runs [`ROUNDS`] checked rounds and a barrier, reporting how it ended;
/// `stop_timeout` and `stop_resume` are the SIGSTOP scenarios.
fn dispatch(scenario: &str, ctx: &ChildCtx) -> Result<(), String> {
    let parts: Vec<&str> = scenario.split(':').collect();
    let p = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
    match parts.as_slice() {
        ["run", m, n, r, q] => {
            let shape = Shape::new(p(m)?, p(n)?, p(r)?);
            fault_run(ctx, if *q == "int8" { shape.int8() } else { shape })
        }
        ["stop_timeout"] => stopped_expert_times_out(ctx),
        ["stop_attention"] => stopped_attention_times_out(ctx),
        ["stop_resume", m, n] => stopped_and_resumed(ctx, p(m)?, p(n)?),
        _ => Err(format!("unknown scenario {scenario:?}")),
    }
}

/// Rounds of A2E + E2A per fault run.
const ROUNDS: u64 = 4;
/// Most tokens per attention rank per round (the count varies per round).
const TOKENS: usize = 6;

/// A job shape: attention ranks, expert ranks, relays, and whether rows travel as INT8 both
/// ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Shape {
    m: usize,
    n: usize,
    relays: usize,
    int8: bool,
}

impl Shape {
    const fn new(m: usize, n: usize, relays: usize) -> Self {
        Shape {
            m,
            n,
            relays,
            int8: false,
        }
    }

    /// The same shape with INT8 rows on the wire both ways.
    const fn int8(self) -> Self {
        Shape { int8: true, ..self }
    }

    fn size(&self) -> usize {
        self.m + self.n
    }

    fn scenario(&self) -> String {
        let q = if self.int8 { "int8" } else { "dtype" };
        format!("run:{}:{}:{}:{q}", self.m, self.n, self.relays)
    }
}

/// The shapes fault runs draw from: 3 and 4 ranks, direct and through one relay, in the dtype
/// and in INT8.
const SHAPES: [Shape; 7] = [
    Shape::new(1, 2, 0),
    Shape::new(2, 1, 0),
    Shape::new(2, 2, 0),
    Shape::new(1, 3, 0),
    Shape::new(2, 2, 1),
    Shape::new(2, 2, 0).int8(),
    Shape::new(2, 2, 1).int8(),
];

fn config(max_tokens: usize, timeout: Duration) -> MoeConfig {
    let mut cfg = MoeConfig::new(32, DType::BF16, 4, max_tokens);
    cfg.timeout = timeout;
    // A few rows per chunk, so a message streams in several chunks and a fault can land
    // between them.
    cfg.chunk_bytes = 256;
    cfg
}

fn join(ctx: &ChildCtx, shape: Shape, mut cfg: MoeConfig) -> xccl::Result<Communicator> {
    if shape.int8 {
        cfg.a2e_quant = Quant::Int8;
        cfg.e2a_quant = Quant::Int8;
    }
    let ex = ctx.connect(Duration::from_secs(30))?;
    let mut topo = Topology::contiguous(shape.m, shape.n, 4 * shape.n.max(2))?;
    if shape.relays > 0 {
        topo = topo.with_relays(Some(shape.relays))?;
    }
    Communicator::init_shm(ex, Arc::new(topo), cfg)
}

/// Joins `shape` with per-call timeout `timeout` and returns the communicator with the
/// workload of seed `seed` (`TOKENS` tokens per round, or up to that many when `vary`).
fn joined(
    ctx: &ChildCtx,
    shape: Shape,
    timeout: Duration,
    seed: u64,
    vary: bool,
) -> xccl::Result<(Communicator, Workload)> {
    let comm = join(ctx, shape, config(TOKENS, timeout))?;
    let wl = Workload {
        seed,
        tokens: TOKENS,
        vary,
        skew: None,
        shared_experts: 0,
    };
    Ok((comm, wl))
}

/// One rank of a fault run: init, checked rounds with [`BETWEEN`] before every call but the
/// first, then [`BETWEEN`] and a barrier (so a kill after a rank's last call is noticed by every
/// rank). Prints a [`REPORT`] line (and a [`CENSUS`] line under `XCCL_FAULT=census`); a wrong
/// result fails the rank.
fn fault_run(ctx: &ChildCtx, shape: Shape) -> Result<(), String> {
    let outcome = rounds_and_barrier(ctx, shape);
    let census = fault::census();
    if !census.is_empty() {
        let counts: Vec<String> = census.iter().map(|(k, v)| format!("{k}={v}")).collect();
        announce(&format!("{CENSUS} rank={} {}", ctx.rank, counts.join(",")));
    }
    let line = match outcome {
        Ok(Ok(())) => format!("{REPORT} rank={} ok", ctx.rank),
        Ok(Err(mismatch)) => return Err(mismatch),
        Err(e) => {
            let t = fault::now_ns();
            let (kind, peer) = match &e {
                Error::PeerFailed { peer, .. } => ("PeerFailed", *peer),
                Error::Timeout { peer, .. } => ("Timeout", *peer),
                Error::Aborted { by, .. } => ("Aborted", *by),
                Error::Protocol { peer, .. } => ("Protocol", *peer),
                _ => ("Other", usize::MAX),
            };
            format!(
                "{REPORT} rank={} err kind={kind} peer={peer} t_ns={t} error={e}",
                ctx.rank
            )
        }
    };
    announce(&line);
    Ok(())
}

fn rounds_and_barrier(ctx: &ChildCtx, shape: Shape) -> xccl::Result<Result<(), String>> {
    let seed = 0xfa17 + shape.size() as u64;
    let (mut comm, wl) = joined(ctx, shape, Duration::from_secs(20), seed, true)?;
    let mut batch = ExpertBatch::new();
    let mut tokens = TokenBatch::new();
    for round in 0..ROUNDS {
        if round > 0 {
            fault::point(BETWEEN);
        }
        let verdict = if shape.relays == 0 {
            mixed_round(&mut comm, &wl, round, true, &mut batch, &mut tokens)?
        } else {
            // Relays take push transfers and caller buffers, expert-major or token-major.
            match comm.role() {
                Role::Attention => attention_round::<bf16>(&mut comm, &wl, round)?,
                Role::Expert if round % 2 == 0 => {
                    expert_round::<bf16>(&mut comm, &wl, round, &mut batch, true)?
                }
                Role::Expert => expert_round_tokens_with::<bf16>(
                    &mut comm,
                    &wl,
                    round,
                    &mut tokens,
                    true,
                    Buffers::Copy,
                )?,
            }
        };
        if verdict.is_err() {
            return Ok(verdict);
        }
    }
    fault::point(BETWEEN);
    comm.barrier()?;
    Ok(Ok(()))
}

/// What one rank printed in its [`REPORT`] line.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Report {
    Ok,
    Err {
        kind: String,
        peer: usize,
        t_ns: u64,
    },
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

fn report_of(output: &str) -> Option<Report> {
    let line = output.lines().find_map(|l| {
        let at = l.find(REPORT)?;
        Some(&l[at..])
    })?;
    if line.contains(" ok") {
        return Some(Report::Ok);
    }
    Some(Report::Err {
        kind: field(line, "kind")?.to_string(),
        peer: field(line, "peer")?.parse().ok()?,
        t_ns: field(line, "t_ns")?.parse().ok()?,
    })
}

/// When the victim's fault fired, from its [`FIRED_MARK`] line.
fn fired_at(output: &str) -> Option<u64> {
    let line = output.lines().find(|l| l.contains(FIRED_MARK))?;
    field(line, "t_ns")?.parse().ok()
}

/// Hits per point of every rank of `shape`, from one run with `XCCL_FAULT=census` everywhere.
type Census = Vec<BTreeMap<String, u64>>;

fn census(shape: Shape) -> Census {
    let mut job = spawn_armed(&shape.scenario(), shape.size(), &|_| Some("census".into()));
    job.expect_success(Duration::from_secs(60));
    (0..shape.size())
        .map(|r| {
            let out = job.output(r);
            assert_eq!(report_of(&out), Some(Report::Ok), "census rank {r}: {out}");
            let line = out
                .lines()
                .find_map(|l| l.find(CENSUS).map(|at| &l[at..]))
                .unwrap_or_else(|| panic!("census rank {r} printed no counts: {out}"));
            line.split_whitespace()
                .last()
                .unwrap_or_default()
                .split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.parse().expect("census count")))
                .collect()
        })
        .collect()
}

/// What one fault run drew.
#[derive(Clone, Debug)]
struct Draw {
    seed: u64,
    shape: Shape,
    victim: usize,
    point: String,
    hit: u64,
}

/// Draws a point uniformly among every point some rank of some shape reaches, then a shape and
/// rank that reach it, then a hit within the rank's census count.
fn draw(seed: u64, censuses: &BTreeMap<Shape, Census>) -> Draw {
    let mut rng = SplitMix64::new(seed);
    let reached: Vec<(&String, Shape, usize, u64)> = censuses
        .iter()
        .flat_map(|(&shape, ranks)| {
            ranks.iter().enumerate().flat_map(move |(rank, points)| {
                points
                    .iter()
                    .filter(|(_, &n)| n > 0)
                    .map(move |(p, &n)| (p, shape, rank, n))
            })
        })
        .collect();
    let mut names: Vec<&String> = reached.iter().map(|r| r.0).collect();
    names.sort_unstable();
    names.dedup();
    let point = names[rng.below(names.len())];
    let at: Vec<_> = reached.iter().filter(|r| r.0 == point).collect();
    let &(_, shape, victim, count) = at[rng.below(at.len())];
    let hit = 1 + rng.below(count as usize) as u64;
    Draw {
        seed,
        shape,
        victim,
        point: point.clone(),
        hit,
    }
}

/// How a fault run ended.
#[derive(Debug)]
enum Outcome {
    /// The victim was killed and every survivor named it; detection times in ns.
    Named(Vec<u64>),
    /// The drawn hit never came; the job completed with every result checked.
    NotReached,
    /// Anything else, described.
    Failed(String),
}

fn run_once(d: &Draw) -> Outcome {
    let spec = format!("{}:{}", d.point, d.hit);
    let victim = d.victim;
    let armed = |rank: usize| (rank == victim).then(|| spec.clone());
    let mut job = spawn_armed(&d.shape.scenario(), d.shape.size(), &armed);
    let statuses = job.wait(Duration::from_secs(60));
    let prefix = xccl::fabric::shm::segment_prefix(job.job_id());
    let left = shm_entries(&prefix);
    let outputs: Vec<String> = (0..job.size()).map(|r| job.output(r)).collect();
    drop(job);
    let show = || {
        outputs
            .iter()
            .enumerate()
            .map(|(r, o)| format!("--- rank {r} ({}) ---\n{o}", statuses[r]))
            .collect::<String>()
    };
    if !left.is_empty() {
        return Outcome::Failed(format!("left in /dev/shm: {left:?}\n{}", show()));
    }
    let Some(fired) = fired_at(&outputs[victim]) else {
        // Not reached: the job must have completed, every rank ok.
        let all_ok = (0..outputs.len())
            .all(|r| statuses[r].success() && report_of(&outputs[r]) == Some(Report::Ok));
        return if all_ok {
            Outcome::NotReached
        } else {
            Outcome::Failed(format!("fault not reached and the job failed\n{}", show()))
        };
    };
    if statuses[victim].signal() != Some(libc::SIGKILL) {
        return Outcome::Failed(format!(
            "victim not SIGKILLed: {}\n{}",
            statuses[victim],
            show()
        ));
    }
    let mut times = Vec::new();
    for r in (0..outputs.len()).filter(|&r| r != victim) {
        if !statuses[r].success() {
            return Outcome::Failed(format!("survivor {r} failed: {}\n{}", statuses[r], show()));
        }
        match report_of(&outputs[r]) {
            Some(Report::Err { kind, peer, t_ns }) if kind == "PeerFailed" && peer == victim => {
                let took = t_ns.saturating_sub(fired);
                if Duration::from_nanos(took) > DETECTION_BOUND {
                    return Outcome::Failed(format!(
                        "survivor {r} named rank {victim} after {:?}, over {DETECTION_BOUND:?}\n{}",
                        Duration::from_nanos(took),
                        show()
                    ));
                }
                times.push(took);
            }
            other => {
                return Outcome::Failed(format!(
                    "survivor {r} reported {other:?}, not PeerFailed naming rank {victim}\n{}",
                    show()
                ))
            }
        }
    }
    Outcome::Named(times)
}

/// Counts per point and outcome, and every detection time.
#[derive(Default)]
struct Tally {
    per_point: BTreeMap<String, [u64; 3]>,
    times: Vec<u64>,
    failures: Vec<String>,
}

impl Tally {
    fn add(&mut self, d: &Draw, outcome: Outcome) {
        let row = self.per_point.entry(d.point.clone()).or_default();
        match outcome {
            Outcome::Named(t) => {
                row[0] += 1;
                self.times.extend(t);
            }
            Outcome::NotReached => row[1] += 1,
            Outcome::Failed(why) => {
                row[2] += 1;
                self.failures.push(format!(
                    "seed {:#x} ({:?}, victim rank {}, {}={}:{}): {why}\n(replay: \
                     XCCL_FAULT_SEED={:#x} XCCL_FAULT_RUNS=1)",
                    d.seed, d.shape, d.victim, FAULT_ENV, d.point, d.hit, d.seed
                ));
            }
        }
    }

    fn print(&self, runs: usize, elapsed: Duration) {
        let ms = |ns: u64| ns as f64 / 1e6;
        eprintln!("fault injection: {runs} runs in {elapsed:.1?}");
        eprintln!(
            "{:<18} {:>6} {:>8} {:>12} {:>7}",
            "point", "runs", "named", "not reached", "failed"
        );
        let mut total = [0u64; 3];
        for (point, row) in &self.per_point {
            eprintln!(
                "{point:<18} {:>6} {:>8} {:>12} {:>7}",
                row.iter().sum::<u64>(),
                row[0],
                row[1],
                row[2]
            );
            total.iter_mut().zip(row).for_each(|(t, v)| *t += v);
        }
        eprintln!(
            "{:<18} {:>6} {:>8} {:>12} {:>7}",
            "total",
            total.iter().sum::<u64>(),
            total[0],
            total[1],
            total[2]
        );
        let mut t = self.times.clone();
        t.sort_unstable();
        if let (Some(&min), Some(&max)) = (t.first(), t.last()) {
            let q = |p: f64| t[((t.len() - 1) as f64 * p).round() as usize];
            eprintln!(
                "detection time over {} survivor reports (ms): min {:.2}, median {:.2}, \
                 p99 {:.2}, max {:.2} (bound {DETECTION_BOUND:?})",
                t.len(),
                ms(min),
                ms(q(0.5)),
                ms(q(0.99)),
                ms(max)
            );
        }
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .map(|v| {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok().map(|x| x.to_string()),
                None => Some(v.to_string()),
            };
            parsed
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("{name}={v:?} is not a number"))
        })
        .unwrap_or(default)
}

/// The fault-injection campaign: `XCCL_FAULT_RUNS` runs (100 by default), each a random SIGKILL
/// (see the module docs); every run's survivors name the victim within the bound, leave no
/// process and nothing in `/dev/shm`.
#[test]
fn random_sigkills_are_named_by_every_survivor_and_leave_nothing_behind() {
    let runs: usize = env_or("XCCL_FAULT_RUNS", 100);
    let default_seed = u64::from(std::process::id()) << 32 ^ fault::now_ns();
    let base: u64 = env_or("XCCL_FAULT_SEED", default_seed);
    eprintln!(
        "fault injection: seed {base:#x}, {runs} runs (run i uses seed + i; replay one with \
         XCCL_FAULT_SEED=<its seed> XCCL_FAULT_RUNS=1)"
    );
    let start = Instant::now();
    let censuses: BTreeMap<Shape, Census> = SHAPES.iter().map(|&s| (s, census(s))).collect();
    let mut tally = Tally::default();
    for i in 0..runs {
        let d = draw(base.wrapping_add(i as u64), &censuses);
        let outcome = std::panic::catch_unwind(|| run_once(&d))
            .unwrap_or_else(|_| Outcome::Failed("the run panicked (output above)".into()));
        tally.add(&d, outcome);
        if runs >= 1000 && (i + 1) % 500 == 0 {
            eprintln!(
                "... {} runs, {} failed, {:.0?}",
                i + 1,
                tally.failures.len(),
                start.elapsed()
            );
        }
    }
    tally.print(runs, start.elapsed());
    assert!(
        tally.failures.is_empty(),
        "{} of {runs} fault runs failed:\n{}",
        tally.failures.len(),
        tally.failures.join("\n\n")
    );
    let named: u64 = tally.per_point.values().map(|r| r[0]).sum();
    assert!(
        runs < 20 || named as usize * 2 > runs,
        "only {named} of {runs} runs killed their victim: the draws miss their points"
    );
}

/// Runs one fault run with a fixed draw and checks every survivor named the victim.
fn kill_at(shape: Shape, victim: usize, point: &str, hit: u64) {
    let d = Draw {
        seed: 0,
        shape,
        victim,
        point: point.into(),
        hit,
    };
    match run_once(&d) {
        Outcome::Named(times) => eprintln!("{point}: detected after {times:?} ns"),
        other => panic!("{d:?}: {other:?}"),
    }
}

#[test]
fn a_rank_killed_after_creating_its_segment_is_named_and_the_survivors_unlink_the_segment() {
    kill_at(Shape::new(2, 2, 0), 3, "init.shm.created", 1);
}

#[test]
fn an_attention_rank_killed_between_two_chunks_of_its_a2e_is_named_by_every_expert() {
    kill_at(Shape::new(1, 3, 0), 0, "a2e.chunk", 2);
}

#[test]
fn an_expert_rank_killed_after_crediting_one_of_two_attention_ranks_is_named_by_all() {
    kill_at(Shape::new(2, 2, 0), 2, "a2e.credit", 3);
}

/// Waits in `call` (retried) until it stops timing out; the first timeout must name `peer`, and
/// is announced (`timed out naming rank <peer> (<what it waited for>)`) so the parent can resume
/// it.
fn retry_after_timeout<R>(
    comm: &mut Communicator,
    peer: usize,
    mut call: impl FnMut(&mut Communicator) -> xccl::Result<R>,
) -> Result<R, String> {
    let mut announced = false;
    loop {
        match call(comm) {
            Err(Error::Timeout { peer: p, what, .. }) if p == peer => {
                if !announced {
                    announce(&format!(
                        "rank {} timed out naming rank {peer} ({what})",
                        comm.rank()
                    ));
                    announced = true;
                }
                if let Some(e) = comm.poisoned() {
                    return Err(format!(
                        "a timeout waiting for a stopped rank poisoned: {e}"
                    ));
                }
            }
            Err(e) => return Err(format!("rank {}: {e}", comm.rank())),
            Ok(r) if announced => return Ok(r),
            Ok(_) => {
                return Err(format!(
                    "rank {}: the call completed without waiting for stopped rank {peer}",
                    comm.rank()
                ))
            }
        }
    }
}

/// 2A:1E, timeout 1 s; expert rank 2 stops itself in its first E2A where the parent's
/// `XCCL_FAULT` says (`e2a.record:1:stop`: after the record to rank 0, before its signal;
/// `e2a.chunk:1:stop`: after the first chunk of rows to rank 0, before its signal). Both
/// attention ranks' E2A receives time out naming rank 2, are retried until the parent resumes
/// it, and check their results.
fn stopped_expert_times_out(ctx: &ChildCtx) -> Result<(), String> {
    let shape = Shape::new(2, 1, 0);
    let (mut comm, wl) =
        joined(ctx, shape, Duration::from_secs(1), 0x5709, false).map_err(|e| e.to_string())?;
    let mut batch = ExpertBatch::new();
    for round in 0..3 {
        match comm.role() {
            Role::Attention => {
                let topo = comm.topology().clone();
                let (k, hidden) = (comm.config().topk, comm.config().hidden);
                let input = wl.input(&topo, k, comm.rank(), round);
                let x: Vec<bf16> = wl.hidden_states(comm.rank(), round, input.num_tokens, hidden);
                let h = comm
                    .a2e_send(&x, &input.topk_idx, &input.topk_weights)
                    .map_err(|e| e.to_string())?;
                let mut out = vec![bf16::ZERO; x.len()];
                if round == 0 {
                    retry_after_timeout(&mut comm, 2, |c| c.e2a_recv(&h, &mut out))?;
                } else {
                    comm.e2a_recv(&h, &mut out).map_err(|e| e.to_string())?;
                }
                let want = expected_combine_quant(
                    &topo,
                    &input,
                    &x,
                    hidden,
                    &test_expert,
                    comm.config().a2e_quant,
                    comm.config().e2a_quant,
                );
                if let Some(d) = first_difference(&out, &want, hidden) {
                    return Err(format!("rank {} round {round}: out{d}", comm.rank()));
                }
            }
            Role::Expert => {
                // The stop comes after the first record: the parent resumes it after both
                // attention ranks have timed out, well within this rank's own 20 s.
                comm.set_timeout(Duration::from_secs(20))
                    .map_err(|e| e.to_string())?;
                expert_round::<bf16>(&mut comm, &wl, round, &mut batch, true)
                    .map_err(|e| e.to_string())??;
            }
        }
    }
    comm.barrier().map_err(|e| e.to_string())
}

/// 1A:1E, timeout 1 s; attention rank 0 stops itself (`XCCL_FAULT=a2e.chunk:1:stop`, set by the
/// parent) in its first A2E after its record, the record's signal and its first chunk of rows,
/// before that chunk's signal. The expert rank's receive times out naming rank 0 and what it
/// still waited for (the rows: it read the record while they were written), is retried until
/// the parent resumes rank 0, and the job completes with every round checked.
fn stopped_attention_times_out(ctx: &ChildCtx) -> Result<(), String> {
    let shape = Shape::new(1, 1, 0);
    let (mut comm, wl) =
        joined(ctx, shape, Duration::from_secs(1), 0x5711, false).map_err(|e| e.to_string())?;
    let mut tokens = TokenBatch::new();
    for round in 0..3 {
        let verdict = match comm.role() {
            Role::Attention => {
                // Resumed after the expert rank timed out, well within its own 20 s.
                comm.set_timeout(Duration::from_secs(20))
                    .map_err(|e| e.to_string())?;
                attention_round::<bf16>(&mut comm, &wl, round).map_err(|e| e.to_string())?
            }
            Role::Expert if round == 0 => {
                retry_after_timeout(&mut comm, 0, |c| {
                    c.a2e_recv_tokens(&mut tokens, &mut |_, _| {})
                })?;
                let locals = comm.topology().local_experts(comm.rank()).to_vec();
                let replies = token_replies::<bf16>(&locals, &tokens);
                comm.e2a_send_tokens(&tokens, &replies)
                    .map_err(|e| e.to_string())?;
                Ok(())
            }
            Role::Expert => expert_round_tokens::<bf16>(&mut comm, &wl, round, &mut tokens, true)
                .map_err(|e| e.to_string())?,
        };
        verdict?;
    }
    comm.barrier().map_err(|e| e.to_string())
}

/// `M`A:`N`E, timeout 20 s, 12 checked rounds; the rank the parent arms stops itself mid-call
/// and is resumed by the parent after a while well below the timeout. Nobody notices.
fn stopped_and_resumed(ctx: &ChildCtx, m: usize, n: usize) -> Result<(), String> {
    let shape = Shape::new(m, n, 0);
    let (mut comm, wl) =
        joined(ctx, shape, Duration::from_secs(20), 0x5710, true).map_err(|e| e.to_string())?;
    let mut batch = ExpertBatch::new();
    let mut tokens = TokenBatch::new();
    for round in 0..12 {
        mixed_round(&mut comm, &wl, round, true, &mut batch, &mut tokens)
            .map_err(|e| format!("rank {} round {round}: {e}", ctx.rank))??;
    }
    comm.barrier().map_err(|e| e.to_string())
}

/// Spawns a job of `size` ranks running `scenario`, with [`FAULT_ENV`] set to `fault(rank)` on
/// the ranks it returns a value for.
fn spawn_armed(scenario: &str, size: usize, fault: &dyn Fn(usize) -> Option<String>) -> Job {
    Job::spawn_with(
        ENTRY,
        scenario,
        size,
        &|job_id| {
            let bind = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
            xccl::bootstrap::UniqueId::start_root(bind, xccl::bootstrap::RootConfig::new(job_id))
        },
        &|rank, cmd| {
            if let Some(spec) = fault(rank) {
                cmd.env(FAULT_ENV, spec);
            }
        },
    )
}

/// [`spawn_armed`] with `spec` on rank `rank` only.
fn spawn_with_fault(scenario: &str, size: usize, rank: usize, spec: &str) -> Job {
    spawn_armed(scenario, size, &|r| (r == rank).then(|| spec.to_string()))
}

/// Runs `scenario` on `size` ranks with `spec` on rank `stopped`, waits until it has stopped
/// itself and each rank of `lines` has printed its line (the waiting ranks' timeouts), resumes
/// it, and expects the job to complete.
fn stop_then_resume(
    scenario: &str,
    size: usize,
    stopped: usize,
    spec: &str,
    lines: &[(usize, &str)],
) -> Job {
    let mut job = spawn_with_fault(scenario, size, stopped, spec);
    job.wait_stopped(stopped, Duration::from_secs(30));
    for &(r, line) in lines {
        job.wait_for_line(r, line, Duration::from_secs(30));
    }
    job.signal(stopped, libc::SIGCONT);
    job.expect_success(Duration::from_secs(60));
    let point = spec.split(':').next().expect("a point");
    assert!(job
        .output(stopped)
        .contains(&format!("point={point} hit=1 action=stop")));
    job
}

#[test]
fn a_stopped_expert_makes_each_waiting_rank_time_out_naming_it_then_the_job_completes() {
    let waiting = "timed out naming rank 2 (E2A record)";
    let job = stop_then_resume(
        "stop_timeout",
        3,
        2,
        "e2a.record:1:stop",
        &[(0, waiting), (1, waiting)],
    );
    assert!(shm_entries(&xccl::fabric::shm::segment_prefix(job.job_id())).is_empty());
}

#[test]
fn an_attention_rank_reads_an_e2a_record_while_its_rows_are_written() {
    // Stopped after its first chunk of rows to rank 0 and before that chunk's signal, expert
    // rank 2 has signalled that message's record: rank 0 waits for the rows, rank 1 (whose
    // message comes next) for its record.
    let lines = [
        (0, "timed out naming rank 2 (E2A rows)"),
        (1, "timed out naming rank 2 (E2A record)"),
    ];
    stop_then_resume("stop_timeout", 3, 2, "e2a.chunk:1:stop", &lines);
}

#[test]
fn an_expert_rank_reads_an_a2e_record_while_its_rows_are_written() {
    // Stopped after its first chunk of rows and before that chunk's signal, the attention rank
    // has signalled its record: the expert rank's timeout names the rows it waits for, not the
    // record.
    let lines = [(1, "timed out naming rank 0 (A2E rows)")];
    stop_then_resume("stop_attention", 2, 0, "a2e.chunk:1:stop", &lines);
}

#[test]
fn a_rank_stopped_mid_call_and_resumed_within_the_timeout_is_not_noticed() {
    // An attention rank stopped after a chunk of its third A2E, and an expert rank stopped
    // after a chunk of its E2A: each resumed 300 ms later, far below the 20 s timeout.
    for (rank, spec) in [(1, "a2e.chunk:9:stop"), (3, "e2a.chunk:5:stop")] {
        let mut job = spawn_with_fault("stop_resume:2:2", 4, rank, spec);
        job.wait_stopped(rank, Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(300));
        job.signal(rank, libc::SIGCONT);
        job.expect_success(Duration::from_secs(60));
        assert!(job.output(rank).contains("action=stop"));
    }
}
