//! The calls of `xccl.h` that are not MoE data movement: errors, version, unique id, init,
//! destroy, abort, async error and the queries.

use std::ffi::{c_char, c_int, CStr};
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::config::{self, xcclConfig_t};
use super::*;
use crate::bootstrap::{Exchange, TcpBootstrap, UniqueId};
use crate::fabric::shm::ShmFabric;
use crate::fabric::Fabric;
use crate::{Communicator, Role};

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

fn build(exchange: Arc<dyn Exchange>, parsed: config::Parsed) -> Result<Comm, Fail> {
    let config::Parsed { topo, cfg } = parsed;
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
        recv_rows: cfg.recv_rows_per_source(),
        topk: cfg.topk,
        row_bytes: cfg.hidden * cfg.dtype.size(),
        dtype: cfg.dtype,
        comm: Mutex::new(comm),
        fabric: shm,
        aborted: AtomicBool::new(false),
        first_error: Mutex::new(None),
        last_error: Mutex::new(String::new()),
        spare_expert: Mutex::new(Vec::new()),
        spare_token: Mutex::new(Vec::new()),
    })
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
