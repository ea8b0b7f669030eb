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
/// them. Kills every child when one fails or when `limit` passes. Returns the exit code to use.
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
    let mut children: Vec<Option<Child>> = Vec::with_capacity(size);
    for rank in 0..size {
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
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
    let start = Instant::now();
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
        if start.elapsed() > limit {
            kill_all(&mut children);
            return Err(format!(
                "the job took longer than {:.0} s; killed every rank",
                limit.as_secs_f64()
            ));
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
