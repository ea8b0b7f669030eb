//! The safe layer over the CUDA driver (`xccl_sys::cuda`, `libcuda.so.1` opened at run time):
//! the bottom of xccl's CUDA path, below the fabrics.
//!
//! This module owns every unsafe call into the driver; the fabrics and the data plane above it
//! use the types here:
//! - [`Driver`]: the library, loaded and initialised (`cuInit`) once per process.
//! - [`Device`]: one GPU (ordinal, name, compute capability) with its primary context retained;
//!   [`Device::bind`] makes that context current on the calling thread (every call here does it
//!   first, so any thread may use any object).
//! - [`DeviceMemory`]: owned `cuMemAlloc` bytes, freed on drop; [`DevicePtr`]: a device address
//!   with its device ordinal, never dereferenced on the host; [`DeviceSlice`] and
//!   [`DeviceSliceMut`]: device memory a caller lends to one call.
//! - [`Stream`] (owned, or a caller's stream borrowed by its raw handle), [`Event`]: every wait
//!   on the GPU is bounded ([`Stream::synchronize`], [`Event::wait`] poll `cuStreamQuery` /
//!   `cuEventQuery`, spinning then napping, and fail with [`Error::Timeout`]);
//!   `cuStreamSynchronize` is never called.
//! - [`IpcExport`] (a 64-byte CUDA IPC handle of a [`DeviceMemory`]) and [`IpcMapping`] (a peer
//!   process's memory opened from one, closed on drop).
//! - [`Module`] and [`Function`] (`cuModuleLoadData`, `cuModuleGetFunction`) and the unsafe
//!   [`Stream::launch`].
//!
//! Every non-zero `CUresult` becomes [`Error::Native`] naming the call, the code's name and the
//! driver's string, and what xccl was doing. A missing library is
//! [`Error::FabricUnavailable`] (fabric `cuda`) naming `libcuda.so.1` and `XCCL_CUDA_LIBRARY`.
//!
//! On machines without a GPU this layer is tested against the stand-in driver of
//! `tests/cuda_standin/` (`xccl::testing::build_cuda_standin`), whose device memory is host
//! shared memory.

use std::ffi::{c_int, c_uint, c_void, CStr, CString};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use xccl_sys::cuda::{self as sys, CUcontext, CUdevice, CUresult, Cuda};

use crate::{Error, Result};

mod slice;
pub(crate) use slice::ReadRegion;
pub use slice::{DeviceSlice, DeviceSliceMut};

/// The library name used in errors.
pub const LIBRARY: &str = sys::LIBRARY;

/// Polls of a stream or event before a wait starts to sleep.
const SPIN_POLLS: u32 = 200;
const FIRST_NAP: Duration = Duration::from_micros(5);
const LONGEST_NAP: Duration = Duration::from_micros(500);
/// Longest a dropped stream waits for a copy that still uses its host buffer.
const DROP_WAIT: Duration = Duration::from_secs(10);

/// The CUDA driver, loaded and initialised once per process.
pub struct Driver {
    cuda: Arc<Cuda>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("path", &self.cuda.path())
            .finish()
    }
}

static DRIVER: Mutex<Option<Arc<Driver>>> = Mutex::new(None);

impl Driver {
    /// The process's driver: opens the library (see `xccl_sys::cuda::load`: `XCCL_CUDA_LIBRARY`,
    /// then `libcuda.so.1`, `libcuda.so`) and calls `cuInit` the first time; later calls return
    /// the same driver. Fails with [`Error::FabricUnavailable`] naming the library when it is
    /// missing, [`Error::Native`] when `cuInit` fails (no device: `CUDA_ERROR_NO_DEVICE`).
    pub fn get() -> Result<Arc<Driver>> {
        Self::init_with(sys::load)
    }

    /// [`Driver::get`] that opens `path` if no driver is loaded in this process yet (tests load
    /// the stand-in this way without touching the environment).
    pub fn get_from(path: &Path) -> Result<Arc<Driver>> {
        Self::init_with(|| sys::load_from(path))
    }

    fn init_with(
        load: impl FnOnce() -> std::result::Result<Arc<Cuda>, sys::LoadError>,
    ) -> Result<Arc<Driver>> {
        let mut slot = DRIVER.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = slot.as_ref() {
            return Ok(d.clone());
        }
        let cuda = load().map_err(|e| Error::FabricUnavailable {
            fabric: "cuda".into(),
            detail: e.to_string(),
        })?;
        let driver = Arc::new(Driver { cuda });
        // SAFETY: cuInit takes a flags word (must be 0).
        let code = unsafe { (driver.api().cuInit)(0) };
        driver.check(code, "cuInit", || "initialising the CUDA driver".into())?;
        *slot = Some(driver.clone());
        Ok(driver)
    }

    fn api(&self) -> &sys::CudaDriver {
        self.cuda.api()
    }

    /// The library file that was opened.
    pub fn path(&self) -> &Path {
        self.cuda.path()
    }

    /// The driver's CUDA version (`cuDriverGetVersion`: 1000 * major + 10 * minor).
    pub fn version(&self) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a live local the call writes.
        let code = unsafe { (self.api().cuDriverGetVersion)(&mut v) };
        self.check(code, "cuDriverGetVersion", || {
            "asking the driver version".into()
        })?;
        Ok(v)
    }

    /// Number of devices this process sees.
    pub fn device_count(&self) -> Result<usize> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a live local the call writes.
        let code = unsafe { (self.api().cuDeviceGetCount)(&mut n) };
        self.check(code, "cuDeviceGetCount", || "counting devices".into())?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Opens device `ordinal`: its name and compute capability, and its primary context
    /// (retained until the last clone of the [`Device`] and of everything made on it drops).
    pub fn device(self: &Arc<Self>, ordinal: usize) -> Result<Device> {
        let count = self.device_count()?;
        if ordinal >= count {
            return Err(Error::invalid(format!(
                "CUDA device {ordinal} does not exist: this process sees {count} device(s)"
            )));
        }
        let ord = ordinal as c_int;
        let mut dev: CUdevice = 0;
        // SAFETY: `dev` is a live local the call writes.
        let code = unsafe { (self.api().cuDeviceGet)(&mut dev, ord) };
        self.check(code, "cuDeviceGet", || format!("opening device {ordinal}"))?;
        let attr = |a: sys::CUdevice_attribute, what: &str| -> Result<u32> {
            let mut v: c_int = 0;
            // SAFETY: `v` is a live local the call writes; `dev` came from cuDeviceGet.
            let code = unsafe { (self.api().cuDeviceGetAttribute)(&mut v, a, dev) };
            self.check(code, "cuDeviceGetAttribute", || {
                format!("reading the {what} of device {ordinal}")
            })?;
            Ok(v.max(0) as u32)
        };
        let major = attr(
            sys::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            "compute capability",
        )?;
        let minor = attr(
            sys::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            "compute capability",
        )?;
        let mut name = [0u8; 256];
        // SAFETY: `name` is a live buffer of the length passed.
        let code = unsafe {
            (self.api().cuDeviceGetName)(name.as_mut_ptr().cast(), name.len() as c_int, dev)
        };
        self.check(code, "cuDeviceGetName", || {
            format!("reading the name of device {ordinal}")
        })?;
        let name = CStr::from_bytes_until_nul(&name)
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a live local the call writes; `dev` came from cuDeviceGet.
        let code = unsafe { (self.api().cuDevicePrimaryCtxRetain)(&mut ctx, dev) };
        self.check(code, "cuDevicePrimaryCtxRetain", || {
            format!("retaining the primary context of device {ordinal}")
        })?;
        let device = Device {
            inner: Arc::new(DeviceInner {
                driver: self.clone(),
                ordinal,
                handle: dev,
                ctx,
                name,
                capability: (major, minor),
            }),
        };
        device.bind()?;
        Ok(device)
    }

    /// `Ok` for `CUDA_SUCCESS`, else [`Error::Native`] naming `call`, the code's name, the
    /// driver's string and `context()` (what xccl was doing).
    pub fn check(
        &self,
        code: CUresult,
        call: &'static str,
        context: impl FnOnce() -> String,
    ) -> Result<()> {
        if code == sys::CUDA_SUCCESS {
            return Ok(());
        }
        Err(Error::Native {
            library: LIBRARY,
            call,
            code: i64::from(code),
            message: self.describe(code),
            context: context(),
        })
    }

    /// `"<name>: <string>"` of `code` as the driver tells them.
    pub fn describe(&self, code: CUresult) -> String {
        let text = |f: unsafe extern "C" fn(CUresult, *mut *const std::ffi::c_char) -> CUresult| {
            let mut p: *const std::ffi::c_char = std::ptr::null();
            // SAFETY: `p` is a live local the call writes; on success it points at a static
            // NUL-terminated string of the driver.
            let ok = unsafe { f(code, &mut p) } == sys::CUDA_SUCCESS && !p.is_null();
            // SAFETY: see above: a static C string when `ok`.
            ok.then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        let name = text(self.api().cuGetErrorName).unwrap_or_else(|| "unknown code".into());
        let string = text(self.api().cuGetErrorString).unwrap_or_else(|| "no description".into());
        format!("{name}: {string}")
    }
}

struct DeviceInner {
    driver: Arc<Driver>,
    ordinal: usize,
    handle: CUdevice,
    ctx: CUcontext,
    name: String,
    capability: (u32, u32),
}

// SAFETY: a CUcontext is a process-wide driver handle that any thread may make current; the
// other fields are plain data.
unsafe impl Send for DeviceInner {}
// SAFETY: see `Send`; nothing here is mutated after construction.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: balances the cuDevicePrimaryCtxRetain of `Driver::device`; every object made
        // on this device holds a clone of it, so none outlives the context.
        let _ = unsafe { (self.driver.api().cuDevicePrimaryCtxRelease)(self.handle) };
    }
}

/// One GPU with its primary context (cheap to clone; the context is released when the last
/// clone, and everything made on it, is gone).
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("capability", &self.inner.capability)
            .finish()
    }
}

impl Device {
    /// Device `ordinal` of the process's driver ([`Driver::get`]).
    pub fn open(ordinal: usize) -> Result<Device> {
        Driver::get()?.device(ordinal)
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<Driver> {
        &self.inner.driver
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The device's name (`cuDeviceGetName`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Compute capability `(major, minor)` (9.0 on an H100/H200).
    pub fn compute_capability(&self) -> (u32, u32) {
        self.inner.capability
    }

    fn api(&self) -> &sys::CudaDriver {
        self.inner.driver.api()
    }

    fn check(
        &self,
        code: CUresult,
        call: &'static str,
        ctx: impl FnOnce() -> String,
    ) -> Result<()> {
        self.inner.driver.check(code, call, ctx)
    }

    /// Makes this device's primary context current on the calling thread (a no-op when it is
    /// already). Every call of this module does it first.
    pub fn bind(&self) -> Result<()> {
        let mut cur: CUcontext = std::ptr::null_mut();
        // SAFETY: `cur` is a live local the call writes.
        let code = unsafe { (self.api().cuCtxGetCurrent)(&mut cur) };
        self.check(code, "cuCtxGetCurrent", || {
            "reading the calling thread's context".into()
        })?;
        if cur == self.inner.ctx {
            return Ok(());
        }
        // SAFETY: the primary context is retained for the life of `self.inner`.
        let code = unsafe { (self.api().cuCtxSetCurrent)(self.inner.ctx) };
        self.check(code, "cuCtxSetCurrent", || {
            format!(
                "making device {}'s primary context current on this thread",
                self.inner.ordinal
            )
        })
    }

    /// Whether this device can map `peer`'s memory (`cuDeviceCanAccessPeer`; false for itself).
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        let mut can: c_int = 0;
        // SAFETY: `can` is a live local; both handles came from cuDeviceGet.
        let code = unsafe {
            (self.api().cuDeviceCanAccessPeer)(&mut can, self.inner.handle, peer.inner.handle)
        };
        self.check(code, "cuDeviceCanAccessPeer", || {
            format!(
                "asking whether device {} can access device {}",
                self.ordinal(),
                peer.ordinal()
            )
        })?;
        Ok(can != 0)
    }

    /// Lets this device's context access `peer`'s memory (`cuCtxEnablePeerAccess`); enabled
    /// already is fine.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        self.bind()?;
        // SAFETY: the peer's primary context is retained while `peer` lives.
        let code = unsafe { (self.api().cuCtxEnablePeerAccess)(peer.inner.ctx, 0) };
        if code == sys::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        self.check(code, "cuCtxEnablePeerAccess", || {
            format!(
                "enabling access of device {} to device {}",
                self.ordinal(),
                peer.ordinal()
            )
        })
    }

    /// Checks that the `len` bytes at `addr` (a caller's pointer) are device memory of this
    /// device, inside one allocation (`cuPointerGetAttribute`: memory type, device ordinal,
    /// allocation range); the error says what the pointer is instead, naming both devices where
    /// it is another's.
    pub fn device_pointer(&self, addr: u64, len: usize) -> Result<DevicePtr> {
        self.bind()?;
        let Some(kind) = self.memory_type(addr)? else {
            return Err(Error::invalid(format!(
                "{addr:#x} is not device memory (host memory, or not allocated by CUDA); \
                 expected memory of CUDA device {}",
                self.ordinal()
            )));
        };
        if kind != sys::CU_MEMORYTYPE_DEVICE {
            let what = match kind {
                sys::CU_MEMORYTYPE_HOST => "pinned host memory",
                sys::CU_MEMORYTYPE_ARRAY => "a CUDA array",
                sys::CU_MEMORYTYPE_UNIFIED => "managed memory",
                _ => "not device memory",
            };
            return Err(Error::invalid(format!(
                "{addr:#x} is {what}; expected memory of CUDA device {}",
                self.ordinal()
            )));
        }
        let ordinal = self.ordinal_of(addr)?;
        if usize::try_from(ordinal).ok() != Some(self.ordinal()) {
            return Err(Error::invalid(format!(
                "{addr:#x} is memory of CUDA device {ordinal}, expected CUDA device {}",
                self.ordinal()
            )));
        }
        let mut start: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: `start` is a live `CUdeviceptr` and `size` a live `size_t`, what
        // RANGE_START_ADDR and RANGE_SIZE write.
        let codes = unsafe {
            [
                (self.api().cuPointerGetAttribute)(
                    (&mut start as *mut sys::CUdeviceptr).cast(),
                    sys::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                    addr,
                ),
                (self.api().cuPointerGetAttribute)(
                    (&mut size as *mut usize).cast(),
                    sys::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                    addr,
                ),
            ]
        };
        for code in codes {
            self.check(code, "cuPointerGetAttribute", || {
                format!("reading the allocation that holds pointer {addr:#x}")
            })?;
        }
        let end = start.saturating_add(size as u64);
        if addr.checked_add(len as u64).is_none_or(|e| e > end) {
            return Err(Error::invalid(format!(
                "{len} bytes at {addr:#x} run past the end of their allocation on CUDA device {} \
                 ({size} bytes at {start:#x})",
                self.ordinal()
            )));
        }
        Ok(DevicePtr::new(addr, self.ordinal()))
    }

    /// The device whose memory `addr` is (`cuPointerGetAttribute`), or `None` where the host may
    /// read it: memory the driver does not know (ordinary host memory), pinned host memory or
    /// managed memory. The C ABI's host-buffer calls on a cuda communicator use it to refuse a
    /// device pointer before dereferencing it.
    pub fn memory_device_of(&self, addr: u64) -> Result<Option<usize>> {
        self.bind()?;
        match self.memory_type(addr)? {
            Some(sys::CU_MEMORYTYPE_DEVICE | sys::CU_MEMORYTYPE_ARRAY) => {
                let ordinal = self.ordinal_of(addr)?;
                Ok(Some(usize::try_from(ordinal).unwrap_or(usize::MAX)))
            }
            _ => Ok(None),
        }
    }

    /// The `CUmemorytype` of `addr`, or `None` for memory the driver does not know
    /// (`CUDA_ERROR_INVALID_VALUE`: ordinary host memory). The context is bound by the caller.
    fn memory_type(&self, addr: u64) -> Result<Option<c_uint>> {
        let mut kind: c_uint = 0;
        // SAFETY: `kind` is a live `unsigned int`, what MEMORY_TYPE writes; the driver only
        // looks the address up.
        let code = unsafe {
            (self.api().cuPointerGetAttribute)(
                (&mut kind as *mut c_uint).cast(),
                sys::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        };
        if code == sys::CUDA_ERROR_INVALID_VALUE {
            return Ok(None);
        }
        self.check(code, "cuPointerGetAttribute", || {
            format!("checking where pointer {addr:#x} lives")
        })?;
        Ok(Some(kind))
    }

    /// The device ordinal of the device memory at `addr` (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`).
    fn ordinal_of(&self, addr: u64) -> Result<c_int> {
        let mut ordinal: c_int = -1;
        // SAFETY: `ordinal` is a live `int`, what DEVICE_ORDINAL writes.
        let code = unsafe {
            (self.api().cuPointerGetAttribute)(
                (&mut ordinal as *mut c_int).cast(),
                sys::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        };
        self.check(code, "cuPointerGetAttribute", || {
            format!("reading the device of pointer {addr:#x}")
        })?;
        Ok(ordinal)
    }

    /// Opens a peer process's memory from its [`IpcExport`] (`cuIpcOpenMemHandle`, with lazy
    /// peer access where it lives on another device). The driver refuses a handle this very
    /// process exported (`CUDA_ERROR_INVALID_CONTEXT`): such memory is used directly.
    pub fn open_ipc(&self, export: &IpcExport, what: impl Fn() -> String) -> Result<IpcMapping> {
        self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        let handle = sys::CUipcMemHandle {
            reserved: export.handle.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: `ptr` is a live local; the handle is passed by value.
        let code = unsafe {
            (self.api().cuIpcOpenMemHandle)(
                &mut ptr,
                handle,
                sys::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
            )
        };
        self.check(code, "cuIpcOpenMemHandle_v2", || {
            format!("opening {}", what())
        })?;
        Ok(IpcMapping {
            device: self.clone(),
            ptr: DevicePtr::new(ptr, export.device),
            len: export.len,
        })
    }
}

/// A device address and the ordinal of the device whose memory it is. Never dereferenced on
/// the host: only the driver and kernels read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DevicePtr {
    addr: u64,
    device: usize,
}

impl DevicePtr {
    /// `addr` on device `device` (no check: see [`Device::device_pointer`] for one).
    pub const fn new(addr: u64, device: usize) -> Self {
        DevicePtr { addr, device }
    }

    /// The address.
    pub const fn addr(self) -> u64 {
        self.addr
    }

    /// The device ordinal.
    pub const fn device(self) -> usize {
        self.device
    }

    /// The address `offset` bytes further (wrapping, like pointer arithmetic; callers
    /// range-check).
    pub const fn add(self, offset: usize) -> Self {
        DevicePtr {
            addr: self.addr.wrapping_add(offset as u64),
            device: self.device,
        }
    }
}

/// Device memory this process can address with the driver: a base and a length, valid while
/// the value lives. Implemented by [`DeviceMemory`] and [`IpcMapping`]; the safe copies of
/// [`Stream`] take a region and a range-checked offset.
///
/// # Safety
/// `ptr()..ptr()+len()` must be device memory this process may read and write, allocated for
/// as long as the value lives (freeing it waits for queued work that uses it).
pub unsafe trait DeviceRegion {
    /// The first byte.
    fn ptr(&self) -> DevicePtr;
    /// Bytes.
    fn len(&self) -> usize;
    /// Whether it has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Bytes allocated with `cuMemAlloc` on a device, freed (`cuMemFree`) on drop.
pub struct DeviceMemory {
    device: Device,
    ptr: DevicePtr,
    len: usize,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr.addr))
            .field("device", &self.ptr.device)
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceMemory {
    /// Allocates `len` bytes (not zeroed) on `device`; `what` names the use in errors.
    pub fn alloc(device: &Device, len: usize, what: impl FnOnce() -> String) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid(format!(
                "{}: a device allocation of 0 bytes",
                what()
            )));
        }
        device.bind()?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: `p` is a live local the call writes.
        let code = unsafe { (device.api().cuMemAlloc)(&mut p, len) };
        device.check(code, "cuMemAlloc_v2", || {
            format!(
                "allocating {len} bytes on device {} for {}",
                device.ordinal(),
                what()
            )
        })?;
        Ok(DeviceMemory {
            device: device.clone(),
            ptr: DevicePtr::new(p, device.ordinal()),
            len,
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Exports the allocation for other processes of the host (`cuIpcGetMemHandle`).
    pub fn export(&self) -> Result<IpcExport> {
        self.device.bind()?;
        let mut h = sys::CUipcMemHandle {
            reserved: [0; sys::CU_IPC_HANDLE_SIZE],
        };
        // SAFETY: `h` is a live 64-byte handle the call writes; the address is this live
        // allocation's base.
        let code = unsafe { (self.device.api().cuIpcGetMemHandle)(&mut h, self.ptr.addr) };
        self.device.check(code, "cuIpcGetMemHandle", || {
            format!("exporting {} bytes of device {}", self.len, self.ptr.device)
        })?;
        Ok(IpcExport {
            handle: h.reserved.map(|c| c as u8),
            len: self.len,
            device: self.ptr.device,
        })
    }
}

// SAFETY: the allocation lives until `self` drops; cuMemFree waits for work using it.
unsafe impl DeviceRegion for DeviceMemory {
    fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: frees this allocation once; the driver waits for work using it
            // (cuMemFree synchronizes with the device), and no safe handle to it outlives
            // `self`.
            let _ = unsafe { (self.device.api().cuMemFree)(self.ptr.addr) };
        }
    }
}

/// A CUDA IPC handle of a [`DeviceMemory`] (what another process passes to
/// [`Device::open_ipc`]), with the allocation's length and device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcExport {
    /// The driver's 64 handle bytes.
    pub handle: [u8; sys::CU_IPC_HANDLE_SIZE],
    /// Bytes of the exported allocation.
    pub len: usize,
    /// Ordinal of the exporter's device.
    pub device: usize,
}

/// Another process's device memory opened in this one, closed (`cuIpcCloseMemHandle`) on drop.
pub struct IpcMapping {
    device: Device,
    ptr: DevicePtr,
    len: usize,
}

impl std::fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMapping")
            .field("ptr", &format_args!("{:#x}", self.ptr.addr))
            .field("device", &self.ptr.device)
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: the mapping lives until `self` drops (see `copy` on queued work at release).
unsafe impl DeviceRegion for IpcMapping {
    fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: closes this mapping once (its address came from cuIpcOpenMemHandle);
            // no safe handle to it outlives `self`.
            let _ = unsafe { (self.device.api().cuIpcCloseMemHandle)(self.ptr.addr) };
        }
    }
}

/// Checks that `[offset, offset + len)` lies in `region`; the error names `what`.
fn check_range(region: &dyn DeviceRegion, offset: usize, len: usize, what: &str) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= region.len() => Ok(()),
        _ => Err(Error::invalid(format!(
            "{what}: [{offset}, {offset}+{len}) is outside a device region of {} bytes",
            region.len()
        ))),
    }
}

/// A stream: owned (destroyed on drop) or a caller's, borrowed by its raw handle.
pub struct Stream {
    device: Device,
    raw: sys::CUstream,
    owned: bool,
    /// The host buffer of [`Stream::write`] and [`Stream::read`].
    staging: Mutex<Staging>,
}

/// A host buffer that queued copies read or write.
#[derive(Default)]
struct Staging {
    buf: Vec<u8>,
    /// A copy that uses `buf` may still be queued (its wait gave up).
    in_flight: bool,
}

// SAFETY: a CUstream is a driver handle usable from any thread whose current context is its
// device's (every method binds first); the driver serialises work queued on it.
unsafe impl Send for Stream {}
// SAFETY: see `Send`.
unsafe impl Sync for Stream {}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("raw", &format_args!("{:#x}", self.raw as usize))
            .field("device", &self.device.ordinal())
            .field("owned", &self.owned)
            .finish()
    }
}

/// Polls `query` (a `cuStreamQuery`/`cuEventQuery`) until it reports completion: spins, then
/// naps growing to [`LONGEST_NAP`]; past `deadline` an [`Error::Timeout`] naming `peer` and
/// `what`.
fn poll_until_done(
    device: &Device,
    call: &'static str,
    deadline: Instant,
    peer: usize,
    what: &dyn Fn() -> String,
    query: &dyn Fn() -> CUresult,
) -> Result<()> {
    let start = Instant::now();
    let mut polls: u32 = 0;
    let mut nap = FIRST_NAP;
    loop {
        match query() {
            sys::CUDA_SUCCESS => return Ok(()),
            sys::CUDA_ERROR_NOT_READY => {}
            code => return device.check(code, call, what),
        }
        polls = polls.saturating_add(1);
        if polls < SPIN_POLLS {
            std::hint::spin_loop();
            continue;
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout {
                peer,
                what: format!(
                    "{} (device work on CUDA device {})",
                    what(),
                    device.ordinal()
                ),
                waited: now - start,
            });
        }
        std::thread::sleep(nap.min(deadline - now));
        nap = (nap * 2).min(LONGEST_NAP);
    }
}

impl Stream {
    /// A new non-blocking stream on `device` (`cuStreamCreate`), destroyed on drop.
    pub fn new(device: &Device) -> Result<Self> {
        device.bind()?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: `s` is a live local the call writes.
        let code = unsafe { (device.api().cuStreamCreate)(&mut s, sys::CU_STREAM_NON_BLOCKING) };
        device.check(code, "cuStreamCreate", || {
            format!("creating a stream on device {}", device.ordinal())
        })?;
        Ok(Stream {
            device: device.clone(),
            raw: s,
            owned: true,
            staging: Mutex::default(),
        })
    }

    /// A caller's stream (e.g. torch's current stream), by its raw `CUstream` value (0: the
    /// legacy default stream); never destroyed by xccl.
    ///
    /// # Safety
    /// `raw` must be 0 or a stream of `device`'s primary context that stays valid while the
    /// returned value lives.
    pub unsafe fn borrowed(device: &Device, raw: u64) -> Self {
        Stream {
            device: device.clone(),
            raw: raw as usize as sys::CUstream,
            owned: false,
            staging: Mutex::default(),
        }
    }

    /// The raw `CUstream` value.
    pub fn raw(&self) -> u64 {
        self.raw as usize as u64
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether every operation queued so far completed (`cuStreamQuery`).
    pub fn is_idle(&self) -> Result<bool> {
        self.device.bind()?;
        // SAFETY: a live stream of this device (owned, or valid by `borrowed`'s contract).
        match unsafe { (self.device.api().cuStreamQuery)(self.raw) } {
            sys::CUDA_SUCCESS => Ok(true),
            sys::CUDA_ERROR_NOT_READY => Ok(false),
            code => self
                .device
                .check(code, "cuStreamQuery", || "querying a stream".into())
                .map(|()| false),
        }
    }

    /// Waits until every operation queued so far completed, polling `cuStreamQuery` (spin,
    /// then short naps); past `deadline` an [`Error::Timeout`] naming `peer` (the rank the
    /// work is for, or this rank) and `what`.
    pub fn synchronize(
        &self,
        deadline: Instant,
        peer: usize,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        self.device.bind()?;
        let api = self.device.api();
        poll_until_done(&self.device, "cuStreamQuery", deadline, peer, what, &|| {
            // SAFETY: a live stream of this device (see `borrowed`'s contract).
            unsafe { (api.cuStreamQuery)(self.raw) }
        })
    }

    /// Makes later work on this stream wait for `event` (`cuStreamWaitEvent`); returns at once.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.device.bind()?;
        // SAFETY: both handles are live (owned by their values).
        let code = unsafe { (self.device.api().cuStreamWaitEvent)(self.raw, event.raw, 0) };
        self.device.check(code, "cuStreamWaitEvent", || {
            "ordering a stream after an event".into()
        })
    }

    /// Copies `src` into `region` at `offset` and waits for it (bounded by `deadline`, naming
    /// `peer` on timeout). The bytes pass through a host buffer the stream owns, so a copy
    /// still queued when the wait gives up never reads `src` after the call returned.
    pub fn write(
        &self,
        region: &dyn DeviceRegion,
        offset: usize,
        src: &[u8],
        deadline: Instant,
        peer: usize,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        check_range(region, offset, src.len(), &what())?;
        if src.is_empty() {
            return Ok(());
        }
        let mut st = self.staged(deadline, peer, what)?;
        st.buf.clear();
        st.buf.extend_from_slice(src);
        // SAFETY: the destination range lies in the live `region` (checked); the source is the
        // stream's own buffer, which is neither touched nor freed before the stream ran the
        // copy (`in_flight`, `staged` and `Drop`).
        unsafe {
            self.copy_htod_async(region.ptr().add(offset), st.buf.as_ptr(), src.len(), what)?
        };
        st.in_flight = true;
        self.synchronize(deadline, peer, what)?;
        st.in_flight = false;
        Ok(())
    }

    /// Copies `dst.len()` bytes of `region` at `offset` into `dst` and waits for it (bounded,
    /// through the stream's host buffer as [`Stream::write`]).
    pub fn read(
        &self,
        region: &dyn DeviceRegion,
        offset: usize,
        dst: &mut [u8],
        deadline: Instant,
        peer: usize,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        self.read_parts(&mut [(region, offset, dst)], deadline, peer, what)
    }

    /// [`Stream::read`] of several ranges with one wait: each `(region, offset, dst)` copies
    /// `dst.len()` bytes of `region` at `offset` into `dst` (every range checked first).
    pub fn read_parts(
        &self,
        parts: &mut [(&dyn DeviceRegion, usize, &mut [u8])],
        deadline: Instant,
        peer: usize,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        for (region, offset, dst) in parts.iter() {
            check_range(*region, *offset, dst.len(), &what())?;
        }
        let total: usize = parts.iter().map(|p| p.2.len()).sum();
        if total == 0 {
            return Ok(());
        }
        let mut st = self.staged(deadline, peer, what)?;
        st.buf.resize(total, 0);
        let mut at = 0;
        for (region, offset, dst) in parts.iter() {
            // SAFETY: the source range lies in the live `region` (checked); the destination is
            // the stream's own buffer, `at..at + len` inside it (see `write`).
            unsafe {
                self.copy_dtoh_async(
                    st.buf[at..].as_mut_ptr(),
                    region.ptr().add(*offset),
                    dst.len(),
                    what,
                )?
            };
            st.in_flight = true;
            at += dst.len();
        }
        self.synchronize(deadline, peer, what)?;
        st.in_flight = false;
        let mut at = 0;
        for (_, _, dst) in parts.iter_mut() {
            let len = dst.len();
            dst.copy_from_slice(&st.buf[at..at + len]);
            at += len;
        }
        Ok(())
    }

    /// The stream's host buffer, once no queued copy uses it any more (bounded wait).
    fn staged(
        &self,
        deadline: Instant,
        peer: usize,
        what: &dyn Fn() -> String,
    ) -> Result<std::sync::MutexGuard<'_, Staging>> {
        let mut st = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if st.in_flight {
            self.synchronize(deadline, peer, what)?;
            st.in_flight = false;
        }
        Ok(st)
    }

    /// Queues a copy of `len` bytes between two regions (range-checked); returns at once.
    pub fn copy(
        &self,
        dst: &dyn DeviceRegion,
        dst_offset: usize,
        src: &dyn DeviceRegion,
        src_offset: usize,
        len: usize,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        check_range(dst, dst_offset, len, &what())?;
        check_range(src, src_offset, len, &what())?;
        // SAFETY: both ranges lie in live regions. Releasing a region while the copy is still
        // queued is left to the driver (cuMemFree synchronizes with the device, as cudaFree
        // does); xccl's owners synchronize their stream before they release regions.
        unsafe {
            self.copy_dtod_async(
                dst.ptr().add(dst_offset),
                src.ptr().add(src_offset),
                len,
                what,
            )
        }
    }

    /// Queues setting `len` bytes of `region` at `offset` to `byte`; returns at once.
    pub fn memset(
        &self,
        region: &dyn DeviceRegion,
        offset: usize,
        byte: u8,
        len: usize,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        check_range(region, offset, len, &what())?;
        self.device.bind()?;
        // SAFETY: the range lies in the live region (checked); see `copy` for its release.
        let code = unsafe {
            (self.device.api().cuMemsetD8Async)(
                region.ptr().add(offset).addr(),
                byte,
                len,
                self.raw,
            )
        };
        self.device.check(code, "cuMemsetD8Async", what)
    }

    /// Queues a host-to-device copy (`cuMemcpyHtoDAsync`).
    ///
    /// # Safety
    /// `dst..dst+len` must be device memory this process may write, and `src..src+len` host
    /// memory that stays valid and unmodified until the stream has run the copy.
    pub unsafe fn copy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller's contract.
        let code =
            unsafe { (self.device.api().cuMemcpyHtoDAsync)(dst.addr(), src.cast(), len, self.raw) };
        self.device.check(code, "cuMemcpyHtoDAsync_v2", what)
    }

    /// Queues a device-to-host copy (`cuMemcpyDtoHAsync`).
    ///
    /// # Safety
    /// `src..src+len` must be device memory this process may read, and `dst..dst+len` host
    /// memory that stays valid, and is not otherwise accessed, until the stream has run it.
    pub unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller's contract.
        let code =
            unsafe { (self.device.api().cuMemcpyDtoHAsync)(dst.cast(), src.addr(), len, self.raw) };
        self.device.check(code, "cuMemcpyDtoHAsync_v2", what)
    }

    /// Queues a device-to-device copy (`cuMemcpyDtoDAsync`; across devices through unified
    /// addressing and peer access).
    ///
    /// # Safety
    /// Both ranges must be device memory this process may access that stays allocated until
    /// the stream has run the copy.
    pub unsafe fn copy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.device.bind()?;
        // SAFETY: the caller's contract.
        let code =
            unsafe { (self.device.api().cuMemcpyDtoDAsync)(dst.addr(), src.addr(), len, self.raw) };
        self.device.check(code, "cuMemcpyDtoDAsync_v2", what)
    }

    /// Launches `function` on this stream (`cuLaunchKernel`); returns once it is queued.
    ///
    /// # Safety
    /// `params` must hold one pointer per kernel parameter, each pointing at a value of that
    /// parameter's type (device pointers as `u64`), valid for the call; the kernel's accesses
    /// must stay in memory that lives until the stream has run it.
    pub unsafe fn launch(
        &self,
        function: &Function,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller's contract; `function` keeps its module loaded.
        let code = unsafe {
            (self.device.api().cuLaunchKernel)(
                function.raw,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                shared_bytes,
                self.raw,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.device.check(code, "cuLaunchKernel", || {
            format!(
                "launching {} on grid {grid:?}, block {block:?}",
                function.name
            )
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let st = self.staging.get_mut().unwrap_or_else(|e| e.into_inner());
        if st.in_flight {
            let deadline = Instant::now() + DROP_WAIT;
            if self
                .synchronize(deadline, usize::MAX, &|| "a copy at teardown".into())
                .is_err()
            {
                // The device never ran the copy: the buffer must outlive it, so leak it.
                let st = self.staging.get_mut().unwrap_or_else(|e| e.into_inner());
                std::mem::forget(std::mem::take(&mut st.buf));
            }
        }
        if self.owned && self.device.bind().is_ok() {
            // SAFETY: destroys the stream this value created, once; the driver lets queued
            // work finish.
            let _ = unsafe { (self.device.api().cuStreamDestroy)(self.raw) };
        }
    }
}

/// An event (no timing), destroyed on drop.
pub struct Event {
    device: Device,
    raw: sys::CUevent,
}

// SAFETY: a CUevent is a driver handle usable from any thread bound to its device.
unsafe impl Send for Event {}
// SAFETY: see `Send`.
unsafe impl Sync for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("device", &self.device.ordinal())
            .finish()
    }
}

impl Event {
    /// A new event on `device` (`cuEventCreate`, timing disabled).
    pub fn new(device: &Device) -> Result<Self> {
        device.bind()?;
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `e` is a live local the call writes.
        let code = unsafe { (device.api().cuEventCreate)(&mut e, sys::CU_EVENT_DISABLE_TIMING) };
        device.check(code, "cuEventCreate", || {
            format!("creating an event on device {}", device.ordinal())
        })?;
        Ok(Event {
            device: device.clone(),
            raw: e,
        })
    }

    /// Records the work queued on `stream` so far (`cuEventRecord`).
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.device.bind()?;
        // SAFETY: both handles are live.
        let code = unsafe { (self.device.api().cuEventRecord)(self.raw, stream.raw) };
        self.device
            .check(code, "cuEventRecord", || "recording an event".into())
    }

    /// Whether the recorded work completed (`cuEventQuery`).
    pub fn is_complete(&self) -> Result<bool> {
        self.device.bind()?;
        // SAFETY: a live event.
        match unsafe { (self.device.api().cuEventQuery)(self.raw) } {
            sys::CUDA_SUCCESS => Ok(true),
            sys::CUDA_ERROR_NOT_READY => Ok(false),
            code => self
                .device
                .check(code, "cuEventQuery", || "querying an event".into())
                .map(|()| false),
        }
    }

    /// Waits until the recorded work completed, polling `cuEventQuery`; past `deadline` an
    /// [`Error::Timeout`] naming `peer` and `what`.
    pub fn wait(&self, deadline: Instant, peer: usize, what: &dyn Fn() -> String) -> Result<()> {
        self.device.bind()?;
        let api = self.device.api();
        poll_until_done(&self.device, "cuEventQuery", deadline, peer, what, &|| {
            // SAFETY: a live event.
            unsafe { (api.cuEventQuery)(self.raw) }
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: destroys this value's event once.
            let _ = unsafe { (self.device.api().cuEventDestroy)(self.raw) };
        }
    }
}

struct ModuleInner {
    device: Device,
    raw: sys::CUmodule,
}

// SAFETY: a CUmodule is a driver handle usable from any thread bound to its device.
unsafe impl Send for ModuleInner {}
// SAFETY: see `Send`; never mutated.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: unloads this module once; every `Function` of it holds this value.
            let _ = unsafe { (self.device.api().cuModuleUnload)(self.raw) };
        }
    }
}

/// A loaded module (CUBIN or PTX), unloaded when it and its functions are gone.
#[derive(Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("device", &self.inner.device.ordinal())
            .finish()
    }
}

impl Module {
    /// Loads `image` (a CUBIN, or PTX text) on `device` (`cuModuleLoadData`).
    pub fn load(device: &Device, image: &[u8]) -> Result<Self> {
        if image.is_empty() {
            return Err(Error::invalid("an empty module image"));
        }
        // PTX must be NUL-terminated; a CUBIN does not mind the extra byte.
        let mut owned = image.to_vec();
        owned.push(0);
        device.bind()?;
        let mut m: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `m` is a live local; `owned` is a live, NUL-terminated image for the call.
        let code = unsafe { (device.api().cuModuleLoadData)(&mut m, owned.as_ptr().cast()) };
        device.check(code, "cuModuleLoadData", || {
            format!(
                "loading a module of {} bytes on device {}",
                image.len(),
                device.ordinal()
            )
        })?;
        Ok(Module {
            inner: Arc::new(ModuleInner {
                device: device.clone(),
                raw: m,
            }),
        })
    }

    /// The kernel named `name` (`cuModuleGetFunction`; `CUDA_ERROR_NOT_FOUND` if absent).
    pub fn function(&self, name: &str) -> Result<Function> {
        let c = CString::new(name).map_err(|_| Error::invalid("a kernel name with a NUL"))?;
        let device = &self.inner.device;
        device.bind()?;
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: `f` is a live local; the module is loaded; `c` is NUL-terminated.
        let code =
            unsafe { (device.api().cuModuleGetFunction)(&mut f, self.inner.raw, c.as_ptr()) };
        device.check(code, "cuModuleGetFunction", || {
            format!("finding kernel {name}")
        })?;
        Ok(Function {
            module: self.clone(),
            raw: f,
            name: name.to_string(),
        })
    }
}

/// A kernel of a loaded [`Module`] (which it keeps loaded).
pub struct Function {
    #[allow(dead_code)]
    module: Module,
    raw: sys::CUfunction,
    name: String,
}

// SAFETY: a CUfunction is a driver handle usable from any thread bound to its device.
unsafe impl Send for Function {}
// SAFETY: see `Send`.
unsafe impl Sync for Function {}

impl std::fmt::Debug for Function {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Function")
            .field("name", &self.name)
            .finish()
    }
}

impl Function {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(test)]
pub(crate) mod tests;
