//! The MoE calls of `xccl.h`: A2E send and E2A receive on attention ranks, A2E receive and
//! E2A send on expert ranks, in the copy and the zero-copy (registered buffer) forms.

use std::ffi::{c_int, c_void};

use super::*;
use crate::{A2eHandle, DType, ExpertBatch, TokenBatch};

pub(super) fn check_tokens(c: &Comm, num_tokens: c_int) -> Result<usize, Fail> {
    if num_tokens < 0 || num_tokens as usize > c.max_tokens {
        return Err(Fail::invalid(format!(
            "numTokens = {num_tokens} is outside 0..={} (config.maxTokensPerRank)",
            c.max_tokens
        )));
    }
    Ok(num_tokens as usize)
}

/// Registers `h`. The C ABI refuses to free a live handle on a healthy communicator
/// (`xcclA2EHandleFree`) and releases a destroyed communicator's handles quietly, so the handle
/// is detached: the registry dropping it never aborts the job.
pub(super) fn new_handle(comm: usize, h: A2eHandle) -> *mut xcclA2EHandle {
    h.detach();
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
        check_ptr(handle, "handle")?;
        let t = check_tokens(c, numTokens)?;
        // SAFETY: the caller's contract (see the function's docs).
        let (x, idx, w) = unsafe {
            (
                host_slice(c, x.cast::<u8>(), t * c.row_bytes, "x")?,
                host_slice(c, topkIdx, t * c.topk, "topkIdx")?,
                host_slice(c, topkWeights, t * c.topk, "topkWeights")?,
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
        check_ptr(input, "input")?;
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
        check_ptr(handle, "handle")?;
        let t = check_tokens(c, numTokens)?;
        // SAFETY: the caller's contract (see the function's docs).
        let (idx, w) = unsafe {
            (
                host_slice(c, topkIdx, t * c.topk, "topkIdx")?,
                host_slice(c, topkWeights, t * c.topk, "topkWeights")?,
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
        with_handle(handle, |h| {
            // SAFETY: the caller's contract (see the function's docs).
            let out = unsafe { host_bytes_mut(c, out, h.num_tokens() * c.row_bytes, "out")? };
            inner.e2a_recv_bytes(h, out).map_err(Fail::from)
        })
    })
}

/// Runs `f` with the live A2E handle `handle` taken out of the registry: freed when `f`
/// succeeds (its E2A was received), put back when it fails (a retryable failure leaves the
/// handle valid; after a poisoning one it can be freed).
pub(super) fn with_handle(
    handle: *mut xcclA2EHandle,
    f: impl FnOnce(&A2eHandle) -> Result<(), Fail>,
) -> Result<(), Fail> {
    check_ptr(handle, "handle")?;
    let hid = handle as usize;
    let (owner, h) = lock(&HANDLES).remove(&hid).ok_or_else(|| {
        Fail::usage(format!(
            "handle {hid:#x} is not a live A2E handle (already received or freed)"
        ))
    })?;
    let res = f(&h);
    if res.is_err() {
        lock(&HANDLES).insert(hid, (owner, h));
    }
    res
}

/// `xcclA2EHandleFree`: drops a handle without its E2A (after a failure).
#[no_mangle]
pub extern "C" fn xcclA2EHandleFree(handle: *mut xcclA2EHandle) -> xcclResult_t {
    guard("xcclA2EHandleFree", || {
        check_ptr(handle, "handle")?;
        free_live(
            &HANDLES,
            handle as usize,
            |(owner, h)| (*owner, h.epoch()),
            Live {
                what: "the A2E handle",
                gone: "handle is not a live A2E handle (already received or freed)",
                instead: "receive its E2A (xcclE2ARecv)",
            },
        )
    })
}

/// What a free call says of the kind of object it frees.
struct Live {
    /// The object, as messages name it ("the expert batch").
    what: &'static str,
    /// The message for a key that names no live object of this kind.
    gone: &'static str,
    /// What to do instead of freeing it while its communicator can still answer it.
    instead: &'static str,
}

/// Frees the live object `key` of `registry`: refused (and kept) while its communicator is
/// healthy and its call unanswered (see `refuse_if_answerable`), else removed and dropped.
/// `owner_epoch` gives the object's communicator and epoch.
fn free_live<T>(
    registry: &std::sync::Mutex<std::collections::BTreeMap<usize, T>>,
    key: usize,
    owner_epoch: impl Fn(&T) -> (usize, u64),
    live: Live,
) -> Result<(), Fail> {
    let gone = || Fail::usage(live.gone);
    let (owner, epoch) = lock(registry).get(&key).map(owner_epoch).ok_or_else(gone)?;
    refuse_if_answerable(owner, live.what, epoch, live.instead)?;
    lock(registry).remove(&key).map(drop).ok_or_else(gone)
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
    with_comm("xcclA2ERecv", comm, |id, c, inner| {
        check_ptr(batch, "batch")?;
        let mut b = lock(&c.spare_expert).pop().unwrap_or_default();
        inner.a2e_recv(&mut b)?;
        let bid = register_expert_batch(id, b, false);
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(batch, bid as *mut xcclExpertBatch, "batch") }
    })
}

/// Registers a received expert batch of communicator `id` as a live C object (`on_device`:
/// its rows are in the caller's device buffer, and its info says `rows` NULL); returns its
/// id. Its Rust drop no longer aborts the job: freeing a live batch is refused instead
/// (`xcclExpertBatchFree`).
pub(super) fn register_expert_batch(id: usize, b: ExpertBatch, on_device: bool) -> usize {
    let n = b.num_local_experts();
    let counts: Vec<usize> = (0..n).map(|j| b.expert_rows(j).len()).collect();
    let mut offsets = vec![0usize];
    offsets.extend((0..n).map(|j| b.expert_rows(j).end));
    b.recv.answered();
    let bid = next_id();
    let sources = Sources::of(b.sources());
    lock(&EXPERT_BATCHES).insert(
        bid,
        ExpertBatchObj {
            comm: id,
            batch: b,
            counts,
            offsets,
            sources,
            on_device,
        },
    );
    bid
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
        check_ptr(batch, "batch")?;
        let map = lock(&EXPERT_BATCHES);
        let o = map
            .get(&(batch as usize))
            .ok_or_else(|| Fail::usage("batch is not a live expert batch (replied to or freed)"))?;
        let version = lock(&COMMS).get(&o.comm).map_or(0, |c| c.version);
        let b = &o.batch;
        let int8 = b.int8_rows();
        let src = &o.sources;
        let i = xcclExpertBatchInfo_t {
            size: std::mem::size_of::<xcclExpertBatchInfo_t>(),
            numRows: b.num_rows(),
            numTokens: b.num_tokens(),
            numLocalExperts: o.counts.len(),
            rows: if int8.is_some() || o.on_device {
                std::ptr::null()
            } else {
                b.row_bytes().as_ptr().cast()
            },
            expertCounts: o.counts.as_ptr(),
            expertOffsets: o.offsets.as_ptr(),
            srcRank: b.src_rank().as_ptr(),
            srcToken: b.src_token().as_ptr(),
            weights: b.weight().as_ptr(),
            int8Rows: int8.map_or(std::ptr::null(), |(q, _)| q.as_ptr()),
            scales: int8.map_or(std::ptr::null(), |(_, s)| s.as_ptr()),
            tag: b.tag(),
            numSources: src.ranks.len(),
            sourceRanks: src.ranks.as_ptr(),
            sourceCounts: src.counts.as_ptr(),
            sourceFirstToken: src.first.as_ptr(),
            sourceTags: src.tags.as_ptr(),
        };
        let legacy = legacy_info_len(version, 9);
        // SAFETY: the caller's contract: its layout of the struct (see the function's docs).
        unsafe { ext::write_sized(info, &i, version, legacy, "info") }
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
        with_expert_batch(c, batch, |b| {
            // SAFETY: the caller's contract (see the function's docs).
            let out = unsafe {
                host_slice(
                    c,
                    expertOut.cast::<u8>(),
                    b.num_rows() * c.row_bytes,
                    "expertOut",
                )?
            };
            let mode = inner.config().mode;
            match c.dtype {
                DType::F32 => inner.e2a_send_with::<f32>(b, bytemuck_cast(out)?, mode),
                DType::F16 => inner.e2a_send_with::<half::f16>(b, bytemuck_cast(out)?, mode),
                DType::BF16 => inner.e2a_send_with::<half::bf16>(b, bytemuck_cast(out)?, mode),
            }
            .map_err(Fail::from)
        })
    })
}

/// Runs `f` with the live expert batch `batch` taken out of the registry; hands its buffers
/// to `c`'s next receive when `f` succeeds (the reply went out), puts it back when it fails (a
/// retryable failure leaves the batch valid).
pub(super) fn with_expert_batch(
    c: &Comm,
    batch: *mut xcclExpertBatch,
    f: impl FnOnce(&ExpertBatch) -> Result<(), Fail>,
) -> Result<(), Fail> {
    check_ptr(batch, "batch")?;
    let bid = batch as usize;
    let o = lock(&EXPERT_BATCHES).remove(&bid).ok_or_else(|| {
        Fail::usage(format!(
            "batch {bid:#x} is not a live expert batch (replied to or freed)"
        ))
    })?;
    let res = f(&o.batch);
    match res {
        Ok(()) => recycle(&c.spare_expert, o.batch),
        Err(_) => {
            lock(&EXPERT_BATCHES).insert(bid, o);
        }
    }
    res
}

fn bytemuck_cast<T: bytemuck::Pod>(b: &[u8]) -> Result<&[T], Fail> {
    if b.is_empty() {
        return Ok(&[]);
    }
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
        check_ptr(batch, "batch")?;
        free_live(
            &EXPERT_BATCHES,
            batch as usize,
            |b| (b.comm, b.batch.epoch()),
            Live {
                what: "the expert batch",
                gone: "batch is not a live expert batch (replied to or freed)",
                instead: "reply to it (xcclE2ASend)",
            },
        )
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
    with_comm("xcclA2ERecvTokens", comm, |id, c, inner| {
        check_ptr(batch, "batch")?;
        let mut b = lock(&c.spare_token).pop().unwrap_or_default();
        inner.a2e_recv_tokens(&mut b, &mut |_, _| {})?;
        let bid = register_token_batch(id, b, false);
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(batch, bid as *mut xcclTokenBatch, "batch") }
    })
}

/// Registers a received token batch of communicator `id` as a live C object (`on_device`: its
/// rows are in the caller's device buffer, and its info says `rows` NULL); returns its id.
/// Its Rust drop no longer aborts the job: freeing a live batch is refused instead
/// (`xcclTokenBatchFree`).
pub(super) fn register_token_batch(id: usize, b: TokenBatch, on_device: bool) -> usize {
    b.recv.answered();
    let bid = next_id();
    let sources = Sources::of(b.sources());
    lock(&TOKEN_BATCHES).insert(
        bid,
        TokenBatchObj {
            comm: id,
            batch: b,
            sources,
            on_device,
        },
    );
    bid
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
        check_ptr(batch, "batch")?;
        let map = lock(&TOKEN_BATCHES);
        let o = map
            .get(&(batch as usize))
            .ok_or_else(|| Fail::usage("batch is not a live token batch (replied to or freed)"))?;
        let version = lock(&COMMS).get(&o.comm).map_or(0, |c| c.version);
        let i = token_info(&o.batch, Some(&o.sources), o.on_device);
        let legacy = legacy_info_len(version, 8);
        // SAFETY: the caller's contract: its layout of the struct (see the function's docs).
        unsafe { ext::write_sized(info, &i, version, legacy, "info") }
    })
}

/// What `b` holds, as pointers into it (and into `sources`: none in an arrival callback);
/// `rows` is NULL when they are kept as INT8 or are `on_device` (in the caller's buffer).
fn token_info(b: &TokenBatch, sources: Option<&Sources>, on_device: bool) -> xcclTokenBatchInfo_t {
    let int8 = b.int8_rows();
    let empty = Sources::default();
    let src = sources.unwrap_or(&empty);
    let (tag, n) = match sources {
        Some(s) => (b.tag(), s.ranks.len()),
        None => (0, 0),
    };
    let ptr = |n: usize, p: *const u8| if n == 0 { std::ptr::null() } else { p };
    xcclTokenBatchInfo_t {
        size: std::mem::size_of::<xcclTokenBatchInfo_t>(),
        tag,
        numSources: n,
        sourceRanks: ptr(n, src.ranks.as_ptr().cast()).cast(),
        sourceCounts: ptr(n, src.counts.as_ptr().cast()).cast(),
        sourceFirstToken: ptr(n, src.first.as_ptr().cast()).cast(),
        sourceTags: ptr(n, src.tags.as_ptr().cast()).cast(),
        numTokens: b.num_tokens(),
        topk: b.topk,
        rows: if int8.is_some() || on_device {
            std::ptr::null()
        } else {
            b.row_bytes().as_ptr().cast()
        },
        int8Rows: int8.map_or(std::ptr::null(), |(q, _)| q.as_ptr()),
        scales: int8.map_or(std::ptr::null(), |(_, s)| s.as_ptr()),
        srcRank: b.src_rank().as_ptr(),
        srcToken: b.src_token().as_ptr(),
        expertCount: b.expert_count.as_ptr(),
        localExperts: b.local_expert.as_ptr(),
        weights: b.weight.as_ptr(),
    }
}

/// `xcclArrivalFn`: called by [`xcclA2ERecvTokensWithCallback`] when one source's tokens have
/// landed.
pub type xcclArrivalFn = Option<
    unsafe extern "C" fn(
        userData: *mut c_void,
        arrived: *const xcclTokenBatchInfo_t,
        firstToken: usize,
        numTokens: usize,
    ),
>;

/// Marks this thread as inside an arrival callback of communicator `id` until dropped, so a
/// call on that communicator from the callback fails instead of deadlocking on its lock.
struct InCallback(usize);

impl InCallback {
    fn enter(id: usize) -> Self {
        IN_CALLBACK.with(|c| InCallback(c.replace(id)))
    }
}

impl Drop for InCallback {
    fn drop(&mut self) {
        IN_CALLBACK.with(|c| c.set(self.0));
    }
}

/// `xcclA2ERecvTokensWithCallback`: token-major receive calling `onArrival` as each source
/// lands.
///
/// # Safety
/// `batch`, when non-NULL, is valid for a write of a pointer; `onArrival` is a function that
/// follows the header's rules (it does not unwind) and may be called with `userData`.
#[no_mangle]
pub unsafe extern "C" fn xcclA2ERecvTokensWithCallback(
    comm: *mut xcclComm,
    batch: *mut *mut xcclTokenBatch,
    onArrival: xcclArrivalFn,
    userData: *mut c_void,
) -> xcclResult_t {
    with_comm("xcclA2ERecvTokensWithCallback", comm, |id, c, inner| {
        check_ptr(batch, "batch")?;
        if onArrival.is_none() {
            return Err(Fail::invalid("onArrival is NULL"));
        }
        let mut b = lock(&c.spare_token).pop().unwrap_or_default();
        // SAFETY: the caller's contract (see the function's docs).
        let mut arrival = unsafe { arrival_callback(id, c, onArrival, userData, false) };
        inner.a2e_recv_tokens(&mut b, &mut arrival)?;
        let bid = register_token_batch(id, b, false);
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(batch, bid as *mut xcclTokenBatch, "batch") }
    })
}

/// The `on_arrival` of a token-major receive of communicator `id` (`c`) that calls the C
/// callback `on_arrival` with `user_data` and the arrived tokens' info (`rows` NULL when they
/// are `on_device`); nothing when `on_arrival` is NULL.
///
/// # Safety
/// `on_arrival`, when not NULL, follows the header's rules (it does not unwind) and may be
/// called with `user_data` during the receive.
pub(super) unsafe fn arrival_callback(
    id: usize,
    c: &Comm,
    on_arrival: xcclArrivalFn,
    user_data: *mut c_void,
    on_device: bool,
) -> impl FnMut(&TokenBatch, std::ops::Range<usize>) {
    let legacy = c.version < 4;
    move |tb, range| {
        let Some(on_arrival) = on_arrival else {
            return;
        };
        let info = token_info(tb, None, on_device);
        // A caller of config version 1 to 3 reads its layout: the fields after `size`.
        let at: *const xcclTokenBatchInfo_t = if legacy {
            std::ptr::addr_of!(info.numTokens).cast()
        } else {
            &info
        };
        let _inside = InCallback::enter(id);
        // SAFETY: the caller's contract: `on_arrival` may be called with `user_data`; `at`
        // points into `info`, which points into `tb`, untouched while the callback runs.
        unsafe { on_arrival(user_data, at, range.start, range.len()) };
    }
}

/// Runs `f` with the live token batch `batch` taken out of the registry; puts it back when
/// `f` fails (a retryable failure leaves the batch valid) or when `keep` says so, else hands
/// its buffers to `c`'s next receive.
pub(super) fn with_token_batch(
    c: &Comm,
    batch: *mut xcclTokenBatch,
    keep: bool,
    f: impl FnOnce(&TokenBatch) -> Result<(), Fail>,
) -> Result<(), Fail> {
    check_ptr(batch, "batch")?;
    let bid = batch as usize;
    let o = lock(&TOKEN_BATCHES).remove(&bid).ok_or_else(|| {
        Fail::usage(format!(
            "batch {bid:#x} is not a live token batch (replied to or freed)"
        ))
    })?;
    let res = f(&o.batch);
    if keep || res.is_err() {
        lock(&TOKEN_BATCHES).insert(bid, o);
    } else {
        recycle(&c.spare_token, o.batch);
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
        with_token_batch(c, batch, false, |b| {
            // SAFETY: the caller's contract (see the function's docs).
            let r = unsafe {
                host_slice(
                    c,
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
        check_ptr(output, "output")?;
        with_token_batch(c, batch, true, |b| {
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
    with_comm("xcclE2ASendOutput", comm, |_, c, inner| {
        with_token_batch(c, batch, false, |b| Ok(inner.e2a_send_output(b)?))
    })
}

/// `xcclTokenBatchFree`: drops a batch without replying (after a failure).
#[no_mangle]
pub extern "C" fn xcclTokenBatchFree(batch: *mut xcclTokenBatch) -> xcclResult_t {
    guard("xcclTokenBatchFree", || {
        check_ptr(batch, "batch")?;
        free_live(
            &TOKEN_BATCHES,
            batch as usize,
            |b| (b.comm, b.batch.epoch()),
            Live {
                what: "the token batch",
                gone: "batch is not a live token batch (replied to or freed)",
                instead: "reply to it (xcclE2ASendTokens or xcclE2ASendOutput)",
            },
        )
    })
}
