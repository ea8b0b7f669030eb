//! The panic boundary and the registry, without processes.

use std::ffi::CStr;

use super::init::register;
use super::*;
use crate::fabric::local::LocalFabric;
use crate::{MoeConfig, Topology};

/// Two registered communicators (rank 0 attention, rank 1 expert) over a local fabric.
fn pair() -> Vec<*mut xcclComm> {
    let mut cfg = MoeConfig::new(4, DType::F32, 1, 2);
    cfg.timeout = Duration::from_secs(5);
    pair_with(cfg)
}

/// [`pair`] with `cfg` (hidden 4, f32, top-1 of 2 experts).
fn pair_with(cfg: MoeConfig) -> Vec<*mut xcclComm> {
    let topo = Topology::contiguous(1, 1, 2).unwrap();
    let lens = Communicator::window_lens(&topo, &cfg).unwrap();
    let fabrics = LocalFabric::group(&lens, Communicator::signal_slots(&topo)).unwrap();
    let topo = Arc::new(topo);
    let comms: Vec<Comm> = std::thread::scope(|s| {
        let joins: Vec<_> = fabrics
            .into_iter()
            .map(|f| {
                let (topo, cfg) = (topo.clone(), cfg.clone());
                s.spawn(move || {
                    let fabric: Arc<dyn Fabric> = Arc::new(f);
                    let comm = Communicator::from_fabric(
                        Box::new(SharedFabric(fabric.clone())),
                        topo.clone(),
                        cfg.clone(),
                    )
                    .unwrap();
                    Comm::new(
                        comm,
                        fabric,
                        super::config::CONFIG_VERSION,
                        Default::default(),
                    )
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

/// The library's `#[repr(C)]` structs against the header as a C compiler lays it out: every
/// field's offset and size and every struct's size, as `_Static_assert`s compiled with gcc.
#[test]
fn rust_structs_have_the_layout_the_header_compiles_to() {
    use std::mem::{offset_of, size_of};
    let mut checks = String::new();
    macro_rules! layout {
        ($t:ident { $($f:ident),* $(,)? }) => {{
            let s = stringify!($t);
            checks.push_str(&format!(
                "_Static_assert(sizeof({s}) == {}, \"sizeof {s}\");\n",
                size_of::<$t>()
            ));
            $(
                let f = stringify!($f);
                checks.push_str(&format!(
                    "_Static_assert(offsetof({s}, {f}) == {}, \"{s}.{f}\");\n",
                    offset_of!($t, $f)
                ));
            )*
        }};
    }
    use super::config::xcclConfig_t;
    layout!(xcclUniqueId { internal });
    layout!(xcclConfig_t {
        size,
        magic,
        version,
        numAttentionRanks,
        numExpertRanks,
        numExperts,
        topk,
        hidden,
        maxTokensPerRank,
        dtype,
        transferMode,
        maxInFlight,
        timeoutMs,
        fabric,
        placementCounts,
        placementRanks,
        a2eQuant,
        e2aQuant,
        keepInt8,
        recvCapacity,
        role,
        device,
        ofiProvider,
        ofiInterface,
    });
    layout!(xcclExpertBatchInfo_t {
        size,
        numRows,
        numTokens,
        numLocalExperts,
        rows,
        expertCounts,
        expertOffsets,
        srcRank,
        srcToken,
        weights,
        int8Rows,
        scales,
        tag,
        numSources,
        sourceRanks,
        sourceCounts,
        sourceFirstToken,
        sourceTags,
    });
    layout!(xcclTokenBatchInfo_t {
        size,
        numTokens,
        topk,
        rows,
        srcRank,
        srcToken,
        expertCount,
        localExperts,
        weights,
        int8Rows,
        scales,
        tag,
        numSources,
        sourceRanks,
        sourceCounts,
        sourceFirstToken,
        sourceTags,
    });
    layout!(xcclPeerStats_t {
        rowsSent,
        rowsReceived,
        bytesPut,
        bytesGot,
        waitedNs
    });
    layout!(xcclCallStats_t {
        calls,
        recordsWritten,
        recordsPolled,
        relayRowsForwarded,
        droppedSlots,
        slowestPeer,
        straggler,
        slowestWaitedNs,
    });
    layout!(xcclStats_t {
        size,
        peerCapacity,
        lastPeers,
        totalPeers,
        numPeers,
        last,
        total
    });
    layout!(xcclShrinkOptions_t {
        size,
        dropOrphanedExperts,
        timeoutMs
    });
    let dir = std::env::temp_dir().join(format!("xccl-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("layout.c");
    std::fs::write(
        &src,
        format!(
            "#include <stddef.h>\n#include \"xccl.h\"\n{checks}int main(void) {{ return 0; }}\n"
        ),
    )
    .unwrap();
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/../include");
    let out = std::process::Command::new("gcc")
        .args(["-std=c11", "-fsyntax-only", "-I", include])
        .arg(&src)
        .output()
        .expect("running gcc");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "the library's structs differ from the header:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What may run concurrently on one communicator, as the header says: a query answers while
/// another thread is blocked in a call; any other call waits for it (here xcclCommGetStats, which
/// then sees the counters of the call it waited for).
#[test]
fn queries_answer_while_a_call_blocks_and_other_calls_wait_for_it() {
    use std::sync::atomic::AtomicBool;
    let comms = pair();
    let (a, e) = (comms[0] as usize, comms[1] as usize);
    let (x, idx, w) = ([1f32; 4], [0i32], [1f32]);
    let mut h: *mut xcclA2EHandle = std::ptr::null_mut();
    // SAFETY: one token of 4 f32, one routing entry, a valid out-pointer.
    let code = unsafe {
        xcclA2ESend(
            comms[0],
            x.as_ptr().cast(),
            1,
            idx.as_ptr(),
            w.as_ptr(),
            &mut h,
        )
    };
    assert_eq!(code, XCCL_SUCCESS, "{}", last_error(comms[0]));
    let h = h as usize;
    let replied = Arc::new(AtomicBool::new(false));
    std::thread::scope(|s| {
        let replied2 = replied.clone();
        s.spawn(move || {
            let mut b: *mut xcclExpertBatch = std::ptr::null_mut();
            // SAFETY: a valid out-pointer.
            let code = unsafe { xcclA2ERecv(e as *mut xcclComm, &mut b) };
            assert_eq!(code, XCCL_SUCCESS);
            std::thread::sleep(Duration::from_millis(300));
            replied2.store(true, Ordering::SeqCst);
            let y = [2f32; 4];
            // SAFETY: the batch's one row of 4 f32.
            let code = unsafe { xcclE2ASend(e as *mut xcclComm, b, y.as_ptr().cast()) };
            assert_eq!(code, XCCL_SUCCESS);
        });
        s.spawn(move || {
            let mut out = [0f32; 4];
            // SAFETY: one token of 4 f32 to write.
            let code = unsafe {
                xcclE2ARecv(
                    a as *mut xcclComm,
                    h as *mut xcclA2EHandle,
                    out.as_mut_ptr().cast(),
                )
            };
            assert_eq!(code, XCCL_SUCCESS);
            assert_eq!(out, [2f32; 4]);
        });
        std::thread::sleep(Duration::from_millis(50));
        let mut n = 0;
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { xcclCommCount(comms[0], &mut n) }, XCCL_SUCCESS);
        assert_eq!(n, 2);
        assert!(
            !replied.load(Ordering::SeqCst),
            "the query waited for the blocked call"
        );
        let mut st = ext::xcclStats_t {
            size: std::mem::size_of::<ext::xcclStats_t>(),
            peerCapacity: 0,
            lastPeers: std::ptr::null_mut(),
            totalPeers: std::ptr::null_mut(),
            numPeers: 0,
            last: Default::default(),
            total: Default::default(),
        };
        // SAFETY: a whole stats struct, no peer arrays.
        assert_eq!(unsafe { xcclCommGetStats(comms[0], &mut st) }, XCCL_SUCCESS);
        assert!(
            replied.load(Ordering::SeqCst),
            "GetStats did not wait for the blocked call"
        );
        assert!(
            st.last.recordsPolled > 0,
            "the stats are not those of the E2A it waited for"
        );
        assert_eq!(st.total.calls, 2);
    });
}

#[test]
fn a_live_handle_or_batch_cannot_be_freed_on_a_healthy_communicator_but_can_after_an_abort() {
    let comms = pair();
    let (attn, expert) = (comms[0], comms[1]);
    let x = [1.0f32; 4];
    let (idx, w) = ([0i32], [1.0f32]);
    let mut h: *mut xcclA2EHandle = std::ptr::null_mut();
    // SAFETY: one token of 4 f32, top-1 routing arrays of one entry; `h` is a valid out-pointer.
    let code = unsafe { xcclA2ESend(attn, x.as_ptr().cast(), 1, idx.as_ptr(), w.as_ptr(), &mut h) };
    assert_eq!(code, XCCL_SUCCESS, "{}", last_error(attn));
    // Freeing the live handle is refused, naming the epoch, and the handle stays valid.
    assert_eq!(xcclA2EHandleFree(h), XCCL_INVALID_USAGE);
    assert!(last_error(attn).contains("epoch 1"), "{}", last_error(attn));
    let mut b: *mut xcclExpertBatch = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let code = unsafe { xcclA2ERecv(expert, &mut b) };
    assert_eq!(code, XCCL_SUCCESS, "{}", last_error(expert));
    assert_eq!(xcclExpertBatchFree(b), XCCL_INVALID_USAGE);
    assert!(
        last_error(expert).contains("still live"),
        "{}",
        last_error(expert)
    );
    // Both still complete the call: the reply goes out and the E2A lands.
    let y = [2.0f32; 4];
    // SAFETY: one row of 4 f32 for the batch's one row.
    let code = unsafe { xcclE2ASend(expert, b, y.as_ptr().cast()) };
    assert_eq!(code, XCCL_SUCCESS, "{}", last_error(expert));
    let mut out = [0.0f32; 4];
    // SAFETY: `out` holds one token of 4 f32.
    let code = unsafe { xcclE2ARecv(attn, h, out.as_mut_ptr().cast()) };
    assert_eq!(code, XCCL_SUCCESS, "{}", last_error(attn));
    assert_eq!(out, [2.0f32; 4]);
    // After an abort a live handle may be freed.
    let mut h2: *mut xcclA2EHandle = std::ptr::null_mut();
    // SAFETY: as above.
    let code = unsafe {
        xcclA2ESend(
            attn,
            x.as_ptr().cast(),
            1,
            idx.as_ptr(),
            w.as_ptr(),
            &mut h2,
        )
    };
    assert_eq!(code, XCCL_SUCCESS, "{}", last_error(attn));
    assert_eq!(xcclCommAbort(attn), XCCL_SUCCESS);
    assert_eq!(xcclA2EHandleFree(h2), XCCL_SUCCESS);
    for c in comms {
        assert_eq!(xcclCommDestroy(c), XCCL_SUCCESS);
    }
}

/// A token-major receive on `expert`, its batch's rows and the batch.
fn recv_tokens(expert: *mut xcclComm) -> (*mut xcclTokenBatch, Vec<f32>) {
    let mut b: *mut xcclTokenBatch = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let code = unsafe { xcclA2ERecvTokens(expert, &mut b) };
    assert_eq!(code, XCCL_SUCCESS, "{}", last_error(expert));
    // SAFETY: an all-zero xcclTokenBatchInfo_t is valid (integers and NULL pointers).
    let mut info: xcclTokenBatchInfo_t = unsafe { std::mem::zeroed() };
    info.size = std::mem::size_of::<xcclTokenBatchInfo_t>();
    // SAFETY: `info` is a valid, sized out-struct.
    assert_eq!(unsafe { xcclTokenBatchGetInfo(b, &mut info) }, XCCL_SUCCESS);
    // SAFETY: `rows` points at `numTokens` rows of 4 f32 in the live batch.
    let rows = unsafe { std::slice::from_raw_parts(info.rows.cast::<f32>(), info.numTokens * 4) };
    (b, rows.to_vec())
}

#[test]
fn a_nan_int8_reply_is_invalid_argument_with_nothing_sent_and_a_retry_with_finite_rows_succeeds() {
    use crate::testing::reference::quantize_int8;
    let mut cfg = MoeConfig::new(4, DType::F32, 1, 2);
    cfg.timeout = Duration::from_secs(5);
    cfg.e2a_quant = crate::Quant::Int8;
    let comms = pair_with(cfg);
    let (attn, expert) = (comms[0], comms[1]);
    let x = [1.5f32, -2.0, 0.25, 3.0, 4.0, 5.0, -6.0, 7.5];
    let (idx, w) = ([0i32, 1], [1.0f32, 1.0]);
    let mut h: *mut xcclA2EHandle = std::ptr::null_mut();
    // SAFETY: two tokens of 4 f32, top-1 routing arrays of two entries; `h` is valid.
    let code = unsafe { xcclA2ESend(attn, x.as_ptr().cast(), 2, idx.as_ptr(), w.as_ptr(), &mut h) };
    assert_eq!(code, XCCL_SUCCESS, "{}", last_error(attn));
    let (b, rows) = recv_tokens(expert);
    let reduced: Vec<f32> = rows.iter().map(|v| v * 2.0).collect();
    let mut bad = reduced.clone();
    bad[6] = f32::NAN;
    // SAFETY: two rows of 4 f32 for the batch's two tokens.
    let code = unsafe { xcclE2ASendTokens(expert, b, bad.as_ptr().cast()) };
    assert_eq!(code, XCCL_INVALID_ARGUMENT, "{}", last_error(expert));
    assert!(
        last_error(expert).contains("non-finite"),
        "{}",
        last_error(expert)
    );
    // Nothing was sent: no async error, nothing arrived, the batch stays valid.
    let mut async_err = -1;
    // SAFETY: a valid out-pointer.
    let code = unsafe { xcclCommGetAsyncError(expert, &mut async_err) };
    assert_eq!(code, XCCL_SUCCESS);
    assert_eq!(async_err, XCCL_SUCCESS, "{}", last_error(expert));
    let mut done = -1;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { xcclE2ATest(attn, h, &mut done) }, XCCL_SUCCESS);
    assert_eq!(done, 0, "the failed reply reached the attention rank");
    // SAFETY: as above.
    let code = unsafe { xcclE2ASendTokens(expert, b, reduced.as_ptr().cast()) };
    assert_eq!(code, XCCL_SUCCESS, "{}", last_error(expert));
    let mut out = [0f32; 8];
    // SAFETY: `out` holds two tokens of 4 f32.
    let code = unsafe { xcclE2ARecv(attn, h, out.as_mut_ptr().cast()) };
    assert_eq!(code, XCCL_SUCCESS, "{}", last_error(attn));
    // Token t's row back from the batch (rows in arrival order: one source, so in order).
    for t in 0..2 {
        let r: Vec<f32> = x[t * 4..(t + 1) * 4].iter().map(|v| v * 2.0).collect();
        let (q, scale) = quantize_int8(&r);
        for j in 0..4 {
            assert_eq!(out[t * 4 + j].to_bits(), (q[j] as f32 * scale).to_bits());
        }
    }
    for c in comms {
        assert_eq!(xcclCommDestroy(c), XCCL_SUCCESS);
    }
}

#[test]
fn a_call_that_poisons_after_sending_never_returns_invalid_argument() {
    let comms = pair();
    let (attn, expert) = (comms[0], comms[1]);
    // A failure of this rank's own after data went out, through the communicator's failure
    // path (its kind says "invalid argument", which alone would promise nothing was sent).
    let code = with_comm("xcclTestPoison", expert, |_, _, inner| {
        let e = inner.fail_after_publishing(Error::invalid("a row went bad mid-send"));
        Err(Fail::from(e))
    });
    assert_eq!(code, XCCL_ABORTED, "{}", last_error(expert));
    let mut async_err = -1;
    // SAFETY: a valid out-pointer.
    let code = unsafe { xcclCommGetAsyncError(expert, &mut async_err) };
    assert_eq!(code, XCCL_SUCCESS);
    assert_eq!(async_err, XCCL_ABORTED);
    // Later calls return the first error again, with the same code.
    let mut b: *mut xcclExpertBatch = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let code = unsafe { xcclA2ERecv(expert, &mut b) };
    assert_eq!(code, XCCL_ABORTED, "{}", last_error(expert));
    assert!(
        last_error(expert).contains("mid-send"),
        "{}",
        last_error(expert)
    );
    // A check of this module's on the poisoned communicator still says what it is.
    // SAFETY: a NULL out-pointer, rejected before anything is read.
    let code = unsafe { xcclA2ERecv(expert, std::ptr::null_mut()) };
    assert_eq!(code, XCCL_INVALID_ARGUMENT);
    // The peer was told.
    let mut h: *mut xcclA2EHandle = std::ptr::null_mut();
    // SAFETY: 0 tokens (no buffers read); `h` is a valid out-pointer.
    let code = unsafe {
        xcclA2ESend(
            attn,
            std::ptr::null(),
            0,
            std::ptr::null(),
            std::ptr::null(),
            &mut h,
        )
    };
    assert_eq!(code, XCCL_ABORTED, "{}", last_error(attn));
    for c in comms {
        assert_eq!(xcclCommDestroy(c), XCCL_SUCCESS);
    }
}

/// Found by review: `xcclCommGetStats` made a `&xcclStats_t` over the caller's struct, which may
/// be as short as its 32-byte header: a reference past the caller's memory (undefined behaviour,
/// reported by Miri: `ci/miri.sh` runs this test). The header is read through raw pointers.
#[test]
fn get_stats_on_a_header_only_struct_reads_no_byte_past_it() {
    let comms = pair();
    let head = std::mem::offset_of!(ext::xcclStats_t, numPeers);
    assert_eq!(head, 32);
    // Exactly the header: size, peerCapacity, lastPeers, totalPeers.
    let mut header: Box<[usize; 4]> = Box::new([head, 0, 0, 0]);
    let p = header.as_mut_ptr().cast::<ext::xcclStats_t>();
    // SAFETY: `p` holds `size` = 32 bytes, aligned for the struct, no peer arrays.
    let code = unsafe { xcclCommGetStats(comms[0], p) };
    assert_eq!(code, XCCL_SUCCESS, "{}", last_error(comms[0]));
    assert_eq!(header[0], head, "the caller's size is kept");
    for c in comms {
        assert_eq!(xcclCommDestroy(c), XCCL_SUCCESS);
    }
}

/// What the arrival callback of the shrink test saw.
struct ShrinkFromCallback {
    comm: *mut xcclComm,
    code: Option<xcclResult_t>,
}

/// Calls `xcclCommShrink` on the receiving communicator from its own arrival callback.
unsafe extern "C" fn shrink_from_callback(
    user: *mut c_void,
    _: *const xcclTokenBatchInfo_t,
    _: usize,
    _: usize,
) {
    // SAFETY: `user` is the test's `ShrinkFromCallback`, alive for the receive.
    let seen = unsafe { &mut *user.cast::<ShrinkFromCallback>() };
    let mut newcomm: *mut xcclComm = std::ptr::null_mut();
    // SAFETY: no options; `newcomm` is a valid out-pointer.
    seen.code = Some(unsafe { xcclCommShrink(seen.comm, std::ptr::null(), &mut newcomm) });
}

/// Found by review: `xcclCommShrink` from an arrival callback deadlocked on the lock the
/// receive holds, although the header promises `xcclInvalidUsage` for any call from a callback.
#[test]
fn shrink_from_an_arrival_callback_is_invalid_usage_not_a_deadlock() {
    let comms = pair();
    let (attn, expert) = (comms[0] as usize, comms[1] as usize);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (attn, expert) = (attn as *mut xcclComm, expert as *mut xcclComm);
        let mut h: *mut xcclA2EHandle = std::ptr::null_mut();
        let (x, idx, w) = ([1f32; 4], [0i32], [1f32]);
        // SAFETY: one token of hidden 4, top-1, valid buffers and out-pointer.
        let sent =
            unsafe { xcclA2ESend(attn, x.as_ptr().cast(), 1, idx.as_ptr(), w.as_ptr(), &mut h) };
        assert_eq!(sent, XCCL_SUCCESS);
        let mut seen = ShrinkFromCallback {
            comm: expert,
            code: None,
        };
        let mut batch: *mut xcclTokenBatch = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the callback follows the header's rules; `seen` outlives
        // the receive.
        let received = unsafe {
            moe::xcclA2ERecvTokensWithCallback(
                expert,
                &mut batch,
                Some(shrink_from_callback),
                std::ptr::addr_of_mut!(seen).cast(),
            )
        };
        let _ = tx.send((received, seen.code));
    });
    let (received, code) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the receive deadlocked in its callback");
    assert_eq!(received, XCCL_SUCCESS, "{}", last_error(comms[1]));
    assert_eq!(code, Some(XCCL_INVALID_USAGE));
    for c in comms {
        assert_eq!(xcclCommDestroy(c), XCCL_SUCCESS);
    }
}

#[test]
fn the_shared_fabric_forwards_the_wait_counters_and_the_cuda_view_of_its_fabric() {
    let fabrics = LocalFabric::group(&[4096, 4096], 4).unwrap();
    let inner: Arc<dyn Fabric> = Arc::new(fabrics.into_iter().next().unwrap());
    let shared = SharedFabric(inner.clone());
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut polls = 0;
    shared
        .wait_until(deadline, &mut || {
            polls += 1;
            (polls < 3).then_some(Waiting {
                peer: 1,
                what: "a test signal",
                progress: 0,
            })
        })
        .unwrap();
    let counted = inner.wait_counters();
    assert!(counted.waits > 0, "{counted:?}");
    assert_eq!(shared.wait_counters(), counted);
    // The positive case needs a cuda fabric: the C test on the stand-in driver
    // (`c11_device_buffer_calls_on_the_cuda_fabric_match_the_host_calls_bit_for_bit`).
    assert!(shared.as_cuda().is_none());
}
