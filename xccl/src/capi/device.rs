//! The device-buffer calls of `xccl.h` (a communicator on the cuda fabric): A2E send, E2A
//! receive, A2E receive and E2A send with the rows in GPU memory (the receive and the send
//! expert-major and token-major), each with a `cudaStream_t` (`xcclCudaStream_t`) argument,
//! over `Communicator::a2e_send_device` and the others; and the queries `xcclCommCuDevice`,
//! `xcclCommDeviceRecvSize` and `xcclCommDeviceRecvTokensSize`.
//!
//! Every pointer is checked here, under its C name, before the call reaches the communicator:
//! a device buffer must be memory of the communicator's GPU inside one allocation of the
//! length the call needs (`Device::device_pointer`), a host buffer (the routing with
//! `xcclMemoryHost`) must not be device memory. On a communicator of another fabric every
//! device call fails with `xcclInvalidArgument` naming the fabric. Nothing is sent when a check
//! fails; the communicator's own checks then run again (they cannot disagree).

use std::ffi::{c_int, c_void};

use super::moe::{
    arrival_callback, register_expert_batch, register_token_batch, with_expert_batch, with_handle,
    with_token_batch, xcclArrivalFn,
};
use super::*;
use crate::cuda::{Device, DeviceSlice, DeviceSliceMut, Stream};
use crate::Routing;

/// `xcclCudaStream_t`: a `CUstream` / `cudaStream_t` of the communicator's device (its primary
/// context, the runtime's), or NULL for the legacy default stream.
pub type xcclCudaStream_t = *mut c_void;

/// `xcclMemoryHost`: an argument in host memory.
pub const XCCL_MEMORY_HOST: c_int = 0;
/// `xcclMemoryDevice`: an argument in device memory of the communicator's GPU.
pub const XCCL_MEMORY_DEVICE: c_int = 1;

/// The GPU of `c`, or the error of the device call `call` on a communicator of another fabric.
fn cuda_device<'c>(c: &'c Comm, call: &str) -> Result<&'c Device, Fail> {
    c.cuda_device.as_ref().ok_or_else(|| {
        Fail::invalid(format!(
            "{call} takes device memory and needs a communicator on the cuda fabric \
             (config.fabric = \"cuda\"); this one is on the {} fabric (use the host-buffer call)",
            c.fabric.name()
        ))
    })
}

/// Checks that the `len` bytes at `p` (the argument `name`) are device memory of `device`
/// inside one allocation (NULL allowed when `len` is 0); returns its address.
fn check_device(device: &Device, p: *const c_void, len: usize, name: &str) -> Result<u64, Fail> {
    if len == 0 {
        return Ok(p as u64);
    }
    if p.is_null() {
        return Err(Fail::invalid(format!("{name} is NULL")));
    }
    match device.device_pointer(p as u64, len) {
        Ok(ptr) => Ok(ptr.addr()),
        Err(Error::InvalidArgument(m)) => Err(Fail::invalid(format!(
            "{name}: {m} (it must hold {len} bytes of device memory of this communicator's GPU)"
        ))),
        Err(e) => Err(Fail::from_error(&e).prefixed(name)),
    }
}

/// The caller's device buffer `name` (`len` bytes at `p`), lent for reading, once checked.
///
/// # Safety
/// When the check passes, the memory must stay allocated and unwritten by others during the
/// call (the header's contract).
unsafe fn lend<'a>(
    device: &Device,
    p: *const c_void,
    len: usize,
    name: &str,
) -> Result<DeviceSlice<'a>, Fail> {
    let addr = check_device(device, p, len, name)?;
    // SAFETY: `addr..addr + len` is device memory of `device` in one allocation (checked, or
    // `len` is 0); the caller keeps it so for the call.
    Ok(unsafe { DeviceSlice::from_raw(addr, len, device.ordinal()) })
}

/// The caller's device buffer `name` (`len` bytes at `p`), lent for writing, once checked.
///
/// # Safety
/// When the check passes, the memory must stay allocated and untouched by others during the
/// call (the header's contract).
unsafe fn lend_mut<'a>(
    device: &Device,
    p: *mut c_void,
    len: usize,
    name: &str,
) -> Result<DeviceSliceMut<'a>, Fail> {
    let addr = check_device(device, p, len, name)?;
    // SAFETY: as `lend`, and no one else reads or writes it during the call.
    Ok(unsafe { DeviceSliceMut::from_raw(addr, len, device.ordinal()) })
}

/// The caller's device buffer `name` (`len` bytes at `p`), lent for reading once checked,
/// and the caller's `stream`: the inputs of an E2A device send.
///
/// # Safety
/// As [`lend`] and [`borrow_stream`].
unsafe fn lend_with_stream<'a>(
    device: &Device,
    p: *const c_void,
    len: usize,
    name: &str,
    stream: xcclCudaStream_t,
) -> Result<(DeviceSlice<'a>, Stream), Fail> {
    // SAFETY: the caller's contract.
    let slice = unsafe { lend(device, p, len, name)? };
    // SAFETY: the caller's contract.
    Ok((slice, unsafe { borrow_stream(device, stream) }))
}

/// The caller's stream (NULL: the legacy default stream) on `device`.
///
/// # Safety
/// `stream` is NULL or a stream of `device`'s primary context, valid during the call.
unsafe fn borrow_stream(device: &Device, stream: xcclCudaStream_t) -> Stream {
    // SAFETY: the caller's contract.
    unsafe { Stream::borrowed(device, stream as usize as u64) }
}

/// Checks that `outBytes` (`out_bytes`) holds `rows` rows of `c`'s dtype, the size the
/// query `size_query` tells.
fn check_out_bytes(c: &Comm, out_bytes: usize, rows: usize, size_query: &str) -> Result<(), Fail> {
    let need = rows * c.row_bytes;
    if out_bytes < need {
        return Err(Fail::invalid(format!(
            "outBytes = {out_bytes}; out must hold at least {need} bytes ({rows} rows of {} \
             bytes: {size_query})",
            c.row_bytes
        )));
    }
    Ok(())
}

/// `xcclA2ESendDevice`: `xcclA2ESend` with `x` in device memory, the routing where
/// `routingMemory` says, ordered after the work queued on `stream`.
///
/// # Safety
/// `x` is `numTokens * rowBytes` bytes of device memory of the communicator's GPU,
/// `topkIdx` and `topkWeights` `numTokens * topk` elements in the memory `routingMemory`
/// names (any may be NULL when `numTokens` is 0), all unwritten during the call; `stream` is
/// NULL or a stream of that GPU valid during the call; `handle` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn xcclA2ESendDevice(
    comm: *mut xcclComm,
    x: *const c_void,
    numTokens: c_int,
    topkIdx: *const i32,
    topkWeights: *const f32,
    routingMemory: c_int,
    stream: xcclCudaStream_t,
    handle: *mut *mut xcclA2EHandle,
) -> xcclResult_t {
    with_comm("xcclA2ESendDevice", comm, |id, c, inner| {
        let device = cuda_device(c, "xcclA2ESendDevice")?;
        check_ptr(handle, "handle")?;
        let t = super::moe::check_tokens(c, numTokens)?;
        let n = t * c.topk;
        // SAFETY: the caller's contract (see the function's docs).
        let x = unsafe { lend(device, x, t * c.row_bytes, "x")? };
        let routing = match routingMemory {
            XCCL_MEMORY_HOST => Routing::Host {
                // SAFETY: the caller's contract (see the function's docs).
                topk_idx: unsafe { host_slice(c, topkIdx, n, "topkIdx")? },
                // SAFETY: the caller's contract (see the function's docs).
                topk_weights: unsafe { host_slice(c, topkWeights, n, "topkWeights")? },
            },
            XCCL_MEMORY_DEVICE => Routing::Device {
                // SAFETY: the caller's contract (see the function's docs).
                topk_idx: unsafe { lend(device, topkIdx.cast(), n * 4, "topkIdx")? },
                // SAFETY: the caller's contract (see the function's docs).
                topk_weights: unsafe { lend(device, topkWeights.cast(), n * 4, "topkWeights")? },
            },
            other => {
                return Err(Fail::invalid(format!(
                    "routingMemory = {other} is not an xcclMemory_t (0 xcclMemoryHost, \
                     1 xcclMemoryDevice)"
                )))
            }
        };
        // SAFETY: the caller's contract (see the function's docs).
        let stream = unsafe { borrow_stream(device, stream) };
        let h = inner.a2e_send_device(x, routing, &stream)?;
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(handle, super::moe::new_handle(id, h), "handle") }
    })
}

/// `xcclE2ARecvDevice`: `xcclE2ARecv` into `out` in device memory.
///
/// # Safety
/// `out` is `numTokens * rowBytes` bytes of device memory of the communicator's GPU
/// (`numTokens` of the handle's call) nobody else touches during the call; `stream` as
/// [`xcclA2ESendDevice`]'s.
#[no_mangle]
pub unsafe extern "C" fn xcclE2ARecvDevice(
    comm: *mut xcclComm,
    handle: *mut xcclA2EHandle,
    out: *mut c_void,
    stream: xcclCudaStream_t,
) -> xcclResult_t {
    with_comm("xcclE2ARecvDevice", comm, |_, c, inner| {
        let device = cuda_device(c, "xcclE2ARecvDevice")?;
        with_handle(handle, |h| {
            // SAFETY: the caller's contract (see the function's docs).
            let out = unsafe { lend_mut(device, out, h.num_tokens() * c.row_bytes, "out")? };
            // SAFETY: the caller's contract (see the function's docs).
            let stream = unsafe { borrow_stream(device, stream) };
            Ok(inner.e2a_recv_device(h, out, &stream)?)
        })
    })
}

/// `xcclA2ERecvDevice`: `xcclA2ERecv` with the rows written into `out` in device memory.
///
/// # Safety
/// `out` is `outBytes` bytes of device memory of the communicator's GPU nobody else touches
/// during the call; `stream` as [`xcclA2ESendDevice`]'s; `batch` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn xcclA2ERecvDevice(
    comm: *mut xcclComm,
    batch: *mut *mut xcclExpertBatch,
    out: *mut c_void,
    outBytes: usize,
    stream: xcclCudaStream_t,
) -> xcclResult_t {
    with_comm("xcclA2ERecvDevice", comm, |id, c, inner| {
        let device = cuda_device(c, "xcclA2ERecvDevice")?;
        check_ptr(batch, "batch")?;
        check_out_bytes(c, outBytes, c.max_expert_rows, "xcclCommDeviceRecvSize")?;
        // SAFETY: the caller's contract (see the function's docs).
        let out = unsafe { lend_mut(device, out, outBytes, "out")? };
        // SAFETY: the caller's contract (see the function's docs).
        let stream = unsafe { borrow_stream(device, stream) };
        let mut b = lock(&c.spare_expert).pop().unwrap_or_default();
        inner.a2e_recv_device(&mut b, out, &stream)?;
        let bid = register_expert_batch(id, b, true);
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(batch, bid as *mut xcclExpertBatch, "batch") }
    })
}

/// `xcclE2ASendDevice`: `xcclE2ASend` with `expertOut` in device memory.
///
/// # Safety
/// `expertOut` is `numRows * rowBytes` bytes of device memory of the communicator's GPU,
/// unwritten during the call; `stream` as [`xcclA2ESendDevice`]'s.
#[no_mangle]
pub unsafe extern "C" fn xcclE2ASendDevice(
    comm: *mut xcclComm,
    batch: *mut xcclExpertBatch,
    expertOut: *const c_void,
    stream: xcclCudaStream_t,
) -> xcclResult_t {
    with_comm("xcclE2ASendDevice", comm, |_, c, inner| {
        let device = cuda_device(c, "xcclE2ASendDevice")?;
        with_expert_batch(c, batch, |b| {
            let len = b.num_rows() * c.row_bytes;
            // SAFETY: the caller's contract (see the function's docs).
            let (out, stream) =
                unsafe { lend_with_stream(device, expertOut, len, "expertOut", stream)? };
            Ok(inner.e2a_send_device(b, out, &stream)?)
        })
    })
}

/// `xcclA2ERecvTokensDevice`: `xcclA2ERecvTokens` (with `onArrival`, when not NULL, as
/// `xcclA2ERecvTokensWithCallback`'s) with row `i` of `out` in device memory the batch's
/// token `i`.
///
/// # Safety
/// `out` is `outBytes` bytes of device memory of the communicator's GPU nobody else touches
/// during the call; `stream` as [`xcclA2ESendDevice`]'s; `batch` is valid for a write;
/// `onArrival`, when not NULL, follows the header's rules (it does not unwind) and may be
/// called with `userData`.
#[no_mangle]
pub unsafe extern "C" fn xcclA2ERecvTokensDevice(
    comm: *mut xcclComm,
    batch: *mut *mut xcclTokenBatch,
    out: *mut c_void,
    outBytes: usize,
    stream: xcclCudaStream_t,
    onArrival: xcclArrivalFn,
    userData: *mut c_void,
) -> xcclResult_t {
    with_comm("xcclA2ERecvTokensDevice", comm, |id, c, inner| {
        let device = cuda_device(c, "xcclA2ERecvTokensDevice")?;
        check_ptr(batch, "batch")?;
        check_out_bytes(
            c,
            outBytes,
            c.max_recv_tokens,
            "xcclCommDeviceRecvTokensSize",
        )?;
        // SAFETY: the caller's contract (see the function's docs).
        let out = unsafe { lend_mut(device, out, outBytes, "out")? };
        // SAFETY: the caller's contract (see the function's docs).
        let stream = unsafe { borrow_stream(device, stream) };
        // SAFETY: the caller's contract (see the function's docs).
        let mut arrival = unsafe { arrival_callback(id, c, onArrival, userData, true) };
        let mut b = lock(&c.spare_token).pop().unwrap_or_default();
        inner.a2e_recv_tokens_device(&mut b, out, &stream, &mut arrival)?;
        let bid = register_token_batch(id, b, true);
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(batch, bid as *mut xcclTokenBatch, "batch") }
    })
}

/// `xcclE2ASendTokensDevice`: `xcclE2ASendTokens` with `reduced` in device memory.
///
/// # Safety
/// `reduced` is `numTokens * rowBytes` bytes of device memory of the communicator's GPU,
/// unwritten during the call; `stream` as [`xcclA2ESendDevice`]'s.
#[no_mangle]
pub unsafe extern "C" fn xcclE2ASendTokensDevice(
    comm: *mut xcclComm,
    batch: *mut xcclTokenBatch,
    reduced: *const c_void,
    stream: xcclCudaStream_t,
) -> xcclResult_t {
    with_comm("xcclE2ASendTokensDevice", comm, |_, c, inner| {
        let device = cuda_device(c, "xcclE2ASendTokensDevice")?;
        with_token_batch(c, batch, false, |b| {
            let len = b.num_tokens() * c.row_bytes;
            // SAFETY: the caller's contract (see the function's docs).
            let (reduced, stream) =
                unsafe { lend_with_stream(device, reduced, len, "reduced", stream)? };
            Ok(inner.e2a_send_tokens_device(b, reduced, &stream)?)
        })
    })
}

/// `xcclCommCuDevice`: the CUDA device ordinal of a communicator on the cuda fabric, -1 on
/// other fabrics.
///
/// # Safety
/// `device`, when non-NULL, is valid for a write of an `int`.
#[no_mangle]
pub unsafe extern "C" fn xcclCommCuDevice(comm: *mut xcclComm, device: *mut c_int) -> xcclResult_t {
    query("xcclCommCuDevice", comm, |c| {
        let d = c.cuda_device.as_ref().map_or(-1, |d| d.ordinal() as c_int);
        // SAFETY: the caller's contract (see the function's docs).
        unsafe { put(device, d, "device") }
    })
}

/// `xcclCommDeviceRecvSize`: the rows and bytes `xcclA2ERecvDevice`'s `out` needs.
///
/// # Safety
/// `maxExpertRows` and `outBytes`, when non-NULL, are valid for a write of a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn xcclCommDeviceRecvSize(
    comm: *mut xcclComm,
    maxExpertRows: *mut usize,
    outBytes: *mut usize,
) -> xcclResult_t {
    query("xcclCommDeviceRecvSize", comm, |c| {
        // SAFETY: the caller's contract (see the function's docs).
        unsafe {
            put(maxExpertRows, c.max_expert_rows, "maxExpertRows")?;
            put(outBytes, c.max_expert_rows * c.row_bytes, "outBytes")
        }
    })
}

/// `xcclCommDeviceRecvTokensSize`: the tokens and bytes `xcclA2ERecvTokensDevice`'s `out`
/// needs.
///
/// # Safety
/// `maxRecvTokens` and `outBytes`, when non-NULL, are valid for a write of a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn xcclCommDeviceRecvTokensSize(
    comm: *mut xcclComm,
    maxRecvTokens: *mut usize,
    outBytes: *mut usize,
) -> xcclResult_t {
    query("xcclCommDeviceRecvTokensSize", comm, |c| {
        // SAFETY: the caller's contract (see the function's docs).
        unsafe {
            put(maxRecvTokens, c.max_recv_tokens, "maxRecvTokens")?;
            put(outBytes, c.max_recv_tokens * c.row_bytes, "outBytes")
        }
    })
}
