//! The panic boundary and the registry, without processes.

use std::ffi::CStr;

use super::init::register;
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
