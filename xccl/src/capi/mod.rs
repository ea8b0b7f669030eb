//! The C ABI declared by `include/xccl.h` (hand-written; `ci/check-capi.sh` checks that every
//! declared function is exported here and nothing else is).
//!
//! This is the only module with `extern "C"`, raw pointers from callers and `catch_unwind`:
//! this file holds the panic boundary, the handle registry and the pointer checks; `init.rs`
//! the calls for errors, version, init, teardown and queries; `moe.rs` the A2E/E2A calls;
//! `device.rs` their device-buffer forms (cuda fabric, a stream argument); `config.rs` the
//! versioned `xcclConfig_t`.
//!
//! Rules every exported function follows:
//! - the body runs inside [`catch_unwind`]: a panic becomes `xcclInternalError` and poisons the
//!   communicator (the job is aborted with a reason naming the call); it never unwinds into C
//!   and never aborts the host process;
//! - every pointer is checked for NULL (`xcclInvalidArgument`, naming the argument) and for the
//!   alignment of its type before it is read or written; on a cuda communicator a host buffer
//!   must not be device memory, and a device buffer must be memory of its GPU (`device.rs`);
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
//!
//! `xcclCommDestroy` from another thread must not leave a call running on a destroyed
//! communicator (it would go on writing the caller's buffers): every communicator is built with
//! an interrupt check reading its `destroyed` flag, so destroy unregisters it, raises the flag,
//! and takes the communicator's lock, which it gets once the interrupted call has returned;
//! only then are its handles, batches and fabric released.

#![allow(non_camel_case_types, non_snake_case)]

pub(crate) mod config;
mod device;
mod ext;
mod init;
mod moe;

pub use device::*;
pub use ext::*;
pub use init::*;
pub use moe::*;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// An error of the library (not a check of this module's): on a poisoned communicator it
    /// gets the code of the poisoning ([`poisoned_code`]).
    from_error: bool,
}

impl Fail {
    fn new(code: xcclResult_t, msg: impl Into<String>) -> Self {
        Fail {
            code,
            msg: msg.into(),
            from_error: false,
        }
    }

    fn invalid(msg: impl Into<String>) -> Self {
        Fail::new(XCCL_INVALID_ARGUMENT, msg)
    }

    fn usage(msg: impl Into<String>) -> Self {
        Fail::new(XCCL_INVALID_USAGE, msg)
    }

    fn from_error(e: &Error) -> Self {
        Fail {
            from_error: true,
            ..Fail::new(code_of(e), e.to_string())
        }
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
        Error::PeerFailed { .. } | Error::Protocol { .. } | Error::ExpertLost { .. } => {
            XCCL_REMOTE_ERROR
        }
        Error::Aborted { .. } => XCCL_ABORTED,
        // The only interrupt the C ABI installs: xcclCommDestroy from another thread.
        Error::Interrupted { .. } => XCCL_INVALID_USAGE,
        Error::Bootstrap(_) | Error::Os { .. } | Error::Native { .. } => XCCL_SYSTEM_ERROR,
        Error::FabricUnavailable { .. } => XCCL_UNAVAILABLE,
        Error::OutOfWindow { .. } => XCCL_INTERNAL_ERROR,
        #[allow(unreachable_patterns)]
        _ => XCCL_INTERNAL_ERROR,
    }
}

/// The result code `code` becomes when its error poisoned a communicator. xcclInvalidArgument
/// and xcclInvalidUsage promise that nothing was sent; a failure that poisoned came after data
/// went out (a failure of this rank's own, such as a non-finite INT8 sum on a relay), and the
/// job is aborted: xcclAborted.
fn poisoned_code(code: xcclResult_t) -> xcclResult_t {
    match code {
        XCCL_INVALID_ARGUMENT | XCCL_INVALID_USAGE => XCCL_ABORTED,
        code => code,
    }
}

thread_local! {
    /// The message `xcclGetLastError` returns on this thread.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// The communicator whose arrival callback this thread is running (0: none).
    static IN_CALLBACK: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn set_thread_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Null and alignment check of a pointer argument (an opaque handle's type has alignment 1, so
/// for handles only NULL fails). Calls check their out-pointers before any side effect, so a
/// bad out-pointer never loses a handle or a batch.
fn check_ptr<T>(p: *mut T, name: &str) -> Result<(), Fail> {
    if p.is_null() {
        return Err(Fail::invalid(format!("{name} is NULL")));
    }
    if !(p as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(Fail::invalid(format!("{name} is not aligned")));
    }
    Ok(())
}

/// Null and alignment check of an output pointer, then the write.
///
/// # Safety
/// `p`, when non-NULL, is valid for a write of `T`.
unsafe fn put<T>(p: *mut T, v: T, name: &str) -> Result<(), Fail> {
    check_ptr(p, name)?;
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

/// Refuses device memory at `p` (the host-buffer argument `name`) on a communicator on the
/// cuda fabric, before the host would dereference it; on other fabrics there is no driver to
/// ask, and nothing is checked.
fn not_device_memory<T>(c: &Comm, p: *const T, len: usize, name: &str) -> Result<(), Fail> {
    let Some(device) = &c.cuda_device else {
        return Ok(());
    };
    if len == 0 || p.is_null() {
        return Ok(());
    }
    match device.memory_device_of(p as u64) {
        Ok(None) => Ok(()),
        Ok(Some(d)) => Err(Fail::invalid(format!(
            "{name} ({p:p}) is device memory of CUDA device {d}; this call takes host memory \
             (the device-buffer calls, xccl*Device, take device memory)"
        ))),
        Err(e) => Err(Fail::from_error(&e).prefixed(name)),
    }
}

/// [`slice`] of a host-buffer argument, refusing device memory on a cuda communicator.
///
/// # Safety
/// As [`slice`].
unsafe fn host_slice<'a, T>(
    c: &Comm,
    p: *const T,
    len: usize,
    name: &str,
) -> Result<&'a [T], Fail> {
    not_device_memory(c, p, len, name)?;
    // SAFETY: the caller's contract.
    unsafe { slice(p, len, name) }
}

/// [`bytes_mut`] of a host-buffer argument, refusing device memory on a cuda communicator.
///
/// # Safety
/// As [`bytes_mut`].
unsafe fn host_bytes_mut<'a>(
    c: &Comm,
    p: *mut c_void,
    len: usize,
    name: &str,
) -> Result<&'a mut [u8], Fail> {
    not_device_memory(c, p, len, name)?;
    // SAFETY: the caller's contract.
    unsafe { bytes_mut(p, len, name) }
}

/// A fabric shared between the communicator and this module, so that `xcclCommAbort` reaches
/// it while a call holds the communicator. Every method forwards, default ones included.
struct SharedFabric(Arc<dyn Fabric>);

// SAFETY: every method forwards to the inner fabric (whose contract holds); the clone this
// module keeps is used only to abort (`xcclCommAbort`), which writes the control area's abort
// word and reason (atomics), never a window.
unsafe impl Fabric for SharedFabric {
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
    fn signal_quiet(&self, peer: usize, slot: usize, value: u64) -> crate::Result<()> {
        self.0.signal_quiet(peer, slot, value)
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
    fn abort_reporting(&self, dead: Option<usize>, reason: &str) {
        self.0.abort_reporting(dead, reason)
    }
    fn forward_abort(&self, notice: &crate::AbortNotice) {
        self.0.forward_abort(notice)
    }
    fn check_peer(&self, peer: usize) -> crate::Result<()> {
        self.0.check_peer(peer)
    }
    fn leave(&self) {
        self.0.leave()
    }
    fn as_cuda(&self) -> Option<&crate::fabric::cuda::CudaFabric> {
        self.0.as_cuda()
    }
    fn wait_counters(&self) -> crate::fabric::WaitCounters {
        self.0.wait_counters()
    }
    fn aborted(&self) -> Option<crate::AbortNotice> {
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
    /// Rows an expert rank receives from one attention rank per call at most.
    recv_rows: usize,
    topk: usize,
    row_bytes: usize,
    dtype: DType,
    /// The GPU of a communicator on the cuda fabric (whose memory the device calls take).
    cuda_device: Option<crate::cuda::Device>,
    /// Rows of `xcclA2ERecvDevice`'s `out` (`Communicator::max_expert_rows`).
    max_expert_rows: usize,
    /// Rows of `xcclA2ERecvTokensDevice`'s `out` (`Communicator::max_recv_tokens`).
    max_recv_tokens: usize,
    /// `None` once `xcclCommShrink` moved it into a new communicator.
    comm: Mutex<Option<Communicator>>,
    fabric: Arc<dyn Fabric>,
    /// The config version the caller compiled against: versions 1 to 3 get the output
    /// structs of their layout (no `size` field); 4 and later say their size.
    version: std::ffi::c_uint,
    /// Where a shrink's rebuild leaves the new communicator's fabric.
    rebuilt: Arc<Mutex<Option<Arc<dyn Fabric>>>>,
    /// Set by `xcclCommAbort`.
    aborted: AtomicBool,
    /// Set by `xcclCommDestroy`: a call in progress stops at its next wait (the
    /// communicator's interrupt check reads it) and later calls are refused.
    destroyed: Arc<AtomicBool>,
    /// The first error that poisoned the communicator (code and message).
    first_error: Mutex<Option<(xcclResult_t, String)>>,
    /// Batches whose reply went out, reused by the next receive (their buffers keep their
    /// capacity, so steady-state receives do not allocate).
    spare_expert: Mutex<Vec<ExpertBatch>>,
    /// As `spare_expert`, token-major.
    spare_token: Mutex<Vec<TokenBatch>>,
}

impl Comm {
    /// The C side of `comm`, whose fabric is `fabric` (shared, so that abort reaches it while a
    /// call holds the communicator), for a caller of config version `version`.
    fn new(
        mut comm: Communicator,
        fabric: Arc<dyn Fabric>,
        version: std::ffi::c_uint,
        rebuilt: Arc<Mutex<Option<Arc<dyn Fabric>>>>,
    ) -> Comm {
        let destroyed = Arc::new(AtomicBool::new(false));
        let flag = destroyed.clone();
        comm.set_interrupt_check(Some(Arc::new(move || flag.load(Ordering::Acquire))));
        let (topo, cfg, rank) = (comm.topology(), comm.config(), comm.rank());
        Comm {
            rank,
            nranks: topo.world_size(),
            role: topo.role(rank),
            local_experts: topo.local_experts(rank).to_vec(),
            num_attention: topo.attention_ranks().len(),
            max_tokens: cfg.max_tokens_per_rank,
            recv_rows: cfg.recv_rows_per_source(),
            topk: cfg.topk,
            row_bytes: cfg.hidden * cfg.dtype.size(),
            dtype: cfg.dtype,
            cuda_device: comm.cuda_device().cloned(),
            max_expert_rows: comm.max_expert_rows(),
            max_recv_tokens: comm.max_recv_tokens(),
            comm: Mutex::new(Some(comm)),
            fabric,
            version,
            rebuilt,
            aborted: AtomicBool::new(false),
            destroyed,
            first_error: Mutex::new(None),
            spare_expert: Mutex::new(Vec::new()),
            spare_token: Mutex::new(Vec::new()),
        }
    }
}

/// Keeps `batch` for the next receive (at most `MAX_IN_FLIGHT` spares).
fn recycle<T>(pool: &Mutex<Vec<T>>, batch: T) {
    let mut p = lock(pool);
    if p.len() < crate::moe::config::MAX_IN_FLIGHT {
        p.push(batch);
    }
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
    sources: Sources,
    /// Received by `xcclA2ERecvDevice`: the rows are in the caller's device buffer.
    on_device: bool,
}

struct TokenBatchObj {
    comm: usize,
    batch: TokenBatch,
    sources: Sources,
    /// Received by `xcclA2ERecvTokensDevice`: the rows are in the caller's device buffer.
    on_device: bool,
}

/// A batch's sources as the info structs point to them (attention ranks in rank order).
#[derive(Default)]
struct Sources {
    ranks: Vec<u32>,
    counts: Vec<usize>,
    first: Vec<usize>,
    tags: Vec<u64>,
}

impl Sources {
    fn of(sources: &[crate::SourceInfo]) -> Self {
        Sources {
            ranks: sources.iter().map(|s| s.rank() as u32).collect(),
            counts: sources.iter().map(|s| s.count()).collect(),
            first: sources.iter().map(|s| s.first_token()).collect(),
            tags: sources.iter().map(|s| s.tag()).collect(),
        }
    }
}

/// Bytes of the `xcclExpertBatchInfo_t` and `xcclTokenBatchInfo_t` a caller of config version
/// 1 to 3 has (no `size` field): version 1 without `int8Rows` and `scales`.
fn legacy_info_len(version: std::ffi::c_uint, fields_v1: usize) -> usize {
    let word = std::mem::size_of::<usize>();
    if version < 2 {
        fields_v1 * word
    } else {
        (fields_v1 + 2) * word
    }
}

/// `xcclExpertBatchInfo_t`.
#[repr(C)]
pub struct xcclExpertBatchInfo_t {
    /// `sizeof(xcclExpertBatchInfo_t)`, set by the caller (config version 4 and later).
    pub size: usize,
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
    /// With `keepInt8`: `[numRows, hidden]` INT8 values; else NULL.
    pub int8Rows: *const i8,
    /// With `keepInt8`: per-row scales; else NULL.
    pub scales: *const f32,
    /// The call's tag (its lowest source's).
    pub tag: u64,
    /// Attention ranks (entries of the source arrays).
    pub numSources: usize,
    /// Per source: its rank.
    pub sourceRanks: *const u32,
    /// Per source: tokens received from it.
    pub sourceCounts: *const usize,
    /// Per source: index of its first token.
    pub sourceFirstToken: *const usize,
    /// Per source: its tag.
    pub sourceTags: *const u64,
}

/// `xcclTokenBatchInfo_t`.
#[repr(C)]
pub struct xcclTokenBatchInfo_t {
    /// `sizeof(xcclTokenBatchInfo_t)`, set by the caller (config version 4 and later).
    pub size: usize,
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
    /// With `keepInt8`: `[numTokens, hidden]` INT8 values; else NULL.
    pub int8Rows: *const i8,
    /// With `keepInt8`: per-token scales; else NULL.
    pub scales: *const f32,
    /// The call's tag (its lowest source's); 0 in an arrival callback.
    pub tag: u64,
    /// Attention ranks (entries of the source arrays); 0 in an arrival callback.
    pub numSources: usize,
    /// Per source: its rank.
    pub sourceRanks: *const u32,
    /// Per source: tokens received from it.
    pub sourceCounts: *const usize,
    /// Per source: index of its first token.
    pub sourceFirstToken: *const usize,
    /// Per source: its tag.
    pub sourceTags: *const u64,
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
        Ok(Ok(())) => {
            set_thread_error("");
            return XCCL_SUCCESS;
        }
        Ok(Err(fail)) => fail,
        Err(_) => Fail::new(XCCL_INTERNAL_ERROR, "internal error (panic); see stderr"),
    };
    set_thread_error(&format!("{name}: {}", fail.msg));
    fail.code
}

/// Refuses to free `what` (of call `epoch`) while its communicator `owner` can still answer
/// it: registered, not aborted, not poisoned. Freeing it then would leave this communicator
/// stuck on the unanswered call and its peers waiting for a reply that never comes; once the
/// communicator is aborted, poisoned or destroyed, freeing is allowed.
fn refuse_if_answerable(owner: usize, what: &str, epoch: u64, instead: &str) -> Result<(), Fail> {
    let Some(c) = lock(&COMMS).get(&owner).cloned() else {
        return Ok(());
    };
    if c.aborted.load(Ordering::SeqCst) || lock(&c.first_error).is_some() {
        return Ok(());
    }
    // Shrunk into a new communicator: this one answers nothing any more. (`try_lock`: a call
    // in progress holds the lock, and the communicator is then certainly not shrunk.)
    if let Ok(inner) = c.comm.try_lock() {
        if inner.is_none() {
            return Ok(());
        }
    }
    Err(Fail::usage(format!(
        "{what} of call epoch {epoch} on rank {} is still live: {instead}, or abort the \
         communicator first (xcclCommAbort); it stays valid",
        c.rank
    )))
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
        not_in_callback(id)?;
        if c.aborted.load(Ordering::Acquire) {
            return Err(Fail::new(
                XCCL_ABORTED,
                format!(
                    "rank {}: the communicator was aborted by xcclCommAbort",
                    c.rank
                ),
            ));
        }
        let mut guard = lock_comm(&c)?;
        if c.destroyed.load(Ordering::Acquire) {
            return Err(Fail::usage(destroyed_during(id)));
        }
        let Some(inner) = guard.as_mut() else {
            return Err(Fail::usage(
                "this communicator was shrunk into a new one (xcclCommShrink): use that one, \
                 and destroy this one",
            ));
        };
        let mut res = f(id, &c, inner);
        if c.destroyed.load(Ordering::Acquire) {
            // Interrupted (or finished) while xcclCommDestroy waited for it: whatever it
            // failed with, the communicator is gone.
            res =
                res.map_err(|fail| Fail::usage(format!("{} ({})", destroyed_during(id), fail.msg)));
        }
        if let Some(e) = inner.poisoned() {
            let code = poisoned_code(code_of(e));
            lock(&c.first_error).get_or_insert_with(|| (code, e.to_string()));
            // The library's error on a poisoned communicator is the poisoning (or it again).
            if let Err(fail) = &mut res {
                if fail.from_error {
                    fail.code = poisoned_code(fail.code);
                }
            }
        }
        res
    }));
    let fail = match outcome {
        Ok(Ok(())) => {
            set_thread_error("");
            return XCCL_SUCCESS;
        }
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
    set_thread_error(&format!("{name}: {}", fail.msg));
    fail.code
}

/// Refuses a call on communicator `id` from one of its own arrival callbacks: the receive that
/// runs the callback holds the communicator, so the call would deadlock on its lock.
fn not_in_callback(id: usize) -> Result<(), Fail> {
    if IN_CALLBACK.with(|cb| cb.get()) == id {
        return Err(Fail::usage(
            "called from an arrival callback of this communicator (the receive is still running)",
        ));
    }
    Ok(())
}

/// Locks `c`'s communicator, refusing one whose lock a panic poisoned (an internal error: the
/// job was aborted then).
fn lock_comm(c: &Comm) -> Result<std::sync::MutexGuard<'_, Option<Communicator>>, Fail> {
    c.comm.lock().map_err(|_| {
        Fail::new(
            XCCL_INTERNAL_ERROR,
            "the communicator was poisoned by an internal error (panic) in an earlier call",
        )
    })
}

/// The message of a call that `xcclCommDestroy` (on another thread) ended or refused.
fn destroyed_during(id: usize) -> String {
    format!(
        "comm {id:#x} was destroyed by xcclCommDestroy on another thread during this call \
         (a wait in progress stops within about 40 ms; nothing is used after it returns)"
    )
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

#[cfg(test)]
mod tests;
