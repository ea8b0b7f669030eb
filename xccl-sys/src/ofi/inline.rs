//! libfabric's `static inline` calls, rewritten over the ops tables.
//!
//! In C these are one-line wrappers that call through a function pointer of the object's ops
//! table (`ep->rma->write(...)`); they have no symbol to bind, so each is rewritten here with the
//! same name and arguments. An ops table entry that a provider left NULL returns `-FI_ENOSYS`
//! instead of crashing.
//!
//! Every function is `unsafe`: the caller passes live libfabric objects and buffers that the
//! provider may access as the libfabric man pages describe.

use std::ffi::{c_char, c_int, c_void};

use super::bindings::*;

/// `-FI_ENOSYS`, convertible to both `c_int` and `ssize_t` returns.
const NEG_ENOSYS: i8 = -(FI_ENOSYS as i8);

macro_rules! op {
    ($f:expr) => {
        match $f {
            Some(f) => f,
            None => return NEG_ENOSYS.into(),
        }
    };
}

/// `fi_allocinfo`: a zeroed `fi_info` with all attribute structs allocated (`fi_dupinfo(NULL)`).
///
/// # Safety
/// `dupinfo` must be libfabric's `fi_dupinfo`; free the result with `fi_freeinfo`.
pub unsafe fn fi_allocinfo(dupinfo: super::DupinfoFn) -> *mut fi_info {
    // SAFETY: fi_dupinfo(NULL) is documented to allocate a fresh, zeroed fi_info.
    unsafe { dupinfo(std::ptr::null()) }
}

/// `fi_close`: closes any libfabric object.
///
/// # Safety
/// `fid` must be a live libfabric object; it is freed by the call and must not be used after.
pub unsafe fn fi_close(fid: *mut fid) -> c_int {
    // SAFETY: `fid` is live (caller), so its ops table pointer is valid.
    let close = unsafe { op!((*(*fid).ops).close) };
    // SAFETY: the provider's close for this very object.
    unsafe { close(fid) }
}

/// `fi_control`.
///
/// # Safety
/// `fid` must be a live libfabric object and `arg` what `command` expects.
pub unsafe fn fi_control(fid: *mut fid, command: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `fid` is live (caller).
    let control = unsafe { op!((*(*fid).ops).control) };
    // SAFETY: caller guarantees `arg` matches `command`.
    unsafe { control(fid, command, arg) }
}

/// `fi_domain`: opens a domain of `fabric` described by `info`.
///
/// # Safety
/// `fabric` live, `info` a valid `fi_info` from `fi_getinfo`, `domain` writable.
pub unsafe fn fi_domain(
    fabric: *mut fid_fabric,
    info: *mut fi_info,
    domain: *mut *mut fid_domain,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `fabric` is live (caller), so `ops` points at its ops table.
    let f = unsafe { op!((*(*fabric).ops).domain) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(fabric, info, domain, context) }
}

/// `fi_endpoint`: opens an endpoint on `domain`.
///
/// # Safety
/// `domain` live, `info` a valid `fi_info`, `ep` writable.
pub unsafe fn fi_endpoint(
    domain: *mut fid_domain,
    info: *mut fi_info,
    ep: *mut *mut fid_ep,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `domain` is live (caller).
    let f = unsafe { op!((*(*domain).ops).endpoint) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(domain, info, ep, context) }
}

/// `fi_cq_open`.
///
/// # Safety
/// `domain` live, `attr` valid, `cq` writable.
pub unsafe fn fi_cq_open(
    domain: *mut fid_domain,
    attr: *mut fi_cq_attr,
    cq: *mut *mut fid_cq,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `domain` is live (caller).
    let f = unsafe { op!((*(*domain).ops).cq_open) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(domain, attr, cq, context) }
}

/// `fi_av_open`.
///
/// # Safety
/// `domain` live, `attr` valid, `av` writable.
pub unsafe fn fi_av_open(
    domain: *mut fid_domain,
    attr: *mut fi_av_attr,
    av: *mut *mut fid_av,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `domain` is live (caller).
    let f = unsafe { op!((*(*domain).ops).av_open) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(domain, attr, av, context) }
}

/// `fi_ep_bind`: binds a CQ, AV (or other object) to an endpoint.
///
/// # Safety
/// `ep` and `bfid` live libfabric objects of the same domain.
pub unsafe fn fi_ep_bind(ep: *mut fid_ep, bfid: *mut fid, flags: u64) -> c_int {
    // SAFETY: `ep` is live (caller); `fid` is its first member.
    let (f, this) = unsafe { (op!((*(*ep).fid.ops).bind), &raw mut (*ep).fid) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(this, bfid, flags) }
}

/// `fi_enable`: enables an endpoint once its CQ and AV are bound.
///
/// # Safety
/// `ep` live.
pub unsafe fn fi_enable(ep: *mut fid_ep) -> c_int {
    // SAFETY: `ep` is live (caller); FI_ENABLE takes no argument.
    unsafe { fi_control(&raw mut (*ep).fid, FI_ENABLE as c_int, std::ptr::null_mut()) }
}

/// `fi_getname`: the endpoint's address, in the provider's format.
///
/// # Safety
/// `ep` live and enabled; `addr` writable for `*addrlen` bytes; `addrlen` valid.
pub unsafe fn fi_getname(ep: *mut fid_ep, addr: *mut c_void, addrlen: *mut usize) -> c_int {
    // SAFETY: `ep` is live (caller), so `cm` points at its CM ops.
    let f = unsafe { op!((*(*ep).cm).getname) };
    // SAFETY: arguments as the caller guarantees; the C inline passes `&ep->fid`.
    unsafe { f(&raw mut (*ep).fid, addr, addrlen) }
}

/// `fi_av_insert`: inserts `count` addresses, writing their handles to `fi_addr`.
///
/// # Safety
/// `av` live; `addr` holds `count` addresses in the AV's format; `fi_addr` writable for `count`.
pub unsafe fn fi_av_insert(
    av: *mut fid_av,
    addr: *const c_void,
    count: usize,
    fi_addr: *mut fi_addr_t,
    flags: u64,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `av` is live (caller).
    let f = unsafe { op!((*(*av).ops).insert) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(av, addr, count, fi_addr, flags, context) }
}

/// `fi_mr_reg`: registers `len` bytes at `buf` with access `acs`.
///
/// # Safety
/// `domain` live; `buf..buf+len` stays allocated until the MR is closed; `mr` writable.
#[allow(clippy::too_many_arguments)]
pub unsafe fn fi_mr_reg(
    domain: *mut fid_domain,
    buf: *const c_void,
    len: usize,
    acs: u64,
    offset: u64,
    requested_key: u64,
    flags: u64,
    mr: *mut *mut fid_mr,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `domain` is live (caller), so `mr` points at its MR ops.
    let (f, this) = unsafe { (op!((*(*domain).mr).reg), &raw mut (*domain).fid) };
    // SAFETY: arguments as the caller guarantees.
    unsafe {
        f(
            this,
            buf,
            len,
            acs,
            offset,
            requested_key,
            flags,
            mr,
            context,
        )
    }
}

/// `fi_mr_key`: the key peers address the region with.
///
/// # Safety
/// `mr` live.
pub unsafe fn fi_mr_key(mr: *mut fid_mr) -> u64 {
    // SAFETY: `mr` is live (caller).
    unsafe { (*mr).key }
}

/// `fi_mr_desc`: the local descriptor of the region (for FI_MR_LOCAL providers).
///
/// # Safety
/// `mr` live.
pub unsafe fn fi_mr_desc(mr: *mut fid_mr) -> *mut c_void {
    // SAFETY: `mr` is live (caller).
    unsafe { (*mr).mem_desc }
}

/// `fi_mr_bind`: binds a region to an endpoint (FI_MR_ENDPOINT providers).
///
/// # Safety
/// `mr` and `bfid` live.
pub unsafe fn fi_mr_bind(mr: *mut fid_mr, bfid: *mut fid, flags: u64) -> c_int {
    // SAFETY: `mr` is live (caller).
    let (f, this) = unsafe { (op!((*(*mr).fid.ops).bind), &raw mut (*mr).fid) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(this, bfid, flags) }
}

/// `fi_mr_enable` (FI_MR_ENDPOINT providers, after `fi_mr_bind`).
///
/// # Safety
/// `mr` live.
pub unsafe fn fi_mr_enable(mr: *mut fid_mr) -> c_int {
    // SAFETY: `mr` is live (caller); FI_ENABLE takes no argument.
    unsafe { fi_control(&raw mut (*mr).fid, FI_ENABLE as c_int, std::ptr::null_mut()) }
}

/// `fi_write`: RMA write of `len` bytes at `buf` to `addr` (key `key`) of `dest_addr`.
///
/// # Safety
/// `ep` live and enabled; `buf..buf+len` readable until the operation completes; `desc` as
/// the domain's MR mode requires.
#[allow(clippy::too_many_arguments)]
pub unsafe fn fi_write(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    dest_addr: fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is live (caller), so `rma` points at its RMA ops.
    let f = unsafe { op!((*(*ep).rma).write) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(ep, buf, len, desc, dest_addr, addr, key, context) }
}

/// `fi_writedata`: `fi_write` that also delivers `data` in a completion at the target.
///
/// # Safety
/// As [`fi_write`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn fi_writedata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    data: u64,
    dest_addr: fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is live (caller).
    let f = unsafe { op!((*(*ep).rma).writedata) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(ep, buf, len, desc, data, dest_addr, addr, key, context) }
}

/// `fi_writemsg`: RMA write described by `msg`, with per-operation `flags`.
///
/// # Safety
/// `ep` live and enabled; `msg` and everything it points to valid for the call; the data
/// buffers readable until completion (or only for the call with `FI_INJECT`).
pub unsafe fn fi_writemsg(ep: *mut fid_ep, msg: *const fi_msg_rma, flags: u64) -> isize {
    // SAFETY: `ep` is live (caller).
    let f = unsafe { op!((*(*ep).rma).writemsg) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(ep, msg, flags) }
}

/// `fi_inject_writedata`: small write with CQ data; `buf` is reusable on return and no local
/// completion is generated.
///
/// # Safety
/// `ep` live and enabled; `len` at most the endpoint's inject size.
#[allow(clippy::too_many_arguments)]
pub unsafe fn fi_inject_writedata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest_addr: fi_addr_t,
    addr: u64,
    key: u64,
) -> isize {
    // SAFETY: `ep` is live (caller).
    let f = unsafe { op!((*(*ep).rma).injectdata) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(ep, buf, len, data, dest_addr, addr, key) }
}

/// `fi_read`: RMA read of `len` bytes from `addr` (key `key`) of `src_addr` into `buf`.
///
/// # Safety
/// `ep` live and enabled; `buf..buf+len` writable and not otherwise accessed until completion.
#[allow(clippy::too_many_arguments)]
pub unsafe fn fi_read(
    ep: *mut fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    src_addr: fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is live (caller).
    let f = unsafe { op!((*(*ep).rma).read) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(ep, buf, len, desc, src_addr, addr, key, context) }
}

/// `fi_cq_read`: up to `count` completions in the CQ's format; drives progress on
/// manual-progress providers.
///
/// # Safety
/// `cq` live; `buf` writable for `count` entries of the CQ's format.
pub unsafe fn fi_cq_read(cq: *mut fid_cq, buf: *mut c_void, count: usize) -> isize {
    // SAFETY: `cq` is live (caller).
    let f = unsafe { op!((*(*cq).ops).read) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(cq, buf, count) }
}

/// `fi_cq_sread`: like [`fi_cq_read`] but blocks up to `timeout` ms (CQs with a wait object).
///
/// # Safety
/// As [`fi_cq_read`]; `cond` as the CQ's wait condition expects (NULL for none).
pub unsafe fn fi_cq_sread(
    cq: *mut fid_cq,
    buf: *mut c_void,
    count: usize,
    cond: *const c_void,
    timeout: c_int,
) -> isize {
    // SAFETY: `cq` is live (caller).
    let f = unsafe { op!((*(*cq).ops).sread) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(cq, buf, count, cond, timeout) }
}

/// `fi_cq_readerr`: the next error completion (after a read returned `-FI_EAVAIL`).
///
/// # Safety
/// `cq` live; `buf` a valid `fi_cq_err_entry` (with `err_data_size` 0 or a real buffer).
pub unsafe fn fi_cq_readerr(cq: *mut fid_cq, buf: *mut fi_cq_err_entry, flags: u64) -> isize {
    // SAFETY: `cq` is live (caller).
    let f = unsafe { op!((*(*cq).ops).readerr) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(cq, buf, flags) }
}

/// `fi_cq_strerror`: the provider's text for an error completion, written to `buf`.
///
/// # Safety
/// `cq` live; `err_data` from the error entry; `buf` writable for `len` bytes.
pub unsafe fn fi_cq_strerror(
    cq: *mut fid_cq,
    prov_errno: c_int,
    err_data: *const c_void,
    buf: *mut c_char,
    len: usize,
) -> *const c_char {
    // SAFETY: `cq` is live (caller).
    let Some(f) = (unsafe { (*(*cq).ops).strerror }) else {
        return std::ptr::null();
    };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(cq, prov_errno, err_data, buf, len) }
}

/// `fi_trywait`: 0 when it is safe to block on the wait objects of `fids` (nothing is pending),
/// `-FI_EAGAIN` when completions must be read first.
///
/// # Safety
/// `fabric` live; `fids` points to `count` live objects of that fabric with wait objects.
pub unsafe fn fi_trywait(fabric: *mut fid_fabric, fids: *mut *mut fid, count: c_int) -> c_int {
    // SAFETY: `fabric` is live (caller).
    let f = unsafe { op!((*(*fabric).ops).trywait) };
    // SAFETY: arguments as the caller guarantees.
    unsafe { f(fabric, fids, count) }
}
