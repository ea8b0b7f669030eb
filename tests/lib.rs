//! Helpers for xccl's multi-process tests: real ranks in real processes.
//!
//! A test binary re-runs **itself** as the child ranks (`std::env::current_exe()`), selecting
//! one `#[test]` function (the child entry) with libtest's `--exact` filter and telling it what
//! to do through environment variables ([`SCENARIO_ENV`], [`RANK_ENV`], [`SIZE_ENV`],
//! [`ID_ENV`]). The entry calls [`child_main`], which returns at once in the parent (no
//! scenario set) and otherwise runs the rank's scenario and exits the process with its outcome.
//!
//! The parent side is [`Job`]: it starts a bootstrap root for a job id made of this process's
//! pid and a counter (so concurrent tests never share segment names), spawns the ranks, captures
//! their output, bounds every wait with a timeout (killing the ranks that overrun), checks
//! **every** rank's exit status, and kills whatever is still running when it is dropped, also
//! when the test panics. Process tests take a global lock, so on a small machine they do not
//! compete with each other for cores.
//!
//! [`cuda_support`] runs jobs on the CUDA stand-in driver and reads its transfer counters.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xccl::bootstrap::{Exchange, RootConfig, RootHandle, TcpBootstrap, UniqueId};

pub mod cuda_support;

/// Names the scenario a child rank runs; its presence marks the process as a child.
pub const SCENARIO_ENV: &str = "XCCL_TEST_SCENARIO";
/// The child's rank.
pub const RANK_ENV: &str = "XCCL_TEST_RANK";
/// The number of ranks.
pub const SIZE_ENV: &str = "XCCL_TEST_SIZE";
/// The job's [`UniqueId`] in hex.
pub const ID_ENV: &str = "XCCL_TEST_UNIQUE_ID";

/// Exit code of a child whose scenario returned an error.
pub const EXIT_FAILED: i32 = 1;
/// Exit code of a child whose scenario panicked.
pub const EXIT_PANICKED: i32 = 2;

/// What a child rank knows about itself.
#[derive(Debug, Clone)]
pub struct ChildCtx {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// The job's rendezvous id.
    pub id: UniqueId,
}

impl ChildCtx {
    /// Joins the job's TCP bootstrap.
    pub fn connect(&self, timeout: Duration) -> xccl::Result<Arc<dyn Exchange>> {
        let b = TcpBootstrap::connect(&self.id, self.rank, self.size, timeout)?;
        Ok(Arc::new(b))
    }
}

fn env<T: std::str::FromStr>(name: &str) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("child rank: environment variable {name} missing or bad"))
}

/// The child entry. In the parent (no [`SCENARIO_ENV`]) it returns at once. In a child it runs
/// `dispatch(scenario, ctx)` and exits the process: 0 on `Ok`, [`EXIT_FAILED`] after printing
/// the error, [`EXIT_PANICKED`] on a panic. Never returns in a child.
pub fn child_main(dispatch: fn(&str, &ChildCtx) -> Result<(), String>) {
    let Ok(scenario) = std::env::var(SCENARIO_ENV) else {
        return;
    };
    let ctx = ChildCtx {
        rank: env(RANK_ENV),
        size: env(SIZE_ENV),
        id: env(ID_ENV),
    };
    let outcome = std::panic::catch_unwind(|| dispatch(&scenario, &ctx));
    let code = match outcome {
        Ok(Ok(())) => 0,
        Ok(Err(msg)) => {
            eprintln!("rank {}: scenario {scenario} failed: {msg}", ctx.rank);
            EXIT_FAILED
        }
        Err(_) => {
            eprintln!("rank {}: scenario {scenario} panicked", ctx.rank);
            EXIT_PANICKED
        }
    };
    std::process::exit(code);
}

/// Prints a marker line on stdout (flushed) that the parent can wait for with
/// [`Job::wait_for_line`].
pub fn announce(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Entries of `/dev/shm` whose name starts with `prefix`.
pub fn shm_entries(prefix: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The shared-memory segments of a stand-in runtime (the Ascend or CUDA stand-in) for one job:
/// a unique prefix (`<tag>-<pid>-<n>`) to pass to the stand-in, whose segments left under it
/// are removed on drop, also when the test fails.
pub struct StandinSegments(pub String);

impl StandinSegments {
    /// A fresh prefix starting with `tag`.
    pub fn new(tag: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        StandinSegments(format!(
            "{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// The segments of this prefix still in `/dev/shm`.
    pub fn left(&self) -> Vec<String> {
        shm_entries(&format!("{}-", self.0))
    }
}

impl Drop for StandinSegments {
    fn drop(&mut self) {
        for name in self.left() {
            let _ = std::fs::remove_file(std::path::Path::new("/dev/shm").join(name));
        }
    }
}

/// `rounds` checked rounds of [`mixed_round`] on a fresh communicator of an `m`A:`n`E job
/// (32-wide bf16 rows, top-4 of `4 * max(n, 2)` experts, 16 tokens per rank, varying), made by
/// `init` (a device fabric's constructor): push and pull, every receive path, the caller's
/// buffers only (the registered ones are slices of a window the host cannot address). Checks
/// that the communicator runs on `fabric`.
pub fn checked_device_rounds(
    ctx: &ChildCtx,
    (m, n): (usize, usize),
    rounds: u64,
    quant: xccl::Quant,
    fabric: &str,
    init: &dyn Fn(
        Arc<dyn Exchange>,
        Arc<xccl::Topology>,
        xccl::MoeConfig,
    ) -> xccl::Result<xccl::Communicator>,
) -> Result<(), String> {
    let mut cfg = xccl::MoeConfig::new(32, xccl::DType::BF16, 4, 16);
    cfg.timeout = Duration::from_secs(30);
    cfg.a2e_quant = quant;
    cfg.e2a_quant = quant;
    let ex = ctx
        .connect(Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    let topo = xccl::Topology::contiguous(m, n, 4 * n.max(2)).map_err(|e| e.to_string())?;
    let mut comm = init(ex, Arc::new(topo), cfg).map_err(|e| e.to_string())?;
    if comm.fabric_name() != fabric {
        return Err(format!("fabric {}", comm.fabric_name()));
    }
    let wl = xccl::testing::harness::Workload {
        seed: 0xa5c3 + (m * 10 + n) as u64,
        tokens: 16,
        vary: true,
        skew: None,
        shared_experts: 0,
    };
    let mut batch = xccl::ExpertBatch::new();
    let mut tokens = xccl::TokenBatch::new();
    for round in 0..rounds {
        let verdict = mixed_round(&mut comm, &wl, round, false, &mut batch, &mut tokens);
        verdict
            .map_err(|e| format!("round {round}: {e}"))?
            .map_err(|e| format!("round {round}: {e}"))?;
    }
    announce(&format!("{rounds} rounds checked"));
    Ok(())
}

/// A job id unique on this host while this process lives: pid and a per-process counter.
pub fn unique_job_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    (0x7e57u64 << 48) | (u64::from(std::process::id()) << 16) | NEXT.fetch_add(1, Ordering::Relaxed)
}

static SERIAL: Mutex<()> = Mutex::new(());

struct Rank {
    child: Child,
    status: Option<ExitStatus>,
    output: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
}

/// The ranks of one multi-process job, killed on drop if still running.
pub struct Job {
    ranks: Vec<Rank>,
    job_id: u64,
    scenario: String,
    root: Option<RootHandle>,
    _serial: MutexGuard<'static, ()>,
}

impl Job {
    /// Starts a bootstrap root and spawns `size` ranks of this test binary, each running the
    /// test function `entry` (the one that calls [`child_main`]) with scenario `scenario`.
    pub fn spawn(entry: &str, scenario: &str, size: usize) -> Job {
        let bind = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0);
        Job::spawn_with(
            entry,
            scenario,
            size,
            &|job_id| UniqueId::start_root(bind, RootConfig::new(job_id)),
            &|_, _| {},
        )
    }

    /// [`Job::spawn`] with the bootstrap root made by `start_root(job_id)` (e.g. bound in
    /// another network namespace) and each rank's command adjusted by `customize(rank, cmd)`
    /// before it is spawned (environment, `pre_exec`).
    pub fn spawn_with(
        entry: &str,
        scenario: &str,
        size: usize,
        start_root: &dyn Fn(u64) -> xccl::Result<(UniqueId, RootHandle)>,
        customize: &dyn Fn(usize, &mut Command),
    ) -> Job {
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let job_id = unique_job_id();
        let (id, root) = start_root(job_id).expect("starting bootstrap root");
        let exe = std::env::current_exe().expect("current_exe");
        let mut job = Job {
            ranks: Vec::with_capacity(size),
            job_id,
            scenario: scenario.to_string(),
            root: Some(root),
            _serial: serial,
        };
        for rank in 0..size {
            let mut cmd = Command::new(&exe);
            cmd.args([entry, "--exact", "--nocapture", "--test-threads=1"])
                .env(SCENARIO_ENV, scenario)
                .env(RANK_ENV, rank.to_string())
                .env(SIZE_ENV, size.to_string())
                .env(ID_ENV, id.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            customize(rank, &mut cmd);
            let mut child = cmd
                .spawn()
                .unwrap_or_else(|e| panic!("spawning rank {rank}: {e}"));
            let output = Arc::new(Mutex::new(String::new()));
            let mut readers = Vec::new();
            let pipes: [Box<dyn std::io::Read + Send>; 2] = [
                Box::new(child.stdout.take().expect("piped stdout")),
                Box::new(child.stderr.take().expect("piped stderr")),
            ];
            for pipe in pipes {
                let out = output.clone();
                readers.push(std::thread::spawn(move || {
                    for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                        let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
                        o.push_str(&line);
                        o.push('\n');
                    }
                }));
            }
            job.ranks.push(Rank {
                child,
                status: None,
                output,
                readers,
            });
        }
        job
    }

    /// The job id (segment names of the job start with `xccl-<it in hex>-`).
    pub fn job_id(&self) -> u64 {
        self.job_id
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// What rank `rank` printed so far (stdout and stderr, by line).
    pub fn output(&self, rank: usize) -> String {
        self.ranks[rank]
            .output
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn all_output(&self) -> String {
        (0..self.ranks.len())
            .map(|r| format!("--- rank {r} ---\n{}", self.output(r)))
            .collect()
    }

    /// Waits until rank `rank` prints a line ending with `line` (libtest may have printed the
    /// test name on the same line before it). Panics (killing the job) if it
    /// does not within `timeout` or exits first.
    pub fn wait_for_line(&mut self, rank: usize, line: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if self.output(rank).lines().any(|l| l.ends_with(line)) {
                return;
            }
            self.poll();
            if let Some(st) = self.ranks[rank].status {
                // Its last lines may still be in the pipes (the reader threads can lag behind
                // the exit on a loaded machine): read them to their end before deciding.
                self.drain_output(rank, Duration::from_secs(10));
                if self.output(rank).lines().any(|l| l.ends_with(line)) {
                    return;
                }
                panic!(
                    "{}: rank {rank} exited ({st}) before printing {line:?}\n{}",
                    self.scenario,
                    self.all_output()
                );
            }
            if Instant::now() >= deadline {
                self.kill_all();
                panic!(
                    "{}: rank {rank} did not print {line:?} within {timeout:?}\n{}",
                    self.scenario,
                    self.all_output()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sends SIGKILL to rank `rank`.
    pub fn kill(&mut self, rank: usize) {
        let _ = self.ranks[rank].child.kill();
    }

    /// The process id of rank `rank`.
    pub fn pid(&self, rank: usize) -> u32 {
        self.ranks[rank].child.id()
    }

    /// Sends `signal` (e.g. `libc::SIGCONT`) to rank `rank` if it has not been reaped yet.
    pub fn signal(&mut self, rank: usize, signal: i32) {
        self.poll();
        if self.ranks[rank].status.is_none() {
            let pid = self.pid(rank) as i32;
            // SAFETY: kill(2) on our own unreaped child (its pid cannot have been reused);
            // takes no pointers.
            unsafe { libc::kill(pid, signal) };
        }
    }

    /// Waits until rank `rank` is stopped (state `T` in `/proc/<pid>/stat`, e.g. after it
    /// raised `SIGSTOP`); panics (killing the job) if it is not within `timeout`.
    pub fn wait_stopped(&mut self, rank: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let stat = format!("/proc/{}/stat", self.pid(rank));
        loop {
            let state = std::fs::read_to_string(&stat).ok().and_then(|s| {
                // The state follows the parenthesised command name.
                s.rsplit_once(')')
                    .and_then(|(_, rest)| rest.trim_start().chars().next())
            });
            if state == Some('T') {
                return;
            }
            if Instant::now() >= deadline {
                self.kill_all();
                panic!(
                    "{}: rank {rank} did not stop within {timeout:?} (state {state:?})\n{}",
                    self.scenario,
                    self.all_output()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn poll(&mut self) {
        for r in &mut self.ranks {
            if r.status.is_none() {
                if let Ok(Some(st)) = r.child.try_wait() {
                    r.status = Some(st);
                }
            }
        }
    }

    fn kill_all(&mut self) {
        for r in &mut self.ranks {
            if r.status.is_none() {
                let _ = r.child.kill();
                r.status = r.child.wait().ok();
            }
        }
    }

    /// Waits for every rank to exit, at most `timeout` in all; ranks still running then are
    /// killed and the call panics naming them, with every rank's output. Returns the statuses.
    pub fn wait(&mut self, timeout: Duration) -> Vec<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            self.poll();
            let running: Vec<usize> = (0..self.ranks.len())
                .filter(|&r| self.ranks[r].status.is_none())
                .collect();
            if running.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                self.kill_all();
                self.join_readers();
                panic!(
                    "{}: ranks {running:?} still running after {timeout:?}; killed\n{}",
                    self.scenario,
                    self.all_output()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.join_readers();
        self.ranks
            .iter()
            .map(|r| r.status.expect("every rank exited"))
            .collect()
    }

    /// Waits (at most `bound`) until the reader threads of exited rank `rank` have read its
    /// pipes to the end, and joins those that have.
    fn drain_output(&mut self, rank: usize, bound: Duration) {
        let deadline = Instant::now() + bound;
        let readers = &mut self.ranks[rank].readers;
        while readers.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        for h in std::mem::take(readers) {
            if h.is_finished() {
                let _ = h.join();
            } else {
                readers.push(h);
            }
        }
    }

    fn join_readers(&mut self) {
        for r in &mut self.ranks {
            for h in r.readers.drain(..) {
                let _ = h.join();
            }
        }
    }

    /// Waits (bounded by `timeout`) and panics unless every rank exited with status 0.
    pub fn expect_success(&mut self, timeout: Duration) {
        let statuses = self.wait(timeout);
        let bad: Vec<String> = statuses
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.success())
            .map(|(r, s)| format!("rank {r}: {s}"))
            .collect();
        if !bad.is_empty() {
            panic!(
                "{}: ranks failed: {}\n{}",
                self.scenario,
                bad.join(", "),
                self.all_output()
            );
        }
    }

    /// Asserts that rank `rank` exited with code 0 (after [`Job::wait`]).
    pub fn assert_succeeded(&self, rank: usize) {
        match self.ranks[rank].status {
            Some(s) if s.success() => {}
            other => panic!(
                "{}: rank {rank} did not succeed: {other:?}\n{}",
                self.scenario,
                self.all_output()
            ),
        }
    }

    /// Asserts that rank `rank` was killed by SIGKILL (after [`Job::wait`]).
    pub fn assert_killed(&self, rank: usize) {
        match self.ranks[rank].status {
            Some(s) if s.signal() == Some(libc::SIGKILL) => {}
            other => panic!(
                "{}: rank {rank} was not SIGKILLed: {other:?}\n{}",
                self.scenario,
                self.all_output()
            ),
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.kill_all();
        self.join_readers();
        if let Some(root) = self.root.take() {
            root.shutdown();
        }
    }
}

/// One checked round of the mixed workload every fabric's A2E/E2A test runs, bf16: push or pull
/// by `(round + rank) % 3`, registered buffers every fourth round when `registered` (fabrics
/// whose windows the host can address), and the expert-major, view and token-major receive
/// paths in turn. Returns the reference check's verdict.
pub fn mixed_round(
    comm: &mut xccl::Communicator,
    wl: &xccl::testing::harness::Workload,
    round: u64,
    registered: bool,
    batch: &mut xccl::ExpertBatch,
    tokens: &mut xccl::TokenBatch,
) -> xccl::Result<Result<(), String>> {
    use half::bf16;
    use xccl::testing::harness::{
        attention_round_with, expert_round, expert_round_tokens_with, expert_round_view, Buffers,
    };
    let r = round + comm.rank() as u64;
    comm.set_mode(if r.is_multiple_of(3) {
        xccl::TransferMode::Pull
    } else {
        xccl::TransferMode::Push
    });
    let buffers = if registered && r % 4 == 3 {
        Buffers::Registered
    } else {
        Buffers::Copy
    };
    match comm.role() {
        xccl::Role::Attention => attention_round_with::<bf16>(comm, wl, round, buffers),
        xccl::Role::Expert if round.is_multiple_of(2) => {
            expert_round::<bf16>(comm, wl, round, batch, true)
        }
        xccl::Role::Expert if round % 4 == 1 => expert_round_view::<bf16>(comm, wl, round, true),
        xccl::Role::Expert => {
            expert_round_tokens_with::<bf16>(comm, wl, round, tokens, true, buffers)
        }
    }
}

/// Rank 1 of a job on fabric `f` SIGKILLs itself right after init; rank 0's wait for a signal
/// from it must fail naming it within 3 s (the fabric's liveness check).
pub fn rank_1_killed_after_init(f: &dyn xccl::fabric::Fabric) -> xccl::Result<()> {
    if f.rank() == 1 {
        sigkill_self();
    }
    let start = Instant::now();
    let r = f.wait_signal(
        0,
        1,
        "a signal from a dying peer",
        xccl::fabric::deadline_after(Duration::from_secs(30)),
        &|v| v > 0,
    );
    match r {
        Err(xccl::Error::PeerFailed { peer: 1, detail })
            if start.elapsed() < Duration::from_secs(3) =>
        {
            announce(&format!("noticed in {:?}: {detail}", start.elapsed()));
            Ok(())
        }
        other => Err(xccl::Error::Protocol {
            peer: usize::MAX,
            detail: format!(
                "expected PeerFailed naming rank 1 within 3 s, got {other:?} after {:?}",
                start.elapsed()
            ),
        }),
    }
}

/// SIGKILLs this process: a rank dying without a word, as a crash does.
pub fn sigkill_self() -> ! {
    // SAFETY: kill(2) on this process's own pid; takes no pointers.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL cannot be caught");
}

/// An expert rank receives the next A2E and SIGKILLs itself holding it unanswered. The attention
/// ranks send a call only after finishing the one before, so every rank has finished every
/// earlier call and only this one can fail on the death. (Dying right after a reply raced: an
/// attention rank still waiting for another expert's reply to that call could see the death
/// and fail it.) Returns only the receive's error.
pub fn sigkill_holding_the_next_a2e(comm: &mut xccl::Communicator) -> String {
    // A batch dropped unanswered aborts the job: this one lives until the kill.
    let mut held = xccl::ExpertBatch::new();
    match comm.a2e_recv(&mut held) {
        Ok(()) => sigkill_self(),
        Err(e) => e.to_string(),
    }
}
