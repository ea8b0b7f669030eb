//! Support for the package's own tests.
//!
//! Fault injection: `xccl._xccl._inject_panic(site)` makes the next call on a communicator
//! (`"call"`) or the next init/shrink helper thread (`"helper"`) panic once, so that the tests
//! can check that no panic reaches Python and that the job is told. Nothing else reads it; it
//! costs one atomic load per call.
//!
//! CUDA tensors without a GPU (torch cannot make them there): `_to_device` copies a host tensor
//! into device memory allocated with xccl's CUDA layer (on the stand-in driver in CI) and hands
//! it out as a CUDA `Buffer`; `_to_host` reads any CUDA DLPack tensor back; `_new_stream` makes
//! a stream to stand in for torch's current one.

use std::sync::atomic::{AtomicU8, Ordering};

use pyo3::prelude::*;

use crate::errors::invalid;

/// Where an injected panic fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Site {
    /// Inside the next call on a communicator, with its lock held.
    Call = 1,
    /// On the next helper thread of init or shrink, before its work.
    Helper = 2,
}

/// The armed site (0: none).
static ARMED: AtomicU8 = AtomicU8::new(0);

/// Panics if a test armed `site` (once).
pub(crate) fn maybe_panic(site: Site) {
    if ARMED.load(Ordering::Relaxed) == site as u8
        && ARMED
            .compare_exchange(site as u8, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    {
        panic!("a panic injected by a test at {site:?}");
    }
}

/// Arms a panic at `site` (`"call"` or `"helper"`): for the package's tests only.
#[pyfunction]
pub(crate) fn _inject_panic(py: Python<'_>, site: &str) -> PyResult<()> {
    let site = match site {
        "call" => Site::Call,
        "helper" => Site::Helper,
        other => {
            return Err(invalid(
                py,
                format!("unknown site {other:?} (expected \"call\" or \"helper\")"),
            ))
        }
    };
    ARMED.store(site as u8, Ordering::Release);
    Ok(())
}

/// Streams made by [`_new_stream`], alive for the process (tests hand their raw values to
/// xccl as "torch's current stream").
static STREAMS: std::sync::Mutex<Vec<xccl::cuda::Stream>> = std::sync::Mutex::new(Vec::new());

/// How long the test helpers' copies may take.
const COPY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// A copy of the host tensor `obj` in new device memory of CUDA device `device`, as a writable
/// CUDA `Buffer` of the same shape and dtype: a producer of CUDA tensors for the package's
/// tests, which have no GPU (the stand-in driver's device memory is host memory).
#[pyfunction]
pub(crate) fn _to_device(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: usize,
) -> PyResult<crate::buffer::Buffer> {
    use xccl::cuda::{Device, DeviceMemory, DeviceRegion, Stream};
    let t = crate::tensor::Tensor::import(py, obj, "obj")?;
    let shape = t.shape().to_vec();
    let bytes = t.bytes();
    let to_py = |e: xccl::Error| crate::errors::to_py(py, &e, false);
    let dev = Device::open(device).map_err(to_py)?;
    let (owner, ptr) = if bytes.is_empty() {
        let empty = crate::buffer::HostBytes::zeroed(0);
        (crate::buffer::Owner::Host(std::sync::Arc::new(empty)), 0)
    } else {
        let mem =
            DeviceMemory::alloc(&dev, bytes.len(), || "a test tensor".into()).map_err(to_py)?;
        let stream = Stream::new(&dev).map_err(to_py)?;
        let deadline = std::time::Instant::now() + COPY_DEADLINE;
        stream
            .write(&mem, 0, bytes, deadline, 0, &|| {
                "uploading a test tensor".into()
            })
            .map_err(to_py)?;
        let ptr = mem.ptr().addr();
        (crate::buffer::Owner::Device(std::sync::Arc::new(mem)), ptr)
    };
    Ok(crate::buffer::Buffer::on_device(
        owner,
        ptr,
        device,
        &shape,
        t.elem(),
        false,
    ))
}

/// A host copy (a CPU `Buffer`) of `obj`, any DLPack tensor in memory of CUDA device `device`,
/// imported as xccl imports a call's tensors (device, layout; the stream protocol on the legacy
/// default stream) and read with one device-to-host copy on that stream.
#[pyfunction]
pub(crate) fn _to_host(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: usize,
) -> PyResult<crate::buffer::Buffer> {
    use crate::tensor::{CudaPlace, Place, Tensor};
    let place = Place::cuda(CudaPlace { device, stream: 0 });
    let t = Tensor::import_at(py, obj, "obj", &place)?;
    match t.host_copy(py, 0, COPY_DEADLINE)? {
        Some(copy) => Ok(copy),
        None => Err(crate::errors::invalid(py, "obj is not device memory")),
    }
}

/// A new stream on CUDA device `device`, kept for the life of the process; returns its raw
/// `CUstream` value (for tests that stand in for torch's current stream).
#[pyfunction]
pub(crate) fn _new_stream(py: Python<'_>, device: usize) -> PyResult<u64> {
    let to_py = |e: xccl::Error| crate::errors::to_py(py, &e, false);
    let dev = xccl::cuda::Device::open(device).map_err(to_py)?;
    let stream = xccl::cuda::Stream::new(&dev).map_err(to_py)?;
    let raw = stream.raw();
    STREAMS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(stream);
    Ok(raw)
}
