//! Starting ranks: the bench's own launcher (re-executes itself once per rank) and detection of
//! external launchers (mpirun, srun, torchrun, PMI).

use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use xccl::bootstrap::env::{LaunchEnv, Launcher, ROOT_ENV};
use xccl::bootstrap::{Exchange, RootHandle, TcpBootstrap, UniqueId};

/// Environment variable carrying the unique id (hex) to a child rank.
pub const ID_ENV: &str = "XCCL_BENCH_ID";
/// Environment variable carrying a child's rank.
pub const RANK_ENV: &str = "XCCL_BENCH_RANK";
/// Environment variable carrying the world size to a child.
pub const SIZE_ENV: &str = "XCCL_BENCH_SIZE";
/// Environment variable naming the launcher's heartbeat file to a child: one little-endian
/// `u64` per rank, which the rank raises as it makes progress ([`beat`]).
pub const HEARTBEAT_ENV: &str = "XCCL_BENCH_HEARTBEAT";

/// A rank raises its heartbeat at most this often (one `pwrite` per period, off the timed
/// spans: between rounds).
const BEAT_EVERY: Duration = Duration::from_millis(100);

/// How long the launcher lets a rank go without a heartbeat before it kills the job: three
/// call timeouts (a rank blocked in a call fails by itself within one) and 10 s of slack for
/// process start and set-up. A liveness check, not a cap on the job's total time.
pub fn stall_limit(timeout: Duration) -> Duration {
    timeout
        .saturating_mul(3)
        .saturating_add(Duration::from_secs(10))
}

/// This process's heartbeat, when a launcher of [`spawn_ranks`] watches it.
struct Heartbeat {
    file: std::fs::File,
    at: u64,
    count: u64,
    last: Instant,
}

static HEARTBEAT: std::sync::Mutex<Option<Heartbeat>> = std::sync::Mutex::new(None);

/// Starts this rank's heartbeat if a launcher watches it ([`HEARTBEAT_ENV`]), and beats once.
pub fn start_heartbeat(rank: usize) -> Result<(), String> {
    let Ok(path) = std::env::var(HEARTBEAT_ENV) else {
        return Ok(());
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .map_err(|e| format!("{HEARTBEAT_ENV}={path}: {e}"))?;
    let heartbeat = Heartbeat {
        file,
        at: rank as u64 * 8,
        count: 0,
        last: Instant::now() - BEAT_EVERY,
    };
    *HEARTBEAT.lock().unwrap_or_else(|p| p.into_inner()) = Some(heartbeat);
    beat();
    Ok(())
}

/// Tells the launcher this rank is alive and progressing (at most every [`BEAT_EVERY`]);
/// nothing without a launcher watching.
pub fn beat() {
    use std::os::unix::fs::FileExt;
    let mut guard = HEARTBEAT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(h) = guard.as_mut() {
        if h.last.elapsed() >= BEAT_EVERY {
            h.count += 1;
            h.last = Instant::now();
            let _ = h.file.write_all_at(&h.count.to_le_bytes(), h.at);
        }
    }
}

/// The launcher's side: when each rank last raised its heartbeat.
pub struct Liveness {
    counts: Vec<u64>,
    since: Vec<Instant>,
    limit: Duration,
}

impl Liveness {
    /// `size` ranks, each allowed `limit` between heartbeats, counted from `now`.
    pub fn new(size: usize, limit: Duration, now: Instant) -> Self {
        Liveness {
            counts: vec![0; size],
            since: vec![now; size],
            limit,
        }
    }

    /// Takes the heartbeat words read at `now` (`running[r]`: rank `r` has not exited);
    /// returns a running rank that has not beaten for longer than the limit, with how long.
    pub fn observe(
        &mut self,
        counts: &[u64],
        running: &[bool],
        now: Instant,
    ) -> Option<(usize, Duration)> {
        for (r, &c) in counts.iter().enumerate().take(self.counts.len()) {
            if c != self.counts[r] {
                self.counts[r] = c;
                self.since[r] = now;
            }
        }
        (0..self.counts.len())
            .filter(|&r| running.get(r).copied().unwrap_or(false))
            .map(|r| (r, now.saturating_duration_since(self.since[r])))
            .find(|&(_, quiet)| quiet > self.limit)
    }
}

/// Reads the heartbeat words of `size` ranks from `path` (zeros for a short read).
fn read_heartbeats(path: &std::path::Path, size: usize) -> Vec<u64> {
    let bytes = std::fs::read(path).unwrap_or_default();
    (0..size)
        .map(|r| {
            bytes
                .get(r * 8..r * 8 + 8)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u64::from_le_bytes)
        })
        .collect()
}

/// How this process became a rank.
pub struct RankEnv {
    /// This rank.
    pub rank: usize,
    /// The bootstrap joined.
    pub exchange: Arc<dyn Exchange>,
    /// The root service, when this rank hosts it (kept alive for the job).
    pub _root: Option<RootHandle>,
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// A child started by [`spawn_ranks`]: rank and size from [`RANK_ENV`] and [`SIZE_ENV`].
pub fn child_rank(timeout: Duration) -> Result<Option<RankEnv>, String> {
    let Ok(hex) = std::env::var(ID_ENV) else {
        return Ok(None);
    };
    let id: UniqueId = hex.parse().map_err(|e| format!("{ID_ENV}: {e}"))?;
    let rank = env_usize(RANK_ENV).ok_or(format!("{RANK_ENV} is not set"))?;
    let size = env_usize(SIZE_ENV).ok_or(format!("{SIZE_ENV} is not set"))?;
    let boot = TcpBootstrap::connect(&id, rank, size, timeout).map_err(|e| e.to_string())?;
    Ok(Some(RankEnv {
        rank,
        exchange: Arc::new(boot),
        _root: None,
    }))
}

/// The job of an external launcher (mpirun, srun, torchrun, PMI), if this process runs under one.
///
/// Detection is the library's ([`LaunchEnv::detect_with`]). On one host the launchers' own
/// variables are enough: when neither `XCCL_ROOT` nor `MASTER_ADDR` says where rank 0's
/// bootstrap root listens, it listens on 127.0.0.1 at a port derived from the launcher's job id
/// (`OMPI_MCA_ess_base_jobid`, `PMIX_NAMESPACE`, `SLURM_JOB_ID`.`SLURM_STEP_ID`), so every rank
/// computes the same address with no extra set-up.
pub fn launcher_env() -> Result<Option<LaunchEnv>, String> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let derived_root = || {
        let key = var("OMPI_MCA_ess_base_jobid")
            .or_else(|| var("PMIX_NAMESPACE"))
            .or_else(|| {
                Some(format!(
                    "{}.{}",
                    var("SLURM_JOB_ID")?,
                    var("SLURM_STEP_ID")?
                ))
            })
            .unwrap_or_else(|| "xccl-bench".into());
        format!("127.0.0.1:{}", 20_000 + fnv(&key) % 20_000)
    };
    let launched = Launcher::ALL.iter().any(|l| var(l.variables().0).is_some());
    LaunchEnv::detect_with(&|k| match var(k) {
        None if launched && k == ROOT_ENV && var("MASTER_ADDR").is_none() => Some(derived_root()),
        v => v,
    })
    .map_err(|e| e.to_string())
}

/// FNV-1a of a string.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Joins the external launcher's job: rank 0 hosts the bootstrap root.
pub fn launcher_rank(env: &LaunchEnv, timeout: Duration) -> Result<RankEnv, String> {
    let boot = env.connect(timeout).map_err(|e| e.to_string())?;
    Ok(RankEnv {
        rank: env.rank,
        exchange: Arc::new(boot),
        _root: None,
    })
}

/// Starts `size` copies of this executable (same arguments) as ranks of one job and waits for
/// them. Kills every child when one fails, or when a running rank has not raised its heartbeat
/// for `limit` ([`stall_limit`]): a liveness check, so a long healthy job runs to its end.
/// Returns the exit code to use.
/// With `hosts` (`--netns`), rank `r` runs in host `r mod K` and the bootstrap root in host 0.
pub fn spawn_ranks(
    size: usize,
    limit: Duration,
    hosts: Option<&xccl::testing::netns::Hosts>,
) -> Result<i32, String> {
    let (id, _root) = match hosts {
        Some(h) => {
            let job = u64::from(std::process::id()) << 32 ^ u64::from(rand_word());
            let (id, root) = h
                .start_root(job)
                .map_err(|e| format!("starting the bootstrap root in host 0: {e}"))?;
            (id, Some(root))
        }
        None => (
            UniqueId::new().map_err(|e| format!("starting the bootstrap root: {e}"))?,
            None,
        ),
    };
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let heartbeats = std::env::temp_dir().join(format!(
        "xccl-bench-heartbeat-{}-{:08x}",
        std::process::id(),
        rand_word()
    ));
    std::fs::write(&heartbeats, vec![0u8; size * 8])
        .map_err(|e| format!("creating {}: {e}", heartbeats.display()))?;
    let outcome = watch_ranks(&exe, &args, &id, size, limit, hosts, &heartbeats);
    let _ = std::fs::remove_file(&heartbeats);
    outcome
}

/// [`spawn_ranks`] with the heartbeat file made.
fn watch_ranks(
    exe: &std::path::Path,
    args: &[std::ffi::OsString],
    id: &UniqueId,
    size: usize,
    limit: Duration,
    hosts: Option<&xccl::testing::netns::Hosts>,
    heartbeats: &std::path::Path,
) -> Result<i32, String> {
    let mut children: Vec<Option<Child>> = Vec::with_capacity(size);
    for rank in 0..size {
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .env(HEARTBEAT_ENV, heartbeats)
            .env(ID_ENV, id.to_string())
            .env(RANK_ENV, rank.to_string())
            .env(SIZE_ENV, size.to_string())
            .stdin(Stdio::null());
        let spawned = match hosts.map(|h| h.place(h.host_of(rank), &mut cmd)) {
            Some(Err(e)) => Err(std::io::Error::other(e)),
            _ => cmd.spawn(),
        };
        match spawned {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                kill_all(&mut children);
                return Err(format!("spawning rank {rank}: {e}"));
            }
        }
    }
    let mut liveness = Liveness::new(size, limit, Instant::now());
    let mut last_look = Instant::now();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; size];
    let mut first_failure: Option<(usize, ExitStatus, Instant)> = None;
    loop {
        for (rank, slot) in children.iter_mut().enumerate() {
            if let Some(child) = slot {
                match child.try_wait() {
                    Ok(Some(st)) => {
                        statuses[rank] = Some(st);
                        *slot = None;
                        if !st.success() && first_failure.is_none() {
                            first_failure = Some((rank, st, Instant::now()));
                        }
                    }
                    Ok(None) => {}
                    Err(e) => return Err(format!("waiting for rank {rank}: {e}")),
                }
            }
        }
        if children.iter().all(Option::is_none) {
            break;
        }
        // After a failure the others get a moment to report theirs, then are killed.
        if let Some((rank, st, when)) = first_failure {
            if when.elapsed() > Duration::from_secs(2) {
                kill_all(&mut children);
                eprintln!("xccl-bench: rank {rank} failed ({st}); killed the other ranks");
                break;
            }
        }
        if last_look.elapsed() >= BEAT_EVERY {
            last_look = Instant::now();
            let running: Vec<bool> = children.iter().map(Option::is_some).collect();
            let counts = read_heartbeats(heartbeats, size);
            if let Some((rank, quiet)) = liveness.observe(&counts, &running, last_look) {
                kill_all(&mut children);
                return Err(format!(
                    "rank {rank} made no progress for {:.1} s (the liveness limit: 3 x \
                     --timeout + 10 s); killed every rank",
                    quiet.as_secs_f64()
                ));
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if let Some((rank, st, _)) = first_failure {
        eprintln!("xccl-bench: rank {rank} exited with {st}");
        return Ok(st.code().unwrap_or(1).max(1));
    }
    Ok(0)
}

/// A word that differs between jobs (the clock's nanoseconds).
fn rand_word() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
}

fn kill_all(children: &mut [Option<Child>]) {
    for child in children.iter_mut().flatten() {
        let _ = child.kill();
        let _ = child.wait();
    }
    for slot in children.iter_mut() {
        *slot = None;
    }
}

/// Pins this process (rank `rank` of `size`) to one CPU of the set it may run on, per `bind`.
/// Returns the CPU, or `None` when left unpinned.
pub fn bind_rank(
    bind: crate::cli::Bind,
    rank: usize,
    size: usize,
) -> Result<Option<usize>, String> {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let allowed =
        sched_getaffinity(Pid::from_raw(0)).map_err(|e| format!("sched_getaffinity: {e}"))?;
    let cpus: Vec<usize> = (0..CpuSet::count())
        .filter(|&c| allowed.is_set(c).unwrap_or(false))
        .collect();
    let pin = match bind {
        crate::cli::Bind::None => false,
        crate::cli::Bind::Core => true,
        crate::cli::Bind::Auto => size <= cpus.len(),
    };
    if !pin || cpus.is_empty() {
        return Ok(None);
    }
    let cpu = cpus[rank % cpus.len()];
    let mut set = CpuSet::new();
    set.set(cpu).map_err(|e| format!("CPU {cpu}: {e}"))?;
    sched_setaffinity(Pid::from_raw(0), &set)
        .map_err(|e| format!("pinning rank {rank} to CPU {cpu}: {e}"))?;
    Ok(Some(cpu))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_kills_only_a_rank_that_stopped_beating_whatever_the_total_time() {
        let t0 = Instant::now();
        let limit = Duration::from_secs(5);
        let mut live = Liveness::new(2, limit, t0);
        let running = [true, true];
        // An hour of healthy beats: never a stall.
        for s in 1..=3600u64 {
            let now = t0 + Duration::from_secs(s);
            assert_eq!(live.observe(&[s, s], &running, now), None);
        }
        // Rank 1 stops beating: named once its silence passes the limit.
        let at = |s: u64| t0 + Duration::from_secs(3600 + s);
        assert_eq!(live.observe(&[3601, 3600], &running, at(1)), None);
        assert_eq!(
            live.observe(&[3606, 3600], &running, at(6)),
            Some((1, limit + Duration::from_secs(1)))
        );
        // A rank that exited is not waited for.
        assert_eq!(live.observe(&[3606, 3600], &[true, false], at(6)), None);
        assert_eq!(stall_limit(Duration::from_secs(2)), Duration::from_secs(16));
        assert_eq!(stall_limit(Duration::MAX), Duration::MAX);
    }
}
