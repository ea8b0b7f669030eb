//! Hostile and malformed input against a live job's bootstrap port and shared memory.
//!
//! The bootstrap root runs in this (the parent) process, the ranks are child processes joined
//! over TCP and shared memory (see `xccl_tests::Job`). Strangers are another process running as
//! the unprivileged uid 65534 (`setpriv`; the suite runs as root) that knows what any user of the
//! host can learn (the root's port from `/proc/net/tcp`, the job id) but not the job's key.
//! While the ranks rendezvous, the stranger sends random bytes, a truncated hello, a wrong magic,
//! a wrong job id, a 4 GiB length field, a hello with the right job id but a forged proof, and,
//! once the ranks have joined, a hello for every rank that is taken; a partial header is left
//! idle (half-open). Each is answered with an ERROR frame naming the cause but no secret and not
//! the real job id, closed, and logged at `warn`; the real ranks complete their rendezvous and
//! checked A2E/E2A rounds. Another stranger holds 700 connections open (partial headers and
//! hellos it never authenticates) against a root whose process may hold at most 512 descriptors,
//! and a third pre-creates the job's shared-memory names it can guess, mode 0666: both jobs
//! complete. A last test has a member of the job (one holding the key) squat a rank before its
//! owner arrives: the owner is refused naming the duplicate, and the other ranks fail naming the
//! squatted rank once the root drops it.
//!
//! A counting global allocator records the largest single allocation of this process (where
//! the root runs): a length field claiming 4 GiB, or 16 MiB followed by 1 KiB, must not make
//! the root allocate more than what arrived.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use xccl::bootstrap::{RootConfig, UniqueId, MAX_BLOB};
use xccl::testing::harness::Workload;
use xccl::{Communicator, DType, Error, ExpertBatch, MoeConfig, TokenBatch, Topology};
use xccl_tests::{announce, child_main, mixed_round, shm_entries, ChildCtx, Job};

const ENTRY: &str = "child_rank_entry";

/// The system allocator, recording the largest single allocation request.
struct PeakAlloc;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; the only addition is a
// relaxed atomic max, which neither allocates nor touches the memory.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which `System` shares.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: `ptr` was allocated by this allocator (that is, by `System`) with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator (that is, by `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// Most bytes one allocation of the parent may take while the hostile input arrives.
const ALLOCATION_BOUND: usize = 1 << 20;

#[test]
fn child_rank_entry() {
    child_main(dispatch);
}

/// Environment variable that makes [`stranger_entry`] play a stranger (see [`stranger`]).
const STRANGER_ENV: &str = "XCCL_TEST_STRANGER";

/// The stranger's entry: returns at once unless [`STRANGER_ENV`] is set; then runs that
/// scenario, prints what it saw, and exits (0 when the scenario ran to its end).
#[test]
fn stranger_entry() {
    let Ok(scenario) = std::env::var(STRANGER_ENV) else {
        return;
    };
    let code = match play_stranger(&scenario) {
        Ok(()) => 0,
        Err(e) => {
            println!("stranger failed: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// Runs the test binary's [`stranger_entry`] as uid/gid 65534 with no supplementary groups and
/// an environment holding only `scenario` (so nothing of the job leaks to it but what the
/// scenario says: root address, job id).
fn stranger(scenario: &str) -> std::process::Child {
    let exe = std::env::current_exe().expect("current_exe");
    std::process::Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(exe)
        .args([
            "stranger_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env(STRANGER_ENV, scenario)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("spawning the stranger with setpriv")
}

/// Runs [`stranger`] to its end and returns what it printed; panics if it failed.
fn stranger_output(scenario: &str) -> String {
    let out = stranger(scenario)
        .wait_with_output()
        .expect("stranger output");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "stranger {scenario}: {text}");
    text
}

/// What a stranger does: `probe:<root>:<job>:<size>` sends each hostile input of the probe
/// list and prints `case <i>: <the root's answer>`; `taken:<root>:<job>:<size>` says hello for
/// every rank with a forged proof and prints the answers; `hold:<root>:<job>:<n>:<file>` opens
/// `n` connections (partial headers and hellos it never authenticates), prints `holding <k>`,
/// and keeps them until `<file>` exists; `shm:<job>:<size>` creates the shared-memory names
/// the job would have had before they were keyed (`/xccl-<job>-<rank>`), mode 0666.
fn play_stranger(scenario: &str) -> Result<(), String> {
    if nix_uid() != 65534 {
        return Err(format!("the stranger runs as uid {}, not 65534", nix_uid()));
    }
    let parts: Vec<&str> = scenario.split('|').collect();
    let num = |i: usize| -> Result<u64, String> {
        parts
            .get(i)
            .and_then(|v| v.parse().ok())
            .ok_or(format!("bad field {i} in {scenario}"))
    };
    let addr = |i: usize| -> Result<SocketAddr, String> {
        parts
            .get(i)
            .and_then(|v| v.parse().ok())
            .ok_or(format!("bad address in {scenario}"))
    };
    match parts[0] {
        "probe" => {
            let (root, job, size) = (addr(1)?, num(2)?, num(3)?);
            for (i, bytes, close) in probe_cases(job, size) {
                match rejection(root, &bytes, close) {
                    Ok(text) => println!("case {i}: {text}"),
                    Err(e) => println!("case {i} failed: {e}"),
                }
            }
            Ok(())
        }
        "taken" => {
            let (root, job, size) = (addr(1)?, num(2)?, num(3)?);
            for rank in 0..size {
                let text = rejection(root, &forged(job, rank, size), false)?;
                println!("rank {rank}: {text}");
            }
            Ok(())
        }
        "hold" => {
            let (root, job, n) = (addr(1)?, num(2)?, num(3)?);
            let release = PathBuf::from(parts.get(4).ok_or("no release file")?);
            raise_fd_limit();
            let mut held = Vec::new();
            for i in 0..n {
                let Ok(mut s) = TcpStream::connect(root) else {
                    continue;
                };
                let bytes = if i % 2 == 0 {
                    header(b"XCBT", HELLO, 0, 56)[..10].to_vec()
                } else {
                    hello(job, i % 3, 3)
                };
                let _ = s.write_all(&bytes);
                held.push(s);
            }
            announce(&format!("holding {}", held.len()));
            let deadline = Instant::now() + Duration::from_secs(120);
            while !release.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(())
        }
        "shm" => {
            let (job, size) = (num(1)?, num(2)?);
            let mut made = 0;
            for rank in 0..size {
                let path = format!("/dev/shm/xccl-{job:016x}-{rank}");
                use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(0o666)
                    .open(&path);
                if let Ok(f) = f {
                    let _ = f.set_len(1 << 20);
                    let _ = f.set_permissions(std::fs::Permissions::from_mode(0o666));
                    made += 1;
                }
            }
            println!("squatted {made}");
            Ok(())
        }
        other => Err(format!("unknown stranger scenario {other}")),
    }
}

/// This process's real uid.
fn nix_uid() -> u32 {
    // SAFETY: `getuid` takes no arguments, touches no memory of ours and always succeeds.
    unsafe { libc::getuid() }
}

/// Raises this process's soft descriptor limit to its hard limit (any user may).
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable `rlimit` for the duration of both calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Sets this process's soft descriptor limit to `n`, returning the previous one.
fn set_fd_limit(n: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable `rlimit` for the duration of both calls.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        let old = lim.rlim_cur;
        lim.rlim_cur = n.min(lim.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        old
    }
}

/// `(threads, open descriptors)` of this process.
fn threads_and_fds() -> (usize, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0);
    (threads, fds)
}

/// `go:<file>:<rounds>`: join, wait for `<file>`, then init over shm and run checked rounds.
/// `squatted:<rank>`: rank `<rank>` must be refused as a duplicate; the others must fail
/// naming it.
fn dispatch(scenario: &str, ctx: &ChildCtx) -> Result<(), String> {
    let parts: Vec<&str> = scenario.split(':').collect();
    match parts.as_slice() {
        ["go", file, rounds] => {
            let rounds = rounds.parse::<u64>().map_err(|e| e.to_string())?;
            rounds_after_go(ctx, Path::new(file), rounds)
        }
        ["squatted", taken] => {
            let taken = taken.parse::<usize>().map_err(|e| e.to_string())?;
            squatted(ctx, taken)
        }
        _ => Err(format!("unknown scenario {scenario:?}")),
    }
}

fn topology(size: usize) -> Result<Arc<Topology>, String> {
    Topology::contiguous(1, size - 1, 4)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

fn config() -> MoeConfig {
    let mut cfg = MoeConfig::new(32, DType::BF16, 2, 16);
    cfg.timeout = Duration::from_secs(30);
    cfg
}

fn rounds_after_go(ctx: &ChildCtx, go: &Path, rounds: u64) -> Result<(), String> {
    let ex = ctx
        .connect(Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    announce(&format!("rank {} joined", ctx.rank));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !go.exists() {
        if Instant::now() >= deadline {
            return Err(format!("the go file {} did not appear", go.display()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut comm =
        Communicator::init_shm(ex, topology(ctx.size)?, config()).map_err(|e| e.to_string())?;
    let wl = Workload {
        seed: 0x4057,
        tokens: 16,
        vary: true,
        skew: None,
        shared_experts: 0,
    };
    let mut batch = ExpertBatch::new();
    let mut tokens = TokenBatch::new();
    for round in 0..rounds {
        mixed_round(&mut comm, &wl, round, true, &mut batch, &mut tokens)
            .map_err(|e| e.to_string())??;
    }
    announce(&format!("rank {} checked {rounds} rounds", ctx.rank));
    Ok(())
}

fn squatted(ctx: &ChildCtx, taken: usize) -> Result<(), String> {
    let joined = ctx.connect(Duration::from_secs(30));
    if ctx.rank == taken {
        return match joined {
            Err(Error::Bootstrap(m)) if m.contains("duplicate rank") => {
                announce(&format!("rank {taken} refused: {m}"));
                Ok(())
            }
            Err(e) => Err(format!("expected a duplicate-rank refusal, got {e}")),
            Ok(_) => Err("joined a rank that was already taken".into()),
        };
    }
    let ex = joined.map_err(|e| e.to_string())?;
    announce(&format!("rank {} joined", ctx.rank));
    match Communicator::init_shm(ex, topology(ctx.size)?, config()) {
        Err(Error::PeerFailed { peer, detail }) if peer == taken => {
            announce(&format!(
                "rank {} failed naming rank {peer}: {detail}",
                ctx.rank
            ));
            Ok(())
        }
        Err(e) => Err(format!("expected a failure naming rank {taken}, got {e}")),
        Ok(_) => Err("init completed with a squatted rank".into()),
    }
}

/// `warn` lines logged in this process, captured by a subscriber installed once.
fn logs() -> &'static Mutex<String> {
    static LOGS: OnceLock<&'static Mutex<String>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs: &'static Mutex<String> = Box::leak(Box::new(Mutex::new(String::new())));
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || Capture(logs))
            .try_init();
        logs
    })
}

/// Appends what the subscriber writes to the captured log.
struct Capture(&'static Mutex<String>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut l = self.0.lock().unwrap_or_else(|e| e.into_inner());
        l.push_str(&String::from_utf8_lossy(buf));
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits (at most 10 s) until the captured log has a `warn` line for `job` containing `text`.
fn wait_for_warning(job: u64, text: &str) {
    let job = format!("{job:016x}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = {
            let l = logs().lock().unwrap_or_else(|e| e.into_inner());
            l.lines()
                .any(|line| line.contains("WARN") && line.contains(&job) && line.contains(text))
        };
        if found {
            return;
        }
        if Instant::now() >= deadline {
            let l = logs().lock().unwrap_or_else(|e| e.into_inner());
            panic!("no warning for job {job} containing {text:?}; log:\n{l}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A frame header as the bootstrap wire format lays it out (see `xccl::bootstrap` wire docs):
/// magic, version 2, kind, round, payload length.
fn header(magic: &[u8; 4], kind: u16, round: u64, len: u64) -> Vec<u8> {
    let mut h = magic.to_vec();
    h.extend_from_slice(&3u16.to_le_bytes());
    h.extend_from_slice(&kind.to_le_bytes());
    h.extend_from_slice(&round.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h
}

const HELLO: u16 = 1;
const ERROR: u16 = 3;
const DATA: u16 = 4;
const CHALLENGE: u16 = 13;
const AUTH: u16 = 14;

/// A whole HELLO frame (with an all-zero nonce).
fn hello(job_id: u64, rank: u64, size: u64) -> Vec<u8> {
    let mut f = header(b"XCBT", HELLO, 0, 24 + 32);
    for v in [job_id, rank, size] {
        f.extend_from_slice(&v.to_le_bytes());
    }
    f.extend_from_slice(&[0u8; 32]);
    f
}

/// A HELLO for `rank` followed by an AUTH frame whose proof is made up (the stranger does not
/// know the key).
fn forged(job_id: u64, rank: u64, size: u64) -> Vec<u8> {
    let mut f = hello(job_id, rank, size);
    f.extend_from_slice(&header(b"XCBT", AUTH, 0, 32));
    f.extend_from_slice(&[0x5a; 32]);
    f
}

/// Reads one frame from the root: `(kind, payload)`; the payload is at most 64 KiB.
fn read_reply(s: &mut TcpStream) -> Result<(u16, Vec<u8>), String> {
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let mut h = [0u8; 24];
    s.read_exact(&mut h)
        .map_err(|e| format!("reading a reply header: {e}"))?;
    if &h[..4] != b"XCBT" {
        return Err(format!("reply with magic {:02x?}", &h[..4]));
    }
    let kind = u16::from_le_bytes([h[6], h[7]]);
    let len = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
    if len > 64 << 10 {
        return Err(format!("reply of {len} bytes"));
    }
    let mut payload = vec![0u8; len as usize];
    s.read_exact(&mut payload)
        .map_err(|e| format!("reading a reply payload: {e}"))?;
    Ok((kind, payload))
}

/// Connects to `root`, sends `bytes` (half-closing after them when `close`), and returns the
/// text of the ERROR frame the root answers with.
fn rejection(root: SocketAddr, bytes: &[u8], close: bool) -> Result<String, String> {
    let mut s = TcpStream::connect(root).map_err(|e| e.to_string())?;
    s.write_all(bytes).map_err(|e| e.to_string())?;
    if close {
        s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
    }
    loop {
        match read_reply(&mut s)? {
            (ERROR, text) => return Ok(String::from_utf8_lossy(&text).into_owned()),
            (CHALLENGE, _) => continue,
            (kind, _) => return Err(format!("expected an ERROR frame, got kind {kind}")),
        }
    }
}

/// What the root must answer to each of [`probe_cases`], in order.
const PROBE_EXPECT: [&str; 6] = [
    "bad magic",
    "truncated Hello payload",
    "bad magic",
    "job id mismatch",
    "4294967296 bytes exceeds the limit",
    "authentication failed",
];

/// The stranger's hostile inputs for job `job` of `size` ranks: `(index, bytes, half-close)`.
fn probe_cases(job: u64, size: u64) -> Vec<(usize, Vec<u8>, bool)> {
    let mut truncated = hello(job, 0, size);
    truncated.truncate(24 + 10);
    let cases = vec![
        (random_bytes(4096), false),
        (truncated, true),
        (header(b"XCBX", HELLO, 0, 24), false),
        (hello(job ^ 0x5a5a, 0, size), false),
        (header(b"XCBT", HELLO, 0, 4 << 30), false),
        (forged(job, 0, size), false),
    ];
    cases
        .into_iter()
        .enumerate()
        .map(|(i, (b, c))| (i, b, c))
        .collect()
}

/// `n` pseudo-random bytes (xorshift, fixed seed) that do not start with the frame magic.
fn random_bytes(n: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut v: Vec<u8> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    v[0] = b'?';
    v
}

/// Starts the job's root for `test` in this process: records the id, resets the allocation
/// peak (the caller holds the job lock from here on), and returns what `Job::spawn_with` wants.
fn root_starter(
    slot: &Mutex<Option<UniqueId>>,
    hello_timeout: Duration,
) -> impl Fn(u64) -> xccl::Result<(UniqueId, xccl::bootstrap::RootHandle)> + '_ {
    move |job_id| {
        let mut cfg = RootConfig::new(job_id);
        cfg.hello_timeout = hello_timeout;
        let bind = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0);
        let (id, root) = UniqueId::start_root(bind, cfg)?;
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
        LARGEST.store(0, Ordering::Relaxed);
        Ok((id, root))
    }
}

/// A go file that does not exist yet, removed on drop.
struct GoFile(PathBuf);

impl Drop for GoFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn hostile_input_on_the_bootstrap_port_is_dropped_and_the_job_completes() {
    logs();
    let size = 3;
    let go = GoFile(std::env::temp_dir().join(format!(
        "xccl-hostile-go-{}-{}",
        std::process::id(),
        xccl_tests::unique_job_id()
    )));
    let id_slot = Mutex::new(None);
    // A long hello timeout: the idle connection below stays open for the whole job.
    let start_root = root_starter(&id_slot, Duration::from_secs(120));
    let mut job = Job::spawn_with(
        ENTRY,
        &format!("go:{}:12", go.0.display()),
        size,
        &start_root,
        &|_, _| {},
    );
    let id = id_slot.lock().unwrap().expect("root started");
    let (root, job_id) = (id.root_addr(), id.job_id());

    // A partial header, then silence: opened while the ranks join and left idle all along.
    let mut idle = TcpStream::connect(root).unwrap();
    idle.write_all(&header(b"XCBT", HELLO, 0, 56)[..10])
        .unwrap();

    // The stranger (uid 65534) knows the root's address and the job id, not the key.
    let key = id.key().to_hex();
    let real_job = format!("{job_id:016x}");
    let probed = stranger_output(&format!("probe|{root}|{job_id}|{size}"));
    for (i, expect) in PROBE_EXPECT.iter().enumerate() {
        let line = probed
            .lines()
            .find(|l| l.contains(&format!("case {i}:")))
            .unwrap_or_else(|| panic!("case {i} ({expect}): no answer; stranger said:\n{probed}"));
        assert!(
            line.contains(expect),
            "case {i}: the root answered {line:?}"
        );
        assert!(
            !line.contains(&real_job),
            "case {i} echoes the job id: {line}"
        );
        assert!(
            !line.contains(&key[..16]),
            "case {i} echoes the key: {line}"
        );
        wait_for_warning(job_id, expect);
    }

    // Every rank has joined: a hello for each, without the key, is refused as unauthenticated
    // (not as a duplicate: a stranger learns nothing about which ranks are taken).
    for rank in 0..size {
        job.wait_for_line(
            rank,
            &format!("rank {rank} joined"),
            Duration::from_secs(60),
        );
    }
    let taken = stranger_output(&format!("taken|{root}|{job_id}|{size}"));
    for rank in 0..size {
        let line = taken
            .lines()
            .find(|l| l.contains(&format!("rank {rank}:")))
            .unwrap_or_else(|| panic!("rank {rank}: no answer; stranger said:\n{taken}"));
        assert!(line.contains("authentication failed"), "{line}");
        assert!(
            !line.contains("duplicate") && !line.contains(&key[..16]),
            "{line}"
        );
    }
    wait_for_warning(job_id, "authentication failed: the hello for rank 2");

    std::fs::write(&go.0, b"go").unwrap();
    job.expect_success(Duration::from_secs(90));
    for rank in 0..size {
        assert!(job.output(rank).contains("checked 12 rounds"));
    }

    // The idle connection was never answered and never held anyone up; half-closing it now
    // gets it dropped as a truncated header.
    idle.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    assert!(
        matches!(idle.read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the root answered or closed the idle connection before it said anything"
    );
    idle.set_nonblocking(false).unwrap();
    idle.shutdown(Shutdown::Write).unwrap();
    match read_reply(&mut idle) {
        Ok((ERROR, text)) => {
            let text = String::from_utf8_lossy(&text).into_owned();
            assert!(text.contains("truncated frame header"), "{text}");
        }
        other => panic!("idle connection: {other:?}"),
    }
    wait_for_warning(job_id, "truncated frame header");
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        largest < ALLOCATION_BOUND,
        "the parent made a {largest}-byte allocation"
    );
}

#[test]
fn a_member_squatting_a_rank_fails_the_job_naming_that_rank_without_allocating_its_claim() {
    logs();
    let size = 3;
    let taken = 1usize;
    let id_slot = Mutex::new(None);
    let squatter: Mutex<Option<TcpStream>> = Mutex::new(None);
    let start = root_starter(&id_slot, Duration::from_secs(30));
    // Before any rank starts: a member of the job (it holds the key) claims rank 1, then starts
    // a DATA frame that claims the largest blob and sends 1 KiB of it.
    let start_and_squat = |job_id: u64| {
        let (id, root) = start(job_id)?;
        let mut s = TcpStream::connect(id.root_addr()).expect("squatter connects");
        xccl::testing::bootstrap_handshake(&mut s, &id, taken, size, Duration::from_secs(10))
            .expect("squatter joins");
        s.write_all(&header(b"XCBT", DATA, 0, MAX_BLOB as u64))
            .expect("squatter header");
        s.write_all(&[0xEE; 1024]).expect("squatter bytes");
        *squatter.lock().unwrap() = Some(s);
        Ok((id, root))
    };
    let mut job = Job::spawn_with(
        ENTRY,
        &format!("squatted:{taken}"),
        size,
        &start_and_squat,
        &|_, _| {},
    );
    let job_id = id_slot.lock().unwrap().expect("root started").job_id();
    job.wait_for_line(
        taken,
        &format!("duplicate rank: rank {taken} has already joined"),
        Duration::from_secs(60),
    );
    wait_for_warning(job_id, "duplicate rank: rank 1");
    for rank in [0, 2] {
        job.wait_for_line(
            rank,
            &format!("rank {rank} joined"),
            Duration::from_secs(60),
        );
    }
    // The squatter goes away mid-frame: the root drops rank 1 and fails the pending round.
    drop(squatter.lock().unwrap().take());
    job.expect_success(Duration::from_secs(60));
    for rank in [0, 2] {
        let out = job.output(rank);
        assert!(
            out.contains(&format!("failed naming rank {taken}"))
                && out.contains("truncated Data payload: 1024 of 16777216 bytes"),
            "rank {rank}: {out}"
        );
    }
    wait_for_warning(
        job_id,
        "rank 1 dropped: protocol error: truncated Data payload",
    );
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        largest < ALLOCATION_BOUND,
        "the parent made a {largest}-byte allocation for a 16 MiB claim of which 1 KiB arrived"
    );
}

/// A release file for a holding stranger, removed on drop.
struct Release(PathBuf);

impl Drop for Release {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, b"done");
        std::thread::sleep(Duration::from_millis(50));
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn a_stranger_holding_700_connections_neither_starves_the_root_nor_blocks_the_job() {
    logs();
    let size = 3;
    let go = GoFile(std::env::temp_dir().join(format!(
        "xccl-hold-go-{}-{}",
        std::process::id(),
        xccl_tests::unique_job_id()
    )));
    let release = Release(std::env::temp_dir().join(format!(
        "xccl-hold-release-{}-{}",
        std::process::id(),
        xccl_tests::unique_job_id()
    )));
    let id_slot = Mutex::new(None);
    let holder: Mutex<Option<std::process::Child>> = Mutex::new(None);
    let old_limit: Mutex<Option<u64>> = Mutex::new(None);
    let start = root_starter(&id_slot, Duration::from_secs(120));
    // The root (this process) may hold at most 512 descriptors; before any rank starts, the
    // stranger opens 700 connections to it and keeps them.
    let start_and_hold = |job_id: u64| {
        let (id, root) = start(job_id)?;
        let mut child = stranger(&format!(
            "hold|{}|{job_id}|700|{}",
            id.root_addr(),
            release.0.display()
        ));
        let out = child.stdout.take().expect("stranger stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        // Keeps reading (so the stranger never writes into a closed pipe).
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let line = rx
            .iter()
            .find(|l| l.contains("holding ") || l.contains("stranger failed"))
            .unwrap_or_default();
        let held: usize = line
            .rsplit("holding ")
            .next()
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("stranger: {line}"));
        assert!(held > 512, "the stranger holds only {held} connections");
        *holder.lock().unwrap() = Some(child);
        *old_limit.lock().unwrap() = Some(set_fd_limit(512));
        Ok((id, root))
    };
    let mut job = Job::spawn_with(
        ENTRY,
        &format!("go:{}:4", go.0.display()),
        size,
        &start_and_hold,
        &|_, _| {},
    );
    std::fs::write(&go.0, b"go").unwrap();
    let (threads, fds) = threads_and_fds();
    job.expect_success(Duration::from_secs(90));
    let after = threads_and_fds();
    if let Some(old) = old_limit.lock().unwrap().take() {
        set_fd_limit(old);
    }
    drop(release);
    if let Some(mut c) = holder.lock().unwrap().take() {
        let _ = c.wait();
    }
    for rank in 0..size {
        assert!(job.output(rank).contains("checked 4 rounds"));
    }
    let bound = 200;
    for (t, f) in [(threads, fds), after] {
        assert!(
            t < bound,
            "{t} threads in the root's process (bound {bound})"
        );
        assert!(f < 512, "{f} descriptors in the root's process");
    }
}

#[test]
fn a_stranger_squatting_guessable_shared_memory_names_cannot_stop_or_read_the_job() {
    let size = 3;
    let go = GoFile(std::env::temp_dir().join(format!(
        "xccl-shm-go-{}-{}",
        std::process::id(),
        xccl_tests::unique_job_id()
    )));
    let squatted: Mutex<Option<String>> = Mutex::new(None);
    let id_slot = Mutex::new(None);
    let start = root_starter(&id_slot, Duration::from_secs(30));
    // Before any rank starts: the stranger creates every name it can derive from the job id.
    let start_and_squat = |job_id: u64| {
        let out = stranger_output(&format!("shm|{job_id}|{size}"));
        *squatted.lock().unwrap() = Some(out);
        start(job_id)
    };
    let mut job = Job::spawn_with(
        ENTRY,
        &format!("go:{}:4", go.0.display()),
        size,
        &start_and_squat,
        &|_, _| {},
    );
    let job_id = job.job_id();
    std::fs::write(&go.0, b"go").unwrap();
    let out = squatted.lock().unwrap().take().unwrap_or_default();
    assert!(out.contains(&format!("squatted {size}")), "stranger: {out}");
    job.expect_success(Duration::from_secs(90));
    for rank in 0..size {
        assert!(job.output(rank).contains("checked 4 rounds"));
    }
    // The squatter's segments were never written: still all zero.
    let prefix = format!("xccl-{job_id:016x}-");
    let mut left = shm_entries(&prefix);
    for name in &left {
        let bytes = std::fs::read(format!("/dev/shm/{name}")).unwrap_or_default();
        assert!(bytes.iter().all(|&b| b == 0), "{name} was written");
        let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
    }
    left.retain(|n| !(0..size).any(|r| *n == format!("{prefix}{r}")));
    assert!(left.is_empty(), "the job left {left:?}");
}

/// One stranger act of the campaign.
#[derive(Clone, Copy, Debug)]
enum Act {
    /// The hostile inputs of [`probe_cases`].
    Probe,
    /// A forged hello for every rank.
    Taken,
    /// That many connections held open for the whole job.
    Hold(u64),
    /// The guessable shared-memory names, created first.
    Shm,
}

/// Starts `act` as a stranger against the job `id` of `size` ranks; returns the holding stranger
/// (to be released) or the output of one that ran to its end.
fn start_act(
    act: Act,
    id: &UniqueId,
    size: usize,
    release: &Path,
) -> (Option<std::process::Child>, String) {
    let (root, job) = (id.root_addr(), id.job_id());
    match act {
        Act::Probe => (None, stranger_output(&format!("probe|{root}|{job}|{size}"))),
        Act::Taken => (None, stranger_output(&format!("taken|{root}|{job}|{size}"))),
        Act::Shm => (None, stranger_output(&format!("shm|{job}|{size}"))),
        Act::Hold(n) => {
            let mut child = stranger(&format!("hold|{root}|{job}|{n}|{}", release.display()));
            let out = child.stdout.take().expect("stranger stdout");
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
            let line = rx
                .iter()
                .find(|l| l.contains("holding ") || l.contains("stranger failed"))
                .unwrap_or_default();
            (Some(child), line)
        }
    }
}

/// The strangers' campaign (also run by `ci/fault-injection.sh`): `XCCL_STRANGER_RUNS` runs
/// (default 4: one of each act), each a 3-rank job over shm with checked rounds and one stranger
/// (uid 65534) doing one act drawn from the seed (`XCCL_STRANGER_SEED` to replay), before the
/// ranks start or after they joined. Every run must complete every rank's rounds, and no
/// stranger answer may carry the key or be a welcome.
#[test]
fn random_strangers_neither_join_nor_stop_a_job() {
    logs();
    let runs: u64 = std::env::var("XCCL_STRANGER_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let seed: u64 = std::env::var("XCCL_STRANGER_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(xccl::bootstrap::random_job_id);
    println!("STRANGER-CAMPAIGN seed {seed} runs {runs}");
    let size = 3;
    let mut counts = std::collections::BTreeMap::new();
    for run in 0..runs {
        let mut x = seed ^ run.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let act = match run % 4 {
            0 => Act::Probe,
            1 => Act::Taken,
            2 => Act::Hold(100 + next() % 601),
            _ => Act::Shm,
        };
        let before = next() % 2 == 0 || matches!(act, Act::Shm);
        let tag = format!("{}-{run}", std::process::id());
        let go = GoFile(std::env::temp_dir().join(format!("xccl-strangers-go-{tag}")));
        let release = Release(std::env::temp_dir().join(format!("xccl-strangers-rel-{tag}")));
        let id_slot = Mutex::new(None);
        let acted: Mutex<Option<(Option<std::process::Child>, String)>> = Mutex::new(None);
        let start = root_starter(&id_slot, Duration::from_secs(120));
        let start_and_act = |job_id: u64| {
            let (id, root) = start(job_id)?;
            if before {
                *acted.lock().unwrap() = Some(start_act(act, &id, size, &release.0));
            }
            Ok((id, root))
        };
        let mut job = Job::spawn_with(
            ENTRY,
            &format!("go:{}:4", go.0.display()),
            size,
            &start_and_act,
            &|_, _| {},
        );
        let id = id_slot.lock().unwrap().expect("root started");
        if !before {
            for rank in 0..size {
                job.wait_for_line(
                    rank,
                    &format!("rank {rank} joined"),
                    Duration::from_secs(60),
                );
            }
            *acted.lock().unwrap() = Some(start_act(act, &id, size, &release.0));
        }
        std::fs::write(&go.0, b"go").unwrap();
        job.expect_success(Duration::from_secs(90));
        for rank in 0..size {
            assert!(
                job.output(rank).contains("checked 4 rounds"),
                "run {run} {act:?}"
            );
        }
        let (holder, said) = acted.lock().unwrap().take().expect("the stranger acted");
        drop(release);
        if let Some(mut c) = holder {
            let _ = c.wait();
        }
        let key = id.key().to_hex();
        assert!(!said.contains(&key[..16]), "run {run} {act:?}: {said}");
        assert!(
            !said.contains("stranger failed"),
            "run {run} {act:?}: {said}"
        );
        if matches!(act, Act::Taken) {
            assert_eq!(
                said.matches("authentication failed").count(),
                size,
                "{said}"
            );
        }
        let prefix = format!("xccl-{:016x}-", id.job_id());
        for name in shm_entries(&prefix) {
            let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
        }
        let when = if before { "before" } else { "during" };
        println!("STRANGER-REPORT run {run} seed {seed} {act:?} {when}: job completed");
        *counts
            .entry(
                format!("{act:?}")
                    .split('(')
                    .next()
                    .unwrap_or("")
                    .to_string(),
            )
            .or_insert(0) += 1;
    }
    println!("STRANGER-CAMPAIGN seed {seed}: {counts:?}");
}
