//! The calls of `xccl.h` added for engines and bindings: `xcclConfigInit`, the unique id's
//! hex form, the non-blocking tests (`xcclE2ATest`, `xcclA2ERecvTest`), per-call tags
//! (`xcclA2ESetTag`), counters (`xcclCommGetStats`) and shrink (`xcclCommShrink`), plus the
//! writer of output structs that can grow ([`write_sized`]).

use std::ffi::{c_char, c_int, c_uint};
use std::time::Duration;

use super::config::{xcclConfig_t, UNDEF};
use super::*;
use crate::bootstrap::UniqueId;
use crate::moe::stats::{PeerStats, Stats};
use crate::ShrinkOptions;

/// Writes `full`, a `#[repr(C)]` output struct whose first field is its `size_t size`, to
/// `out` for a caller of config version `version`: from version 4 the caller's `out->size`
/// says how many bytes it has (at least the `size` field), and no more than that is written
/// (the caller's `size` is kept); versions 1 to 3 had no `size` field, and get the
/// `legacy_len` bytes after it (their layout: the same fields up to there).
///
/// # Safety
/// `out`, when non-NULL, is valid for writes of what its caller's layout holds: `out->size`
/// bytes (version 4 and later) or `legacy_len` bytes (earlier).
pub(super) unsafe fn write_sized<T>(
    out: *mut T,
    full: &T,
    version: c_uint,
    legacy_len: usize,
    name: &str,
) -> Result<(), Fail> {
    check_ptr(out, name)?;
    let word = std::mem::size_of::<usize>();
    // SAFETY: `full` is a live `T`: its bytes are readable for `size_of::<T>()`.
    let bytes = unsafe {
        std::slice::from_raw_parts((full as *const T).cast::<u8>(), std::mem::size_of::<T>())
    };
    let dst = out.cast::<u8>();
    if version < 4 {
        let n = legacy_len.min(bytes.len() - word);
        // SAFETY: the caller's layout holds `legacy_len` writable bytes at `out`.
        unsafe { std::ptr::copy_nonoverlapping(bytes[word..].as_ptr(), dst, n) };
        return Ok(());
    }
    // SAFETY: non-NULL and aligned (checked); every layout starts with `size_t size`.
    let size = unsafe { out.cast::<usize>().read() };
    if size < word {
        return Err(Fail::invalid(format!(
            "{name}->size = {size}: set it to sizeof the struct before the call"
        )));
    }
    let n = size.min(bytes.len());
    // SAFETY: the caller's struct holds `size` writable bytes; the size field itself is kept.
    unsafe { std::ptr::copy_nonoverlapping(bytes[word..n].as_ptr(), dst.add(word), n - word) };
    Ok(())
}

/// `xcclConfigInit`: what `XCCL_CONFIG_INITIALIZER` gives.
///
/// # Safety
/// `config`, when non-NULL, is valid for a write of an `xcclConfig_t`.
#[no_mangle]
pub unsafe extern "C" fn xcclConfigInit(config: *mut xcclConfig_t) -> xcclResult_t {
    // SAFETY: the caller's contract (see the function's docs).
    guard("xcclConfigInit", || unsafe {
        put(config, xcclConfig_t::initializer(), "config")
    })
}

/// `xcclUniqueIdToString`: the id as 256 lowercase hex characters and a NUL.
///
/// # Safety
/// `uniqueId` points to an `xcclUniqueId`; `str` is valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn xcclUniqueIdToString(
    uniqueId: *const xcclUniqueId,
    str: *mut c_char,
    len: usize,
) -> xcclResult_t {
    guard("xcclUniqueIdToString", || {
        check_ptr(uniqueId.cast_mut(), "uniqueId")?;
        check_ptr(str, "str")?;
        if len < 257 {
            return Err(Fail::invalid(format!(
                "len = {len}: the hex form needs 257 bytes (256 characters and a NUL)"
            )));
        }
        // SAFETY: non-NULL and aligned (checked); the caller's contract.
        let id = unsafe { &*uniqueId };
        let mut hex = String::with_capacity(257);
        for &b in &id.internal {
            hex.push_str(&format!("{:02x}", b as u8));
        }
        hex.push('\0');
        // SAFETY: `str` holds `len >= 257` writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(hex.as_ptr().cast::<c_char>(), str, 257) };
        Ok(())
    })
}

/// `xcclUniqueIdFromString`: parses the 256 hex characters of `xcclUniqueIdToString`.
///
/// # Safety
/// `str` is NUL-terminated; `uniqueId` is valid for a write of an `xcclUniqueId`.
#[no_mangle]
pub unsafe extern "C" fn xcclUniqueIdFromString(
    str: *const c_char,
    uniqueId: *mut xcclUniqueId,
) -> xcclResult_t {
    guard("xcclUniqueIdFromString", || {
        check_ptr(str.cast_mut(), "str")?;
        check_ptr(uniqueId, "uniqueId")?;
        // SAFETY: non-NULL; the caller's contract says NUL-terminated.
        let s = unsafe { std::ffi::CStr::from_ptr(str) }.to_bytes();
        if s.len() != 256 {
            return Err(Fail::invalid(format!(
                "str has {} characters; a unique id is 256 hex characters",
                s.len()
            )));
        }
        let digit = |i: usize| -> Result<u8, Fail> {
            (s[i] as char)
                .to_digit(16)
                .map(|d| d as u8)
                .ok_or_else(|| Fail::invalid(format!("str[{i}] is not a hex digit")))
        };
        let mut out = xcclUniqueId { internal: [0; 128] };
        for (k, o) in out.internal.iter_mut().enumerate() {
            *o = (digit(2 * k)? << 4 | digit(2 * k + 1)?) as c_char;
        }
        let bytes: Vec<u8> = out.internal.iter().map(|&b| b as u8).collect();
        UniqueId::from_bytes(&bytes).map_err(|e| Fail::from_error(&e).prefixed("str"))?;
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(uniqueId, out, "uniqueId") }
    })
}

/// `xcclE2ATest`: whether the E2A of `handle` has fully arrived (never blocks).
///
/// # Safety
/// `done`, when non-NULL, is valid for a write of an `int`.
#[no_mangle]
pub unsafe extern "C" fn xcclE2ATest(
    comm: *mut xcclComm,
    handle: *mut xcclA2EHandle,
    done: *mut c_int,
) -> xcclResult_t {
    with_comm("xcclE2ATest", comm, |id, _, inner| {
        check_ptr(handle, "handle")?;
        check_ptr(done, "done")?;
        let hid = handle as usize;
        let handles = lock(&HANDLES);
        let (owner, h) = handles.get(&hid).ok_or_else(|| {
            Fail::usage(format!(
                "handle {hid:#x} is not a live A2E handle (already received or freed)"
            ))
        })?;
        if *owner != id {
            return Err(Fail::usage(format!(
                "handle {hid:#x} belongs to another communicator"
            )));
        }
        let ready = inner.e2a_ready(h)?;
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(done, c_int::from(ready), "done") }
    })
}

/// `xcclA2ERecvTest`: whether the next A2E receive has all its rows (never blocks).
///
/// # Safety
/// `ready`, when non-NULL, is valid for a write of an `int`.
#[no_mangle]
pub unsafe extern "C" fn xcclA2ERecvTest(comm: *mut xcclComm, ready: *mut c_int) -> xcclResult_t {
    with_comm("xcclA2ERecvTest", comm, |_, _, inner| {
        check_ptr(ready, "ready")?;
        let r = inner.a2e_ready()?;
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(ready, c_int::from(r), "ready") }
    })
}

/// `xcclA2ESetTag`: the tag this rank's next A2E call carries.
#[no_mangle]
pub extern "C" fn xcclA2ESetTag(comm: *mut xcclComm, tag: u64) -> xcclResult_t {
    with_comm("xcclA2ESetTag", comm, |_, c, inner| {
        if c.role != Role::Attention {
            return Err(Fail::usage(format!(
                "xcclA2ESetTag is for attention ranks; rank {} is an expert rank",
                c.rank
            )));
        }
        inner.set_next_a2e_tag(tag);
        Ok(())
    })
}

/// `xcclPeerStats_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct xcclPeerStats_t {
    /// Rows this rank announced to the peer.
    pub rowsSent: u64,
    /// Rows the peer announced to this rank.
    pub rowsReceived: u64,
    /// Bytes this rank wrote into the peer's window.
    pub bytesPut: u64,
    /// Bytes this rank read from the peer's window.
    pub bytesGot: u64,
    /// Nanoseconds this rank waited for the peer.
    pub waitedNs: u64,
}

/// `xcclCallStats_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct xcclCallStats_t {
    /// Calls counted.
    pub calls: u64,
    /// Records written.
    pub recordsWritten: u64,
    /// Records read and validated.
    pub recordsPolled: u64,
    /// Rows forwarded as a relay.
    pub relayRowsForwarded: u64,
    /// Expert selections dropped (orphaned experts after a shrink).
    pub droppedSlots: u64,
    /// The peer waited for longest, or -1.
    pub slowestPeer: c_int,
    /// The straggler, or -1.
    pub straggler: c_int,
    /// Nanoseconds waited for the slowest peer.
    pub slowestWaitedNs: u64,
}

/// `xcclStats_t`.
#[repr(C)]
pub struct xcclStats_t {
    /// `sizeof(xcclStats_t)`, set by the caller.
    pub size: usize,
    /// Entries of `lastPeers` and `totalPeers` (set by the caller).
    pub peerCapacity: usize,
    /// Caller's array for the last call's per-peer counters, or NULL.
    pub lastPeers: *mut xcclPeerStats_t,
    /// Caller's array for the totals per peer, or NULL.
    pub totalPeers: *mut xcclPeerStats_t,
    /// Written: ranks of the job (per-peer entries there are).
    pub numPeers: usize,
    /// Written: the last call's counters.
    pub last: xcclCallStats_t,
    /// Written: the totals.
    pub total: xcclCallStats_t,
}

fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

fn call_stats(s: &Stats) -> xcclCallStats_t {
    let slowest = s.slowest_peer();
    xcclCallStats_t {
        calls: s.calls,
        recordsWritten: s.records_written,
        recordsPolled: s.records_polled,
        relayRowsForwarded: s.relay_rows_forwarded,
        droppedSlots: s.dropped_slots,
        slowestPeer: slowest.map_or(-1, |(p, _)| p as c_int),
        straggler: s.straggler().map_or(-1, |p| p as c_int),
        slowestWaitedNs: slowest.map_or(0, |(_, d)| ns(d)),
    }
}

fn peer_stats(p: &PeerStats) -> xcclPeerStats_t {
    xcclPeerStats_t {
        rowsSent: p.rows_sent,
        rowsReceived: p.rows_received,
        bytesPut: p.bytes_put,
        bytesGot: p.bytes_got,
        waitedNs: ns(p.waited),
    }
}

/// `xcclCommGetStats`: the counters of the last call and in total.
///
/// # Safety
/// `stats`, when non-NULL, points to an `xcclStats_t` of `stats->size` bytes whose
/// `lastPeers` and `totalPeers`, when non-NULL, hold `peerCapacity` entries.
#[no_mangle]
pub unsafe extern "C" fn xcclCommGetStats(
    comm: *mut xcclComm,
    stats: *mut xcclStats_t,
) -> xcclResult_t {
    with_comm("xcclCommGetStats", comm, |_, c, inner| {
        check_ptr(stats, "stats")?;
        let head = std::mem::offset_of!(xcclStats_t, numPeers);
        // The caller's struct may be shorter than this build's (`size >= head` is allowed), so
        // no reference to a whole `xcclStats_t` is made: its header fields are read one by
        // one through raw pointers, `size` first, the others once `size` says they are there.
        // SAFETY: non-NULL and aligned (checked); every layout starts with `size_t size`.
        let size = unsafe { std::ptr::addr_of!((*stats).size).read() };
        if size < head {
            return Err(Fail::invalid(format!(
                "stats->size = {size}: set it to sizeof(xcclStats_t) (at least {head})"
            )));
        }
        // SAFETY: the caller's struct holds `size >= head` bytes (checked), so every field
        // before `numPeers` is inside it; raw reads, no reference past it.
        let (cap, last_p, total_p) = unsafe {
            (
                std::ptr::addr_of!((*stats).peerCapacity).read(),
                std::ptr::addr_of!((*stats).lastPeers).read(),
                std::ptr::addr_of!((*stats).totalPeers).read(),
            )
        };
        for (name, p) in [("lastPeers", last_p), ("totalPeers", total_p)] {
            if !p.is_null() {
                check_ptr(p, &format!("stats->{name}"))?;
            }
        }
        let (last, total) = (inner.last_call_stats(), inner.total_stats());
        let full = xcclStats_t {
            size,
            peerCapacity: cap,
            lastPeers: last_p,
            totalPeers: total_p,
            numPeers: c.nranks,
            last: call_stats(last),
            total: call_stats(total),
        };
        for (dst, src) in [(last_p, last), (total_p, total)] {
            if dst.is_null() {
                continue;
            }
            for r in 0..cap.min(c.nranks) {
                let p = src.peers.get(r).map(peer_stats).unwrap_or_default();
                // SAFETY: the caller's array holds `peerCapacity` entries (aligned, checked).
                unsafe { dst.add(r).write(p) };
            }
        }
        // SAFETY: the caller's struct holds `size` bytes (version 4 rule: size-prefixed).
        unsafe { write_sized(stats, &full, 4, 0, "stats") }
    })
}

/// `xcclShrinkOptions_t`.
#[repr(C)]
pub struct xcclShrinkOptions_t {
    /// `sizeof(xcclShrinkOptions_t)`, set by the caller.
    pub size: usize,
    /// 1: drop the selections of an expert with no replica left; 0: fail naming it.
    pub dropOrphanedExperts: c_int,
    /// Bound of each agreement round in ms; `XCCL_CONFIG_UNDEF_INT` or 0: 60000.
    pub timeoutMs: c_int,
}

/// `xcclCommShrink`: the survivors' new communicator, past the dead ranks.
///
/// # Safety
/// `options`, when non-NULL, points to an `xcclShrinkOptions_t` of `options->size` bytes;
/// `newcomm`, when non-NULL, is valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn xcclCommShrink(
    comm: *mut xcclComm,
    options: *const xcclShrinkOptions_t,
    newcomm: *mut *mut xcclComm,
) -> xcclResult_t {
    guard("xcclCommShrink", || {
        check_ptr(newcomm, "newcomm")?;
        let mut opts = ShrinkOptions::default();
        if !options.is_null() {
            check_ptr(options.cast_mut(), "options")?;
            // SAFETY: non-NULL and aligned (checked); the caller's contract.
            let size = unsafe { (*options).size };
            let full = std::mem::size_of::<xcclShrinkOptions_t>();
            if size < std::mem::size_of::<usize>() || size > full {
                return Err(Fail::invalid(format!(
                    "options->size = {size}: set it to sizeof(xcclShrinkOptions_t) ({full})"
                )));
            }
            let mut o = xcclShrinkOptions_t {
                size,
                dropOrphanedExperts: 0,
                timeoutMs: UNDEF,
            };
            // SAFETY: the caller's struct holds `size <= full` readable bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    options.cast::<u8>(),
                    std::ptr::addr_of_mut!(o).cast::<u8>(),
                    size,
                )
            };
            opts.drop_orphaned_experts = match o.dropOrphanedExperts {
                0 => false,
                1 => true,
                v => {
                    return Err(Fail::invalid(format!(
                        "options->dropOrphanedExperts = {v}; 0 or 1"
                    )))
                }
            };
            match o.timeoutMs {
                UNDEF | 0 => {}
                t if t > 0 => opts.timeout = Duration::from_millis(t as u64),
                t => return Err(Fail::invalid(format!("options->timeoutMs = {t}"))),
            }
        }
        let (id, c) = lookup(comm)?;
        // From an arrival callback the receive holds the communicator's lock: refused, as
        // every call is (the header's promise), rather than deadlocking on it.
        not_in_callback(id)?;
        let old = {
            let mut guard = lock_comm(&c)?;
            guard.take().ok_or_else(|| {
                Fail::usage("this communicator was already shrunk (xcclCommShrink)")
            })?
        };
        // Its handles and batches answer calls of the old job: gone with it.
        lock(&HANDLES).retain(|_, (owner, _)| *owner != id);
        lock(&EXPERT_BATCHES).retain(|_, b| b.comm != id);
        lock(&TOKEN_BATCHES).retain(|_, b| b.comm != id);
        let new = old.shrink(&opts)?;
        let fabric = lock(&c.rebuilt)
            .take()
            .ok_or_else(|| Fail::new(XCCL_INTERNAL_ERROR, "shrink built no fabric"))?;
        let made = Comm::new(new, fabric, c.version, c.rebuilt.clone());
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(newcomm, init::register(made), "newcomm") }
    })
}

/// `xcclCommRankAfterShrink`: the rank `oldRank` has in `comm`, made by `xcclCommShrink`.
///
/// # Safety
/// `newRank`, when non-NULL, is valid for a write of an `int`.
#[no_mangle]
pub unsafe extern "C" fn xcclCommRankAfterShrink(
    comm: *mut xcclComm,
    oldRank: c_int,
    newRank: *mut c_int,
) -> xcclResult_t {
    with_comm("xcclCommRankAfterShrink", comm, |_, _, inner| {
        check_ptr(newRank, "newRank")?;
        if inner.shrunk_past().is_empty() && inner.rank_before_shrink().is_none() {
            return Err(Fail::usage(
                "comm was not made by xcclCommShrink: no rank mapping",
            ));
        }
        let r = usize::try_from(oldRank)
            .ok()
            .and_then(|o| inner.rank_after_shrink(o))
            .map_or(-1, |n| n as c_int);
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(newRank, r, "newRank") }
    })
}
