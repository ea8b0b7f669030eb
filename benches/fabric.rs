//! The shm fabric between two processes, each figure beside a plain `memcpy` of the same bytes.
//!
//! - `shm_pingpong_<size>`: put `size` bytes into the peer's window, signal; the peer puts `size`
//!   bytes back and signals; wait. One iteration is one round trip (2 x `size` bytes moved), next
//!   to `memcpy` of 2 x `size` bytes.
//! - `shm_put_<size>`: put `size` bytes and signal; the peer acknowledges with a bare signal. One
//!   iteration is one acknowledged put, next to `memcpy` of `size` bytes.
//!
//! The bench re-runs its own executable as the peer (rank 1), selected by an environment
//! variable checked before criterion parses its arguments. The two ranks meet through a TCP
//! bootstrap rooted in this process; their benchmark threads are pinned to two different CPUs
//! (when at least two are allowed). At the end it prints a table of criterion's medians, fabric
//! beside memcpy with their ratio, and the machine (CPU count and model). Run:
//! `cargo bench -p xccl-benches --bench fabric -- --warm-up-time 1 --measurement-time 2`.

use std::hint::black_box;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use xccl::bootstrap::{Exchange, RootConfig, TcpBootstrap, UniqueId};
use xccl::fabric::shm::ShmFabric;
use xccl::fabric::{deadline_after, Fabric, Waiting};

/// Set (to the job's unique id in hex) in the peer process.
const PEER_ENV: &str = "XCCL_BENCH_FABRIC_PEER";

/// Rank 0 -> rank 1: a new command is in rank 1's window header.
const CMD: usize = 0;
/// Rank 0 -> rank 1: the next ping/put is complete.
const PING: usize = 1;
/// Rank 1 -> rank 0: the pong/ack.
const PONG: usize = 2;
const SLOTS: usize = 4;

/// Commands, stored at offset 0 of rank 1's window as `[op, len]` (two u64).
const OP_PINGPONG: u64 = 1;
const OP_ACK: u64 = 2;
const OP_QUIT: u64 = 3;

/// Payloads start here (past the command header, on its own cache lines).
const DATA: usize = 4096;
const MAX_PAYLOAD: usize = 16 << 20;
const WINDOW: usize = DATA + MAX_PAYLOAD;

const PINGPONG_SIZES: [usize; 3] = [8, 4 << 10, 64 << 10];
const PUT_SIZES: [usize; 3] = [64 << 10, 1 << 20, 16 << 20];

const TIMEOUT: Duration = Duration::from_secs(60);

fn main() {
    if let Ok(id) = std::env::var(PEER_ENV) {
        if let Err(e) = peer_main(&id) {
            eprintln!("fabric bench peer: {e}");
            std::process::exit(1);
        }
        return;
    }
    let mut session = Session::start().unwrap_or_else(|e| panic!("starting the peer: {e}"));
    // After spawning the peer, which would otherwise inherit the pinning.
    let machine = machine();
    let pinned = pin_to_cpu(0);
    let machine = format!("{machine}; {pinned}");
    println!("machine: {machine}");
    let mut c = Criterion::default().configure_from_args();
    let started = std::time::SystemTime::now();
    let mut pairs = Vec::new();
    pingpong(&mut c, &mut session, &mut pairs);
    put_bandwidth(&mut c, &mut session, &mut pairs);
    c.final_summary();
    session.quit();
    summary(&pairs, started);
    println!("machine: {machine}");
}

/// One group: the fabric benchmark, its memcpy twin, and the bytes one iteration moves.
struct Pair {
    group: String,
    fabric: String,
    memcpy: String,
    bytes: u64,
}

/// Where criterion keeps its results (`CRITERION_HOME`, `$CARGO_TARGET_DIR/criterion`, or the
/// `criterion` directory next to `release/` above this executable).
fn criterion_dir() -> Option<std::path::PathBuf> {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return Some(home.into());
    }
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        return Some(std::path::Path::new(&t).join("criterion"));
    }
    let exe = std::env::current_exe().ok()?;
    exe.ancestors()
        .map(|a| a.join("criterion"))
        .find(|d| d.is_dir())
}

/// Criterion's median time per iteration (ns) of `group/id`, if measured in this run.
fn median_ns(
    dir: &std::path::Path,
    group: &str,
    id: &str,
    since: std::time::SystemTime,
) -> Option<f64> {
    let path = dir.join(group).join(id).join("new").join("estimates.json");
    let fresh = std::fs::metadata(&path).and_then(|m| m.modified()).ok()? >= since;
    let text = std::fs::read_to_string(&path).ok().filter(|_| fresh)?;
    let median = &text[text.find("\"median\"")?..];
    let pe = &median[median.find("\"point_estimate\":")? + "\"point_estimate\":".len()..];
    let end = pe.find([',', '}'])?;
    pe[..end].trim().parse().ok()
}

/// Prints fabric vs memcpy per group from criterion's medians.
fn summary(pairs: &[Pair], since: std::time::SystemTime) {
    let Some(dir) = criterion_dir() else { return };
    println!(
        "\n{:<20} {:>14} {:>12} {:>14} {:>12} {:>8}",
        "group", "fabric", "fabric", "memcpy", "memcpy", "ratio"
    );
    for p in pairs {
        let (Some(f), Some(m)) = (
            median_ns(&dir, &p.group, &p.fabric, since),
            median_ns(&dir, &p.group, &p.memcpy, since),
        ) else {
            continue;
        };
        let gib = |ns: f64| p.bytes as f64 / ns / 1.073_741_824;
        println!(
            "{:<20} {:>11.2} us {:>7.2} GiB/s {:>11.2} us {:>7.2} GiB/s {:>7.1}x",
            p.group,
            f / 1e3,
            gib(f),
            m / 1e3,
            gib(m),
            f / m
        );
    }
}

/// `nproc` and the CPU model from `/proc/cpuinfo`.
fn machine() -> String {
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{nproc} CPUs, {model}")
}

/// Pins the calling thread (the one that runs the benchmark loop) to the `index`-th CPU it may run on, if there are at least two: rank 0 on
/// one core, the peer on another, as latency benchmarks usually do. Otherwise the scheduler may
/// wake the peer on rank 0's core and every hand-off then costs a time slice. Says what it did.
fn pin_to_cpu(index: usize) -> String {
    // SAFETY: `cpu_set_t` is plain bits; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a valid, writable cpu_set_t of `size` bytes; pid 0 is the calling thread.
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
        return "not pinned (sched_getaffinity failed)".into();
    }
    let allowed: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: reads one bit of the valid set above; `c` < CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    if allowed.len() < 2 {
        return format!("not pinned ({} CPU allowed)", allowed.len());
    }
    let cpu = allowed[index % allowed.len()];
    // SAFETY: as above; writes bits of a local set.
    let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` < CPU_SETSIZE.
    unsafe { libc::CPU_SET(cpu, &mut one) };
    // SAFETY: `one` is a valid cpu_set_t of `size` bytes; pid 0 is the calling thread.
    if unsafe { libc::sched_setaffinity(0, size, &one) } != 0 {
        return "not pinned (sched_setaffinity failed)".into();
    }
    let who = if index == 0 { "rank 0" } else { "peer" };
    format!(
        "{who} pinned to CPU {cpu} (rank 0 on CPU {}, peer on CPU {})",
        allowed[0], allowed[1]
    )
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{}MiB", b >> 20),
        b if b >= 1 << 10 => format!("{}KiB", b >> 10),
        b => format!("{b}B"),
    }
}

/// Rank 0's side: the fabric and the peer process, killed on drop if still running.
struct Session {
    fabric: ShmFabric,
    peer: Child,
    cmds: u64,
    pings: u64,
    src: Vec<u8>,
}

impl Session {
    fn start() -> xccl::Result<Session> {
        let bind = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0);
        let (id, _root) =
            UniqueId::start_root(bind, RootConfig::new(xccl::bootstrap::random_job_id()))?;
        let exe = std::env::current_exe().map_err(|e| xccl::Error::os("current_exe", e))?;
        let peer = Command::new(exe)
            .env(PEER_ENV, id.to_string())
            .spawn()
            .map_err(|e| xccl::Error::os("spawning the peer process", e))?;
        let session = Session {
            fabric: join(&id, 0)?,
            peer,
            cmds: 0,
            pings: 0,
            src: (0..MAX_PAYLOAD).map(|i| i as u8).collect(),
        };
        session.fabric.barrier(TIMEOUT)?;
        Ok(session)
    }

    /// Tells the peer how to answer the next pings.
    fn command(&mut self, op: u64, len: usize) {
        let mut header = [0u8; 16];
        header[..8].copy_from_slice(&op.to_le_bytes());
        header[8..].copy_from_slice(&(len as u64).to_le_bytes());
        self.fabric.put(1, 0, &header).expect("put command");
        self.cmds += 1;
        self.fabric
            .signal(1, CMD, self.cmds)
            .expect("signal command");
    }

    /// One put of `len` bytes, signal, and wait for the peer's answer.
    fn round(&mut self, len: usize) {
        let f = &self.fabric;
        f.put(1, DATA, &self.src[..len]).expect("put");
        self.pings += 1;
        let want = self.pings;
        f.signal(1, PING, want).expect("signal");
        f.wait_signal(PONG, 1, "pong", deadline_after(TIMEOUT), &|v| v >= want)
            .expect("pong");
    }

    fn quit(mut self) {
        self.command(OP_QUIT, 0);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.peer.try_wait() {
                assert!(st.success(), "peer exited with {st}");
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("peer did not exit after quit");
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Ok(None) = self.peer.try_wait() {
            let _ = self.peer.kill();
            let _ = self.peer.wait();
        }
    }
}

fn join(id: &UniqueId, rank: usize) -> xccl::Result<ShmFabric> {
    let ex: Arc<dyn Exchange> = Arc::new(TcpBootstrap::connect(id, rank, 2, TIMEOUT)?);
    ShmFabric::new(ex, WINDOW, SLOTS)
}

fn memcpy_bench(dst: &mut [u8], src: &[u8], copies: usize) {
    for _ in 0..copies {
        dst.copy_from_slice(black_box(src));
    }
    black_box(&mut *dst);
}

fn pingpong(c: &mut Criterion, s: &mut Session, pairs: &mut Vec<Pair>) {
    let mut dst = vec![0u8; MAX_PAYLOAD];
    for len in PINGPONG_SIZES {
        let group = format!("shm_pingpong_{}", human(len));
        pairs.push(Pair {
            group: group.clone(),
            fabric: format!("round_trip/{len}"),
            memcpy: format!("memcpy_2x/{len}"),
            bytes: 2 * len as u64,
        });
        let mut g = c.benchmark_group(group);
        g.throughput(Throughput::Bytes(2 * len as u64));
        s.command(OP_PINGPONG, len);
        g.bench_function(BenchmarkId::new("round_trip", len), |b| {
            b.iter(|| s.round(len))
        });
        let src = &s.src[..len];
        g.bench_function(BenchmarkId::new("memcpy_2x", len), |b| {
            b.iter(|| memcpy_bench(&mut dst[..len], src, 2))
        });
        g.finish();
    }
}

fn put_bandwidth(c: &mut Criterion, s: &mut Session, pairs: &mut Vec<Pair>) {
    let mut dst = vec![0u8; MAX_PAYLOAD];
    for len in PUT_SIZES {
        let group = format!("shm_put_{}", human(len));
        pairs.push(Pair {
            group: group.clone(),
            fabric: format!("put_signal_ack/{len}"),
            memcpy: format!("memcpy/{len}"),
            bytes: len as u64,
        });
        let mut g = c.benchmark_group(group);
        g.throughput(Throughput::Bytes(len as u64));
        if len >= 1 << 20 {
            g.sample_size(20);
        }
        s.command(OP_ACK, len);
        g.bench_function(BenchmarkId::new("put_signal_ack", len), |b| {
            b.iter(|| s.round(len))
        });
        let src = &s.src[..len];
        g.bench_function(BenchmarkId::new("memcpy", len), |b| {
            b.iter(|| memcpy_bench(&mut dst[..len], src, 1))
        });
        g.finish();
    }
}

/// Rank 1: serves commands until told to quit (or rank 0 dies).
fn peer_main(id: &str) -> xccl::Result<()> {
    pin_to_cpu(1);
    let id: UniqueId = id.parse()?;
    let f = join(&id, 1)?;
    f.barrier(TIMEOUT)?;
    let payload: Vec<u8> = (0..MAX_PAYLOAD).map(|i| !(i as u8)).collect();
    let (mut cmds, mut served) = (0u64, 0u64);
    let (mut op, mut len) = (0u64, 0usize);
    // Rank 0 sleeps while criterion analyses; the wait then sleeps on the futex.
    let forever = Duration::from_secs(24 * 3600);
    loop {
        f.wait_until(deadline_after(forever), &mut || {
            if f.signal_value(CMD) > cmds || f.signal_value(PING) > served {
                None
            } else {
                Some(Waiting::on(0, "a bench command"))
            }
        })?;
        let c = f.signal_value(CMD);
        if c > cmds {
            cmds = c;
            let mut header = [0u8; 16];
            f.local_window()
                .expect("host window")
                .read(0, &mut header)?;
            op = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
            len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes")) as usize;
            if op == OP_QUIT {
                return Ok(());
            }
        }
        let p = f.signal_value(PING);
        if p > served {
            served = p;
            if op == OP_PINGPONG {
                f.put(0, DATA, &payload[..len])?;
            }
            f.signal(0, PONG, p)?;
        }
    }
}
