//! Starting ranks: the bench's own launcher (re-executes itself once per rank) and detection of
//! external launchers (mpirun, srun, torchrun, PMI).

use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use xccl::bootstrap::{Exchange, RootConfig, RootHandle, TcpBootstrap, UniqueId};

/// Environment variable carrying the unique id (hex) to a child rank.
pub const ID_ENV: &str = "XCCL_BENCH_ID";
/// Environment variable carrying a child's rank.
pub const RANK_ENV: &str = "XCCL_BENCH_RANK";
/// Environment variable carrying the world size to a child.
pub const SIZE_ENV: &str = "XCCL_BENCH_SIZE";
/// Overrides the bootstrap root address (`IP:port`) under an external launcher.
pub const ROOT_ENV: &str = "XCCL_BENCH_ROOT";

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

/// Rank, size and a job key from an external launcher's environment, if there is one.
pub fn launcher_env() -> Option<(usize, usize, &'static str)> {
    const KINDS: [(&str, &str, &str); 4] = [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun"),
        ("PMI_RANK", "PMI_SIZE", "pmi"),
        ("SLURM_PROCID", "SLURM_NTASKS", "srun"),
        ("RANK", "WORLD_SIZE", "torchrun"),
    ];
    KINDS.iter().find_map(|&(r, s, kind)| {
        let (rank, size) = (env_usize(r)?, env_usize(s)?);
        (rank < size).then_some((rank, size, kind))
    })
}

/// FNV-1a of a string.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Joins the job of an external launcher: rank 0 hosts the bootstrap root.
///
/// The root address is [`ROOT_ENV`] if set, else `MASTER_ADDR` (default `127.0.0.1`) with a port
/// derived from the launcher's job id (`OMPI_MCA_ess_base_jobid`, `PMIX_NAMESPACE`,
/// `SLURM_JOB_ID`.`SLURM_STEP_ID`, `TORCHELASTIC_RUN_ID`, or `MASTER_PORT`), so every rank
/// computes the same address with no extra communication.
pub fn launcher_rank(rank: usize, size: usize, timeout: Duration) -> Result<RankEnv, String> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let key = var("OMPI_MCA_ess_base_jobid")
        .or_else(|| var("PMIX_NAMESPACE"))
        .or_else(|| {
            Some(format!(
                "{}.{}",
                var("SLURM_JOB_ID")?,
                var("SLURM_STEP_ID")?
            ))
        })
        .or_else(|| var("TORCHELASTIC_RUN_ID"))
        .or_else(|| var("MASTER_PORT"))
        .unwrap_or_else(|| "xccl-bench".into());
    let job_id = fnv(&format!("xccl-bench:{key}:{size}"));
    let root: std::net::SocketAddr = match var(ROOT_ENV) {
        Some(a) => a
            .parse()
            .map_err(|_| format!("{ROOT_ENV}={a:?} is not IP:port"))?,
        None => {
            let host = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
            let port = 20_000 + (job_id % 20_000) as u16;
            let ip: std::net::IpAddr = host
                .parse()
                .or_else(|_| {
                    use std::net::ToSocketAddrs;
                    (host.as_str(), port)
                        .to_socket_addrs()
                        .ok()
                        .and_then(|mut a| a.next())
                        .map(|a| a.ip())
                        .ok_or(())
                })
                .map_err(|()| format!("cannot resolve MASTER_ADDR {host:?}"))?;
            (ip, port).into()
        }
    };
    let hosted = if rank == 0 {
        let mut cfg = RootConfig::new(job_id);
        cfg.size = Some(size);
        let bind = std::net::SocketAddr::new(
            if root.is_ipv4() {
                std::net::Ipv4Addr::UNSPECIFIED.into()
            } else {
                std::net::Ipv6Addr::UNSPECIFIED.into()
            },
            root.port(),
        );
        Some(RootHandle::bind(bind, cfg).map_err(|e| e.to_string())?)
    } else {
        None
    };
    let id = UniqueId::from_parts(job_id, root);
    let boot = TcpBootstrap::connect(&id, rank, size, timeout).map_err(|e| e.to_string())?;
    Ok(RankEnv {
        rank,
        exchange: Arc::new(boot),
        _root: hosted,
    })
}

/// Starts `size` copies of this executable (same arguments) as ranks of one job and waits for
/// them. Kills every child when one fails or when `limit` passes. Returns the exit code to use.
pub fn spawn_ranks(size: usize, limit: Duration) -> Result<i32, String> {
    let id = UniqueId::new().map_err(|e| format!("starting the bootstrap root: {e}"))?;
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let mut children: Vec<Option<Child>> = Vec::with_capacity(size);
    for rank in 0..size {
        let spawned = Command::new(&exe)
            .args(&args)
            .env(ID_ENV, id.to_string())
            .env(RANK_ENV, rank.to_string())
            .env(SIZE_ENV, size.to_string())
            .stdin(Stdio::null())
            .spawn();
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

fn kill_all(children: &mut [Option<Child>]) {
    for child in children.iter_mut().flatten() {
        let _ = child.kill();
        let _ = child.wait();
    }
    for slot in children.iter_mut() {
        *slot = None;
    }
}
