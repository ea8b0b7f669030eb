//! NVRTC, CUDA's run-time compiler (`libnvrtc.so`), opened at run time.
//!
//! xccl compiles its CUDA C kernels with NVRTC for the architecture of the device in use, so
//! nothing CUDA is needed at build time and `libxccl` loads where CUDA is absent. The handful of
//! calls used here are declared by hand from `nvrtc.h` (CUDA 12 and 13 share them); each is a
//! field of [`Nvrtc`] resolved by name with `dlsym`.
//!
//! [`load`] tries, in order:
//! 1. `$XCCL_NVRTC_LIBRARY` ([`PATH_ENV`]), an explicit file;
//! 2. `libnvrtc.so.13`, `libnvrtc.so.12`, `libnvrtc.so` in every directory of `$LD_LIBRARY_PATH`,
//!    in `$CUDA_HOME/lib64` and in `/usr/local/cuda/lib64`;
//! 3. the same names bare, for the dynamic loader's own search.
//!
//! The first file that opens and has every function is kept for the life of the process.

use std::ffi::{c_char, c_int};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// `nvrtcResult`: 0 is success.
pub type NvrtcResult = c_int;
/// `nvrtcProgram`: an opaque handle.
pub type NvrtcProgram = *mut std::ffi::c_void;

/// `NVRTC_SUCCESS`.
pub const NVRTC_SUCCESS: NvrtcResult = 0;
/// `NVRTC_ERROR_COMPILATION`: the source did not compile (the log says why).
pub const NVRTC_ERROR_COMPILATION: NvrtcResult = 6;
/// Environment variable naming the NVRTC library file to use.
pub const PATH_ENV: &str = "XCCL_NVRTC_LIBRARY";
/// File names tried, newest first.
pub const NAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// The opened library's functions.
pub struct Nvrtc {
    _lib: libloading::Library,
    path: PathBuf,
    /// `nvrtcVersion(int* major, int* minor)`.
    pub version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult,
    /// `nvrtcGetErrorString(nvrtcResult)`.
    pub get_error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
    /// `nvrtcCreateProgram(prog, src, name, numHeaders, headers, includeNames)`.
    pub create_program: unsafe extern "C" fn(
        *mut NvrtcProgram,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    /// `nvrtcDestroyProgram(prog*)`.
    pub destroy_program: unsafe extern "C" fn(*mut NvrtcProgram) -> NvrtcResult,
    /// `nvrtcCompileProgram(prog, numOptions, options)`.
    pub compile_program:
        unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> NvrtcResult,
    /// `nvrtcGetProgramLogSize(prog, size_t*)`.
    pub get_program_log_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult,
    /// `nvrtcGetProgramLog(prog, char*)`.
    pub get_program_log: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult,
    /// `nvrtcGetCUBINSize(prog, size_t*)`.
    pub get_cubin_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult,
    /// `nvrtcGetCUBIN(prog, char*)`.
    pub get_cubin: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc").field("path", &self.path).finish()
    }
}

impl Nvrtc {
    /// The file that was opened.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens `path` and resolves every function, or says which one is missing.
    fn open(path: &Path) -> Result<Self, String> {
        // SAFETY: opening a shared library runs its initialisers; NVRTC's are those of any
        // CUDA library and have no preconditions.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the field's type is the function's C signature in nvrtc.h; the
                // library stays loaded as long as the pointer (`_lib` is kept beside it).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{} lacks {}: {e}", path.display(), $name))?
            };
        }
        Ok(Nvrtc {
            version: sym!("nvrtcVersion"),
            get_error_string: sym!("nvrtcGetErrorString"),
            create_program: sym!("nvrtcCreateProgram"),
            destroy_program: sym!("nvrtcDestroyProgram"),
            compile_program: sym!("nvrtcCompileProgram"),
            get_program_log_size: sym!("nvrtcGetProgramLogSize"),
            get_program_log: sym!("nvrtcGetProgramLog"),
            get_cubin_size: sym!("nvrtcGetCUBINSize"),
            get_cubin: sym!("nvrtcGetCUBIN"),
            _lib: lib,
            path: path.to_path_buf(),
        })
    }
}

/// The paths [`load`] tries, in order (see the module docs).
pub fn candidates() -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os(PATH_ENV).filter(|p| !p.is_empty()) {
        return vec![PathBuf::from(p)];
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&paths).filter(|d| !d.as_os_str().is_empty()));
    }
    if let Some(home) = std::env::var_os("CUDA_HOME").filter(|h| !h.is_empty()) {
        dirs.push(Path::new(&home).join("lib64"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    let mut out = Vec::new();
    for d in &dirs {
        out.extend(NAMES.iter().map(|n| d.join(n)));
    }
    out.extend(NAMES.iter().map(PathBuf::from));
    out
}

/// Opens NVRTC once per process (later calls return the same library), or says every path
/// tried and why each failed.
pub fn load() -> Result<Arc<Nvrtc>, String> {
    static LOADED: Mutex<Option<Arc<Nvrtc>>> = Mutex::new(None);
    let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(n) = loaded.as_ref() {
        return Ok(n.clone());
    }
    let mut tried = Vec::new();
    for path in candidates() {
        // A bare name is for the loader's own search; a path must exist to be worth a try.
        if path.components().count() > 1 && !path.exists() {
            continue;
        }
        match Nvrtc::open(&path) {
            Ok(n) => {
                let n = Arc::new(n);
                *loaded = Some(n.clone());
                return Ok(n);
            }
            Err(e) => tried.push(format!("{} ({e})", path.display())),
        }
    }
    Err(format!(
        "libnvrtc (CUDA's run-time compiler) not found: set {PATH_ENV} to the file, or add the \
         directory holding libnvrtc.so.13 or .so.12 to LD_LIBRARY_PATH (pip's \
         nvidia-cuda-nvrtc has it under site-packages/nvidia/.../lib); tried {}",
        tried.join("; ")
    ))
}
