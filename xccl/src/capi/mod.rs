//! The C ABI declared by `include/xccl.h` (hand-written; `ci/check-capi.sh` checks that every
//! declared function is exported here and nothing else is).
//!
//! This is the only module with `extern "C"`, raw pointers from callers and `catch_unwind`.
//! Rules every exported function follows:
//! - the body runs inside [`catch_unwind`]: a panic becomes `xcclInternalError` and poisons the
//!   communicator (the job is aborted with a reason naming the call); it never unwinds into C
//!   and never aborts the host process;
//! - every pointer is checked for NULL (`xcclInvalidArgument`, naming the argument) and for the
//!   alignment of its type before it is read or written;
//! - communicators, A2E handles and batches are *ids*, not addresses: the `xcclComm_t` a caller
//!   holds is a number looked up in a registry, so a destroyed or made-up handle is reported
//!   (`xcclInvalidUsage`) instead of being dereferenced;
//! - a call on a communicator aborted with `xcclCommAbort` returns `xcclAborted`;
//! - every failure leaves its message for `xcclGetLastError`.
//!
//! `xcclCommAbort` must work while another thread is blocked in a call on the same
//! communicator, which holds the communicator's lock. So the communicator is built on a
//! `SharedFabric` whose fabric this module also keeps: abort raises the fabric's abort flag
//! directly, the blocked wait sees it within milliseconds and returns `Aborted`.

#![allow(non_camel_case_types, non_snake_case)]

mod config;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::bootstrap::{Exchange, TcpBootstrap, UniqueId};
use crate::fabric::shm::ShmFabric;
use crate::fabric::{Capabilities, Fabric, Waiting, Window};
use crate::{A2eHandle, Communicator, DType, Error, ExpertBatch, Role, TokenBatch};

pub use config::xcclConfig_t;

/// `xcclResult_t` (a C enum: an `int`).
pub type xcclResult_t = c_int;

/// `xcclSuccess`.
pub const XCCL_SUCCESS: xcclResult_t = 0;
/// `xcclInvalidArgument`: a NULL pointer, a value out of range, a buffer of the wrong size.
pub const XCCL_INVALID_ARGUMENT: xcclResult_t = 1;
/// `xcclInvalidUsage`: a call the state does not allow (wrong role, destroyed handle, order).
pub const XCCL_INVALID_USAGE: xcclResult_t = 2;
/// `xcclSystemError`: the OS or the rendezvous failed.
pub const XCCL_SYSTEM_ERROR: xcclResult_t = 3;
/// `xcclRemoteError`: a peer failed or broke the protocol.
pub const XCCL_REMOTE_ERROR: xcclResult_t = 4;
/// `xcclTimeout`: a wait passed the call's deadline.
pub const XCCL_TIMEOUT: xcclResult_t = 5;
/// `xcclAborted`: the job was aborted (here or by a peer).
pub const XCCL_ABORTED: xcclResult_t = 6;
/// `xcclUnavailable`: the fabric asked for is not available.
pub const XCCL_UNAVAILABLE: xcclResult_t = 7;
/// `xcclInternalError`: a bug in xccl (a panic or an impossible state).
pub const XCCL_INTERNAL_ERROR: xcclResult_t = 8;

/// A failed C call: its result code and message.
#[derive(Debug)]
pub(crate) struct Fail {
    code: xcclResult_t,
    msg: String,
}

impl Fail {
    fn new(code: xcclResult_t, msg: impl Into<String>) -> Self {
        Fail {
            code,
            msg: msg.into(),
        }
    }

    fn invalid(msg: impl Into<String>) -> Self {
        Fail::new(XCCL_INVALID_ARGUMENT, msg)
    }

    fn usage(msg: impl Into<String>) -> Self {
        Fail::new(XCCL_INVALID_USAGE, msg)
    }

    fn from_error(e: &Error) -> Self {
        Fail::new(code_of(e), e.to_string())
    }

    fn prefixed(mut self, what: &str) -> Self {
        self.msg = format!("{what}: {}", self.msg);
        self
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::from_error(&e)
    }
}

/// The result code of an xccl error.
fn code_of(e: &Error) -> xcclResult_t {
    match e {
        Error::InvalidArgument(_) => XCCL_INVALID_ARGUMENT,
        Error::WrongRole(_) => XCCL_INVALID_USAGE,
        Error::Timeout { .. } => XCCL_TIMEOUT,
        Error::PeerFailed { .. } | Error::Protocol { .. } => XCCL_REMOTE_ERROR,
        Error::Aborted { .. } => XCCL_ABORTED,
        Error::Bootstrap(_) | Error::Os { .. } => XCCL_SYSTEM_ERROR,
        Error::FabricUnavailable { .. } => XCCL_UNAVAILABLE,
        Error::OutOfWindow { .. } => XCCL_INTERNAL_ERROR,
        #[allow(unreachable_patterns)]
        _ => XCCL_INTERNAL_ERROR,
    }
}

thread_local! {
    /// The message `xcclGetLastError` returns on this thread.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_thread_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Null and alignment check of an output pointer, then the write.
///
/// # Safety
/// `p`, when non-NULL, is valid for a write of `T`.
unsafe fn put<T>(p: *mut T, v: T, name: &str) -> Result<(), Fail> {
    if p.is_null() {
        return Err(Fail::invalid(format!("{name} is NULL")));
    }
    if !(p as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(Fail::invalid(format!("{name} is not aligned")));
    }
    // SAFETY: non-NULL and aligned (checked); the caller guarantees it is writable.
    unsafe { p.write(v) };
    Ok(())
}

/// The `len` elements at `p` (NULL allowed when `len` is 0).
///
/// # Safety
/// `p`, when non-NULL, is valid for reads of `len` `T`s that nobody writes while the slice
/// lives.
unsafe fn slice<'a, T>(p: *const T, len: usize, name: &str) -> Result<&'a [T], Fail> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Fail::invalid(format!("{name} is NULL")));
    }
    if !(p as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(Fail::invalid(format!(
            "{name} is not aligned to {} bytes",
            std::mem::align_of::<T>()
        )));
    }
    // SAFETY: non-NULL and aligned (checked); the caller guarantees `len` readable elements.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// The `len` bytes at `p`, writable (NULL allowed when `len` is 0).
///
/// # Safety
/// `p`, when non-NULL, is valid for writes of `len` bytes nobody else touches meanwhile.
unsafe fn bytes_mut<'a>(p: *mut c_void, len: usize, name: &str) -> Result<&'a mut [u8], Fail> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(Fail::invalid(format!("{name} is NULL")));
    }
    // SAFETY: non-NULL (checked); the caller guarantees `len` writable bytes.
    Ok(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) })
}

/// A fabric shared between the communicator and this module, so that `xcclCommAbort` reaches
/// it while a call holds the communicator. Every method forwards, default ones included.
struct SharedFabric(Arc<dyn Fabric>);

impl Fabric for SharedFabric {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    fn window_len(&self, rank: usize) -> usize {
        self.0.window_len(rank)
    }
    fn num_signal_slots(&self) -> usize {
        self.0.num_signal_slots()
    }
    fn local_window(&self) -> Option<Window<'_>> {
        self.0.local_window()
    }
    fn peer_window(&self, peer: usize) -> Option<Window<'_>> {
        self.0.peer_window(peer)
    }
    fn put(&self, peer: usize, offset: usize, data: &[u8]) -> crate::Result<()> {
        self.0.put(peer, offset, data)
    }
    fn get(&self, peer: usize, offset: usize, buf: &mut [u8]) -> crate::Result<()> {
        self.0.get(peer, offset, buf)
    }
    fn signal(&self, peer: usize, slot: usize, value: u64) -> crate::Result<()> {
        self.0.signal(peer, slot, value)
    }
    fn signal_value(&self, slot: usize) -> u64 {
        self.0.signal_value(slot)
    }
    fn flush(&self) -> crate::Result<()> {
        self.0.flush()
    }
    fn wait_until(
        &self,
        deadline: Instant,
        poll: &mut dyn FnMut() -> Option<Waiting>,
    ) -> crate::Result<()> {
        self.0.wait_until(deadline, poll)
    }
    fn barrier(&self, timeout: Duration) -> crate::Result<()> {
        self.0.barrier(timeout)
    }
    fn abort(&self, reason: &str) {
        self.0.abort(reason)
    }
    fn check_peer(&self, peer: usize) -> crate::Result<()> {
        self.0.check_peer(peer)
    }
    fn aborted(&self) -> Option<(usize, String)> {
        self.0.aborted()
    }
    fn check_peers(&self) -> crate::Result<()> {
        self.0.check_peers()
    }
    fn wait_signal(
        &self,
        slot: usize,
        peer: usize,
        what: &'static str,
        deadline: Instant,
        ready: &dyn Fn(u64) -> bool,
    ) -> crate::Result<u64> {
        self.0.wait_signal(slot, peer, what, deadline, ready)
    }
}

/// What the C side's `xcclComm_t` names.
struct Comm {
    rank: usize,
    nranks: usize,
    role: Role,
    local_experts: Vec<usize>,
    num_attention: usize,
    max_tokens: usize,
    topk: usize,
    row_bytes: usize,
    dtype: DType,
    comm: Mutex<Communicator>,
    fabric: Arc<dyn Fabric>,
    /// Set by `xcclCommAbort`.
    aborted: AtomicBool,
    /// The first error that poisoned the communicator (code and message).
    first_error: Mutex<Option<(xcclResult_t, String)>>,
    /// The message of the last failed call on this communicator.
    last_error: Mutex<String>,
}

/// An opaque C handle (`xcclComm_t`): an id from a counter, never an address.
pub enum xcclComm {}
/// Opaque A2E handle (an id).
pub enum xcclA2EHandle {}
/// Opaque expert-major batch (an id).
pub enum xcclExpertBatch {}
/// Opaque token-major batch (an id).
pub enum xcclTokenBatch {}

static NEXT_ID: AtomicUsize = AtomicUsize::new(0x100);
static COMMS: Mutex<BTreeMap<usize, Arc<Comm>>> = Mutex::new(BTreeMap::new());
static HANDLES: Mutex<BTreeMap<usize, (usize, A2eHandle)>> = Mutex::new(BTreeMap::new());
static EXPERT_BATCHES: Mutex<BTreeMap<usize, ExpertBatchObj>> = Mutex::new(BTreeMap::new());
static TOKEN_BATCHES: Mutex<BTreeMap<usize, TokenBatchObj>> = Mutex::new(BTreeMap::new());

fn next_id() -> usize {
    // Multiples of 16, so ids look like (and compare like) aligned pointers in debuggers.
    NEXT_ID.fetch_add(1, Ordering::Relaxed) << 4
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct ExpertBatchObj {
    comm: usize,
    batch: ExpertBatch,
    counts: Vec<usize>,
    offsets: Vec<usize>,
}

struct TokenBatchObj {
    comm: usize,
    batch: TokenBatch,
}

/// `xcclExpertBatchInfo_t`.
#[repr(C)]
pub struct xcclExpertBatchInfo_t {
    /// Rows (received (token, local expert) pairs).
    pub numRows: usize,
    /// Received tokens.
    pub numTokens: usize,
    /// Local experts of this rank.
    pub numLocalExperts: usize,
    /// `[numRows, hidden]` rows, expert-major.
    pub rows: *const c_void,
    /// Rows per local expert.
    pub expertCounts: *const usize,
    /// `numLocalExperts + 1` offsets.
    pub expertOffsets: *const usize,
    /// Per row: source attention rank.
    pub srcRank: *const u32,
    /// Per row: token index at the source.
    pub srcToken: *const u32,
    /// Per row: gating weight.
    pub weights: *const f32,
}

/// `xcclTokenBatchInfo_t`.
#[repr(C)]
pub struct xcclTokenBatchInfo_t {
    /// Received tokens.
    pub numTokens: usize,
    /// Stride of `localExperts` and `weights`.
    pub topk: usize,
    /// `[numTokens, hidden]` rows.
    pub rows: *const c_void,
    /// Per token: source attention rank.
    pub srcRank: *const u32,
    /// Per token: token index at the source.
    pub srcToken: *const u32,
    /// Per token: local experts it selected here.
    pub expertCount: *const u32,
    /// `[numTokens, topk]` local expert indices, ascending.
    pub localExperts: *const u32,
    /// `[numTokens, topk]` gating weights.
    pub weights: *const f32,
}

/// `xcclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct xcclUniqueId {
    /// The encoded id.
    pub internal: [c_char; 128],
}

/// Runs `f` inside the panic boundary, records its failure for `xcclGetLastError`, returns the
/// code.
fn guard(name: &str, f: impl FnOnce() -> Result<(), Fail>) -> xcclResult_t {
    let outcome = catch_unwind(AssertUnwindSafe(f));
    let fail = match outcome {
        Ok(Ok(())) => return XCCL_SUCCESS,
        Ok(Err(fail)) => fail,
        Err(_) => Fail::new(XCCL_INTERNAL_ERROR, "internal error (panic); see stderr"),
    };
    set_thread_error(&format!("{name}: {}", fail.msg));
    fail.code
}

fn lookup(comm: *mut xcclComm) -> Result<(usize, Arc<Comm>), Fail> {
    if comm.is_null() {
        return Err(Fail::invalid("comm is NULL"));
    }
    let id = comm as usize;
    lock(&COMMS)
        .get(&id)
        .cloned()
        .map(|c| (id, c))
        .ok_or_else(|| {
            Fail::usage(format!(
                "comm {id:#x} is not a live communicator (destroyed, or not from xcclCommInit*)"
            ))
        })
}

/// Runs a call on a live, not aborted communicator, holding its lock: the panic boundary,
/// the poisoned state and the error message.
fn with_comm(
    name: &str,
    comm: *mut xcclComm,
    f: impl FnOnce(usize, &Comm, &mut Communicator) -> Result<(), Fail>,
) -> xcclResult_t {
    let mut target = None;
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let (id, c) = lookup(comm)?;
        target = Some(c.clone());
        if c.aborted.load(Ordering::Acquire) {
            return Err(Fail::new(
                XCCL_ABORTED,
                format!(
                    "rank {}: the communicator was aborted by xcclCommAbort",
                    c.rank
                ),
            ));
        }
        let mut guard = c.comm.lock().map_err(|_| {
            Fail::new(
                XCCL_INTERNAL_ERROR,
                "the communicator was poisoned by an internal error (panic) in an earlier call",
            )
        })?;
        let res = f(id, &c, &mut guard);
        if let Some(e) = guard.poisoned() {
            lock(&c.first_error).get_or_insert_with(|| (code_of(e), e.to_string()));
        }
        res
    }));
    let fail = match outcome {
        Ok(Ok(())) => return XCCL_SUCCESS,
        Ok(Err(fail)) => fail,
        Err(_) => {
            let msg = "internal error (panic); the communicator is poisoned and the job aborted";
            if let Some(c) = &target {
                c.fabric
                    .abort(&format!("rank {}: panic inside {name}", c.rank));
                lock(&c.first_error).get_or_insert((XCCL_INTERNAL_ERROR, msg.to_string()));
            }
            Fail::new(XCCL_INTERNAL_ERROR, msg)
        }
    };
    let msg = format!("{name}: {}", fail.msg);
    if let Some(c) = &target {
        *lock(&c.last_error) = msg.clone();
    }
    set_thread_error(&msg);
    fail.code
}

/// Like [`with_comm`] for queries: no lock, answers from what init cached.
fn query(
    name: &str,
    comm: *mut xcclComm,
    f: impl FnOnce(&Comm) -> Result<(), Fail>,
) -> xcclResult_t {
    guard(name, || {
        let (_, c) = lookup(comm)?;
        if c.aborted.load(Ordering::Acquire) {
            return Err(Fail::new(
                XCCL_ABORTED,
                format!(
                    "rank {}: the communicator was aborted by xcclCommAbort",
                    c.rank
                ),
            ));
        }
        f(&c)
    })
}

// ---------------------------------------------------------------------------------------------
// Errors and version

/// `xcclGetErrorString`: a static description of `result`.
#[no_mangle]
pub extern "C" fn xcclGetErrorString(result: xcclResult_t) -> *const c_char {
    let s: &'static CStr = match result {
        XCCL_SUCCESS => c"success",
        XCCL_INVALID_ARGUMENT => c"invalid argument",
        XCCL_INVALID_USAGE => c"invalid usage",
        XCCL_SYSTEM_ERROR => c"system error",
        XCCL_REMOTE_ERROR => c"remote error (a peer failed or broke the protocol)",
        XCCL_TIMEOUT => c"timeout",
        XCCL_ABORTED => c"aborted",
        XCCL_UNAVAILABLE => c"unavailable (fabric or library missing)",
        XCCL_INTERNAL_ERROR => c"internal error",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

/// `xcclGetLastError`: the last failure's message on `comm`, or on this thread when `comm` is
/// NULL or not live. The string stays valid until this thread's next xccl call.
#[no_mangle]
pub extern "C" fn xcclGetLastError(comm: *mut xcclComm) -> *const c_char {
    let _ = catch_unwind(|| {
        if comm.is_null() {
            return;
        }
        if let Ok((_, c)) = lookup(comm) {
            let msg = lock(&c.last_error).clone();
            set_thread_error(&msg);
        }
    });
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// `xcclGetVersion`.
///
/// # Safety
/// `version`, when non-NULL, is valid for a write of an `int`.
#[no_mangle]
pub unsafe extern "C" fn xcclGetVersion(version: *mut c_int) -> xcclResult_t {
    guard("xcclGetVersion", || {
        let v = |s: &str| s.parse::<c_int>().unwrap_or(0);
        let code = v(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
            + v(env!("CARGO_PKG_VERSION_MINOR")) * 100
            + v(env!("CARGO_PKG_VERSION_PATCH"));
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(version, code, "version") }
    })
}

// ---------------------------------------------------------------------------------------------
// Init and teardown

/// `xcclGetUniqueId`: starts the rendezvous root in this process.
///
/// # Safety
/// `uniqueId`, when non-NULL, is valid for a write of an `xcclUniqueId`.
#[no_mangle]
pub unsafe extern "C" fn xcclGetUniqueId(uniqueId: *mut xcclUniqueId) -> xcclResult_t {
    guard("xcclGetUniqueId", || {
        if uniqueId.is_null() {
            return Err(Fail::invalid("uniqueId is NULL"));
        }
        let id = UniqueId::new()?;
        let mut out = xcclUniqueId { internal: [0; 128] };
        for (o, b) in out.internal.iter_mut().zip(id.to_bytes()) {
            *o = b as c_char;
        }
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(uniqueId, out, "uniqueId") }
    })
}

fn build(exchange: Arc<dyn Exchange>, parsed: config::Parsed) -> Result<Comm, Fail> {
    let config::Parsed { topo, cfg, fabric } = parsed;
    if fabric != "shm" {
        return Err(Fail::from_error(&Error::FabricUnavailable {
            fabric,
            detail: "not available through the C ABI in this build (available: shm)".into(),
        }));
    }
    let rank = exchange.rank();
    let lens = Communicator::window_lens(&topo, &cfg)?;
    let shm: Arc<dyn Fabric> = Arc::new(ShmFabric::new(
        exchange,
        lens[rank],
        Communicator::signal_slots(&topo),
    )?);
    let topo = Arc::new(topo);
    let comm = Communicator::new(
        Box::new(SharedFabric(shm.clone())),
        topo.clone(),
        cfg.clone(),
    )?;
    Ok(Comm {
        rank,
        nranks: topo.world_size(),
        role: topo.role(rank),
        local_experts: topo.local_experts(rank).to_vec(),
        num_attention: topo.attention_ranks().len(),
        max_tokens: cfg.max_tokens_per_rank,
        topk: cfg.topk,
        row_bytes: cfg.hidden * cfg.dtype.size(),
        dtype: cfg.dtype,
        comm: Mutex::new(comm),
        fabric: shm,
        aborted: AtomicBool::new(false),
        first_error: Mutex::new(None),
        last_error: Mutex::new(String::new()),
    })
}

fn register(c: Comm) -> *mut xcclComm {
    let id = next_id();
    lock(&COMMS).insert(id, Arc::new(c));
    id as *mut xcclComm
}

/// `xcclCommInitRankConfig`: joins the job named by `commId` as `rank` of `nranks`.
///
/// # Safety
/// `comm`, when non-NULL, is valid for a write of a pointer; `config`, when non-NULL, points to
/// an `xcclConfig_t` filled as the header says.
#[no_mangle]
pub unsafe extern "C" fn xcclCommInitRankConfig(
    comm: *mut *mut xcclComm,
    nranks: c_int,
    commId: xcclUniqueId,
    rank: c_int,
    config: *const xcclConfig_t,
) -> xcclResult_t {
    guard("xcclCommInitRankConfig", || {
        if comm.is_null() {
            return Err(Fail::invalid("comm is NULL"));
        }
        if nranks < 2 {
            return Err(Fail::invalid(format!(
                "nranks = {nranks}; a job needs at least one attention and one expert rank"
            )));
        }
        if rank < 0 || rank >= nranks {
            return Err(Fail::invalid(format!(
                "rank = {rank} is outside 0..{nranks}"
            )));
        }
        // SAFETY: the caller's contract (see the function's docs).
        let parsed = unsafe { config::parse(config, nranks as usize)? };
        let bytes: Vec<u8> = commId.internal.iter().map(|&b| b as u8).collect();
        let id =
            UniqueId::from_bytes(&bytes).map_err(|e| Fail::from_error(&e).prefixed("commId"))?;
        let timeout = parsed.cfg.timeout.max(Duration::from_secs(10));
        let boot = TcpBootstrap::connect(&id, rank as usize, nranks as usize, timeout)?;
        let c = build(Arc::new(boot), parsed)?;
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(comm, register(c), "comm") }
    })
}

/// `xcclCommInitFromEnv`: joins the job described by the launcher's environment.
///
/// # Safety
/// As [`xcclCommInitRankConfig`].
#[no_mangle]
pub unsafe extern "C" fn xcclCommInitFromEnv(
    comm: *mut *mut xcclComm,
    config: *const xcclConfig_t,
) -> xcclResult_t {
    guard("xcclCommInitFromEnv", || {
        if comm.is_null() {
            return Err(Fail::invalid("comm is NULL"));
        }
        if config.is_null() {
            return Err(Fail::invalid(
                "config is NULL (start from XCCL_CONFIG_INITIALIZER)",
            ));
        }
        let env = crate::bootstrap::LaunchEnv::detect()?.ok_or_else(|| {
            Fail::invalid(
                "no launcher environment: set XCCL_RANK, XCCL_SIZE and XCCL_ROOT, or launch with \
                 torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), mpirun or srun plus XCCL_ROOT",
            )
        })?;
        // SAFETY: the caller's contract (see the function's docs).
        let parsed = unsafe { config::parse(config, env.size)? };
        let timeout = parsed.cfg.timeout.max(Duration::from_secs(10));
        let boot = env.connect(timeout)?;
        let c = build(Arc::new(boot), parsed)?;
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(comm, register(c), "comm") }
    })
}

/// `xcclCommDestroy`: releases `comm` and every handle and batch still open on it.
#[no_mangle]
pub extern "C" fn xcclCommDestroy(comm: *mut xcclComm) -> xcclResult_t {
    guard("xcclCommDestroy", || {
        let (id, _) = lookup(comm)?;
        let c = lock(&COMMS).remove(&id);
        lock(&HANDLES).retain(|_, (owner, _)| *owner != id);
        lock(&EXPERT_BATCHES).retain(|_, b| b.comm != id);
        lock(&TOKEN_BATCHES).retain(|_, b| b.comm != id);
        // The communicator (and its shared memory) goes when the last call using it returns.
        drop(c);
        Ok(())
    })
}

/// `xcclCommAbort`: aborts the job; returns promptly, from any thread.
#[no_mangle]
pub extern "C" fn xcclCommAbort(comm: *mut xcclComm) -> xcclResult_t {
    guard("xcclCommAbort", || {
        let (_, c) = lookup(comm)?;
        if !c.aborted.swap(true, Ordering::AcqRel) {
            let reason = format!("xcclCommAbort called on rank {}", c.rank);
            c.fabric.abort(&reason);
            lock(&c.first_error).get_or_insert((XCCL_ABORTED, format!("aborted: {reason}")));
            if let Ok(mut inner) = c.comm.try_lock() {
                inner.abort(&reason);
            }
        }
        Ok(())
    })
}

/// `xcclCommGetAsyncError`: the error that poisoned `comm`, or one raised by a peer or the
/// liveness checks since.
///
/// # Safety
/// `asyncError`, when non-NULL, is valid for a write of an `int`.
#[no_mangle]
pub unsafe extern "C" fn xcclCommGetAsyncError(
    comm: *mut xcclComm,
    asyncError: *mut xcclResult_t,
) -> xcclResult_t {
    guard("xcclCommGetAsyncError", || {
        let (_, c) = lookup(comm)?;
        let found = lock(&c.first_error).clone().or_else(|| {
            if let Some((by, reason)) = c.fabric.aborted() {
                return Some((XCCL_ABORTED, format!("aborted by rank {by}: {reason}")));
            }
            c.fabric
                .check_peers()
                .err()
                .map(|e| (code_of(&e), e.to_string()))
        });
        let code = match found {
            Some((code, msg)) => {
                *lock(&c.last_error) = format!("async error: {msg}");
                code
            }
            None => XCCL_SUCCESS,
        };
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(asyncError, code, "asyncError") }
    })
}

// ---------------------------------------------------------------------------------------------
// Queries

/// `xcclCommCount`.
///
/// # Safety
/// `count`, when non-NULL, is valid for a write of an `int`.
#[no_mangle]
pub unsafe extern "C" fn xcclCommCount(comm: *mut xcclComm, count: *mut c_int) -> xcclResult_t {
    // SAFETY: the caller's contract (see the function's docs).
    query("xcclCommCount", comm, |c| unsafe {
        put(count, c.nranks as c_int, "count")
    })
}

/// `xcclCommUserRank`.
///
/// # Safety
/// `rank`, when non-NULL, is valid for a write of an `int`.
#[no_mangle]
pub unsafe extern "C" fn xcclCommUserRank(comm: *mut xcclComm, rank: *mut c_int) -> xcclResult_t {
    // SAFETY: the caller's contract (see the function's docs).
    query("xcclCommUserRank", comm, |c| unsafe {
        put(rank, c.rank as c_int, "rank")
    })
}

/// `xcclCommRole`: `xcclRoleAttention` (0) or `xcclRoleExpert` (1).
///
/// # Safety
/// `role`, when non-NULL, is valid for a write of an `int`.
#[no_mangle]
pub unsafe extern "C" fn xcclCommRole(comm: *mut xcclComm, role: *mut c_int) -> xcclResult_t {
    query("xcclCommRole", comm, |c| {
        let r = match c.role {
            Role::Attention => 0,
            Role::Expert => 1,
        };
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(role, r, "role") }
    })
}

/// `xcclCommLocalExperts`: the number of local experts, and their global ids.
///
/// # Safety
/// `count`, when non-NULL, is valid for a write of an `int`; `experts`, when non-NULL, for
/// `*count` ints.
#[no_mangle]
pub unsafe extern "C" fn xcclCommLocalExperts(
    comm: *mut xcclComm,
    count: *mut c_int,
    experts: *mut c_int,
) -> xcclResult_t {
    query("xcclCommLocalExperts", comm, |c| {
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(count, c.local_experts.len() as c_int, "count")? };
        if !experts.is_null() {
            for (i, &e) in c.local_experts.iter().enumerate() {
                // SAFETY: the caller's contract: `experts` holds `*count` ints.
                unsafe { put(experts.add(i), e as c_int, "experts")? };
            }
        }
        Ok(())
    })
}

/// `xcclCommBufferSizes`: the largest batch of one call on this rank.
///
/// # Safety
/// Every pointer, when non-NULL, is valid for a write of a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn xcclCommBufferSizes(
    comm: *mut xcclComm,
    rowBytes: *mut usize,
    maxRecvTokens: *mut usize,
    maxRecvRows: *mut usize,
) -> xcclResult_t {
    query("xcclCommBufferSizes", comm, |c| {
        let (tokens, rows) = match c.role {
            Role::Attention => (c.max_tokens, c.max_tokens),
            Role::Expert => {
                let t = c.num_attention * c.max_tokens;
                (t, t * c.topk.min(c.local_experts.len()))
            }
        };
        // SAFETY: the caller's contract (see the function's docs).
        unsafe {
            put(rowBytes, c.row_bytes, "rowBytes")?;
            put(maxRecvTokens, tokens, "maxRecvTokens")?;
            put(maxRecvRows, rows, "maxRecvRows")
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Attention ranks

fn check_tokens(c: &Comm, num_tokens: c_int) -> Result<usize, Fail> {
    if num_tokens < 0 || num_tokens as usize > c.max_tokens {
        return Err(Fail::invalid(format!(
            "numTokens = {num_tokens} is outside 0..={} (config.maxTokensPerRank)",
            c.max_tokens
        )));
    }
    Ok(num_tokens as usize)
}

fn new_handle(comm: usize, h: A2eHandle) -> *mut xcclA2EHandle {
    let id = next_id();
    lock(&HANDLES).insert(id, (comm, h));
    id as *mut xcclA2EHandle
}

/// `xcclA2ESend`.
///
/// # Safety
/// `x` is valid for `numTokens * rowBytes` bytes, `topkIdx` and `topkWeights` for
/// `numTokens * topk` elements (any may be NULL when `numTokens` is 0); `handle` for a write.
#[no_mangle]
pub unsafe extern "C" fn xcclA2ESend(
    comm: *mut xcclComm,
    x: *const c_void,
    numTokens: c_int,
    topkIdx: *const i32,
    topkWeights: *const f32,
    handle: *mut *mut xcclA2EHandle,
) -> xcclResult_t {
    with_comm("xcclA2ESend", comm, |id, c, inner| {
        if handle.is_null() {
            return Err(Fail::invalid("handle is NULL"));
        }
        let t = check_tokens(c, numTokens)?;
        // SAFETY: the caller's contract (see the function's docs).
        let (x, idx, w) = unsafe {
            (
                slice(x.cast::<u8>(), t * c.row_bytes, "x")?,
                slice(topkIdx, t * c.topk, "topkIdx")?,
                slice(topkWeights, t * c.topk, "topkWeights")?,
            )
        };
        let mode = inner.config().mode;
        let h = inner.a2e_send_bytes(x, idx, w, mode)?;
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(handle, new_handle(id, h), "handle") }
    })
}

/// `xcclA2EInput`: the registered input of the next A2E call.
///
/// # Safety
/// `input`, when non-NULL, is valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn xcclA2EInput(
    comm: *mut xcclComm,
    input: *mut *mut c_void,
) -> xcclResult_t {
    with_comm("xcclA2EInput", comm, |_, c, inner| {
        if input.is_null() {
            return Err(Fail::invalid("input is NULL"));
        }
        let p: *mut c_void = match c.dtype {
            DType::F32 => inner.a2e_input::<f32>()?.as_mut_ptr().cast(),
            DType::F16 => inner.a2e_input::<half::f16>()?.as_mut_ptr().cast(),
            DType::BF16 => inner.a2e_input::<half::bf16>()?.as_mut_ptr().cast(),
        };
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(input, p, "input") }
    })
}

/// `xcclA2ESendInput`: A2E of the first `numTokens` rows written into `xcclA2EInput`.
///
/// # Safety
/// As [`xcclA2ESend`], without `x`.
#[no_mangle]
pub unsafe extern "C" fn xcclA2ESendInput(
    comm: *mut xcclComm,
    numTokens: c_int,
    topkIdx: *const i32,
    topkWeights: *const f32,
    handle: *mut *mut xcclA2EHandle,
) -> xcclResult_t {
    with_comm("xcclA2ESendInput", comm, |id, c, inner| {
        if handle.is_null() {
            return Err(Fail::invalid("handle is NULL"));
        }
        let t = check_tokens(c, numTokens)?;
        // SAFETY: the caller's contract (see the function's docs).
        let (idx, w) = unsafe {
            (
                slice(topkIdx, t * c.topk, "topkIdx")?,
                slice(topkWeights, t * c.topk, "topkWeights")?,
            )
        };
        let h = inner.a2e_send_input(t, idx, w)?;
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(handle, new_handle(id, h), "handle") }
    })
}

/// `xcclE2ARecv`: the combined outputs of the A2E call of `handle`; frees `handle` on success.
///
/// # Safety
/// `out` is valid for writes of `numTokens * rowBytes` bytes (`numTokens` of the handle's call).
#[no_mangle]
pub unsafe extern "C" fn xcclE2ARecv(
    comm: *mut xcclComm,
    handle: *mut xcclA2EHandle,
    out: *mut c_void,
) -> xcclResult_t {
    with_comm("xcclE2ARecv", comm, |_, c, inner| {
        if handle.is_null() {
            return Err(Fail::invalid("handle is NULL"));
        }
        let hid = handle as usize;
        let (owner, h) = lock(&HANDLES).remove(&hid).ok_or_else(|| {
            Fail::usage(format!(
                "handle {hid:#x} is not a live A2E handle (already received or freed)"
            ))
        })?;
        let res = (|| {
            // SAFETY: the caller's contract (see the function's docs).
            let out = unsafe { bytes_mut(out, h.num_tokens() * c.row_bytes, "out")? };
            inner.e2a_recv_bytes(&h, out).map_err(Fail::from)
        })();
        if res.is_err() {
            lock(&HANDLES).insert(hid, (owner, h));
        }
        res
    })
}

/// `xcclA2EHandleFree`: drops a handle without its E2A (after a failure).
#[no_mangle]
pub extern "C" fn xcclA2EHandleFree(handle: *mut xcclA2EHandle) -> xcclResult_t {
    guard("xcclA2EHandleFree", || {
        if handle.is_null() {
            return Err(Fail::invalid("handle is NULL"));
        }
        lock(&HANDLES)
            .remove(&(handle as usize))
            .map(drop)
            .ok_or_else(|| {
                Fail::usage("handle is not a live A2E handle (already received or freed)")
            })
    })
}

// ---------------------------------------------------------------------------------------------
// Expert ranks

/// `xcclA2ERecv`: expert-major receive.
///
/// # Safety
/// `batch`, when non-NULL, is valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn xcclA2ERecv(
    comm: *mut xcclComm,
    batch: *mut *mut xcclExpertBatch,
) -> xcclResult_t {
    with_comm("xcclA2ERecv", comm, |id, _, inner| {
        if batch.is_null() {
            return Err(Fail::invalid("batch is NULL"));
        }
        let mut b = ExpertBatch::new();
        inner.a2e_recv(&mut b)?;
        let n = b.num_local_experts();
        let counts: Vec<usize> = (0..n).map(|j| b.expert_rows(j).len()).collect();
        let mut offsets = vec![0usize];
        offsets.extend((0..n).map(|j| b.expert_rows(j).end));
        let bid = next_id();
        lock(&EXPERT_BATCHES).insert(
            bid,
            ExpertBatchObj {
                comm: id,
                batch: b,
                counts,
                offsets,
            },
        );
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(batch, bid as *mut xcclExpertBatch, "batch") }
    })
}

/// `xcclExpertBatchGetInfo`.
///
/// # Safety
/// `info`, when non-NULL, is valid for a write of an `xcclExpertBatchInfo_t`.
#[no_mangle]
pub unsafe extern "C" fn xcclExpertBatchGetInfo(
    batch: *mut xcclExpertBatch,
    info: *mut xcclExpertBatchInfo_t,
) -> xcclResult_t {
    guard("xcclExpertBatchGetInfo", || {
        if batch.is_null() {
            return Err(Fail::invalid("batch is NULL"));
        }
        let map = lock(&EXPERT_BATCHES);
        let o = map
            .get(&(batch as usize))
            .ok_or_else(|| Fail::usage("batch is not a live expert batch (replied to or freed)"))?;
        let b = &o.batch;
        let i = xcclExpertBatchInfo_t {
            numRows: b.num_rows(),
            numTokens: b.num_tokens(),
            numLocalExperts: o.counts.len(),
            rows: b.row_bytes().as_ptr().cast(),
            expertCounts: o.counts.as_ptr(),
            expertOffsets: o.offsets.as_ptr(),
            srcRank: b.src_rank().as_ptr(),
            srcToken: b.src_token().as_ptr(),
            weights: b.weight().as_ptr(),
        };
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(info, i, "info") }
    })
}

/// `xcclE2ASend`: expert-major reply; frees `batch` on success.
///
/// # Safety
/// `expertOut` is valid for reads of `numRows * rowBytes` bytes.
#[no_mangle]
pub unsafe extern "C" fn xcclE2ASend(
    comm: *mut xcclComm,
    batch: *mut xcclExpertBatch,
    expertOut: *const c_void,
) -> xcclResult_t {
    with_comm("xcclE2ASend", comm, |_, c, inner| {
        if batch.is_null() {
            return Err(Fail::invalid("batch is NULL"));
        }
        let bid = batch as usize;
        let o = lock(&EXPERT_BATCHES).remove(&bid).ok_or_else(|| {
            Fail::usage(format!(
                "batch {bid:#x} is not a live expert batch (replied to or freed)"
            ))
        })?;
        let res = (|| {
            // SAFETY: the caller's contract (see the function's docs).
            let out = unsafe {
                slice(
                    expertOut.cast::<u8>(),
                    o.batch.num_rows() * c.row_bytes,
                    "expertOut",
                )?
            };
            let mode = inner.config().mode;
            match c.dtype {
                DType::F32 => inner.e2a_send_with::<f32>(&o.batch, bytemuck_cast(out)?, mode),
                DType::F16 => inner.e2a_send_with::<half::f16>(&o.batch, bytemuck_cast(out)?, mode),
                DType::BF16 => {
                    inner.e2a_send_with::<half::bf16>(&o.batch, bytemuck_cast(out)?, mode)
                }
            }
            .map_err(Fail::from)
        })();
        if res.is_err() {
            lock(&EXPERT_BATCHES).insert(bid, o);
        }
        res
    })
}

fn bytemuck_cast<T: bytemuck::Pod>(b: &[u8]) -> Result<&[T], Fail> {
    bytemuck::try_cast_slice(b).map_err(|e| {
        Fail::invalid(format!(
            "buffer is not aligned to {} bytes: {e}",
            std::mem::align_of::<T>()
        ))
    })
}

/// `xcclExpertBatchFree`: drops a batch without replying (after a failure).
#[no_mangle]
pub extern "C" fn xcclExpertBatchFree(batch: *mut xcclExpertBatch) -> xcclResult_t {
    guard("xcclExpertBatchFree", || {
        if batch.is_null() {
            return Err(Fail::invalid("batch is NULL"));
        }
        lock(&EXPERT_BATCHES)
            .remove(&(batch as usize))
            .map(drop)
            .ok_or_else(|| Fail::usage("batch is not a live expert batch (replied to or freed)"))
    })
}

/// `xcclA2ERecvTokens`: token-major receive.
///
/// # Safety
/// `batch`, when non-NULL, is valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn xcclA2ERecvTokens(
    comm: *mut xcclComm,
    batch: *mut *mut xcclTokenBatch,
) -> xcclResult_t {
    with_comm("xcclA2ERecvTokens", comm, |id, _, inner| {
        if batch.is_null() {
            return Err(Fail::invalid("batch is NULL"));
        }
        let mut b = TokenBatch::new();
        inner.a2e_recv_tokens(&mut b, &mut |_, _| {})?;
        let bid = next_id();
        lock(&TOKEN_BATCHES).insert(bid, TokenBatchObj { comm: id, batch: b });
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(batch, bid as *mut xcclTokenBatch, "batch") }
    })
}

/// `xcclTokenBatchGetInfo`.
///
/// # Safety
/// `info`, when non-NULL, is valid for a write of an `xcclTokenBatchInfo_t`.
#[no_mangle]
pub unsafe extern "C" fn xcclTokenBatchGetInfo(
    batch: *mut xcclTokenBatch,
    info: *mut xcclTokenBatchInfo_t,
) -> xcclResult_t {
    guard("xcclTokenBatchGetInfo", || {
        if batch.is_null() {
            return Err(Fail::invalid("batch is NULL"));
        }
        let map = lock(&TOKEN_BATCHES);
        let o = map
            .get(&(batch as usize))
            .ok_or_else(|| Fail::usage("batch is not a live token batch (replied to or freed)"))?;
        let b = &o.batch;
        let i = xcclTokenBatchInfo_t {
            numTokens: b.num_tokens(),
            topk: b.topk,
            rows: b.row_bytes().as_ptr().cast(),
            srcRank: b.src_rank().as_ptr(),
            srcToken: b.src_token().as_ptr(),
            expertCount: b.expert_count.as_ptr(),
            localExperts: b.local_expert.as_ptr(),
            weights: b.weight.as_ptr(),
        };
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(info, i, "info") }
    })
}

/// Runs `f` with the live token batch `batch` taken out of the registry; puts it back when
/// `f` fails (a retryable failure leaves the batch valid) or when `keep` says so.
fn with_token_batch(
    batch: *mut xcclTokenBatch,
    keep: bool,
    f: impl FnOnce(&TokenBatch) -> Result<(), Fail>,
) -> Result<(), Fail> {
    if batch.is_null() {
        return Err(Fail::invalid("batch is NULL"));
    }
    let bid = batch as usize;
    let o = lock(&TOKEN_BATCHES).remove(&bid).ok_or_else(|| {
        Fail::usage(format!(
            "batch {bid:#x} is not a live token batch (replied to or freed)"
        ))
    })?;
    let res = f(&o.batch);
    if keep || res.is_err() {
        lock(&TOKEN_BATCHES).insert(bid, o);
    }
    res
}

/// `xcclE2ASendTokens`: token-major reply; frees `batch` on success.
///
/// # Safety
/// `reduced` is valid for reads of `numTokens * rowBytes` bytes.
#[no_mangle]
pub unsafe extern "C" fn xcclE2ASendTokens(
    comm: *mut xcclComm,
    batch: *mut xcclTokenBatch,
    reduced: *const c_void,
) -> xcclResult_t {
    with_comm("xcclE2ASendTokens", comm, |_, c, inner| {
        with_token_batch(batch, false, |b| {
            // SAFETY: the caller's contract (see the function's docs).
            let r = unsafe {
                slice(
                    reduced.cast::<u8>(),
                    b.num_tokens() * c.row_bytes,
                    "reduced",
                )?
            };
            let mode = inner.config().mode;
            Ok(inner.e2a_send_tokens_bytes(b, r, mode)?)
        })
    })
}

/// `xcclE2AOutput`: the registered output of `batch`'s reply.
///
/// # Safety
/// `output`, when non-NULL, is valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn xcclE2AOutput(
    comm: *mut xcclComm,
    batch: *mut xcclTokenBatch,
    output: *mut *mut c_void,
) -> xcclResult_t {
    with_comm("xcclE2AOutput", comm, |_, c, inner| {
        if output.is_null() {
            return Err(Fail::invalid("output is NULL"));
        }
        with_token_batch(batch, true, |b| {
            let p: *mut c_void = match c.dtype {
                DType::F32 => inner.e2a_output::<f32>(b)?.as_mut_ptr().cast(),
                DType::F16 => inner.e2a_output::<half::f16>(b)?.as_mut_ptr().cast(),
                DType::BF16 => inner.e2a_output::<half::bf16>(b)?.as_mut_ptr().cast(),
            };
            // SAFETY: the caller's contract (see the function's docs).
            unsafe { put(output, p, "output") }
        })
    })
}

/// `xcclE2ASendOutput`: reply with the rows written into `xcclE2AOutput`; frees `batch` on
/// success.
#[no_mangle]
pub extern "C" fn xcclE2ASendOutput(
    comm: *mut xcclComm,
    batch: *mut xcclTokenBatch,
) -> xcclResult_t {
    with_comm("xcclE2ASendOutput", comm, |_, _, inner| {
        with_token_batch(batch, false, |b| Ok(inner.e2a_send_output(b)?))
    })
}

/// `xcclTokenBatchFree`: drops a batch without replying (after a failure).
#[no_mangle]
pub extern "C" fn xcclTokenBatchFree(batch: *mut xcclTokenBatch) -> xcclResult_t {
    guard("xcclTokenBatchFree", || {
        if batch.is_null() {
            return Err(Fail::invalid("batch is NULL"));
        }
        lock(&TOKEN_BATCHES)
            .remove(&(batch as usize))
            .map(drop)
            .ok_or_else(|| Fail::usage("batch is not a live token batch (replied to or freed)"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::local::LocalFabric;
    use crate::{MoeConfig, Topology};

    /// Two registered communicators (rank 0 attention, rank 1 expert) over a local fabric.
    fn pair() -> Vec<*mut xcclComm> {
        let topo = Topology::contiguous(1, 1, 2).unwrap();
        let mut cfg = MoeConfig::new(4, DType::F32, 1, 2);
        cfg.timeout = Duration::from_secs(5);
        let lens = Communicator::window_lens(&topo, &cfg).unwrap();
        let fabrics = LocalFabric::create(&lens, Communicator::signal_slots(&topo)).unwrap();
        let topo = Arc::new(topo);
        let comms: Vec<Comm> = std::thread::scope(|s| {
            let joins: Vec<_> = fabrics
                .into_iter()
                .map(|f| {
                    let (topo, cfg) = (topo.clone(), cfg.clone());
                    s.spawn(move || {
                        let fabric: Arc<dyn Fabric> = Arc::new(f);
                        let comm = Communicator::new(
                            Box::new(SharedFabric(fabric.clone())),
                            topo.clone(),
                            cfg.clone(),
                        )
                        .unwrap();
                        let rank = comm.rank();
                        Comm {
                            rank,
                            nranks: 2,
                            role: topo.role(rank),
                            local_experts: topo.local_experts(rank).to_vec(),
                            num_attention: 1,
                            max_tokens: 2,
                            topk: 1,
                            row_bytes: 16,
                            dtype: DType::F32,
                            comm: Mutex::new(comm),
                            fabric,
                            aborted: AtomicBool::new(false),
                            first_error: Mutex::new(None),
                            last_error: Mutex::new(String::new()),
                        }
                    })
                })
                .collect();
            joins.into_iter().map(|j| j.join().unwrap()).collect()
        });
        comms.into_iter().map(register).collect()
    }

    fn last_error(comm: *mut xcclComm) -> String {
        // SAFETY: xcclGetLastError returns a NUL-terminated string valid until this thread's
        // next xccl call; it is copied at once.
        unsafe { CStr::from_ptr(xcclGetLastError(comm)) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_is_an_internal_error_that_poisons_the_comm_and_aborts_the_peers() {
        let comms = pair();
        let code = with_comm("xcclTestPanic", comms[0], |_, _, _| panic!("injected"));
        assert_eq!(code, XCCL_INTERNAL_ERROR);
        assert!(last_error(comms[0]).contains("xcclTestPanic"));
        // Later calls on the panicked communicator fail the same way, never crash.
        let mut h: *mut xcclA2EHandle = std::ptr::null_mut();
        // SAFETY: 0 tokens (no buffers read); `h` is a valid out-pointer.
        let code = unsafe {
            xcclA2ESend(
                comms[0],
                std::ptr::null(),
                0,
                std::ptr::null(),
                std::ptr::null(),
                &mut h,
            )
        };
        assert_eq!(code, XCCL_INTERNAL_ERROR, "{}", last_error(comms[0]));
        let mut async_err = XCCL_SUCCESS;
        // SAFETY: a valid out-pointer.
        let code = unsafe { xcclCommGetAsyncError(comms[0], &mut async_err) };
        assert_eq!(code, XCCL_SUCCESS);
        assert_eq!(async_err, XCCL_INTERNAL_ERROR);
        // The peer's blocked receive returns xcclAborted naming the panic.
        let mut b: *mut xcclExpertBatch = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let code = unsafe { xcclA2ERecv(comms[1], &mut b) };
        assert_eq!(code, XCCL_ABORTED, "{}", last_error(comms[1]));
        assert!(last_error(comms[1]).contains("panic inside xcclTestPanic"));
        for c in comms {
            assert_eq!(xcclCommDestroy(c), XCCL_SUCCESS);
            assert_eq!(xcclCommDestroy(c), XCCL_INVALID_USAGE);
        }
    }

    #[test]
    fn a_panic_outside_a_comm_is_an_internal_error() {
        assert_eq!(
            guard("xcclTestGuard", || panic!("injected")),
            XCCL_INTERNAL_ERROR
        );
        assert!(last_error(std::ptr::null_mut()).contains("xcclTestGuard"));
    }

    #[test]
    fn every_result_code_has_a_distinct_description() {
        let names: std::collections::BTreeSet<_> = (0..=XCCL_INTERNAL_ERROR)
            // SAFETY: xcclGetErrorString returns static NUL-terminated strings.
            .map(|c| unsafe { CStr::from_ptr(xcclGetErrorString(c)) })
            .collect();
        assert_eq!(names.len(), 9);
    }
}
