//! Tensors out: [`Buffer`], a `[rows, cols]` (or 1-D) block of host memory, or of device memory
//! of a `cuda` communicator's GPU, that exports DLPack (`torch.from_dlpack(buf)`,
//! `np.from_dlpack(buf)` for host memory, take it without a copy). Every export keeps the
//! `Buffer` alive, and the `Buffer` keeps alive what owns the memory: its own allocation (host
//! bytes or a [`DeviceMemory`]), the batch it views, or the communicator whose registered
//! window it is.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use dlpark::ffi::{DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::{export_dlpack, DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use xccl::cuda::DeviceMemory;

use crate::errors::invalid;
use crate::tensor::Elem;

/// Host memory allocated by the binding (8-byte aligned, zeroed), reached only through raw
/// pointers once handed out: Rust never holds a reference to it while Python may write it.
pub(crate) struct HostBytes {
    ptr: *mut u64,
    words: usize,
    len: usize,
}

// SAFETY: `HostBytes` owns a plain heap allocation with no thread affinity; the binding writes
// it only before it is exported (through `as_mut_slice`, which needs `&mut self`), afterwards
// only consumers of the export touch it, as with any DLPack tensor.
unsafe impl Send for HostBytes {}
// SAFETY: see `Send`; `&HostBytes` gives no access to the bytes.
unsafe impl Sync for HostBytes {}

impl HostBytes {
    /// `len` zeroed bytes.
    pub(crate) fn zeroed(len: usize) -> HostBytes {
        let words = len.div_ceil(8).max(1);
        let boxed = vec![0u64; words].into_boxed_slice();
        HostBytes {
            ptr: Box::into_raw(boxed).cast::<u64>(),
            words,
            len,
        }
    }

    /// A copy of `data`.
    pub(crate) fn copy_of(data: &[u8]) -> HostBytes {
        let mut b = HostBytes::zeroed(data.len());
        b.as_mut_slice().copy_from_slice(data);
        b
    }

    /// The bytes, for filling them before the buffer is handed out.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live allocation of `words * 8 >= len` initialised bytes owned by
        // `self`; `&mut self` excludes every other Rust borrow, and the buffer has not been
        // exported yet (exports need a `Buffer`, which takes `self` by value).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<u8>(), self.len) }
    }
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`words` came from `Box::into_raw` of a `[u64]` of `words` elements in
        // `zeroed`, and are freed only here, once.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.words)) });
    }
}

/// What keeps a [`Buffer`]'s memory alive.
pub(crate) enum Owner {
    /// The binding's own allocation (shared by the buffers viewing it).
    Host(Arc<HostBytes>),
    /// A batch object (its memory never changes once received), and the batch's count of
    /// live views (a receive never recycles a batch while one lives).
    Object(Py<PyAny>, Arc<()>),
    /// Something else that keeps the memory mapped: the communicator whose registered window
    /// it is (the registered A2E input), which this reference keeps alive even after `close()`.
    Keep(Arc<dyn std::any::Any + Send + Sync>),
    /// Device memory the binding allocated on a `cuda` communicator's GPU (freed when the last
    /// buffer over it goes).
    Device(Arc<DeviceMemory>),
}

/// A block of memory with a shape and a dtype, exported through DLPack without a copy: host
/// memory, or device memory of a CUDA GPU (from a communicator on the `cuda` fabric:
/// `__dlpack_device__()` is `(2, device id)`).
///
/// The memory stays valid as long as Python holds the `Buffer` or any tensor made from it:
/// each `__dlpack__` export holds a reference to the `Buffer`. Which buffers are writable and
/// until when is said where they come from (`Communicator.e2a_recv`: yours; batch rows:
/// read-only; `Communicator.a2e_input`: writable until `a2e_send_input`). Device memory is
/// complete when the call that returned it returns (xccl's calls are synchronous to the host),
/// so an export on any stream (`__dlpack__(stream=s)`) needs no synchronization.
#[pyclass(frozen, module = "xccl")]
pub struct Buffer {
    /// Where the memory is: the CPU, or a CUDA device.
    device: DLDevice,
    ptr: usize,
    len: usize,
    shape: Vec<i64>,
    elem: Elem,
    read_only: bool,
    /// Cleared when the memory may no longer be exported (a sent registered input).
    live: Option<Arc<AtomicBool>>,
    owner: Owner,
}

impl Buffer {
    /// A buffer over `owner`'s memory at `ptr` (`shape` elements of `elem`, C order).
    ///
    /// `ptr` must point at `shape.product() * elem.size()` bytes that stay allocated while
    /// `owner` lives, writable unless `read_only`.
    pub(crate) fn new(
        owner: Owner,
        ptr: *const u8,
        shape: &[usize],
        elem: Elem,
        read_only: bool,
        live: Option<Arc<AtomicBool>>,
    ) -> Buffer {
        let len = shape.iter().product::<usize>() * elem.size();
        Buffer {
            device: DLDevice::CPU,
            ptr: ptr as usize,
            len,
            shape: shape.iter().map(|&d| d as i64).collect(),
            elem,
            read_only,
            live,
            owner,
        }
    }

    /// A buffer owning `bytes` (writable).
    pub(crate) fn host(bytes: HostBytes, shape: &[usize], elem: Elem) -> Buffer {
        let ptr = bytes.ptr.cast::<u8>().cast_const();
        Buffer::new(Owner::Host(Arc::new(bytes)), ptr, shape, elem, false, None)
    }

    /// A buffer over device memory of CUDA device `device` at `ptr` (`shape` elements of `elem`,
    /// C order; `ptr` 0 when there are none), kept allocated by `owner`, writable unless
    /// `read_only`.
    pub(crate) fn on_device(
        owner: Owner,
        ptr: u64,
        device: usize,
        shape: &[usize],
        elem: Elem,
        read_only: bool,
    ) -> Buffer {
        let mut b = Buffer::new(
            owner,
            ptr as usize as *const u8,
            shape,
            elem,
            read_only,
            None,
        );
        b.device = cuda_device(device);
        b
    }

    /// Where the memory is, as DLPack names it.
    pub(crate) fn dl_device(&self) -> DLDevice {
        self.device
    }

    /// A buffer holding a copy of `values`.
    pub(crate) fn copy_of<T: bytemuck::Pod>(values: &[T], shape: &[usize], elem: Elem) -> Buffer {
        Buffer::host(
            HostBytes::copy_of(bytemuck::cast_slice(values)),
            shape,
            elem,
        )
    }

    fn flags(&self) -> DlpackFlags {
        if self.read_only {
            DlpackFlags::READ_ONLY
        } else {
            DlpackFlags::empty()
        }
    }

    /// Start, length in bytes, shape, element type and read-only flag of the memory.
    pub(crate) fn raw(&self) -> (*mut u8, usize, &[i64], Elem, bool) {
        (
            self.ptr as *mut u8,
            self.len,
            &self.shape,
            self.elem,
            self.read_only,
        )
    }

    /// Fails once the memory may no longer be used (a registered input that was sent).
    pub(crate) fn check_live(&self, py: Python<'_>) -> PyResult<()> {
        match &self.live {
            Some(live) if !live.load(Ordering::Acquire) => Err(invalid(
                py,
                "this registered A2E input was sent (a2e_send_input) and now belongs to the call \
                 in flight: get the next call's input with a2e_input()",
            )),
            _ => Ok(()),
        }
    }

    /// A fresh managed tensor whose context keeps `me` alive.
    fn managed<M: ManagedTensorBase>(&self, me: Py<Buffer>) -> PyResult<Managed<M>> {
        let mut init = Dynamic::compact(self.shape.clone())
            .initialize_as::<M>(Box::new(me))
            .map_err(|e| PyBufferError::new_err(format!("DLPack metadata: {e}")))?;
        init.set_data(self.ptr as *mut std::ffi::c_void)
            .set_device(self.device)
            .set_dtype(self.elem.dl());
        init.set_flags(self.flags())
            .map_err(|e| PyBufferError::new_err(format!("DLPack flags: {e}")))?;
        // SAFETY: the data pointer addresses `len` bytes of memory of `self.device` (host
        // memory, or device memory of that CUDA device, complete: see `prepare_export`) that
        // stay allocated
        // while the context (a reference to this `Buffer`, which holds its owner) lives; the
        // shape and compact strides describe exactly those bytes; the flags say read-only
        // where the memory must not be written.
        Ok(unsafe { init.finish() })
    }
}

/// One export of a buffer: the buffer and a reference to it for the capsule's context.
struct Export<'a> {
    buf: &'a Buffer,
    me: Py<Buffer>,
}

impl DlpackExporter for Export<'_> {
    fn device(&self) -> DLDevice {
        self.buf.device
    }

    fn flags(&self) -> DlpackFlags {
        self.buf.flags()
    }

    /// Device memory is complete when the xccl call that produced it returned (the calls are
    /// synchronous to the host), so every legal `stream` is honoured without synchronizing:
    /// the consumer's work on it sees the data. The value is still checked (the array API's
    /// rules for CUDA: `None`, -1, 1, 2 or a stream pointer; 0 is ambiguous and refused).
    fn prepare_export(&self, _py: Python<'_>, request: &ExportRequest<'_>) -> PyResult<()> {
        if self.buf.device.device_type == DLDeviceType::CUDA {
            request.cuda_stream()?;
        }
        Ok(())
    }

    fn export_legacy(&self, py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.buf.managed(self.me.clone_ref(py))
    }

    fn export_versioned(&self, py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.buf.managed(self.me.clone_ref(py))
    }
}

#[pymethods]
impl Buffer {
    /// DLPack export (the Python array API protocol): a capsule over this memory, no copy.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        slf: &Bound<'_, Self>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let buf = slf.get();
        buf.check_live(py)?;
        let request = ExportRequest::parse(stream, max_version, dl_device, copy)?;
        let export = Export {
            buf,
            me: slf.clone().unbind(),
        };
        export_dlpack(&export, py, request)
    }

    /// `(device_type, device_id)` for DLPack: `(1, 0)` for the CPU, `(2, id)` for CUDA device
    /// `id`.
    fn __dlpack_device__(&self) -> (u32, i32) {
        (self.device.device_type.0, self.device.device_id)
    }

    /// Where the memory is: ``"cpu"`` or ``"cuda:<id>"`` (torch's spelling).
    #[getter(device)]
    fn device_name(&self) -> String {
        if self.device.device_type == DLDeviceType::CPU {
            "cpu".into()
        } else {
            crate::tensor::device_name(self.device)
        }
    }

    /// The shape, as a tuple.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// The element type: `"float32"`, `"float16"`, `"bfloat16"`, `"int32"`, `"int8"`...
    #[getter]
    fn dtype(&self) -> String {
        self.elem.name()
    }

    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// Whether consumers must not write this memory (batch rows).
    #[getter]
    fn readonly(&self) -> bool {
        self.read_only
    }

    /// Length of the first axis.
    fn __len__(&self) -> usize {
        self.shape.first().map_or(0, |&d| d as usize)
    }

    /// This memory as a numpy array, without a copy (`bfloat16` as `ml_dtypes.bfloat16`); host
    /// memory only (a CUDA buffer: ``torch.from_dlpack(buf)``, or copy it to the host first).
    fn numpy<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let buf = slf.get();
        if buf.device.device_type != DLDeviceType::CPU {
            return Err(invalid(
                py,
                format!(
                    "this buffer is device memory ({}); numpy reads host memory only: use \
                     torch.from_dlpack(buf) (no copy) and .cpu() for a host copy",
                    buf.device_name()
                ),
            ));
        }
        let np = py.import("numpy")?;
        if buf.elem == Elem::BF16 {
            let bits = Bound::new(py, buf.reinterpret(py, Elem::U16)?)?;
            let arr = np.call_method1("from_dlpack", (bits,))?;
            let bf16 = py.import("ml_dtypes")?.getattr("bfloat16")?;
            return arr.call_method1("view", (bf16,));
        }
        np.call_method1("from_dlpack", (slf,))
    }

    /// The same memory seen as unsigned integers of the element's width (`uint16` for
    /// float16/bfloat16, `uint32` for float32), for bitwise comparisons; no copy.
    fn bits(slf: &Bound<'_, Self>) -> PyResult<Buffer> {
        let buf = slf.get();
        let elem = match buf.elem.size() {
            1 => Elem::U8,
            2 => Elem::U16,
            4 => Elem::U32,
            _ => Elem::U64,
        };
        buf.reinterpret(slf.py(), elem)
    }

    fn __repr__(&self) -> String {
        let device = if self.device.device_type == DLDeviceType::CPU {
            String::new()
        } else {
            format!(", device={}", self.device_name())
        };
        format!(
            "xccl.Buffer(shape={:?}, dtype={}{device}{})",
            self.shape,
            self.elem.name(),
            if self.read_only { ", readonly" } else { "" }
        )
    }
}

impl Buffer {
    /// The same memory as elements of `elem` (same size), owned by a reference to this buffer's
    /// owner.
    fn reinterpret(&self, py: Python<'_>, elem: Elem) -> PyResult<Buffer> {
        debug_assert_eq!(elem.size(), self.elem.size());
        let owner = match &self.owner {
            Owner::Host(h) => Owner::Host(h.clone()),
            Owner::Object(o, views) => Owner::Object(o.clone_ref(py), views.clone()),
            Owner::Keep(k) => Owner::Keep(k.clone()),
            Owner::Device(m) => Owner::Device(m.clone()),
        };
        let shape: Vec<usize> = self.shape.iter().map(|&d| d as usize).collect();
        let mut same = Buffer::new(
            owner,
            self.ptr as *const u8,
            &shape,
            elem,
            self.read_only,
            self.live.clone(),
        );
        same.device = self.device;
        Ok(same)
    }
}

/// DLPack's name of CUDA device `ordinal`.
fn cuda_device(ordinal: usize) -> DLDevice {
    DLDevice {
        device_type: DLDeviceType::CUDA,
        device_id: i32::try_from(ordinal).unwrap_or(i32::MAX),
    }
}
