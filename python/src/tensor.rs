//! Tensors in: any object with `__dlpack__` (torch CPU tensors, numpy >= 1.22, JAX CPU arrays),
//! numpy arrays of `ml_dtypes.bfloat16`, and (through numpy) any object with the buffer
//! protocol. `Tensor::import` checks the device and the layout; the `expect_*` functions
//! check dtype and shape against what a call needs, before anything is sent.

use std::borrow::Cow;

use dlpark::ffi::{
    DLDataTypeCode, DLDevice, DLDeviceType, DLManagedTensorVersioned, DLPACK_MAJOR_VERSION,
    DLPACK_MINOR_VERSION,
};
use dlpark::python::consumer::exchange::ExchangeApi;
use dlpark::python::{ImportRequest, ImportedDlpack};
use dlpark::{DlpackFlags, Managed, TensorRef};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString, PyType};

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
fn device_name(d: DLDevice) -> String {
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
/// whether the producer marked it read-only. Only host memory is taken ([`accept_device`]:
/// anything else is refused naming its device), C-contiguous.
///
/// Imported by the fastest exact path its type has: an `xccl.Buffer` directly; a producer with
/// the DLPack C exchange API (torch) through a managed tensor, with no capsule and no Python
/// call but `detach()`; a numpy array through `__dlpack__(max_version=...)`; anything else
/// through dlpark's negotiated import (`__dlpack_device__`, `__dlpack__`) or the buffer
/// protocol.
pub(crate) struct Tensor<'py> {
    _owner: Owner<'py>,
    /// Where the memory is (checked by [`accept_device`]).
    #[allow(dead_code)]
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
    /// Checks `t` and reads its layout; `bf16` says its 16-bit unsigned elements are bfloat16
    /// bits (a numpy `ml_dtypes.bfloat16` array seen as `uint16`).
    fn of(py: Python<'_>, t: &TensorRef<'_>, what: &str, bf16: bool) -> PyResult<Layout> {
        accept_device(py, t.device(), what)?;
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
    /// Imports `obj` (`what` names it in errors: `"x"`, `"topk_idx"`...).
    ///
    /// Errors ([`crate::errors`]' `InvalidArgumentError`): no `__dlpack__` and no buffer protocol,
    /// a device the CPU cannot address (named), a non-C-contiguous layout.
    pub(crate) fn import(
        py: Python<'py>,
        obj: &Bound<'py, PyAny>,
        what: &str,
    ) -> PyResult<Tensor<'py>> {
        if let Ok(buf) = obj.cast_exact::<Buffer>() {
            return Tensor::of_buffer(py, buf, what);
        }
        if is_ndarray(py, obj) {
            if let Some(t) = Tensor::numpy(py, obj, what)? {
                return Ok(t);
            }
        } else if let Some(t) = Tensor::exchange(py, obj, what)? {
            return Ok(t);
        }
        Tensor::negotiated(py, obj, what)
    }

    /// An `xccl.Buffer`: its memory directly (its owner stays alive while `buf` is held).
    fn of_buffer(py: Python<'py>, buf: &Bound<'py, Buffer>, what: &str) -> PyResult<Tensor<'py>> {
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
        Ok(Tensor {
            _owner: Owner::Buffer(buf.clone()),
            device: DLDevice::CPU,
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
    fn exchange(
        py: Python<'py>,
        obj: &Bound<'py, PyAny>,
        what: &str,
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
            .map_err(|e| export_failed(py, obj, what, &e))?;
        let (managed, _stream) = imported.into_parts();
        let read_only = managed.flags().contains(DlpackFlags::READ_ONLY);
        let t = managed
            .validate()
            .map_err(|e| invalid(py, format!("{what}: invalid DLPack tensor: {e}")))?;
        let layout = Layout::of(py, &t, what, false)?;
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
            .map_err(|e| export_failed(py, obj, what, &e))?;
        Tensor::managed(py, managed, what, false).map(Some)
    }

    /// Any other producer: dlpark's negotiated import (C exchange API, `__dlpack_device__` and
    /// `__dlpack__`, legacy `__dlpack__`), after [`prepare`].
    fn negotiated(py: Python<'py>, obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Tensor<'py>> {
        let (obj, bf16) = prepare(py, obj, what)?;
        let req =
            ImportRequest::new(obj.as_borrowed()).map_err(|e| export_failed(py, &obj, what, &e))?;
        // Capsules and legacy producers name no device before the import (checked after it).
        if let Ok(device) = req.device() {
            accept_device(py, device, what)?;
        }
        let managed = req
            .import(None, None)
            .map_err(|e| export_failed(py, &obj, what, &e))?;
        Tensor::managed(py, managed, what, bf16)
    }

    /// A checked tensor over an owning import.
    fn managed(
        py: Python<'py>,
        managed: ImportedDlpack,
        what: &str,
        bf16: bool,
    ) -> PyResult<Tensor<'py>> {
        let read_only = managed.flags().contains(DlpackFlags::READ_ONLY);
        let t = managed
            .validate()
            .map_err(|e| invalid(py, format!("{what}: invalid DLPack tensor: {e}")))?;
        let layout = Layout::of(py, &t, what, bf16)?;
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

    /// The data, read-only.
    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len_bytes == 0 {
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
        if self.len_bytes == 0 {
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

/// Accepts a tensor on `device` or refuses it, naming the device: host memory only (the CPU,
/// and pinned host memory of CUDA or ROCm, which the CPU addresses directly).
fn accept_device(py: Python<'_>, device: DLDevice, what: &str) -> PyResult<()> {
    if host_accessible(device) {
        return Ok(());
    }
    Err(not_on_cpu(py, what, &device_name(device)))
}

/// The error for a tensor on `device` (named as its framework prints it).
fn not_on_cpu(py: Python<'_>, what: &str, device: &str) -> PyErr {
    invalid(
        py,
        format!(
            "{what} is on {device}; xccl's communicator here takes CPU tensors (move it with \
             .cpu())"
        ),
    )
}

/// The error for a producer whose DLPack export of `obj` failed with `e`: when `obj` says it is
/// on a device other than the CPU (torch's `meta`, which DLPack cannot name), that device;
/// else the first line of the producer's message (never a C++ stack trace that follows it).
fn export_failed(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str, e: &PyErr) -> PyErr {
    let device = obj
        .getattr(intern!(py, "device"))
        .and_then(|d| d.str())
        .map(|d| d.to_string_lossy().into_owned());
    if let Ok(device) = device {
        if device != "cpu" && !device.starts_with("cpu:") {
            return not_on_cpu(py, what, &device);
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
    if obj.hasattr("__dlpack__")? {
        return Ok((obj.clone(), false));
    }
    let buffer_protocol = py.import("builtins")?.getattr("memoryview")?.call1((obj,));
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
