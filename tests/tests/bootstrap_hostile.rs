//! Hostile and malformed input against a live job's bootstrap port.
//!
//! The bootstrap root runs in this (the parent) process, the ranks are child processes joined
//! over TCP and shared memory (see `xccl_tests::Job`). While they rendezvous, strangers connect
//! to the root's port and send random bytes, a truncated hello, a wrong magic, a wrong job id, a
//! 4 GiB length field, a partial header left idle (half-open) and, once the ranks have joined, a
//! second hello for every rank that is taken. Each is answered with an ERROR frame naming the
//! cause, closed, and logged at `warn`; the real ranks complete their rendezvous and checked
//! A2E/E2A rounds. A second test squats a rank before its owner arrives: the owner is refused
//! naming the duplicate, and the other ranks fail naming the squatted rank once the root drops it.
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
use xccl_tests::{announce, child_main, mixed_round, ChildCtx, Job};

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
/// magic, version 1, kind, round, payload length.
fn header(magic: &[u8; 4], kind: u16, round: u64, len: u64) -> Vec<u8> {
    let mut h = magic.to_vec();
    h.extend_from_slice(&1u16.to_le_bytes());
    h.extend_from_slice(&kind.to_le_bytes());
    h.extend_from_slice(&round.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h
}

const HELLO: u16 = 1;
const WELCOME: u16 = 2;
const ERROR: u16 = 3;
const DATA: u16 = 4;

/// A whole HELLO frame.
fn hello(job_id: u64, rank: u64, size: u64) -> Vec<u8> {
    let mut f = header(b"XCBT", HELLO, 0, 24);
    for v in [job_id, rank, size] {
        f.extend_from_slice(&v.to_le_bytes());
    }
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
    match read_reply(&mut s)? {
        (ERROR, text) => Ok(String::from_utf8_lossy(&text).into_owned()),
        (kind, _) => Err(format!("expected an ERROR frame, got kind {kind}")),
    }
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
    idle.write_all(&header(b"XCBT", HELLO, 0, 24)[..10])
        .unwrap();

    let mut truncated = hello(job_id, 0, size as u64);
    truncated.truncate(24 + 10);
    let cases: Vec<(&str, Vec<u8>, bool, &str)> = vec![
        ("random bytes", random_bytes(4096), false, "bad magic"),
        (
            "a truncated hello",
            truncated,
            true,
            "truncated Hello payload",
        ),
        (
            "a wrong magic",
            header(b"XCBX", HELLO, 0, 24),
            false,
            "bad magic",
        ),
        (
            "a wrong job id",
            hello(job_id ^ 0x5a5a, 0, size as u64),
            false,
            "job id mismatch",
        ),
        (
            "a 4 GiB length",
            header(b"XCBT", HELLO, 0, 4 << 30),
            false,
            "4294967296 bytes exceeds the limit",
        ),
        (
            "a world size of 2^40",
            hello(job_id, 0, 1 << 40),
            false,
            "too large",
        ),
    ];
    let strangers: Vec<_> = cases
        .into_iter()
        .map(|(what, bytes, close, expect)| {
            let h = std::thread::spawn(move || rejection(root, &bytes, close));
            (what, expect, h)
        })
        .collect();
    for (what, expect, h) in strangers {
        let text = h.join().unwrap().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(text.contains(expect), "{what}: the root answered {text:?}");
        wait_for_warning(job_id, expect);
    }

    // Every rank has joined: a second hello for each is refused.
    for rank in 0..size {
        job.wait_for_line(
            rank,
            &format!("rank {rank} joined"),
            Duration::from_secs(60),
        );
    }
    for rank in 0..size {
        let text = rejection(root, &hello(job_id, rank as u64, size as u64), false).unwrap();
        assert!(
            text.contains(&format!("duplicate rank: rank {rank} has already joined")),
            "{text}"
        );
    }
    wait_for_warning(job_id, "duplicate rank: rank 2");

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
fn a_squatter_on_a_rank_fails_the_job_naming_that_rank_without_allocating_its_claim() {
    logs();
    let size = 3;
    let taken = 1usize;
    let id_slot = Mutex::new(None);
    let squatter: Mutex<Option<TcpStream>> = Mutex::new(None);
    let start = root_starter(&id_slot, Duration::from_secs(30));
    // Before any rank starts: claim rank 1 with the job's id, then start a DATA frame that
    // claims the largest blob and send 1 KiB of it.
    let start_and_squat = |job_id: u64| {
        let (id, root) = start(job_id)?;
        let mut s = TcpStream::connect(id.root_addr()).expect("squatter connects");
        s.write_all(&hello(job_id, taken as u64, size as u64))
            .expect("squatter hello");
        let (kind, _) = read_reply(&mut s).expect("squatter welcome");
        assert_eq!(kind, WELCOME);
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
