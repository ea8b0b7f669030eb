//! Tensors in: any object with `__dlpack__` (torch tensors, numpy >= 1.22, JAX arrays, CuPy),
//! numpy arrays of `ml_dtypes.bfloat16`, and (through numpy) any object with the buffer
//! protocol. `Tensor::import_at` checks the device against where the call takes its tensors
//! (`Place`: host memory, or the CUDA device of a `cuda` communicator, whose producers are
//! asked to make their data ready on the call's stream) and the layout; the `expect_*`
//! functions check dtype and shape against what a call needs, before anything is sent.

use std::borrow::Cow;

use dlpark::ffi::{
    DLDataTypeCode, DLDevice, DLDeviceType, DLManagedTensorVersioned, DLPACK_MAJOR_VERSION,
    DLPACK_MINOR_VERSION,
};
use dlpark::python::consumer::exchange::ExchangeApi;
use dlpark::python::consumer::stream;
use dlpark::python::{DlpackStream, ImportRequest, ImportedDlpack, StreamArg};
use dlpark::{DlpackFlags, Managed, TensorRef};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyDict, PyString, PyType};

use crate::buffer::Buffer;
use crate::errors::invalid;

/// Element type of a tensor, as far as xccl cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Elem {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE binary64.
    F64,
    /// Signed integers of 8, 16, 32, 64 bits.
    I8,
    I16,
    I32,
    I64,
    /// Unsigned integers.
    U8,
    U16,
    U32,
    U64,
    /// Anything else (bool, complex, fp8, vector types...), as DLPack's code and bits.
    Other(u8, u8, u16),
}

impl Elem {
    /// The element type of a DLPack dtype.
    fn of(dt: dlpark::ffi::DLDataType) -> Elem {
        if dt.lanes != 1 {
            return Elem::Other(dt.code.0, dt.bits, dt.lanes);
        }
        match (dt.code, dt.bits) {
            (DLDataTypeCode::FLOAT, 32) => Elem::F32,
            (DLDataTypeCode::FLOAT, 16) => Elem::F16,
            (DLDataTypeCode::BFLOAT, 16) => Elem::BF16,
            (DLDataTypeCode::FLOAT, 64) => Elem::F64,
            (DLDataTypeCode::INT, 8) => Elem::I8,
            (DLDataTypeCode::INT, 16) => Elem::I16,
            (DLDataTypeCode::INT, 32) => Elem::I32,
            (DLDataTypeCode::INT, 64) => Elem::I64,
            (DLDataTypeCode::UINT, 8) => Elem::U8,
            (DLDataTypeCode::UINT, 16) => Elem::U16,
            (DLDataTypeCode::UINT, 32) => Elem::U32,
            (DLDataTypeCode::UINT, 64) => Elem::U64,
            (code, bits) => Elem::Other(code.0, bits, 1),
        }
    }

    /// The element type of an xccl dtype.
    pub(crate) fn of_dtype(d: xccl::DType) -> Elem {
        match d {
            xccl::DType::F32 => Elem::F32,
            xccl::DType::F16 => Elem::F16,
            xccl::DType::BF16 => Elem::BF16,
        }
    }

    /// Bytes per element.
    pub(crate) fn size(self) -> usize {
        match self {
            Elem::I8 | Elem::U8 => 1,
            Elem::F16 | Elem::BF16 | Elem::I16 | Elem::U16 => 2,
            Elem::F32 | Elem::I32 | Elem::U32 => 4,
            Elem::F64 | Elem::I64 | Elem::U64 => 8,
            Elem::Other(_, bits, lanes) => (usize::from(bits) * usize::from(lanes)).div_ceil(8),
        }
    }

    /// The name users know it by (`"float32"`, `"bfloat16"`, `"int64"`...).
    pub(crate) fn name(self) -> String {
        match self {
            Elem::F32 => "float32".into(),
            Elem::F16 => "float16".into(),
            Elem::BF16 => "bfloat16".into(),
            Elem::F64 => "float64".into(),
            Elem::I8 => "int8".into(),
            Elem::I16 => "int16".into(),
            Elem::I32 => "int32".into(),
            Elem::I64 => "int64".into(),
            Elem::U8 => "uint8".into(),
            Elem::U16 => "uint16".into(),
            Elem::U32 => "uint32".into(),
            Elem::U64 => "uint64".into(),
            Elem::Other(6, _, 1) => "bool".into(),
            Elem::Other(5, bits, 1) => format!("complex{bits}"),
            Elem::Other(code, bits, lanes) => {
                format!("DLPack type code {code} of {bits} bits x {lanes} lanes")
            }
        }
    }

    /// The DLPack dtype of this element type (for the types xccl hands out).
    pub(crate) fn dl(self) -> dlpark::ffi::DLDataType {
        let (code, bits) = match self {
            Elem::F32 => (DLDataTypeCode::FLOAT, 32),
            Elem::F16 => (DLDataTypeCode::FLOAT, 16),
            Elem::BF16 => (DLDataTypeCode::BFLOAT, 16),
            Elem::F64 => (DLDataTypeCode::FLOAT, 64),
            Elem::I8 => (DLDataTypeCode::INT, 8),
            Elem::I16 => (DLDataTypeCode::INT, 16),
            Elem::I32 => (DLDataTypeCode::INT, 32),
            Elem::I64 => (DLDataTypeCode::INT, 64),
            Elem::U8 => (DLDataTypeCode::UINT, 8),
            Elem::U16 => (DLDataTypeCode::UINT, 16),
            Elem::U32 => (DLDataTypeCode::UINT, 32),
            Elem::U64 => (DLDataTypeCode::UINT, 64),
            Elem::Other(code, bits, lanes) => {
                return dlpark::ffi::DLDataType::new(DLDataTypeCode(code), bits, lanes)
            }
        };
        dlpark::ffi::DLDataType::scalar(code, bits)
    }
}

/// The name of a DLPack device, as frameworks print it (`"cuda:0"`).
pub(crate) fn device_name(d: DLDevice) -> String {
    let kind = match d.device_type.0 {
        1 => "cpu",
        2 => "cuda",
        3 => "cuda_host",
        4 => "opencl",
        7 => "vulkan",
        8 => "metal",
        9 => "vpi",
        10 => "rocm",
        11 => "rocm_host",
        12 => "ext_dev",
        13 => "cuda_managed",
        14 => "oneapi",
        15 => "webgpu",
        16 => "hexagon",
        17 => "maia",
        other => return format!("DLPack device type {other}:{}", d.device_id),
    };
    format!("{kind}:{}", d.device_id)
}

/// Whether this process's CPU may read and write memory of device `d` directly: host memory,
/// pinned host memory of CUDA or ROCm.
fn host_accessible(d: DLDevice) -> bool {
    d.device_type == DLDeviceType::CPU || matches!(d.device_type.0, 3 | 11)
}

/// The CUDA device of a `cuda` communicator and the stream its next call orders after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CudaPlace {
    /// The device ordinal (DLPack's `device_id` of `kDLCUDA`).
    pub(crate) device: usize,
    /// The raw `CUstream` the call orders after (0: the legacy default stream): producers are
    /// asked to make their data ready on it (`__dlpack__(stream=...)`).
    pub(crate) stream: u64,
}

/// Where a call takes a tensor: host memory, memory of a communicator's CUDA device, or either
/// (the routing of a call on a `cuda` communicator).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Place {
    /// Host memory (the CPU, pinned host memory) is taken.
    pub(crate) host: bool,
    /// Memory of this CUDA device is taken.
    pub(crate) cuda: Option<CudaPlace>,
}

impl Place {
    /// Host memory only (every communicator but a `cuda` one).
    pub(crate) const HOST: Place = Place {
        host: true,
        cuda: None,
    };

    /// Device memory of `c` only.
    pub(crate) fn cuda(c: CudaPlace) -> Place {
        Place {
            host: false,
            cuda: Some(c),
        }
    }

    /// Host memory or device memory of `c`.
    pub(crate) fn host_or(c: CudaPlace) -> Place {
        Place {
            host: true,
            cuda: Some(c),
        }
    }

    /// The consumer stream for a producer on `device`, when it is the CUDA device taken.
    fn stream_for(&self, device: DLDevice) -> Option<ConsumerStream> {
        self.cuda
            .filter(|c| is_cuda_device(device, c.device))
            .map(|c| ConsumerStream(c.stream))
    }
}

/// Whether `d` is CUDA device `ordinal` (`kDLCUDA`).
fn is_cuda_device(d: DLDevice, ordinal: usize) -> bool {
    d.device_type == DLDeviceType::CUDA && usize::try_from(d.device_id).ok() == Some(ordinal)
}

/// The stream a call on a `cuda` communicator orders after, as a DLPack consumer: producers
/// are asked (`__dlpack__(stream=...)`) to make their data ready on it; a producer whose C
/// exchange API (torch) reports that very stream as its current one is taken without a
/// Python call.
struct ConsumerStream(u64);

// SAFETY: the value is the raw `CUstream` a call on the communicator's device orders after
// (torch's current stream of that device, or 0, the legacy default stream, sent as DLPack's
// sentinel 1), live for the call; it is offered only for producers on that CUDA device.
unsafe impl DlpackStream for ConsumerStream {
    fn as_python_arg(&self, _py: Python<'_>, _device: DLDevice) -> PyResult<StreamArg> {
        Ok(stream::cuda(self.0 as usize as *mut std::ffi::c_void))
    }

    unsafe fn wait_for_producer(
        &self,
        _device: DLDevice,
        producer: *mut std::ffi::c_void,
    ) -> PyResult<bool> {
        // The data is ready on the producer's current stream: taken as is when that is the
        // call's stream, else through `__dlpack__(stream=...)`, which orders it.
        Ok(producer as usize as u64 == self.0)
    }
}

/// Dimensions kept inline up to this many (every tensor xccl takes has 1 or 2).
const INLINE_DIMS: usize = 4;

/// A tensor's shape, without a heap allocation for the shapes xccl takes.
pub(crate) enum Shape {
    Inline([usize; INLINE_DIMS], usize),
    Heap(Vec<usize>),
}

impl Shape {
    fn of(dims: &[i64]) -> Shape {
        let size = |&d: &i64| usize::try_from(d).unwrap_or(0);
        if dims.len() <= INLINE_DIMS {
            let mut inline = [0; INLINE_DIMS];
            for (slot, d) in inline.iter_mut().zip(dims) {
                *slot = size(d);
            }
            Shape::Inline(inline, dims.len())
        } else {
            Shape::Heap(dims.iter().map(size).collect())
        }
    }

    fn as_slice(&self) -> &[usize] {
        match self {
            Shape::Inline(dims, n) => &dims[..*n],
            Shape::Heap(v) => v,
        }
    }
}

/// What owns a tensor's memory while a call uses it (with the GIL released): an owning
/// reference, never a borrowed view, so that no other thread can free or swap the memory
/// meanwhile (`t.set_(...)`, `del t`). Dropping it releases the reference once.
enum Owner<'py> {
    /// A managed tensor from the producer's DLPack C exchange API (torch), over a fresh alias of
    /// the tensor (`t.detach()`), so that the memory stays the producer's storage even if the
    /// caller's tensor is given other storage: dlpark's [`Managed`] calls its deleter exactly
    /// once, when dropped.
    Exchange(#[allow(dead_code)] Managed<DLManagedTensorVersioned>),
    /// A managed tensor from a `__dlpack__` capsule (numpy, JAX, anything else), dropped the
    /// same way.
    Capsule(#[allow(dead_code)] ImportedDlpack),
    /// An `xccl.Buffer` (which keeps its owner alive), referenced for the call.
    Buffer(#[allow(dead_code)] Bound<'py, Buffer>),
}

/// A tensor handed in by the caller: an owning reference to its memory ([`Owner`]), the device
/// it lives on (type and id, as DLPack names them), its data pointer, shape and dtype, and
/// whether the producer marked it read-only. Only memory of the call's [`Place`] is taken
/// ([`accept_device`]: anything else is refused naming both devices), C-contiguous.
///
/// Imported by the fastest exact path its type has: an `xccl.Buffer` directly; a producer with
/// the DLPack C exchange API (torch) through a managed tensor, with no capsule and no Python
/// call but `detach()`; a numpy array through `__dlpack__(max_version=...)`; anything else
/// through dlpark's negotiated import (`__dlpack_device__`, `__dlpack__`) or the buffer
/// protocol.
pub(crate) struct Tensor<'py> {
    _owner: Owner<'py>,
    /// Where the memory is (checked by [`accept_device`]).
    device: DLDevice,
    /// Start of the data (byte offset applied); null only when the tensor is empty.
    ptr: *mut u8,
    len_bytes: usize,
    shape: Shape,
    elem: Elem,
    read_only: bool,
}

/// The layout facts of a DLPack tensor, checked (host memory, C-contiguous).
struct Layout {
    device: DLDevice,
    ptr: *mut u8,
    len_bytes: usize,
    shape: Shape,
    elem: Elem,
}

impl Layout {
    /// Checks `t` (memory of `place`) and reads its layout; `bf16` says its 16-bit unsigned
    /// elements are bfloat16 bits (a numpy `ml_dtypes.bfloat16` array seen as `uint16`).
    fn of(
        py: Python<'_>,
        t: &TensorRef<'_>,
        what: &str,
        place: &Place,
        bf16: bool,
    ) -> PyResult<Layout> {
        accept_device(py, t.device(), what, place)?;
        let mut elem = Elem::of(t.dtype());
        if bf16 && elem == Elem::U16 {
            elem = Elem::BF16;
        }
        let shape = Shape::of(t.shape());
        let dims = shape.as_slice();
        let numel: usize = dims.iter().product();
        if numel > 0 {
            if let Some(strides) = t.strides() {
                let mut expect: i64 = 1;
                for (axis, (&n, &s)) in dims.iter().zip(strides).enumerate().rev() {
                    if n != 1 && s != expect {
                        return Err(invalid(
                            py,
                            format!(
                                "{what} is not C-contiguous (shape {dims:?}, strides {strides:?} \
                                 in elements; axis {axis} has stride {s}, expected {expect}): \
                                 pass x.contiguous() (torch) or np.ascontiguousarray(x)"
                            ),
                        ));
                    }
                    expect = expect.saturating_mul(n as i64);
                }
            }
        }
        let ptr = if numel == 0 {
            std::ptr::null_mut()
        } else {
            // The byte offset moves the start within the producer's allocation (DLPack's
            // contract); nothing is dereferenced here.
            (t.data_ptr() as *mut u8).wrapping_add(t.byte_offset() as usize)
        };
        if numel > 0 && ptr.is_null() {
            return Err(invalid(
                py,
                format!("{what}: DLPack tensor has no data pointer"),
            ));
        }
        Ok(Layout {
            device: t.device(),
            ptr,
            len_bytes: numel * elem.size(),
            shape,
            elem,
        })
    }
}

impl<'py> Tensor<'py> {
    /// Imports `obj` (`what` names it in errors: `"x"`, `"topk_idx"`...), a tensor in host
    /// memory.
    ///
    /// Errors ([`crate::errors`]' `InvalidArgumentError`): no `__dlpack__` and no buffer protocol,
    /// a device the CPU cannot address (named), a non-C-contiguous layout.
    pub(crate) fn import(
        py: Python<'py>,
        obj: &Bound<'py, PyAny>,
        what: &str,
    ) -> PyResult<Tensor<'py>> {
        Tensor::import_at(py, obj, what, &Place::HOST)
    }

    /// Imports `obj`, a tensor in memory of `place`: a producer on the CUDA device of `place`
    /// is asked to make its data ready on the call's stream (the consumer side of DLPack's
    /// stream protocol). Errors as [`Tensor::import`]; a tensor elsewhere names both devices.
    pub(crate) fn import_at(
        py: Python<'py>,
        obj: &Bound<'py, PyAny>,
        what: &str,
        place: &Place,
    ) -> PyResult<Tensor<'py>> {
        if let Ok(buf) = obj.cast_exact::<Buffer>() {
            return Tensor::of_buffer(py, buf, what, place);
        }
        if is_ndarray(py, obj) {
            if let Some(t) = Tensor::numpy(py, obj, what, place)? {
                return Ok(t);
            }
        } else if let Some(t) = Tensor::exchange(py, obj, what, place)? {
            return Ok(t);
        }
        Tensor::negotiated(py, obj, what, place)
    }

    /// An `xccl.Buffer`: its memory directly (its owner stays alive while `buf` is held).
    fn of_buffer(
        py: Python<'py>,
        buf: &Bound<'py, Buffer>,
        what: &str,
        place: &Place,
    ) -> PyResult<Tensor<'py>> {
        let b = buf.get();
        b.check_live(py).map_err(|e| {
            invalid(
                py,
                format!(
                    "{what}: {}",
                    e.value(py).str().map(|s| s.to_string()).unwrap_or_default()
                ),
            )
        })?;
        let (ptr, len_bytes, dims, elem, read_only) = b.raw();
        let device = b.dl_device();
        accept_device(py, device, what, place)?;
        Ok(Tensor {
            _owner: Owner::Buffer(buf.clone()),
            device,
            ptr: if len_bytes == 0 {
                std::ptr::null_mut()
            } else {
                ptr
            },
            len_bytes,
            shape: Shape::of(dims),
            elem,
            read_only,
        })
    }

    /// A producer with the DLPack C exchange API (torch): a managed tensor of a fresh alias of
    /// `obj` (`obj.detach()`: the same storage, but an object no one else can give other
    /// storage), with no capsule. `None` when `obj`'s type has no such API.
    ///
    /// A CUDA tensor is ready on the producer's current stream, which the exchange API reports:
    /// taken here when that is the call's stream, else imported through `__dlpack__(stream=)`
    /// (the producer orders the call's stream after its work).
    fn exchange(
        py: Python<'py>,
        obj: &Bound<'py, PyAny>,
        what: &str,
        place: &Place,
    ) -> PyResult<Option<Tensor<'py>>> {
        let Ok(Some(api)) = ExchangeApi::from_object(obj.as_borrowed()) else {
            return Ok(None);
        };
        let alias = match obj.call_method0(intern!(py, "detach")) {
            Ok(a) if a.get_type().is(obj.get_type()) => a,
            // Not a torch tensor's `detach`: the object itself.
            _ => obj.clone(),
        };
        let imported = api
            .import_managed_no_sync(alias.as_borrowed())
            .map_err(|e| export_failed(py, obj, what, place, &e))?;
        let (managed, producer) = imported.into_parts();
        let read_only = managed.flags().contains(DlpackFlags::READ_ONLY);
        let t = managed
            .validate()
            .map_err(|e| invalid(py, format!("{what}: invalid DLPack tensor: {e}")))?;
        if let Some(consumer) = place.stream_for(t.device()) {
            if producer as usize as u64 != consumer.0 {
                drop(managed);
                return Tensor::negotiated(py, &alias, what, place).map(Some);
            }
        }
        let layout = Layout::of(py, &t, what, place, false)?;
        Ok(Some(Tensor::with(
            Owner::Exchange(managed),
            layout,
            read_only,
        )))
    }

    /// A numpy array through `__dlpack__(max_version=...)` (a versioned capsule, read-only
    /// flag included). `None` when numpy declines (an `ml_dtypes` dtype, a read-only array on
    /// an old numpy): the negotiated path then says why or takes the array another way.
    fn numpy(
        py: Python<'py>,
        obj: &Bound<'py, PyAny>,
        what: &str,
        place: &Place,
    ) -> PyResult<Option<Tensor<'py>>> {
        static KWARGS: PyOnceLock<Py<PyDict>> = PyOnceLock::new();
        let kwargs = KWARGS.get_or_try_init(py, || -> PyResult<Py<PyDict>> {
            let d = PyDict::new(py);
            d.set_item("max_version", (DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION))?;
            Ok(d.unbind())
        })?;
        let Ok(capsule) = obj.call_method(intern!(py, "__dlpack__"), (), Some(kwargs.bind(py)))
        else {
            return Ok(None);
        };
        let managed = ImportRequest::new(capsule.as_borrowed())
            .and_then(|req| req.import(None, None))
            .map_err(|e| export_failed(py, obj, what, place, &e))?;
        Tensor::managed(py, managed, what, place, false).map(Some)
    }

    /// Any other producer: dlpark's negotiated import (C exchange API, `__dlpack_device__` and
    /// `__dlpack__`, legacy `__dlpack__`), after [`prepare`]. A producer on the CUDA device
    /// of `place` gets the call's stream (`__dlpack__(stream=...)`).
    fn negotiated(
        py: Python<'py>,
        obj: &Bound<'py, PyAny>,
        what: &str,
        place: &Place,
    ) -> PyResult<Tensor<'py>> {
        let (obj, bf16) = prepare(py, obj, what, place)?;
        let req = ImportRequest::new(obj.as_borrowed())
            .map_err(|e| export_failed(py, &obj, what, place, &e))?;
        // Capsules and legacy producers name no device before the import (checked after it).
        let mut consumer = None;
        if let Ok(device) = req.device() {
            accept_device(py, device, what, place)?;
            consumer = place.stream_for(device);
        }
        let stream = consumer.as_ref().map(|c| c as &dyn DlpackStream);
        let managed = req
            .import(stream, None)
            .map_err(|e| export_failed(py, &obj, what, place, &e))?;
        Tensor::managed(py, managed, what, place, bf16)
    }

    /// A checked tensor over an owning import.
    fn managed(
        py: Python<'py>,
        managed: ImportedDlpack,
        what: &str,
        place: &Place,
        bf16: bool,
    ) -> PyResult<Tensor<'py>> {
        let read_only = managed.flags().contains(DlpackFlags::READ_ONLY);
        let t = managed
            .validate()
            .map_err(|e| invalid(py, format!("{what}: invalid DLPack tensor: {e}")))?;
        let layout = Layout::of(py, &t, what, place, bf16)?;
        Ok(Tensor::with(Owner::Capsule(managed), layout, read_only))
    }

    fn with(owner: Owner<'py>, layout: Layout, read_only: bool) -> Tensor<'py> {
        Tensor {
            _owner: owner,
            device: layout.device,
            ptr: layout.ptr,
            len_bytes: layout.len_bytes,
            shape: layout.shape,
            elem: layout.elem,
            read_only,
        }
    }

    /// Shape.
    pub(crate) fn shape(&self) -> &[usize] {
        self.shape.as_slice()
    }

    /// Element type.
    pub(crate) fn elem(&self) -> Elem {
        self.elem
    }

    /// Whether the memory is host memory (else: device memory of the call's CUDA device).
    pub(crate) fn is_host(&self) -> bool {
        host_accessible(self.device)
    }

    /// The memory as a [`xccl::DeviceSlice`] of its CUDA device (to lend to one device call);
    /// `None` for host memory.
    pub(crate) fn device_slice(&self) -> Option<xccl::DeviceSlice<'_>> {
        let ordinal = self.cuda_ordinal()?;
        // SAFETY: `ptr..ptr+len_bytes` is this C-contiguous tensor's memory on CUDA device
        // `ordinal` (device and layout checked at import), kept allocated by `self._owner` for
        // the borrow of `self`; the call that gets the slice reads it only (the caller must not
        // write it meanwhile, documented on every call), and checks the range with the driver
        // (`Device::device_pointer`) before using it.
        Some(unsafe { xccl::DeviceSlice::from_raw(self.ptr as u64, self.len_bytes, ordinal) })
    }

    /// The memory as a writable [`xccl::DeviceSliceMut`] of its CUDA device; `None` for host
    /// memory; fails for a producer that marked it read-only.
    pub(crate) fn device_slice_mut(
        &mut self,
        py: Python<'_>,
        what: &str,
    ) -> PyResult<Option<xccl::DeviceSliceMut<'_>>> {
        let Some(ordinal) = self.cuda_ordinal() else {
            return Ok(None);
        };
        if self.read_only {
            return Err(invalid(
                py,
                format!("{what} is read-only; pass a writable tensor"),
            ));
        }
        // SAFETY: as in `device_slice`; the producer did not mark the memory read-only and
        // `&mut self` makes this the only borrow of it through this value (the caller must not
        // touch the tensor while the call writes it, documented on every call).
        Ok(Some(unsafe {
            xccl::DeviceSliceMut::from_raw(self.ptr as u64, self.len_bytes, ordinal)
        }))
    }

    /// A host copy of this device tensor (a CPU [`Buffer`] of its shape and dtype), read with
    /// one device-to-host copy on the raw `CUstream` `stream` (after the work queued there),
    /// waited for with the GIL released, at most `timeout`; `None` for host memory.
    pub(crate) fn host_copy(
        &self,
        py: Python<'_>,
        stream: u64,
        timeout: std::time::Duration,
    ) -> PyResult<Option<Buffer>> {
        use xccl::cuda::{Device, Stream};
        let Some(ordinal) = self.cuda_ordinal() else {
            return Ok(None);
        };
        let mut host = crate::buffer::HostBytes::zeroed(self.len_bytes);
        if self.len_bytes > 0 {
            let (addr, len) = (self.ptr as u64, self.len_bytes);
            let dst = host.as_mut_slice();
            let copied = py.detach(|| -> xccl::Result<()> {
                let device = Device::open(ordinal)?;
                let at = device.device_pointer(addr, len)?;
                // SAFETY: `stream` is 0 (the legacy default stream) or the caller's live stream
                // of this device (the call's stream, see `CudaPlace`), used for this copy only.
                let stream = unsafe { Stream::borrowed(&device, stream) };
                // SAFETY: `at..at+len` is device memory of `device` (checked by the driver just
                // now), kept allocated by `self._owner`; `dst` is `len` bytes of host memory
                // that nothing touches until the copy ran: the synchronize below waits for it,
                // and if that wait fails the buffer is leaked, never freed under the copy.
                unsafe {
                    stream.copy_dtoh_async(dst.as_mut_ptr(), at, len, &|| {
                        "reading a tensor to the host".into()
                    })?;
                }
                let deadline = std::time::Instant::now() + timeout;
                stream.synchronize(deadline, 0, &|| "reading a tensor to the host".into())
            });
            if let Err(e) = copied {
                std::mem::forget(host);
                return Err(crate::errors::to_py(py, &e, false));
            }
        }
        Ok(Some(Buffer::host(host, self.shape(), self.elem)))
    }

    /// The ordinal of the CUDA device the memory is on; `None` for host memory.
    fn cuda_ordinal(&self) -> Option<usize> {
        (self.device.device_type == DLDeviceType::CUDA)
            .then(|| usize::try_from(self.device.device_id).ok())
            .flatten()
    }

    /// The data, read-only (host memory; empty for device memory, which the host never reads).
    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len_bytes == 0 || !self.is_host() {
            return &[];
        }
        // SAFETY: `ptr` is the start of this C-contiguous tensor's `len_bytes` bytes of host
        // memory (device checked, layout checked in `import`), which stay valid while
        // `self._owner` lives (an owning reference to the producer's memory, see [`Owner`]),
        // so for the borrow of `self`. The caller must not write the tensor from another
        // thread while a call reads it (documented on every call).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len_bytes) }
    }

    /// The data as elements of `T`: borrowed when the data is aligned for `T`, else a copy.
    pub(crate) fn elements<T: bytemuck::Pod>(&self) -> Cow<'_, [T]> {
        match bytemuck::try_cast_slice::<u8, T>(self.bytes()) {
            Ok(s) => Cow::Borrowed(s),
            Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec(self.bytes())),
        }
    }

    /// The data, writable; fails for a producer that marked it read-only.
    pub(crate) fn bytes_mut(&mut self, py: Python<'_>, what: &str) -> PyResult<&mut [u8]> {
        if self.read_only {
            return Err(invalid(
                py,
                format!("{what} is read-only; pass a writable tensor"),
            ));
        }
        if self.len_bytes == 0 || !self.is_host() {
            return Ok(&mut []);
        }
        // SAFETY: as in `bytes`; the producer did not mark the memory read-only, and `&mut
        // self` makes this the only borrow of it through this value.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len_bytes) })
    }
}

/// Whether `obj` is exactly a `numpy.ndarray` (numpy imported by someone already; this never
/// imports it).
fn is_ndarray(py: Python<'_>, obj: &Bound<'_, PyAny>) -> bool {
    static NDARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    if let Some(t) = NDARRAY.get(py) {
        return obj.get_type().is(t.bind(py));
    }
    static MODULES: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let Ok(modules) = MODULES.get_or_try_init(py, || {
        py.import("sys")
            .and_then(|sys| sys.getattr("modules"))
            .map(Bound::unbind)
    }) else {
        return false;
    };
    let found = modules
        .bind(py)
        .get_item("numpy")
        .ok()
        .and_then(|np| np.getattr("ndarray").ok())
        .and_then(|t| t.cast_into::<PyType>().ok());
    match found {
        Some(t) => {
            let same = obj.get_type().is(&t);
            let _ = NDARRAY.set(py, t.unbind());
            same
        }
        None => false,
    }
}

/// Accepts a tensor on `device` or refuses it, naming both devices: host memory (the CPU, and
/// pinned host memory of CUDA or ROCm, which the CPU addresses directly) where `place` takes
/// it, memory of the CUDA device of `place`.
fn accept_device(py: Python<'_>, device: DLDevice, what: &str, place: &Place) -> PyResult<()> {
    if place.host && host_accessible(device) {
        return Ok(());
    }
    if place.cuda.is_some_and(|c| is_cuda_device(device, c.device)) {
        return Ok(());
    }
    Err(wrong_device(py, what, &device_name(device), place))
}

/// The error for a tensor on `device` (named as its framework prints it) where `place` takes
/// none.
fn wrong_device(py: Python<'_>, what: &str, device: &str, place: &Place) -> PyErr {
    let fix = match place.cuda {
        None => "xccl's communicator here takes CPU tensors (move it with .cpu(), or build the \
                 communicator with fabric=\"cuda\" for CUDA tensors)"
            .to_string(),
        Some(c) if place.host => format!(
            "this call takes tensors on the CPU or on the communicator's device, cuda:{} (move \
             it with .to(\"cuda:{}\"))",
            c.device, c.device
        ),
        Some(c) => format!(
            "this communicator (cuda fabric) takes tensors on its device, cuda:{} (move it with \
             .to(\"cuda:{}\"))",
            c.device, c.device
        ),
    };
    invalid(py, format!("{what} is on {device}; {fix}"))
}

/// The error for a producer whose DLPack export of `obj` failed with `e`: when `obj` says it is
/// on a device the call does not take (torch's `meta`, which DLPack cannot name), that device;
/// else the first line of the producer's message (never a C++ stack trace that follows it).
fn export_failed(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    what: &str,
    place: &Place,
    e: &PyErr,
) -> PyErr {
    let device = obj
        .getattr(intern!(py, "device"))
        .and_then(|d| d.str())
        .map(|d| d.to_string_lossy().into_owned());
    if let Ok(device) = device {
        let cpu = device == "cpu" || device.starts_with("cpu:");
        let mine = place
            .cuda
            .is_some_and(|c| device == format!("cuda:{}", c.device));
        let taken = mine || (cpu && place.host);
        if !taken {
            return wrong_device(py, what, &device, place);
        }
    }
    let message = e
        .value(py)
        .str()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let first = message.lines().next().unwrap_or("").trim();
    invalid(py, format!("{what}: its DLPack export failed: {first}"))
}

/// What to hand to DLPack for `obj`: the object itself; a `uint16` view of a numpy array of
/// `ml_dtypes.bfloat16` (numpy cannot export that dtype; the flag says the bits are bf16); or
/// a numpy array over an object that has only the buffer protocol.
fn prepare<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
    what: &str,
    place: &Place,
) -> PyResult<(Bound<'py, PyAny>, bool)> {
    let is_numpy = obj
        .get_type()
        .module()
        .map(|m| m.to_string_lossy().starts_with("numpy"))
        .unwrap_or(false);
    if is_numpy {
        if let Ok(dtype) = obj.getattr("dtype") {
            let name = dtype.str().map(|s| s.to_string_lossy().into_owned());
            if name.ok().as_deref() == Some("bfloat16") {
                let view = obj.call_method1("view", (PyString::new(py, "uint16"),))?;
                return Ok((view, true));
            }
        }
    }
    // A producer, or a capsule one made (`x.__dlpack__()`), consumed here.
    if obj.hasattr("__dlpack__")? || obj.cast::<PyCapsule>().is_ok() {
        return Ok((obj.clone(), false));
    }
    let buffer_protocol = py.import("builtins")?.getattr("memoryview")?.call1((obj,));
    if buffer_protocol.is_ok() && !place.host {
        return Err(wrong_device(py, what, "cpu", place));
    }
    match buffer_protocol {
        Ok(view) => match py.import("numpy") {
            Ok(np) => Ok((np.getattr("asarray")?.call1((view,))?, false)),
            Err(_) => Err(invalid(
                py,
                format!(
                    "{what} ({}) has only the buffer protocol, which xccl takes through numpy: \
                     install numpy, or pass a tensor with __dlpack__",
                    obj.get_type().name()?
                ),
            )),
        },
        Err(_) => Err(invalid(
            py,
            format!(
                "{what} ({}) is not a tensor: pass an object with __dlpack__ (torch, numpy >= \
                 1.22, jax) or the buffer protocol",
                obj.get_type().name()?
            ),
        )),
    }
}

/// Checks that `t` is `[rows, hidden]` of element type `elem` (`rows` any when `None`);
/// returns the number of rows.
pub(crate) fn expect_rows(
    py: Python<'_>,
    t: &Tensor<'_>,
    what: &str,
    elem: Elem,
    rows: Option<usize>,
    hidden: usize,
) -> PyResult<usize> {
    if t.elem() != elem {
        return Err(invalid(
            py,
            format!(
                "{what} has dtype {} but the communicator's dtype is {} (convert it first, e.g. \
                 x.to(torch.{}) or x.astype(np.{}))",
                t.elem().name(),
                elem.name(),
                elem.name(),
                elem.name()
            ),
        ));
    }
    let shape = t.shape();
    let ok = shape.len() == 2 && shape[1] == hidden && rows.is_none_or(|r| shape[0] == r);
    if !ok {
        let want = match rows {
            Some(r) => format!("[{r}, {hidden}]"),
            None => format!("[T, {hidden}]"),
        };
        return Err(invalid(
            py,
            format!("{what} has shape {shape:?}, expected {want}"),
        ));
    }
    Ok(shape[0])
}

/// `topk_idx` as the `i32` expert ids the Rust API takes: int32 as is, int64 converted exactly
/// (a value outside int32 is an error naming its index and value). Shape `[tokens, topk]`.
pub(crate) fn topk_ids<'t>(
    py: Python<'_>,
    t: &'t Tensor<'_>,
    tokens: usize,
    topk: usize,
    num_experts: usize,
) -> PyResult<Cow<'t, [i32]>> {
    check_routing_shape(py, t, "topk_idx", tokens, topk)?;
    match t.elem() {
        Elem::I32 => Ok(t.elements()),
        Elem::I64 => {
            let wide = t.elements::<i64>();
            wide.iter()
                .enumerate()
                .map(|(i, &v)| {
                    i32::try_from(v).map_err(|_| {
                        invalid(
                            py,
                            format!(
                                "topk_idx[{}, {}] = {v} selects no expert: ids are in [0, {num_experts}), \
                                 or -1 for none",
                                i / topk.max(1),
                                i % topk.max(1)
                            ),
                        )
                    })
                })
                .collect::<PyResult<Vec<i32>>>()
                .map(Cow::Owned)
        }
        other => Err(invalid(
            py,
            format!(
                "topk_idx has dtype {}; xccl takes int32 or int64 expert ids",
                other.name()
            ),
        )),
    }
}

/// `topk_weights` as `f32`: float32 as is; float16 and bfloat16 converted exactly (every value
/// of theirs is a float32); float64 is rejected, since rounding it would change the results.
pub(crate) fn topk_weights<'t>(
    py: Python<'_>,
    t: &'t Tensor<'_>,
    tokens: usize,
    topk: usize,
) -> PyResult<Cow<'t, [f32]>> {
    check_routing_shape(py, t, "topk_weights", tokens, topk)?;
    match t.elem() {
        Elem::F32 => Ok(t.elements()),
        Elem::F16 => Ok(t
            .elements::<half::f16>()
            .iter()
            .map(|v| v.to_f32())
            .collect()),
        Elem::BF16 => Ok(t
            .elements::<half::bf16>()
            .iter()
            .map(|v| v.to_f32())
            .collect()),
        Elem::F64 => Err(invalid(
            py,
            "topk_weights has dtype float64; xccl takes float32 weights (float16 and bfloat16 \
             are widened exactly): convert with w.float() (torch) or w.astype(np.float32)",
        )),
        other => Err(invalid(
            py,
            format!(
                "topk_weights has dtype {}; xccl takes float32 weights",
                other.name()
            ),
        )),
    }
}

/// Checks that a routing tensor is `[tokens, topk]`.
fn check_routing_shape(
    py: Python<'_>,
    t: &Tensor<'_>,
    what: &str,
    tokens: usize,
    topk: usize,
) -> PyResult<()> {
    if t.shape() != [tokens, topk] {
        return Err(invalid(
            py,
            format!(
                "{what} has shape {:?}, expected [{tokens}, {topk}] (tokens x topk)",
                t.shape()
            ),
        ));
    }
    Ok(())
}

/// The routing of a call on a `cuda` communicator in device memory, as the Rust API reads it:
/// `topk_idx` int32 and `topk_weights` float32, both `[tokens, topk]` on the communicator's
/// device (the Rust API reads them with one small device-to-host copy each). `None` when they
/// are not both so: the caller takes them to the host ([`Tensor::host_copy`]) and converts
/// them as host routing.
pub(crate) fn device_routing<'t>(
    idx: &'t Tensor<'_>,
    weights: &'t Tensor<'_>,
    tokens: usize,
    topk: usize,
) -> Option<xccl::Routing<'t>> {
    let shaped = |t: &Tensor<'_>| t.shape() == [tokens, topk];
    if idx.elem() != Elem::I32 || weights.elem() != Elem::F32 || !shaped(idx) || !shaped(weights) {
        return None;
    }
    Some(xccl::Routing::Device {
        topk_idx: idx.device_slice()?,
        topk_weights: weights.device_slice()?,
    })
}
