//! Compiles the data plane's kernels ([`super::KERNELS_CU`]) with NVRTC for one GPU
//! architecture, once per process: the CUBIN is cached by architecture.
//!
//! Options: `--gpu-architecture=sm_XY`, `--fmad=false` (no contraction of `a*b+c` into an FMA:
//! the host path does not fuse, and the kernels must give its bits; the kernels also write
//! every product and sum with `__fmul_rn`/`__fadd_rn`, which are never fused), and IEEE
//! subnormals and division (`--ftz=false --prec-div=true`), as on the host.

use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::sync::{Arc, Mutex};

use xccl_sys::nvrtc::{self, Nvrtc, NvrtcProgram, NVRTC_SUCCESS};

use super::{ABI_HEADER, KERNELS_CU};
use crate::{Error, Result};

/// The NVRTC library's name in errors.
const LIBRARY: &str = "libnvrtc.so";

/// Opens NVRTC, or [`Error::FabricUnavailable`] (fabric `cuda`) naming the library and where
/// it was looked for.
pub fn load() -> Result<Arc<Nvrtc>> {
    nvrtc::load().map_err(|detail| Error::FabricUnavailable {
        fabric: "cuda".into(),
        detail,
    })
}

/// NVRTC's version `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    let n = load()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through valid pointers.
    let code = unsafe { (n.version)(&mut major, &mut minor) };
    check(&n, code, "nvrtcVersion", "reading NVRTC's version")?;
    Ok((major, minor))
}

/// The CUBIN of the kernels for compute capability `major.minor` (`sm_{major}{minor}`),
/// compiled on first use in this process and cached; a source that does not compile is an
/// error carrying NVRTC's log.
pub fn cubin(major: i32, minor: i32) -> Result<Arc<Vec<u8>>> {
    /// CUBINs by compute capability.
    type Images = HashMap<(i32, i32), Arc<Vec<u8>>>;
    static CACHE: Mutex<Option<Images>> = Mutex::new(None);
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = cache.get_or_insert_with(HashMap::new).get(&(major, minor)) {
        return Ok(c.clone());
    }
    let image = Arc::new(compile_source(KERNELS_CU, major, minor)?);
    cache
        .get_or_insert_with(HashMap::new)
        .insert((major, minor), image.clone());
    Ok(image)
}

/// An NVRTC program, destroyed on drop.
struct Program<'n> {
    nvrtc: &'n Nvrtc,
    handle: NvrtcProgram,
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        // SAFETY: `handle` came from nvrtcCreateProgram and is destroyed once, here.
        unsafe { (self.nvrtc.destroy_program)(&mut self.handle) };
    }
}

impl Program<'_> {
    /// The compilation log.
    fn log(&self) -> String {
        let mut len = 0usize;
        // SAFETY: a live program and a valid out-pointer.
        if unsafe { (self.nvrtc.get_program_log_size)(self.handle, &mut len) } != NVRTC_SUCCESS {
            return String::new();
        }
        let mut buf = vec![0u8; len.max(1)];
        // SAFETY: `buf` holds the `len` bytes NVRTC said the log has (its NUL included).
        unsafe { (self.nvrtc.get_program_log)(self.handle, buf.as_mut_ptr().cast()) };
        String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .trim()
            .to_string()
    }
}

/// Compiles `source` (which may include the ABI header) for `sm_{major}{minor}` into a CUBIN,
/// with the options of the module docs (no cache).
pub(crate) fn compile_source(source: &str, major: i32, minor: i32) -> Result<Vec<u8>> {
    let n = load()?;
    let arch = format!("sm_{major}{minor}");
    let doing = format!("compiling xccl's kernels for {arch}");
    let cstr = |s: &str| {
        CString::new(s).map_err(|_| Error::invalid("a kernel source holds a NUL byte".to_string()))
    };
    let (src, name) = (cstr(source)?, cstr("xccl_kernels.cu")?);
    let (header, header_name) = (cstr(ABI_HEADER)?, cstr("dataplane_abi.h")?);
    let headers = [header.as_ptr()];
    let header_names = [header_name.as_ptr()];
    let mut handle: NvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a NUL-terminated string alive for the call; the arrays hold one
    // header and its include name.
    let code = unsafe {
        (n.create_program)(
            &mut handle,
            src.as_ptr(),
            name.as_ptr(),
            1,
            headers.as_ptr(),
            header_names.as_ptr(),
        )
    };
    check(&n, code, "nvrtcCreateProgram", &doing)?;
    let program = Program { nvrtc: &n, handle };
    let options = [
        cstr(&format!("--gpu-architecture={arch}"))?,
        cstr("--fmad=false")?,
        cstr("--ftz=false")?,
        cstr("--prec-div=true")?,
        cstr("--prec-sqrt=true")?,
    ];
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: a live program and `option_ptrs.len()` valid option strings.
    let code = unsafe {
        (n.compile_program)(
            program.handle,
            option_ptrs.len() as i32,
            option_ptrs.as_ptr(),
        )
    };
    if code != NVRTC_SUCCESS {
        let log = program.log();
        return Err(native(
            &n,
            code,
            "nvrtcCompileProgram",
            format!("{doing}: {log}"),
        ));
    }
    let mut len = 0usize;
    // SAFETY: a compiled program and a valid out-pointer.
    let code = unsafe { (n.get_cubin_size)(program.handle, &mut len) };
    check(&n, code, "nvrtcGetCUBINSize", &doing)?;
    let mut image = vec![0u8; len];
    // SAFETY: `image` holds the `len` bytes NVRTC said the CUBIN has.
    let code = unsafe { (n.get_cubin)(program.handle, image.as_mut_ptr().cast()) };
    check(&n, code, "nvrtcGetCUBIN", &doing)?;
    if image.is_empty() {
        return Err(native(
            &n,
            0,
            "nvrtcGetCUBIN",
            format!("{doing}: an empty CUBIN"),
        ));
    }
    Ok(image)
}

/// Ok for `NVRTC_SUCCESS`, else the [`Error::Native`] of `call`.
fn check(n: &Nvrtc, code: i32, call: &'static str, doing: &str) -> Result<()> {
    if code == NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(native(n, code, call, doing.to_string()))
    }
}

/// The [`Error::Native`] of `call` returning `code`.
fn native(n: &Nvrtc, code: i32, call: &'static str, context: String) -> Error {
    // SAFETY: nvrtcGetErrorString returns a static string (or NULL) for any code.
    let text = unsafe { (n.get_error_string)(code) };
    let message = if text.is_null() {
        "no message".to_string()
    } else {
        // SAFETY: non-NULL, NUL-terminated and static (checked just above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    };
    Error::Native {
        library: LIBRARY,
        call,
        code: code as i64,
        message,
        context,
    }
}
