//! Rendezvous from the launcher's environment (torchrun, Open MPI, PMI, Slurm).
//!
//! Rank and world size come from the first launcher whose variables are set, in this order:
//!
//! | launcher | rank | size |
//! |---|---|---|
//! | xccl (explicit) | `XCCL_RANK` | `XCCL_SIZE` |
//! | torchrun | `RANK` | `WORLD_SIZE` |
//! | Open MPI | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` |
//! | PMI (MPICH, Intel MPI, Slurm's PMI) | `PMI_RANK` | `PMI_SIZE` |
//! | Slurm | `SLURM_PROCID` | `SLURM_NTASKS` |
//!
//! The root address is `XCCL_ROOT=host:port` if set, otherwise `MASTER_ADDR` + `MASTER_PORT`
//! (torchrun sets them; any launcher may). MPI, PMI and Slurm set neither, so there `XCCL_ROOT`
//! is required. Rank 0 starts the root service on that port, bound to that address (not to
//! every interface; `SO_REUSEADDR` set); every rank then connects.
//!
//! **The job key.** Every rank must hold the same secret ([`JobKey`]): `XCCL_JOB_KEY` (64 hex
//! digits, e.g. from `openssl rand -hex 32`, exported to the launcher so every rank inherits
//! it) or `XCCL_JOB_KEY_FILE` (a file holding them; `/proc/self/fd/N` for an inherited
//! descriptor). Without one, [`LaunchEnv::detect`] refuses to start, unless
//! `XCCL_INSECURE_NO_KEY=1` says the job accepts anyone who can reach the root's port (a
//! warning is logged then). The key never appears in an error or a log line.
//!
//! Note that torchrun's own store may already listen on `MASTER_PORT` when the job also uses
//! `torch.distributed`; set `XCCL_ROOT` to another port then.
//!
//! The job id is a hash of the root address as written in the environment (the same text on
//! every rank, even where a host name resolves differently) plus the optional `XCCL_JOB_ID`. It
//! is not a secret: jobs are told apart, and strangers kept out, by the key.

use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::time::Duration;

use super::key::{self, JobKey, INSECURE_ENV};
use super::root::{RootConfig, RootHandle};
use super::tcp::TcpBootstrap;
use crate::{Error, Result};

/// Overrides the root address: `host:port` (`[v6]:port` for IPv6 literals).
pub const ROOT_ENV: &str = "XCCL_ROOT";
/// Optional text mixed into the job id, to tell apart jobs that reuse a root address.
pub const JOB_ID_ENV: &str = "XCCL_JOB_ID";

/// Which launcher's variables gave the rank and world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `XCCL_RANK` / `XCCL_SIZE`.
    Xccl,
    /// torchrun: `RANK` / `WORLD_SIZE`.
    Torchrun,
    /// Open MPI: `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE`.
    OpenMpi,
    /// PMI: `PMI_RANK` / `PMI_SIZE`.
    Pmi,
    /// Slurm: `SLURM_PROCID` / `SLURM_NTASKS`.
    Slurm,
}

impl Launcher {
    /// The (rank, size) variable names of this launcher.
    pub fn variables(self) -> (&'static str, &'static str) {
        match self {
            Launcher::Xccl => ("XCCL_RANK", "XCCL_SIZE"),
            Launcher::Torchrun => ("RANK", "WORLD_SIZE"),
            Launcher::OpenMpi => ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            Launcher::Pmi => ("PMI_RANK", "PMI_SIZE"),
            Launcher::Slurm => ("SLURM_PROCID", "SLURM_NTASKS"),
        }
    }

    /// Every launcher, in detection order.
    pub const ALL: [Launcher; 5] = [
        Launcher::Xccl,
        Launcher::Torchrun,
        Launcher::OpenMpi,
        Launcher::Pmi,
        Launcher::Slurm,
    ];
}

/// What the launcher's environment says about this rank and the rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// The root service's address (resolved).
    pub root: SocketAddr,
    /// The job id, derived from the root address text and `XCCL_JOB_ID`.
    pub job_id: u64,
    /// Where rank and size came from.
    pub launcher: Launcher,
    /// Where the root address came from: `"XCCL_ROOT"` or `"MASTER_ADDR/MASTER_PORT"`.
    pub root_source: &'static str,
    /// The job's secret key (from `XCCL_JOB_KEY` / `XCCL_JOB_KEY_FILE`; `Debug` hides it).
    pub key: JobKey,
    /// False when the job runs without a key (`XCCL_INSECURE_NO_KEY=1`).
    pub authenticated: bool,
}

impl LaunchEnv {
    /// Reads the process environment; `Ok(None)` when no launcher variables are set.
    pub fn detect() -> Result<Option<LaunchEnv>> {
        Self::detect_with(&|k| std::env::var(k).ok())
    }

    /// Like [`LaunchEnv::detect`], reading variables through `get` (tests pass a map).
    ///
    /// Errors ([`Error::Bootstrap`], naming the variable): a value that does not parse, only one
    /// of a launcher's two variables set, `rank >= size`, size 0, no root address for a launcher
    /// that does not provide one, a root host name that does not resolve, or no job key (and no
    /// `XCCL_INSECURE_NO_KEY=1`).
    pub fn detect_with(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let mut found = None;
        for launcher in Launcher::ALL {
            let (rank_var, size_var) = launcher.variables();
            match (get(rank_var), get(size_var)) {
                (None, None) => continue,
                (Some(_), None) => {
                    return Err(Error::Bootstrap(format!(
                        "{rank_var} is set but {size_var} is not"
                    )))
                }
                (None, Some(_)) => {
                    return Err(Error::Bootstrap(format!(
                        "{size_var} is set but {rank_var} is not"
                    )))
                }
                (Some(r), Some(s)) => {
                    let rank = parse_count(rank_var, &r)?;
                    let size = parse_count(size_var, &s)?;
                    if size == 0 {
                        return Err(Error::Bootstrap(format!("{size_var}=0: a job needs ranks")));
                    }
                    if rank >= size {
                        return Err(Error::Bootstrap(format!(
                            "{rank_var}={rank} is out of range for {size_var}={size}"
                        )));
                    }
                    found = Some((launcher, rank, size));
                    break;
                }
            }
        }
        let Some((launcher, rank, size)) = found else {
            if get(ROOT_ENV).is_some() {
                return Err(Error::Bootstrap(format!(
                    "{ROOT_ENV} is set but no rank/size is: set XCCL_RANK and XCCL_SIZE, or launch \
                     with torchrun, mpirun or srun"
                )));
            }
            return Ok(None);
        };
        let (spec, root_source, root) = if let Some(v) = get(ROOT_ENV) {
            let v = v.trim().to_string();
            let root = parse_host_port(ROOT_ENV, &v)?;
            (v, "XCCL_ROOT", root)
        } else if let Some(addr) = get("MASTER_ADDR") {
            let Some(port) = get("MASTER_PORT") else {
                return Err(Error::Bootstrap(
                    "MASTER_ADDR is set but MASTER_PORT is not".into(),
                ));
            };
            let port = parse_port("MASTER_PORT", port.trim())?;
            let host = addr.trim();
            let root = resolve("MASTER_ADDR", host, port)?;
            (format!("{host}:{port}"), "MASTER_ADDR/MASTER_PORT", root)
        } else {
            let (rank_var, size_var) = launcher.variables();
            return Err(Error::Bootstrap(format!(
                "rank and size come from {rank_var}/{size_var} ({launcher:?}), but there is no \
                 rendezvous address: set {ROOT_ENV}=host:port (a host every rank can reach; rank 0 \
                 listens on that port)"
            )));
        };
        let job_text = get(JOB_ID_ENV);
        let job_id = derive_job_id(&spec, job_text.as_deref());
        let public = format!("{spec}\0{}", job_text.unwrap_or_default());
        let (key, authenticated) = key::key_from_env(&get, &public)?;
        if !authenticated {
            tracing::warn!(
                rank,
                "xccl: {INSECURE_ENV}=1: this job has no key; anyone who can reach {spec} can \
                 join it or pose as its root"
            );
        }
        Ok(Some(LaunchEnv {
            key,
            authenticated,
            rank,
            size,
            root,
            job_id,
            launcher,
            root_source,
        }))
    }

    /// Joins the job: rank 0 first starts the root service on the root's port, then every rank
    /// connects (retrying until `timeout`, as rank 0 may start after the others).
    pub fn connect(&self, timeout: Duration) -> Result<TcpBootstrap> {
        self.connect_with(timeout, RootConfig::with_key(self.job_id, self.key.clone()))
    }

    /// Like [`LaunchEnv::connect`] with the root settings given (job id, key and size are taken
    /// from `self`); used by tests for short timeouts.
    pub fn connect_with(&self, timeout: Duration, mut config: RootConfig) -> Result<TcpBootstrap> {
        let hosted = if self.rank == 0 {
            // Bound to the address the ranks were told, not to every interface.
            let bind = self.root;
            let listener = TcpListener::bind(bind).map_err(|e| {
                if e.kind() == std::io::ErrorKind::AddrInUse {
                    return Error::Bootstrap(format!(
                        "rank 0 cannot start the bootstrap root: port {} of {} is taken by \
                         another program (address from {}), so the job cannot start there; set \
                         {ROOT_ENV} to a free port",
                        bind.port(),
                        bind.ip(),
                        self.root_source
                    ));
                }
                Error::os(
                    format!(
                        "rank 0 binding the bootstrap root to {bind} (address from {}; it must be \
                         an address of rank 0's host; set {ROOT_ENV} to use another address or port)",
                        self.root_source
                    ),
                    e,
                )
            })?;
            config.job_id = self.job_id;
            config.key = self.key.clone();
            config.size = Some(self.size);
            Some(RootHandle::spawn(listener, config)?)
        } else {
            None
        };
        TcpBootstrap::connect_to(
            self.root,
            self.job_id,
            &self.key,
            self.rank,
            self.size,
            timeout,
            hosted,
        )
    }
}

/// Joins the job described by the launcher's environment (see the [module docs](self)).
///
/// Fails with [`Error::Bootstrap`] when no launcher variables are set.
pub fn from_env(timeout: Duration) -> Result<TcpBootstrap> {
    let env = LaunchEnv::detect()?.ok_or_else(|| {
        Error::Bootstrap(
            "no launcher environment: set XCCL_RANK, XCCL_SIZE and XCCL_ROOT, or launch with \
             torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), mpirun or srun plus XCCL_ROOT"
                .into(),
        )
    })?;
    env.connect(timeout)
}

fn parse_count(var: &str, value: &str) -> Result<usize> {
    value
        .trim()
        .parse::<usize>()
        .map_err(|_| Error::Bootstrap(format!("{var}={value:?} is not a non-negative integer")))
}

fn parse_port(var: &str, value: &str) -> Result<u16> {
    match value.parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(Error::Bootstrap(format!(
            "{var}={value:?} is not a port number (1-65535)"
        ))),
    }
}

/// Parses `host:port` or `[v6]:port`.
fn parse_host_port(var: &str, value: &str) -> Result<SocketAddr> {
    let bad = || Error::Bootstrap(format!("{var}={value:?} is not host:port"));
    let (host, port) = value.rsplit_once(':').ok_or_else(bad)?;
    let host = match host.strip_prefix('[') {
        Some(h) => h.strip_suffix(']').ok_or_else(bad)?,
        None if host.contains(':') => return Err(bad()),
        None => host,
    };
    if host.is_empty() {
        return Err(bad());
    }
    let port = parse_port(var, port)?;
    resolve(var, host, port)
}

/// An IP literal as is; a host name through the resolver (IPv4 preferred).
fn resolve(var: &str, host: &str, port: u16) -> Result<SocketAddr> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::Bootstrap(format!("{var}: cannot resolve host {host:?}: {e}")))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| Error::Bootstrap(format!("{var}: host {host:?} has no address")))
}

/// FNV-1a over the root address text and the optional `XCCL_JOB_ID`.
fn derive_job_id(root_spec: &str, job: Option<&str>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let parts: [&[u8]; 4] = [
        b"xccl-launch\0",
        root_spec.as_bytes(),
        b"\0",
        job.unwrap_or("").as_bytes(),
    ];
    for byte in parts.iter().flat_map(|p| p.iter()) {
        h ^= u64::from(*byte);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::bootstrap::Exchange;
    use std::collections::HashMap;

    /// An environment lookup over `pairs` (tests never change the process environment).
    pub(crate) fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    /// A job key for the tests (every rank of a test job gets the same one).
    pub(crate) const TEST_KEY: &str =
        "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    /// Detects from `pairs` plus [`TEST_KEY`] in `XCCL_JOB_KEY`.
    fn detect(pairs: &[(&str, &str)]) -> Result<Option<LaunchEnv>> {
        let mut all = pairs.to_vec();
        all.push((crate::bootstrap::KEY_ENV, TEST_KEY));
        LaunchEnv::detect_with(&env(&all))
    }

    #[test]
    fn a_launcher_job_without_a_key_is_refused_naming_the_variables() {
        let pairs = [
            ("XCCL_RANK", "0"),
            ("XCCL_SIZE", "2"),
            ("XCCL_ROOT", "10.0.0.1:7000"),
        ];
        let err = LaunchEnv::detect_with(&env(&pairs))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no job key")
                && err.contains("XCCL_JOB_KEY")
                && err.contains("XCCL_INSECURE_NO_KEY"),
            "{err}"
        );
        let mut opted_out = pairs.to_vec();
        opted_out.push(("XCCL_INSECURE_NO_KEY", "1"));
        let e = LaunchEnv::detect_with(&env(&opted_out)).unwrap().unwrap();
        assert!(!e.authenticated);
        let keyed = detect(&pairs).unwrap().unwrap();
        assert!(keyed.authenticated);
        assert_eq!(keyed.key.to_hex(), TEST_KEY);
        assert!(!format!("{keyed:?}").contains(TEST_KEY));
    }

    #[test]
    fn a_root_port_taken_by_another_program_fails_rank_0_naming_the_port() {
        let squatter = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = squatter.local_addr().unwrap().port();
        let root = format!("127.0.0.1:{port}");
        let e = detect(&[("XCCL_RANK", "0"), ("XCCL_SIZE", "2"), ("XCCL_ROOT", &root)])
            .unwrap()
            .unwrap();
        let err = e.connect(Duration::from_secs(2)).err().unwrap().to_string();
        assert!(
            err.contains(&format!(
                "port {port} of 127.0.0.1 is taken by another program"
            )) && err.contains("cannot start"),
            "{err}"
        );
    }

    #[test]
    fn rank_0_binds_the_root_to_the_address_the_ranks_were_told() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let root = format!("127.0.0.1:{port}");
        let e = detect(&[("XCCL_RANK", "0"), ("XCCL_SIZE", "2"), ("XCCL_ROOT", &root)])
            .unwrap()
            .unwrap();
        let mut cfg = RootConfig::new(0);
        cfg.idle_timeout = Duration::from_secs(5);
        let b = e.connect_with(Duration::from_secs(5), cfg).unwrap();
        // Another loopback address of this host is not served: the root is not on 0.0.0.0.
        let other: std::net::SocketAddr = format!("127.0.0.2:{port}").parse().unwrap();
        assert!(std::net::TcpStream::connect(other).is_err());
        drop(b);
    }

    fn bootstrap_err(pairs: &[(&str, &str)]) -> String {
        match detect(pairs) {
            Err(Error::Bootstrap(m)) => m,
            other => panic!("expected a bootstrap error, got {other:?}"),
        }
    }

    #[test]
    fn no_launcher_variables_means_none() {
        assert_eq!(detect(&[("HOME", "/root")]).unwrap(), None);
        // Empty values count as unset.
        assert_eq!(detect(&[("RANK", ""), ("WORLD_SIZE", " ")]).unwrap(), None);
    }

    #[test]
    fn torchrun_variables_are_read() {
        let e = detect(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.size, e.launcher), (3, 8, Launcher::Torchrun));
        assert_eq!(e.root, "10.0.0.1:29500".parse().unwrap());
        assert_eq!(e.root_source, "MASTER_ADDR/MASTER_PORT");
    }

    #[test]
    fn open_mpi_pmi_and_slurm_variables_are_read_with_xccl_root() {
        let cases = [
            (
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                Launcher::OpenMpi,
            ),
            ("PMI_RANK", "PMI_SIZE", Launcher::Pmi),
            ("SLURM_PROCID", "SLURM_NTASKS", Launcher::Slurm),
            ("XCCL_RANK", "XCCL_SIZE", Launcher::Xccl),
        ];
        for (rv, sv, launcher) in cases {
            let e = detect(&[(rv, "1"), (sv, " 4 "), ("XCCL_ROOT", "192.168.1.5:7000")])
                .unwrap()
                .unwrap();
            assert_eq!((e.rank, e.size, e.launcher), (1, 4, launcher));
            assert_eq!(e.root, "192.168.1.5:7000".parse().unwrap());
            assert_eq!(e.root_source, "XCCL_ROOT");
        }
    }

    #[test]
    fn launchers_are_tried_in_order() {
        let e = detect(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("RANK", "5"),
            ("WORLD_SIZE", "6"),
            ("XCCL_ROOT", "127.0.0.1:7000"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.size, e.launcher), (5, 6, Launcher::Torchrun));
    }

    #[test]
    fn xccl_root_overrides_master_addr() {
        let e = detect(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("XCCL_ROOT", "[::1]:29600"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(e.root, "[::1]:29600".parse().unwrap());
    }

    #[test]
    fn mpi_pmi_and_slurm_without_a_root_ask_for_xccl_root() {
        for (rv, sv) in [
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            ("PMI_RANK", "PMI_SIZE"),
            ("SLURM_PROCID", "SLURM_NTASKS"),
        ] {
            let m = bootstrap_err(&[(rv, "0"), (sv, "2")]);
            assert!(m.contains("set XCCL_ROOT=host:port"), "{m}");
            assert!(m.contains(rv), "{m}");
        }
    }

    #[test]
    fn malformed_values_name_the_variable() {
        let m = bootstrap_err(&[("RANK", "one"), ("WORLD_SIZE", "2")]);
        assert!(m.contains("RANK=\"one\""), "{m}");
        let m = bootstrap_err(&[("PMI_RANK", "0"), ("PMI_SIZE", "-2")]);
        assert!(m.contains("PMI_SIZE"), "{m}");
        let m = bootstrap_err(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]);
        assert!(m.contains("RANK=2 is out of range for WORLD_SIZE=2"), "{m}");
        let m = bootstrap_err(&[("RANK", "0"), ("WORLD_SIZE", "0")]);
        assert!(m.contains("WORLD_SIZE=0"), "{m}");
        let m = bootstrap_err(&[("RANK", "0")]);
        assert!(m.contains("WORLD_SIZE is not"), "{m}");
        let m = bootstrap_err(&[("SLURM_NTASKS", "4")]);
        assert!(m.contains("SLURM_PROCID is not"), "{m}");
        let torch = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
        ];
        let m = bootstrap_err(&torch);
        assert!(m.contains("MASTER_PORT is not"), "{m}");
        let mut with_port = torch.to_vec();
        with_port.push(("MASTER_PORT", "70000"));
        let m = bootstrap_err(&with_port);
        assert!(m.contains("MASTER_PORT=\"70000\""), "{m}");
        for bad in [
            "10.0.0.1",
            "10.0.0.1:",
            ":29500",
            "::1:29500",
            "[::1:29500",
            "h:0",
        ] {
            let m = bootstrap_err(&[("XCCL_RANK", "0"), ("XCCL_SIZE", "1"), ("XCCL_ROOT", bad)]);
            assert!(m.contains("XCCL_ROOT"), "{bad}: {m}");
        }
        let m = bootstrap_err(&[("XCCL_ROOT", "127.0.0.1:7000")]);
        assert!(m.contains("no rank/size"), "{m}");
        let m = bootstrap_err(&[
            ("XCCL_RANK", "0"),
            ("XCCL_SIZE", "1"),
            ("XCCL_ROOT", "no-such-host.invalid:7000"),
        ]);
        assert!(m.contains("cannot resolve"), "{m}");
    }

    #[test]
    fn host_names_resolve() {
        let e = detect(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert!(e.root.ip().is_loopback());
        assert_eq!(e.root.port(), 29500);
    }

    #[test]
    fn job_id_depends_on_root_address_and_xccl_job_id() {
        let id = |pairs: &[(&str, &str)]| {
            let mut all = vec![("XCCL_RANK", "0"), ("XCCL_SIZE", "2")];
            all.extend_from_slice(pairs);
            detect(&all).unwrap().unwrap().job_id
        };
        let a = id(&[("XCCL_ROOT", "10.0.0.1:7000")]);
        assert_eq!(a, id(&[("XCCL_ROOT", "10.0.0.1:7000")]));
        assert_ne!(a, id(&[("XCCL_ROOT", "10.0.0.1:7001")]));
        assert_ne!(
            a,
            id(&[("XCCL_ROOT", "10.0.0.1:7000"), ("XCCL_JOB_ID", "b")])
        );
        // Every rank of a job derives the same id.
        let other_rank = detect(&[
            ("XCCL_RANK", "1"),
            ("XCCL_SIZE", "2"),
            ("XCCL_ROOT", "10.0.0.1:7000"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(other_rank.job_id, a);
    }

    #[test]
    fn four_ranks_rendezvous_from_launcher_variables() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let port = port.to_string();
        let long = Duration::from_secs(10);
        let out: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|r| {
                    let port = port.clone();
                    s.spawn(move || {
                        let rank = r.to_string();
                        let e = detect(&[
                            ("RANK", rank.as_str()),
                            ("WORLD_SIZE", "4"),
                            ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", port.as_str()),
                        ])
                        .unwrap()
                        .unwrap();
                        let mut cfg = RootConfig::new(0);
                        cfg.idle_timeout = Duration::from_secs(5);
                        let b = e.connect_with(long, cfg).unwrap();
                        assert_eq!(b.job_id(), e.job_id);
                        let all = b.allgather(&[r as u8; 3], long).unwrap();
                        b.barrier(long).unwrap();
                        all
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let expected: Vec<Vec<u8>> = (0..4u8).map(|r| vec![r; 3]).collect();
        assert!(out.iter().all(|o| *o == expected));
    }
}
