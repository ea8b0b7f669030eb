//! The CUDA driver API (`libcuda.so.1`), opened at run time.
//!
//! The subset of `cuda.h` that xccl calls, declared by hand from the CUDA driver API reference
//! (types, the constants xccl uses, one field per function in [`CudaDriver`]). Every function is
//! resolved by its exported symbol name with `dlsym`, using the versioned names the real driver
//! exports (`cuMemAlloc_v2`, `cuStreamDestroy_v2`, ...: what `cuda.h` maps the unversioned
//! names to), so nothing links against the library and `libxccl` loads where there is no CUDA.
//!
//! [`load`] opens, in order:
//! 1. the file named by `$XCCL_CUDA_LIBRARY` ([`PATH_ENV`]; the tests point it at the stand-in
//!    of `tests/cuda_standin/`);
//! 2. `libcuda.so.1` ([`LIBRARY`]), then `libcuda.so`, through the dynamic loader's search.
//!
//! The first that opens is used; every function must resolve, else the load fails naming the
//! missing ones. A missing library is a [`LoadError`] naming it (never a panic). The loaded
//! library is kept for the life of the process (never `dlclose`d).

use std::ffi::{c_char, c_int, c_uint, c_void, OsString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A driver call's result: 0 ([`CUDA_SUCCESS`]) or an error code.
pub type CUresult = c_int;
/// A device ordinal handle.
pub type CUdevice = c_int;
/// A device memory address (unified addressing: one address space per process).
pub type CUdeviceptr = u64;

/// Opaque driver object (`struct CUctx_st`).
#[repr(C)]
pub struct CUctx_st {
    _opaque: [u8; 0],
}
/// Opaque driver object (`struct CUstream_st`).
#[repr(C)]
pub struct CUstream_st {
    _opaque: [u8; 0],
}
/// Opaque driver object (`struct CUevent_st`).
#[repr(C)]
pub struct CUevent_st {
    _opaque: [u8; 0],
}
/// Opaque driver object (`struct CUmod_st`).
#[repr(C)]
pub struct CUmod_st {
    _opaque: [u8; 0],
}
/// Opaque driver object (`struct CUfunc_st`).
#[repr(C)]
pub struct CUfunc_st {
    _opaque: [u8; 0],
}

/// A context.
pub type CUcontext = *mut CUctx_st;
/// A stream (NULL: the legacy default stream).
pub type CUstream = *mut CUstream_st;
/// An event.
pub type CUevent = *mut CUevent_st;
/// A loaded module.
pub type CUmodule = *mut CUmod_st;
/// A kernel of a loaded module.
pub type CUfunction = *mut CUfunc_st;

/// Bytes of an IPC memory handle.
pub const CU_IPC_HANDLE_SIZE: usize = 64;

/// An IPC memory handle: opaque bytes another process of the host opens (passed by value).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CUipcMemHandle {
    /// The handle's bytes.
    pub reserved: [c_char; CU_IPC_HANDLE_SIZE],
}

/// `CUdevice_attribute` (an enum in `cuda.h`).
pub type CUdevice_attribute = c_uint;
/// Compute capability, major number.
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: CUdevice_attribute = 75;
/// Compute capability, minor number.
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: CUdevice_attribute = 76;

/// `CUpointer_attribute`.
pub type CUpointer_attribute = c_uint;
/// The memory type of a pointer (a `CUmemorytype`, written as an `unsigned int`).
pub const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: CUpointer_attribute = 2;
/// The device ordinal of a pointer's memory (an `int`).
pub const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: CUpointer_attribute = 9;
/// The start address of the allocation holding a pointer (a `CUdeviceptr`).
pub const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: CUpointer_attribute = 11;
/// The size of the allocation holding a pointer (a `size_t`).
pub const CU_POINTER_ATTRIBUTE_RANGE_SIZE: CUpointer_attribute = 12;

/// `CUmemorytype`: host memory.
pub const CU_MEMORYTYPE_HOST: c_uint = 1;
/// `CUmemorytype`: device memory.
pub const CU_MEMORYTYPE_DEVICE: c_uint = 2;
/// `CUmemorytype`: a CUDA array.
pub const CU_MEMORYTYPE_ARRAY: c_uint = 3;
/// `CUmemorytype`: unified (managed) memory.
pub const CU_MEMORYTYPE_UNIFIED: c_uint = 4;

/// `cuStreamCreate` flag: the stream does not synchronize with the legacy default stream.
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
/// `cuEventCreate` flag: no timing (the cheapest event).
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;
/// `cuIpcOpenMemHandle` flag: enable peer access to the exporter's device when needed.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// Success.
pub const CUDA_SUCCESS: CUresult = 0;
/// An argument is out of range (also: a pointer the driver does not know).
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
/// Out of device memory.
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
/// `cuInit` was not called.
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
/// No CUDA device.
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
/// Not a valid device ordinal.
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
/// A module image the driver cannot load.
pub const CUDA_ERROR_INVALID_IMAGE: CUresult = 200;
/// No current context, or the wrong one (also: an IPC handle exported by this very process).
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
/// A handle (stream, event, function) that is not valid.
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
/// A named symbol (kernel) was not found.
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
/// Asynchronous work is not complete yet (`cuStreamQuery`, `cuEventQuery`).
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
/// Peer access between the two contexts is enabled already.
pub const CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: CUresult = 704;
/// The operation is not supported (e.g. IPC on this platform).
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;

/// File name of the CUDA driver library.
pub const LIBRARY: &str = "libcuda.so.1";
/// The unversioned development name, tried after [`LIBRARY`].
pub const LIBRARY_UNVERSIONED: &str = "libcuda.so";
/// Environment variable naming the driver library file to open first.
pub const PATH_ENV: &str = "XCCL_CUDA_LIBRARY";

/// Declares the function table and its loader: one `unsafe extern "C"` field per function,
/// resolved by the given symbol name.
macro_rules! driver_api {
    ($( $(#[$doc:meta])* $field:ident = $sym:literal : fn($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty; )*) => {
        /// The driver's functions, each resolved by its exported name (see [`SYMBOLS`]).
        #[allow(non_snake_case)]
        pub struct CudaDriver {
            $( $(#[$doc])* pub $field: unsafe extern "C" fn($($arg: $ty),*) -> $ret, )*
        }

        /// The exported symbol names that [`CudaDriver`] resolves, in declaration order.
        pub const SYMBOLS: &[&str] = &[$($sym),*];

        impl CudaDriver {
            /// Resolves every function in `lib`; the error lists the symbols that are missing.
            ///
            /// # Safety
            /// `lib` must be a CUDA driver (or a stand-in of it) whose symbols of these names
            /// have the declared C signatures.
            #[allow(non_snake_case)]
            unsafe fn resolve(lib: &libloading::Library) -> Result<Self, Vec<&'static str>> {
                let mut missing = Vec::new();
                $(
                    // SAFETY: the caller promises the symbol has this signature; the pointer
                    // stays valid because the library is never unloaded (kept with the table).
                    let $field: Option<unsafe extern "C" fn($($ty),*) -> $ret> = unsafe {
                        lib.get::<unsafe extern "C" fn($($ty),*) -> $ret>(concat!($sym, "\0").as_bytes())
                            .ok()
                            .map(|s| *s)
                    };
                    if $field.is_none() {
                        missing.push($sym);
                    }
                )*
                if !missing.is_empty() {
                    return Err(missing);
                }
                Ok(CudaDriver {
                    $( $field: $field.expect("checked above"), )*
                })
            }
        }
    };
}

driver_api! {
    /// `cuInit(flags)`.
    cuInit = "cuInit": fn(flags: c_uint) -> CUresult;
    /// `cuDriverGetVersion(version)`.
    cuDriverGetVersion = "cuDriverGetVersion": fn(version: *mut c_int) -> CUresult;
    /// `cuDeviceGetCount(count)`.
    cuDeviceGetCount = "cuDeviceGetCount": fn(count: *mut c_int) -> CUresult;
    /// `cuDeviceGet(device, ordinal)`.
    cuDeviceGet = "cuDeviceGet": fn(device: *mut CUdevice, ordinal: c_int) -> CUresult;
    /// `cuDeviceGetAttribute(value, attribute, device)`.
    cuDeviceGetAttribute = "cuDeviceGetAttribute":
        fn(value: *mut c_int, attrib: CUdevice_attribute, dev: CUdevice) -> CUresult;
    /// `cuDeviceGetName(name, len, device)`.
    cuDeviceGetName = "cuDeviceGetName": fn(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult;
    /// `cuDevicePrimaryCtxRetain(ctx, device)`.
    cuDevicePrimaryCtxRetain = "cuDevicePrimaryCtxRetain":
        fn(pctx: *mut CUcontext, dev: CUdevice) -> CUresult;
    /// `cuDevicePrimaryCtxRelease(device)` (`_v2`).
    cuDevicePrimaryCtxRelease = "cuDevicePrimaryCtxRelease_v2": fn(dev: CUdevice) -> CUresult;
    /// `cuCtxSetCurrent(ctx)`.
    cuCtxSetCurrent = "cuCtxSetCurrent": fn(ctx: CUcontext) -> CUresult;
    /// `cuCtxGetCurrent(ctx)`.
    cuCtxGetCurrent = "cuCtxGetCurrent": fn(pctx: *mut CUcontext) -> CUresult;
    /// `cuCtxEnablePeerAccess(peer context, flags)`.
    cuCtxEnablePeerAccess = "cuCtxEnablePeerAccess": fn(peer: CUcontext, flags: c_uint) -> CUresult;
    /// `cuDeviceCanAccessPeer(can, device, peer device)`.
    cuDeviceCanAccessPeer = "cuDeviceCanAccessPeer":
        fn(can: *mut c_int, dev: CUdevice, peer: CUdevice) -> CUresult;
    /// `cuMemAlloc(ptr, bytes)` (`_v2`).
    cuMemAlloc = "cuMemAlloc_v2": fn(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult;
    /// `cuMemFree(ptr)` (`_v2`).
    cuMemFree = "cuMemFree_v2": fn(dptr: CUdeviceptr) -> CUresult;
    /// `cuMemsetD8(dst, byte, count)` (`_v2`).
    cuMemsetD8 = "cuMemsetD8_v2": fn(dst: CUdeviceptr, uc: u8, n: usize) -> CUresult;
    /// `cuMemsetD8Async(dst, byte, count, stream)`.
    cuMemsetD8Async = "cuMemsetD8Async":
        fn(dst: CUdeviceptr, uc: u8, n: usize, stream: CUstream) -> CUresult;
    /// `cuMemcpyHtoD(dst, src, bytes)` (`_v2`).
    cuMemcpyHtoD = "cuMemcpyHtoD_v2": fn(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult;
    /// `cuMemcpyDtoH(dst, src, bytes)` (`_v2`).
    cuMemcpyDtoH = "cuMemcpyDtoH_v2": fn(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult;
    /// `cuMemcpyDtoD(dst, src, bytes)` (`_v2`).
    cuMemcpyDtoD = "cuMemcpyDtoD_v2": fn(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult;
    /// `cuMemcpyHtoDAsync(dst, src, bytes, stream)` (`_v2`).
    cuMemcpyHtoDAsync = "cuMemcpyHtoDAsync_v2":
        fn(dst: CUdeviceptr, src: *const c_void, n: usize, stream: CUstream) -> CUresult;
    /// `cuMemcpyDtoHAsync(dst, src, bytes, stream)` (`_v2`).
    cuMemcpyDtoHAsync = "cuMemcpyDtoHAsync_v2":
        fn(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: CUstream) -> CUresult;
    /// `cuMemcpyDtoDAsync(dst, src, bytes, stream)` (`_v2`).
    cuMemcpyDtoDAsync = "cuMemcpyDtoDAsync_v2":
        fn(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream) -> CUresult;
    /// `cuMemcpyPeerAsync(dst, dst context, src, src context, bytes, stream)`.
    cuMemcpyPeerAsync = "cuMemcpyPeerAsync": fn(
        dst: CUdeviceptr,
        dst_ctx: CUcontext,
        src: CUdeviceptr,
        src_ctx: CUcontext,
        n: usize,
        stream: CUstream,
    ) -> CUresult;
    /// `cuStreamCreate(stream, flags)`.
    cuStreamCreate = "cuStreamCreate": fn(stream: *mut CUstream, flags: c_uint) -> CUresult;
    /// `cuStreamDestroy(stream)` (`_v2`).
    cuStreamDestroy = "cuStreamDestroy_v2": fn(stream: CUstream) -> CUresult;
    /// `cuStreamQuery(stream)`: [`CUDA_SUCCESS`] when idle, [`CUDA_ERROR_NOT_READY`] when not.
    cuStreamQuery = "cuStreamQuery": fn(stream: CUstream) -> CUresult;
    /// `cuStreamWaitEvent(stream, event, flags)`.
    cuStreamWaitEvent = "cuStreamWaitEvent":
        fn(stream: CUstream, event: CUevent, flags: c_uint) -> CUresult;
    /// `cuEventCreate(event, flags)`.
    cuEventCreate = "cuEventCreate": fn(event: *mut CUevent, flags: c_uint) -> CUresult;
    /// `cuEventRecord(event, stream)`.
    cuEventRecord = "cuEventRecord": fn(event: CUevent, stream: CUstream) -> CUresult;
    /// `cuEventQuery(event)`: [`CUDA_SUCCESS`] when complete, [`CUDA_ERROR_NOT_READY`] when not.
    cuEventQuery = "cuEventQuery": fn(event: CUevent) -> CUresult;
    /// `cuEventDestroy(event)` (`_v2`).
    cuEventDestroy = "cuEventDestroy_v2": fn(event: CUevent) -> CUresult;
    /// `cuIpcGetMemHandle(handle, ptr)`.
    cuIpcGetMemHandle = "cuIpcGetMemHandle":
        fn(handle: *mut CUipcMemHandle, dptr: CUdeviceptr) -> CUresult;
    /// `cuIpcOpenMemHandle(ptr, handle, flags)` (`_v2`; the handle is passed by value).
    cuIpcOpenMemHandle = "cuIpcOpenMemHandle_v2":
        fn(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) -> CUresult;
    /// `cuIpcCloseMemHandle(ptr)`.
    cuIpcCloseMemHandle = "cuIpcCloseMemHandle": fn(dptr: CUdeviceptr) -> CUresult;
    /// `cuModuleLoadData(module, image)`.
    cuModuleLoadData = "cuModuleLoadData": fn(module: *mut CUmodule, image: *const c_void) -> CUresult;
    /// `cuModuleUnload(module)`.
    cuModuleUnload = "cuModuleUnload": fn(module: CUmodule) -> CUresult;
    /// `cuModuleGetFunction(function, module, name)`.
    cuModuleGetFunction = "cuModuleGetFunction":
        fn(func: *mut CUfunction, module: CUmodule, name: *const c_char) -> CUresult;
    /// `cuLaunchKernel(f, grid x/y/z, block x/y/z, shared bytes, stream, params, extra)`.
    cuLaunchKernel = "cuLaunchKernel": fn(
        f: CUfunction,
        grid_x: c_uint,
        grid_y: c_uint,
        grid_z: c_uint,
        block_x: c_uint,
        block_y: c_uint,
        block_z: c_uint,
        shared_bytes: c_uint,
        stream: CUstream,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult;
    /// `cuGetErrorName(code, name)`.
    cuGetErrorName = "cuGetErrorName": fn(code: CUresult, name: *mut *const c_char) -> CUresult;
    /// `cuGetErrorString(code, text)`.
    cuGetErrorString = "cuGetErrorString": fn(code: CUresult, text: *mut *const c_char) -> CUresult;
    /// `cuPointerGetAttribute(data, attribute, ptr)`.
    cuPointerGetAttribute = "cuPointerGetAttribute":
        fn(data: *mut c_void, attribute: CUpointer_attribute, ptr: CUdeviceptr) -> CUresult;
}

/// The opened driver library and its function table.
pub struct Cuda {
    api: CudaDriver,
    path: PathBuf,
    /// Keeps the functions of `api` mapped (never unloaded).
    _library: libloading::Library,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda").field("path", &self.path).finish()
    }
}

impl Cuda {
    /// The function table.
    pub fn api(&self) -> &CudaDriver {
        &self.api
    }

    /// The file that was opened.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

pub use crate::LoadError;

/// The error for a driver that none of `tried` provided.
fn not_found(tried: Vec<(PathBuf, String)>) -> LoadError {
    LoadError::NotFound {
        hint: format!(
            "the CUDA driver {LIBRARY} was not found (install the NVIDIA driver, or set \
             {PATH_ENV} to the library's path)"
        ),
        tried,
    }
}

/// The names [`load`] tries, in order (see the module docs).
pub fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os(PATH_ENV).filter(|p| !p.is_empty()) {
        out.push(PathBuf::from(p));
    }
    out.push(PathBuf::from(LIBRARY));
    out.push(PathBuf::from(LIBRARY_UNVERSIONED));
    out
}

static LOADED: Mutex<Option<Arc<Cuda>>> = Mutex::new(None);

/// Opens one file as the driver: every function must resolve.
fn open(path: &Path) -> Result<Cuda, Result<LoadError, String>> {
    let name: OsString = path.as_os_str().to_owned();
    // SAFETY: opening the library runs its initialisers; libcuda (or the stand-in) has none
    // with preconditions on this process: that is the contract of asking for CUDA.
    let lib = unsafe { libloading::Library::new(&name) }.map_err(|e| Err(e.to_string()))?;
    // SAFETY: a library found under the driver's name (or the one the user named for it) is
    // taken to be a CUDA driver with the documented signatures.
    let api = unsafe { CudaDriver::resolve(&lib) }.map_err(|missing| {
        Ok(LoadError::MissingSymbols {
            path: path.to_path_buf(),
            missing,
            verdict: "driver too old or not a CUDA driver",
        })
    })?;
    Ok(Cuda {
        api,
        path: path.to_path_buf(),
        _library: lib,
    })
}

/// Opens the driver (once per process; later calls return the same library). A failed load
/// is not remembered: a later call searches again.
pub fn load() -> Result<Arc<Cuda>, LoadError> {
    let mut slot = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(cuda) = slot.as_ref() {
        return Ok(cuda.clone());
    }
    let mut tried = Vec::new();
    for path in candidates() {
        if path.components().count() > 1 && !path.exists() {
            tried.push((path, "no such file".to_string()));
            continue;
        }
        match open(&path) {
            Ok(cuda) => {
                let cuda = Arc::new(cuda);
                *slot = Some(cuda.clone());
                return Ok(cuda);
            }
            Err(Ok(e)) => return Err(e),
            Err(Err(why)) => tried.push((path, why)),
        }
    }
    Err(not_found(tried))
}

/// Opens `path` as the process's driver unless one is loaded already (then that one is
/// returned, whatever its path): for tests that load a stand-in without the environment.
pub fn load_from(path: &Path) -> Result<Arc<Cuda>, LoadError> {
    let mut slot = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(cuda) = slot.as_ref() {
        return Ok(cuda.clone());
    }
    match open(path) {
        Ok(cuda) => {
            let cuda = Arc::new(cuda);
            *slot = Some(cuda.clone());
            Ok(cuda)
        }
        Err(Ok(e)) => Err(e),
        Err(Err(why)) => Err(not_found(vec![(path.to_path_buf(), why)])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbols_use_the_versioned_names_the_driver_exports() {
        for sym in [
            "cuMemAlloc_v2",
            "cuMemFree_v2",
            "cuMemcpyHtoD_v2",
            "cuMemcpyDtoHAsync_v2",
            "cuStreamDestroy_v2",
            "cuEventDestroy_v2",
            "cuIpcOpenMemHandle_v2",
            "cuDevicePrimaryCtxRelease_v2",
        ] {
            assert!(SYMBOLS.contains(&sym), "{sym}");
        }
        assert_eq!(std::mem::size_of::<CUipcMemHandle>(), 64);
    }

    #[test]
    fn a_missing_library_is_an_error_naming_it_and_the_variable() {
        let e = load_from(Path::new("/nonexistent/libcuda.so.1")).map(|_| ());
        // A driver loaded earlier in this process (none in this crate's tests) is returned as is.
        if let Err(e) = e {
            let s = e.to_string();
            assert!(
                s.contains(LIBRARY) && s.contains(PATH_ENV) && s.contains("/nonexistent"),
                "{s}"
            );
        }
    }

    #[test]
    fn a_library_without_the_driver_functions_is_rejected_naming_them() {
        match open(Path::new("libc.so.6")) {
            Err(Ok(LoadError::MissingSymbols { missing, .. })) => {
                assert!(missing.contains(&"cuInit") && missing.contains(&"cuMemAlloc_v2"))
            }
            Err(other) => panic!("expected MissingSymbols, got {other:?}"),
            Ok(_) => panic!("libc resolved as a CUDA driver"),
        }
    }
}
