//! The calls of `xccl.h` that are not MoE data movement: errors, version, unique id, init,
//! destroy, abort, async error and the queries.

use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::config::{self, xcclConfig_t};
use super::*;
use crate::bootstrap::{Exchange, TcpBootstrap, UniqueId};
use crate::comm::shrink::Rebuild;
use crate::comm::Origin;
use crate::fabric::ascend::AscendFabric;
use crate::fabric::ofi::OfiFabric;
use crate::fabric::shm::ShmFabric;
use crate::fabric::Fabric;
use crate::{Communicator, MoeConfig, Role, Topology};

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

/// `xcclGetLastError`: the message of this thread's last xccl call ("" when it succeeded).
/// `comm` is not used (kept for the NCCL shape). The string stays valid until this thread's
/// next xccl call.
#[no_mangle]
pub extern "C" fn xcclGetLastError(comm: *mut xcclComm) -> *const c_char {
    let _ = comm;
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
        check_ptr(uniqueId, "uniqueId")?;
        let id = UniqueId::new()?;
        let mut out = xcclUniqueId { internal: [0; 128] };
        for (o, b) in out.internal.iter_mut().zip(id.to_bytes()) {
            *o = b as c_char;
        }
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(uniqueId, out, "uniqueId") }
    })
}

/// Builds this rank's communicator over `exchange` on the fabric `spec` asks for, its fabric
/// shared with the C side (for `xcclCommAbort`), through the init agreement
/// ([`Communicator::init_agreed`]). A shrink builds the next one the same way.
pub(super) fn build_comm(
    exchange: Arc<dyn Exchange>,
    topo: Arc<Topology>,
    cfg: MoeConfig,
    spec: config::FabricSpec,
    latest: Arc<Mutex<Option<Arc<dyn Fabric>>>>,
) -> crate::Result<Communicator> {
    let rebuild: Arc<Rebuild> = {
        let (spec, latest) = (spec.clone(), latest.clone());
        Arc::new(move |ex, topo, cfg| build_comm(ex, topo, cfg, spec.clone(), latest.clone()))
    };
    let origin = Origin::Built(exchange.clone(), rebuild);
    let prefix = Communicator::cuda_host_prefix(&topo, &cfg, exchange.rank());
    let comm = Communicator::init_agreed(&exchange, topo, cfg, origin, &|len, slots| {
        let fabric: Arc<dyn Fabric> = match &spec {
            config::FabricSpec::Shm => Arc::new(ShmFabric::new(exchange.clone(), len, slots)?),
            config::FabricSpec::Ofi(opts) => {
                Arc::new(OfiFabric::with_options(exchange.clone(), len, slots, opts)?)
            }
            config::FabricSpec::Ascend(device) => {
                Arc::new(AscendFabric::new(exchange.clone(), len, slots, *device)?)
            }
            config::FabricSpec::Cuda(device) => Arc::new(Communicator::cuda_fabric(
                &exchange,
                (len, prefix),
                slots,
                *device,
            )?),
        };
        *lock(&latest) = Some(fabric.clone());
        Ok(Box::new(SharedFabric(fabric)))
    })?;
    match spec {
        config::FabricSpec::Cuda(_) => comm.build_data_plane(&*exchange),
        _ => Ok(comm),
    }
}

/// Joins the job: parses `config`, rendezvous through `connect`, gathers the roles when the
/// config sets one, builds the topology and the communicator. A rank whose config is invalid
/// still joins the rendezvous (when it can) to tell every rank why, so no peer waits for it
/// until its timeout.
///
/// # Safety
/// As [`config::parse`].
unsafe fn init(
    config: *const xcclConfig_t,
    nranks: usize,
    connect: &dyn Fn(Duration) -> crate::Result<Arc<dyn Exchange>>,
) -> Result<Comm, Fail> {
    // SAFETY: the caller's contract.
    let parsed = match unsafe { config::parse(config, nranks) } {
        Ok(p) => p,
        Err(fail) => {
            let t = Duration::from_secs(10);
            if let Ok(ex) = connect(t) {
                crate::comm::agree::report_failure(&*ex, &format!("config: {}", fail.msg), t);
            }
            return Err(fail);
        }
    };
    let timeout = parsed.cfg.timeout.max(Duration::from_secs(10));
    let exchange = connect(timeout)?;
    let roles = match parsed.role {
        Some(mine) => crate::bootstrap::gather_roles(&*exchange, mine, timeout)?,
        None => parsed.default_roles(),
    };
    let topo = match parsed.topology(roles) {
        Ok(t) => t,
        Err(fail) => {
            let reason = format!("config: {}", fail.msg);
            crate::comm::agree::report_failure(&*exchange, &reason, timeout);
            return Err(fail);
        }
    };
    let latest = Arc::new(Mutex::new(None));
    let comm = build_comm(
        exchange,
        Arc::new(topo),
        parsed.cfg.clone(),
        parsed.fabric.clone(),
        latest.clone(),
    )?;
    let fabric = lock(&latest)
        .take()
        .ok_or_else(|| Fail::new(XCCL_INTERNAL_ERROR, "init built no fabric"))?;
    Ok(Comm::new(comm, fabric, parsed.version, latest))
}

pub(super) fn register(c: Comm) -> *mut xcclComm {
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
        check_ptr(comm, "comm")?;
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
        if config.is_null() {
            return Err(Fail::invalid(
                "config is NULL (start from XCCL_CONFIG_INITIALIZER)",
            ));
        }
        let bytes: Vec<u8> = commId.internal.iter().map(|&b| b as u8).collect();
        // The id is read when init connects: a bad config is reported as such first.
        let connect = |timeout| -> crate::Result<Arc<dyn Exchange>> {
            let id = UniqueId::from_bytes(&bytes).map_err(|e| match e {
                Error::Bootstrap(m) => Error::Bootstrap(format!("commId: {m}")),
                e => e,
            })?;
            let boot = TcpBootstrap::connect(&id, rank as usize, nranks as usize, timeout)?;
            Ok(Arc::new(boot))
        };
        // SAFETY: the caller's contract (see the function's docs).
        let c = unsafe { init(config, nranks as usize, &connect)? };
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
        check_ptr(comm, "comm")?;
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
        let connect =
            |timeout| -> crate::Result<Arc<dyn Exchange>> { Ok(Arc::new(env.connect(timeout)?)) };
        // SAFETY: the caller's contract (see the function's docs).
        let c = unsafe { init(config, env.size, &connect)? };
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(comm, register(c), "comm") }
    })
}

/// `xcclCommDestroy`: releases `comm` and every handle and batch still open on it. A call in
/// progress on another thread is interrupted (its next wait stops, within about 40 ms) and
/// this returns only once that call has returned, so nothing of the caller's (buffers, the
/// handle) is touched after it.
#[no_mangle]
pub extern "C" fn xcclCommDestroy(comm: *mut xcclComm) -> xcclResult_t {
    guard("xcclCommDestroy", || {
        let (id, _) = lookup(comm)?;
        if IN_CALLBACK.with(|cb| cb.get()) == id {
            return Err(Fail::usage(
                "called from an arrival callback of this communicator (the receive is still \
                 running): destroy it after the receive returns; it stays valid",
            ));
        }
        // 1. No later call finds it (a racing second destroy is refused here).
        let c = lock(&COMMS).remove(&id).ok_or_else(|| {
            Fail::usage(format!(
                "comm {id:#x} is already destroyed (xcclCommDestroy)"
            ))
        })?;
        // 2. A call in progress stops at its next wait; calls queued for the lock are refused.
        c.destroyed.store(true, Ordering::Release);
        // 3. Wait for the call in progress to return (a panic inside one poisoned the lock:
        //    the communicator is still taken and dropped).
        let inner = c.comm.lock().unwrap_or_else(|e| e.into_inner()).take();
        // 4. Its handles and batches (a retryable failure of the interrupted call put its
        //    handle or batch back before returning), then the communicator: this rank leaves
        //    the job (its peers see the departure mark).
        lock(&HANDLES).retain(|_, (owner, _)| *owner != id);
        lock(&EXPERT_BATCHES).retain(|_, b| b.comm != id);
        lock(&TOKEN_BATCHES).retain(|_, b| b.comm != id);
        drop(inner);
        // The fabric goes with the last reference (this one, unless a query on another thread
        // still holds it for a moment).
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
                if let Some(inner) = inner.as_mut() {
                    inner.abort(&reason);
                }
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
    let mut message = None;
    let code = guard("xcclCommGetAsyncError", || {
        let (_, c) = lookup(comm)?;
        let found = lock(&c.first_error).clone().or_else(|| {
            if let Some(notice) = c.fabric.aborted() {
                // A death report is that death (the code of a failed peer), any other abort
                // an abort.
                let e = notice.to_error(c.fabric.world_size());
                return Some((code_of(&e), e.to_string()));
            }
            // A dead peer (not one that left cleanly), then a peer that left the job while
            // an open call of this rank still needs it. The second look needs the
            // communicator: when a call holds it, that call itself fails on such a peer within
            // milliseconds (and poisons), so skipping the look here loses nothing.
            let gone = c.fabric.check_peers().err().or_else(|| {
                let inner = c.comm.try_lock().ok()?;
                inner.as_ref()?.check_open_calls().err()
            });
            gone.map(|e| (code_of(&e), e.to_string()))
        });
        let code = match found {
            Some((code, msg)) => {
                message = Some(format!("xcclCommGetAsyncError: async error: {msg}"));
                code
            }
            None => XCCL_SUCCESS,
        };
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(asyncError, code, "asyncError") }
    });
    // A successful call that found an async error leaves its message (the one exception to
    // "a success clears it").
    if let (XCCL_SUCCESS, Some(msg)) = (code, message) {
        set_thread_error(&msg);
    }
    code
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
                let t = c.num_attention * c.recv_rows;
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
