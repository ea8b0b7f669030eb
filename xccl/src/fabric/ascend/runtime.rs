//! A thin safe layer over the raw ACL calls of `xccl_sys::acl`: loading and initialising the
//! runtime once per process, binding the calling thread to a device, and turning non-zero
//! `aclError` codes into [`Error::Native`] with the call's name and `aclGetRecentErrMsg`'s text.
//!
//! Every function here takes device addresses as plain integers-in-pointers and never
//! dereferences them on the host: device memory is not host-addressable on real hardware.

use std::cell::Cell;
use std::collections::HashSet;
use std::ffi::{c_void, CStr, CString};
use std::sync::{Arc, Mutex};

use xccl_sys::acl::{self, Acl};

use crate::{Error, Result};

/// Library name used in errors.
pub(crate) const LIBRARY: &str = acl::LIBRARY;

/// `None` until xccl initialised ACL in this process; `Some(true)` if xccl's `aclInit` did it,
/// `Some(false)` if someone else had (then xccl never finalizes).
static INITIALISED: Mutex<Option<bool>> = Mutex::new(None);
/// `(this device, peer device)` pairs whose peer access this process enabled.
static PEER_ACCESS: Mutex<Option<HashSet<(i32, i32)>>> = Mutex::new(None);

thread_local! {
    /// The device this thread was last bound to with `aclrtSetDevice` by xccl.
    static CURRENT_DEVICE: Cell<Option<i32>> = const { Cell::new(None) };
}

/// The runtime library bound to one device.
#[derive(Clone)]
pub(crate) struct Runtime {
    acl: Arc<Acl>,
    device: i32,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("library", &self.acl.path())
            .field("device", &self.device)
            .finish()
    }
}

/// Opens the runtime library, or [`Error::FabricUnavailable`] naming it and `ASCEND_HOME_PATH`.
pub(crate) fn load() -> Result<Arc<Acl>> {
    acl::load().map_err(|e| Error::FabricUnavailable {
        fabric: "ascend".into(),
        detail: e.to_string(),
    })
}

impl Runtime {
    /// Loads the library, initialises ACL in this process (once) and binds this thread to
    /// `device`. Fails with [`Error::FabricUnavailable`] if the library or one of `needs` (the
    /// optional functions the caller cannot do without) is missing.
    pub(crate) fn open(device: i32, needs: &[&str]) -> Result<Self> {
        let acl = load()?;
        let missing: Vec<&str> = needs.iter().copied().filter(|n| !acl.has(n)).collect();
        if !missing.is_empty() {
            return Err(Error::FabricUnavailable {
                fabric: "ascend".into(),
                detail: format!(
                    "{} lacks {} (CANN 8.2 or later has them)",
                    acl.path().display(),
                    missing.join(", ")
                ),
            });
        }
        let rt = Runtime { acl, device };
        rt.init_process()?;
        // Always bind explicitly here (not through the thread cache): the caller's thread may
        // have been bound by someone else since.
        // SAFETY: aclrtSetDevice takes a plain integer.
        let code = unsafe { rt.acl.runtime().aclrtSetDevice(device) };
        rt.check(code, "aclrtSetDevice", || {
            format!("binding to device {device}")
        })?;
        CURRENT_DEVICE.with(|c| c.set(Some(device)));
        Ok(rt)
    }

    fn init_process(&self) -> Result<()> {
        let mut done = INITIALISED.lock().unwrap_or_else(|e| e.into_inner());
        if done.is_some() {
            return Ok(());
        }
        // SAFETY: aclInit accepts NULL for "no configuration file".
        let code = unsafe { self.acl.runtime().aclInit(std::ptr::null()) };
        // The application (or another library) may have initialised ACL already: fine.
        if code != 0 && code as u32 != acl::ACL_ERROR_REPEAT_INITIALIZE {
            self.check(code, "aclInit", || "initialising the Ascend runtime".into())?;
        }
        let ours = code == 0;
        if !ours {
            // Consume the message the runtime left for the repeated init.
            let _ = self.recent_message();
        }
        *done = Some(ours);
        Ok(())
    }

    /// The raw function table.
    pub(crate) fn raw(&self) -> &acl::AclRuntime {
        self.acl.runtime()
    }

    /// The device this runtime is bound to.
    pub(crate) fn device(&self) -> i32 {
        self.device
    }

    /// The library file that was opened.
    pub(crate) fn library_path(&self) -> &std::path::Path {
        self.acl.path()
    }

    /// Whether optional function `name` exists in the loaded library.
    pub(crate) fn has(&self, name: &str) -> bool {
        self.acl.has(name)
    }

    /// Binds the calling thread to this runtime's device if xccl has not done so on it yet.
    /// ACL contexts are per thread, and the fabric may be used from any thread.
    pub(crate) fn bind_thread(&self) -> Result<()> {
        if CURRENT_DEVICE.with(|c| c.get()) == Some(self.device) {
            return Ok(());
        }
        // SAFETY: aclrtSetDevice takes a plain integer.
        let code = unsafe { self.raw().aclrtSetDevice(self.device) };
        self.check(code, "aclrtSetDevice", || {
            format!("binding a thread to device {}", self.device)
        })?;
        CURRENT_DEVICE.with(|c| c.set(Some(self.device)));
        Ok(())
    }

    /// The runtime's message for the calling thread's last error, if any.
    fn recent_message(&self) -> Option<String> {
        // SAFETY: aclGetRecentErrMsg takes no arguments and returns NULL or a NUL-terminated
        // string owned by the runtime, valid until the next ACL call on this thread; it is
        // copied at once.
        let ptr = unsafe { self.raw().aclGetRecentErrMsg() };
        if ptr.is_null() {
            return None;
        }
        // SAFETY: non-null, NUL-terminated (runtime contract), read before any other ACL call.
        let text = unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .trim()
            .to_string();
        (!text.is_empty()).then_some(text)
    }

    /// `Ok` for code 0, else [`Error::Native`] with the call, code and the runtime's message.
    pub(crate) fn check(
        &self,
        code: acl::aclError,
        call: &'static str,
        context: impl FnOnce() -> String,
    ) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        let message = self
            .recent_message()
            .unwrap_or_else(|| "the runtime gave no message (aclGetRecentErrMsg)".to_string());
        Err(Error::Native {
            library: LIBRARY,
            call,
            code: i64::from(code),
            message,
            context: context(),
        })
    }

    /// The pid the device driver knows this process by (`aclrtDeviceGetBareTgid`, which sees
    /// through containers and VMs), or `getpid()` on runtimes without it.
    pub(crate) fn ipc_pid(&self) -> Result<i32> {
        if !self.has("aclrtDeviceGetBareTgid") {
            return i32::try_from(std::process::id())
                .map_err(|_| Error::invalid("pid out of range"));
        }
        let mut pid = 0i32;
        // SAFETY: `pid` is a valid out-pointer for the call.
        let code = unsafe { self.raw().aclrtDeviceGetBareTgid(&mut pid) };
        self.check(code, "aclrtDeviceGetBareTgid", || {
            "asking the driver for this process's pid".into()
        })?;
        Ok(pid)
    }

    /// Enables access from this device to `peer_device`'s memory (once per process and pair);
    /// [`Error::FabricUnavailable`] if the hardware cannot.
    pub(crate) fn enable_peer_access(&self, peer_device: i32, peer: usize) -> Result<()> {
        if peer_device == self.device {
            return Ok(());
        }
        let mut set = PEER_ACCESS.lock().unwrap_or_else(|e| e.into_inner());
        let set = set.get_or_insert_with(HashSet::new);
        if set.contains(&(self.device, peer_device)) {
            return Ok(());
        }
        let mut can = 0i32;
        // SAFETY: `can` is a valid out-pointer; the ids are plain integers.
        let code = unsafe {
            self.raw()
                .aclrtDeviceCanAccessPeer(&mut can, self.device, peer_device)
        };
        self.check(code, "aclrtDeviceCanAccessPeer", || {
            format!(
                "asking whether device {} can reach device {peer_device} of rank {peer}",
                self.device
            )
        })?;
        if can == 0 {
            return Err(Error::FabricUnavailable {
                fabric: "ascend".into(),
                detail: format!(
                    "device {} cannot access device {peer_device} (rank {peer}): no HCCS/UB path \
                     between them",
                    self.device
                ),
            });
        }
        // SAFETY: plain integers; flags must be 0.
        let code = unsafe { self.raw().aclrtDeviceEnablePeerAccess(peer_device, 0) };
        self.check(code, "aclrtDeviceEnablePeerAccess", || {
            format!(
                "enabling access from device {} to device {peer_device} (rank {peer})",
                self.device
            )
        })?;
        set.insert((self.device, peer_device));
        Ok(())
    }

    /// Allocates `len` bytes of device memory.
    pub(crate) fn malloc(&self, len: usize, what: &str) -> Result<DevPtr> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer; the policy is a valid enum value.
        let code = unsafe {
            self.raw()
                .aclrtMalloc(&mut ptr, len.max(1), acl::ACL_MEM_MALLOC_HUGE_FIRST)
        };
        self.check(code, "aclrtMalloc", || {
            format!("allocating {len} bytes of device memory for {what}")
        })?;
        if ptr.is_null() {
            return Err(Error::Native {
                library: LIBRARY,
                call: "aclrtMalloc",
                code: 0,
                message: "returned success and a NULL pointer".into(),
                context: format!("allocating {len} bytes for {what}"),
            });
        }
        Ok(DevPtr(ptr.cast()))
    }

    /// Frees memory from [`Runtime::malloc`] (errors are reported, not raised: used in drops).
    pub(crate) fn free(&self, ptr: DevPtr) -> Result<()> {
        // SAFETY: `ptr` came from aclrtMalloc of this runtime and is freed once (callers take it
        // out of their Option first).
        let code = unsafe { self.raw().aclrtFree(ptr.0.cast()) };
        self.check(code, "aclrtFree", || "freeing device memory".into())
    }

    /// Synchronous host-to-device copy of `src` to `dst` (this process's own device memory).
    pub(crate) fn copy_to_device(
        &self,
        dst: DevPtr,
        src: &[u8],
        context: impl FnOnce() -> String,
    ) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` is a live host slice of `src.len()` bytes; `dst` is device memory of
        // this process with at least that many bytes (bounds checked by the caller); the copy
        // is complete when the call returns.
        let code = unsafe {
            self.raw().aclrtMemcpy(
                dst.0.cast(),
                src.len(),
                src.as_ptr().cast(),
                src.len(),
                acl::ACL_MEMCPY_HOST_TO_DEVICE,
            )
        };
        self.check(code, "aclrtMemcpy", context)
    }

    /// Synchronous device-to-host copy from `src` (this process's own device memory).
    pub(crate) fn copy_to_host(
        &self,
        dst: &mut [u8],
        src: DevPtr,
        context: impl FnOnce() -> String,
    ) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is a live exclusive host slice; `src` is device memory of this process
        // with at least `dst.len()` bytes (checked by the caller); complete on return.
        let code = unsafe {
            self.raw().aclrtMemcpy(
                dst.as_mut_ptr().cast(),
                dst.len(),
                src.0.cast(),
                dst.len(),
                acl::ACL_MEMCPY_DEVICE_TO_HOST,
            )
        };
        self.check(code, "aclrtMemcpy", context)
    }

    /// Exports `[ptr, ptr+len)` for other processes; returns its key.
    pub(crate) fn export(&self, ptr: DevPtr, len: usize) -> Result<CString> {
        let mut key = [0u8; acl::ACL_IPC_MEM_KEY_LEN as usize];
        // SAFETY: `key` is a writable buffer of exactly the documented key length (65); `ptr`
        // is the start of an allocation of `len` bytes of this process.
        let code = unsafe {
            self.raw().aclrtIpcMemGetExportKey(
                ptr.0.cast(),
                len,
                key.as_mut_ptr().cast(),
                key.len(),
                u64::from(acl::ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT),
            )
        };
        self.check(code, "aclrtIpcMemGetExportKey", || {
            format!("exporting this rank's window ({len} bytes)")
        })?;
        let end = key.iter().position(|&b| b == 0).unwrap_or(key.len());
        CString::new(&key[..end]).map_err(|_| Error::invalid("IPC key with a NUL byte"))
    }

    /// Allows processes `pids` to import `key`.
    pub(crate) fn allow_importers(&self, key: &CString, pids: &[i32]) -> Result<()> {
        if pids.is_empty() {
            return Ok(());
        }
        let mut pids = pids.to_vec();
        // SAFETY: `key` is NUL-terminated; `pids` points to `pids.len()` valid i32s (the call
        // takes a mutable pointer but only reads them).
        let code = unsafe {
            self.raw()
                .aclrtIpcMemSetImportPid(key.as_ptr(), pids.as_mut_ptr(), pids.len())
        };
        self.check(code, "aclrtIpcMemSetImportPid", || {
            format!("allowing processes {pids:?} to import this rank's window")
        })
    }

    /// Maps a peer's exported memory; returns its device address in this process.
    pub(crate) fn import(&self, key: &CString, peer: usize) -> Result<DevPtr> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer, `key` NUL-terminated.
        let code = unsafe {
            self.raw().aclrtIpcMemImportByKey(
                &mut ptr,
                key.as_ptr(),
                u64::from(acl::ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT),
            )
        };
        self.check(code, "aclrtIpcMemImportByKey", || {
            format!("importing rank {peer}'s window (key {key:?})")
        })?;
        Ok(DevPtr(ptr.cast()))
    }

    /// Closes an imported key (importer) or stops exporting it (exporter).
    pub(crate) fn close_key(&self, key: &CString, what: &str) -> Result<()> {
        // SAFETY: `key` is NUL-terminated.
        let code = unsafe { self.raw().aclrtIpcMemClose(key.as_ptr()) };
        self.check(code, "aclrtIpcMemClose", || format!("closing {what}"))
    }

    /// Resets the device binding made by [`Runtime::open`] (balances its `aclrtSetDevice`).
    pub(crate) fn reset_device(&self) -> Result<()> {
        // SAFETY: plain integer.
        let code = unsafe { self.raw().aclrtResetDevice(self.device) };
        CURRENT_DEVICE.with(|c| c.set(None));
        self.check(code, "aclrtResetDevice", || {
            format!("releasing device {}", self.device)
        })
    }
}

/// An address in device memory (own or imported). Never dereferenced on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DevPtr(pub(crate) *mut u8);

// SAFETY: a device address is an integer to the host; it is only passed to runtime calls.
unsafe impl Send for DevPtr {}
// SAFETY: see `Send`.
unsafe impl Sync for DevPtr {}

impl DevPtr {
    /// The address `off` bytes further (no host access, so plain integer arithmetic).
    pub(crate) fn add(self, off: usize) -> DevPtr {
        DevPtr(self.0.wrapping_add(off))
    }

    /// The address as an integer (for alignment arithmetic).
    pub(crate) fn addr(self) -> usize {
        self.0 as usize
    }
}

/// An ACL stream owned by a fabric.
#[derive(Debug)]
pub(crate) struct Stream(pub(crate) acl::aclrtStream);

// SAFETY: a stream handle may be used from any thread bound to its device; the fabric
// serialises its use behind a mutex.
unsafe impl Send for Stream {}

impl Runtime {
    /// Creates a stream on this device.
    pub(crate) fn create_stream(&self) -> Result<Stream> {
        let mut s: acl::aclrtStream = std::ptr::null_mut();
        // SAFETY: `s` is a valid out-pointer.
        let code = unsafe { self.raw().aclrtCreateStream(&mut s) };
        self.check(code, "aclrtCreateStream", || {
            format!("creating a stream on device {}", self.device)
        })?;
        Ok(Stream(s))
    }

    /// Destroys a stream made by [`Runtime::create_stream`].
    pub(crate) fn destroy_stream(&self, s: Stream) -> Result<()> {
        // SAFETY: `s` came from aclrtCreateStream and is consumed here.
        let code = unsafe { self.raw().aclrtDestroyStream(s.0) };
        self.check(code, "aclrtDestroyStream", || {
            "destroying the stream".into()
        })
    }

    /// Waits for every task on `s`, at most `timeout_ms`. The fabric opens only runtimes that
    /// have `aclrtSynchronizeStreamWithTimeout` (its `NEEDS`): no synchronize is unbounded.
    pub(crate) fn synchronize(
        &self,
        s: &Stream,
        timeout_ms: i32,
        context: impl FnOnce() -> String,
    ) -> Result<()> {
        // SAFETY: `s` is a live stream of this device; the function exists (checked at open).
        let code = unsafe {
            self.raw()
                .aclrtSynchronizeStreamWithTimeout(s.0, timeout_ms)
        };
        self.check(code, "aclrtSynchronizeStreamWithTimeout", context)
    }

    /// Queues a device-to-device copy of `len` bytes on `s`.
    ///
    /// # Safety
    /// `dst` and `src` must be device memory reachable from this device (own, or imported with
    /// peer access enabled) with at least `len` bytes each, and stay allocated until the stream
    /// has been synchronized.
    pub(crate) unsafe fn copy_d2d_async(
        &self,
        s: &Stream,
        dst: DevPtr,
        src: DevPtr,
        len: usize,
        context: impl FnOnce() -> String,
    ) -> Result<()> {
        // SAFETY: caller contract; the runtime only records the addresses.
        let code = unsafe {
            self.raw().aclrtMemcpyAsync(
                dst.0.cast(),
                len,
                src.0.cast(),
                len,
                acl::ACL_MEMCPY_DEVICE_TO_DEVICE,
                s.0,
            )
        };
        self.check(code, "aclrtMemcpyAsync", context)
    }

    /// Queues a 64-bit store of `value` at `addr` on `s`, after the tasks queued before it.
    ///
    /// # Safety
    /// `addr` must be 8-byte aligned device memory reachable from this device, allocated until
    /// the stream has been synchronized.
    pub(crate) unsafe fn write_value_async(
        &self,
        s: &Stream,
        addr: DevPtr,
        value: u64,
        context: impl FnOnce() -> String,
    ) -> Result<()> {
        // SAFETY: caller contract; flag 0 is the only documented value.
        let code = unsafe { self.raw().aclrtValueWrite(addr.0.cast(), value, 0, s.0) };
        self.check(code, "aclrtValueWrite", context)
    }
}

/// Calls `aclFinalize` for this process, if xccl's own `aclInit` initialised ACL in it (not if
/// the application had already).
///
/// ACL allows one `aclInit` per process, and the application (or another library, such as
/// torch_npu) may share it, so xccl never finalizes on its own: call this once before exit,
/// after every [`super::AscendFabric`] is dropped, if nothing else in the process uses ACL.
/// Later attempts to build an ascend fabric in this process then fail in the runtime.
pub fn finalize_runtime() -> Result<()> {
    let mut done = INITIALISED.lock().unwrap_or_else(|e| e.into_inner());
    if *done != Some(true) {
        return Ok(());
    }
    let acl = load()?;
    // SAFETY: aclFinalize takes no arguments; ACL was initialised (flag above).
    let code = unsafe { acl.runtime().aclFinalize() };
    // ACL allows one aclInit per process: no fabric can be made after this.
    *done = Some(false);
    let rt = Runtime { acl, device: -1 };
    rt.check(code, "aclFinalize", || {
        "finalizing the Ascend runtime".into()
    })
}
