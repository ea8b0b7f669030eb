//! Jobs on the CUDA stand-in driver (`tests/cuda_standin/`, built with gcc as `libcuda.so.1`
//! and named to xccl through `XCCL_CUDA_LIBRARY`; no GPU is involved), its transfer counters,
//! and one round of the device-buffer calls checked against the reference.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use xccl::bootstrap::{RootConfig, UniqueId};
use xccl::testing::harness::{attention_round_with, expert_round_device, Buffers, Routes};
use xccl::Element;

use crate::{Job, StandinSegments};

/// The stand-in's failure-injection variable (`<symbol>:<code>[:<skip>]`).
pub const FAIL_ENV: &str = "CUDA_STANDIN_FAIL";
/// Prefix of the stand-in's shared-memory segments.
pub const PREFIX_ENV: &str = "CUDA_STANDIN_SHM_PREFIX";
/// How many devices the stand-in shows.
pub const DEVICES_ENV: &str = "CUDA_STANDIN_DEVICES";
/// The stand-in's device memory limit in bytes.
pub const LIMIT_ENV: &str = "CUDA_STANDIN_MEM_LIMIT";
/// Where xccl looks for the driver first.
pub const LIBRARY_ENV: &str = "XCCL_CUDA_LIBRARY";
/// `1` (`ci/device-check.sh` on a GPU): the jobs run on the real driver, not the stand-in.
pub const REAL_CUDA_ENV: &str = "XCCL_TEST_REAL_CUDA";

/// Whether the jobs run on the real driver ([`REAL_CUDA_ENV`]).
pub fn real_cuda() -> bool {
    std::env::var(REAL_CUDA_ENV).as_deref() == Ok("1")
}

/// Builds the stand-in under `dir` (a test binary's `CARGO_TARGET_TMPDIR` subfolder) once per
/// test process; returns the library's path (the first call's, whatever `dir` later calls
/// pass).
pub fn standin_library(dir: &Path) -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| xccl::testing::build_cuda_standin(dir).unwrap_or_else(|e| panic!("{e}")))
}

/// Spawns `size` ranks of this test binary running `scenario` (entry `entry`) with the
/// stand-in (built under `dir`) as their driver, `devices` stand-in devices, segments under a
/// fresh prefix, no failure injection or memory limit; `per_rank(rank)` adds (`Some`) or
/// removes (`None`) environment variables of a rank. On the real driver ([`real_cuda`]) the
/// ranks get no `XCCL_CUDA_LIBRARY`.
pub fn spawn(
    entry: &str,
    scenario: &str,
    (size, devices): (usize, usize),
    dir: &Path,
    per_rank: &dyn Fn(usize) -> Vec<(&'static str, Option<String>)>,
) -> (Job, StandinSegments) {
    let lib = (!real_cuda()).then(|| standin_library(dir).to_string_lossy().into_owned());
    let segs = StandinSegments::new("xccl-cu");
    let devices = devices.to_string();
    let bind = std::net::SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), 0);
    let job = Job::spawn_with(
        entry,
        scenario,
        size,
        &|job_id| UniqueId::start_root(bind, RootConfig::new(job_id)),
        &|rank, cmd| {
            match &lib {
                Some(lib) => cmd.env(LIBRARY_ENV, lib),
                None => cmd.env_remove(LIBRARY_ENV),
            };
            cmd.env(PREFIX_ENV, &segs.0)
                .env(DEVICES_ENV, &devices)
                .env_remove(FAIL_ENV)
                .env_remove(LIMIT_ENV);
            for (k, v) in per_rank(rank) {
                match v {
                    Some(v) => cmd.env(k, v),
                    None => cmd.env_remove(k),
                };
            }
        },
    );
    (job, segs)
}

/// Runs `scenario` with `size` ranks on `devices` stand-in devices (see [`spawn`]); every rank
/// must succeed within `timeout` and leave no stand-in segment behind. Prints how long it took
/// and what rank 0 said; returns the job (for its output).
pub fn run_ok(
    entry: &str,
    scenario: &str,
    (size, devices): (usize, usize),
    dir: &Path,
    timeout: std::time::Duration,
) -> Job {
    let start = std::time::Instant::now();
    let (mut job, segs) = spawn(entry, scenario, (size, devices), dir, &|_| Vec::new());
    job.expect_success(timeout);
    println!(
        "{scenario} with {size} processes on {devices} device(s): {:?}; rank 0 said: {}",
        start.elapsed(),
        job.output(0).trim()
    );
    assert_eq!(segs.left(), Vec::<String>::new(), "stand-in segments left");
    job
}

/// What the stand-in driver counted in this process so far: calls and bytes of every
/// successful copy by direction (sync and async alike; a peer copy counts as device to
/// device), of memsets, and kernel launches. Read with [`StandinCounters::read`]; subtract two
/// readings ([`StandinCounters::since`]) to see what a call moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StandinCounters {
    /// Host-to-device copies.
    pub htod_calls: u64,
    /// Bytes copied from host to device.
    pub htod_bytes: u64,
    /// Device-to-host copies.
    pub dtoh_calls: u64,
    /// Bytes copied from device to host.
    pub dtoh_bytes: u64,
    /// Device-to-device copies.
    pub dtod_calls: u64,
    /// Bytes copied from device to device.
    pub dtod_bytes: u64,
    /// Memsets.
    pub memset_calls: u64,
    /// Bytes set.
    pub memset_bytes: u64,
    /// Kernel launches.
    pub launches: u64,
}

/// The exported `int cuda_standin_counters(unsigned long long *out, int n)`.
type CountersFn = unsafe extern "C" fn(*mut u64, i32) -> i32;

/// Number of counters [`StandinCounters`] holds, in the stand-in's order.
const COUNTERS: usize = 9;

impl StandinCounters {
    /// The counters of the stand-in this process loaded from `driver` (the path xccl opened,
    /// `Driver::path`); `None` when no library of that path is loaded or it is not the
    /// stand-in (the real driver has no counters).
    pub fn read(driver: &Path) -> Option<Self> {
        use libloading::os::unix::{Library, RTLD_NOW};
        // SAFETY: RTLD_NOLOAD opens only a library already loaded in this process (by xccl),
        // so no initialiser runs; the handle keeps it loaded while it is used here.
        let lib = unsafe { Library::open(Some(driver), RTLD_NOW | libc::RTLD_NOLOAD) }.ok()?;
        // SAFETY: the stand-in exports the symbol with this signature (cuda_standin.c).
        let read = unsafe { lib.get::<CountersFn>(b"cuda_standin_counters\0") }.ok()?;
        let mut c = [0u64; COUNTERS];
        // SAFETY: `c` holds COUNTERS writable u64s (unsigned long long on every Linux target).
        let known = unsafe { read(c.as_mut_ptr(), COUNTERS as i32) };
        if known < COUNTERS as i32 {
            return None;
        }
        Some(StandinCounters {
            htod_calls: c[0],
            htod_bytes: c[1],
            dtoh_calls: c[2],
            dtoh_bytes: c[3],
            dtod_calls: c[4],
            dtod_bytes: c[5],
            memset_calls: c[6],
            memset_bytes: c[7],
            launches: c[8],
        })
    }

    /// The counters of the stand-in that `comm` (a communicator on the cuda fabric) runs on.
    pub fn of(comm: &xccl::Communicator) -> Option<Self> {
        Self::read(comm.cuda_device()?.driver().path())
    }

    /// What was counted since `earlier` (a reading of the same process).
    pub fn since(&self, earlier: &Self) -> Self {
        StandinCounters {
            htod_calls: self.htod_calls - earlier.htod_calls,
            htod_bytes: self.htod_bytes - earlier.htod_bytes,
            dtoh_calls: self.dtoh_calls - earlier.dtoh_calls,
            dtoh_bytes: self.dtoh_bytes - earlier.dtoh_bytes,
            dtod_calls: self.dtod_calls - earlier.dtod_calls,
            dtod_bytes: self.dtod_bytes - earlier.dtod_bytes,
            memset_calls: self.memset_calls - earlier.memset_calls,
            memset_bytes: self.memset_bytes - earlier.memset_bytes,
            launches: self.launches - earlier.launches,
        }
    }

    /// Bytes copied between host and device, both ways.
    pub fn host_device_bytes(&self) -> u64 {
        self.htod_bytes + self.dtoh_bytes
    }
}

/// One checked round of the device-buffer calls on a communicator on the cuda fabric: an
/// attention rank's `a2e_send_device` + `e2a_recv_device` (routing in device memory), an
/// expert rank's `a2e_recv_device` + `e2a_send_device`, each compared bit for bit with the
/// reference (`xccl::testing::harness`). Returns the check's verdict.
pub fn device_round<T: Element>(
    comm: &mut xccl::Communicator,
    wl: &impl Routes,
    round: u64,
    batch: &mut xccl::ExpertBatch,
) -> xccl::Result<Result<(), String>> {
    match comm.role() {
        xccl::Role::Attention => attention_round_with::<T>(comm, wl, round, Buffers::Device),
        xccl::Role::Expert => expert_round_device::<T>(comm, wl, round, batch, true),
    }
}
