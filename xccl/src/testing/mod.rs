//! Test tools, behind the `testing` feature: the single-process reference of dispatch and
//! combine ([`mod@reference`]) and deterministic workloads driven through a real communicator and
//! checked against it bit for bit ([`harness`]); fault injection points and their census
//! ([`fault`]); network namespaces as hosts for the multi-host ofi tests ([`netns`]). Used by the crate's tests, the multi-process
//! tests and `xccl-bench --check`; not part of the library's default API.

pub mod fault;
pub mod harness;
pub mod netns;
pub mod reference;

/// Performs the bootstrap handshake (hello, challenge, proof, welcome) for `rank` of `size` of
/// the job `id` on a raw connection to its root, leaving the connection joined: for tests that
/// play a misbehaving rank of the job (one that holds the key) with raw frames afterwards.
pub fn bootstrap_handshake(
    stream: &mut std::net::TcpStream,
    id: &crate::bootstrap::UniqueId,
    rank: usize,
    size: usize,
    timeout: std::time::Duration,
) -> crate::Result<()> {
    crate::bootstrap::raw_handshake(stream, id, rank, size, timeout)
}

/// Builds the Ascend stand-in runtime (`tests/ascend_standin/acl_standin.c`, the only runtime
/// the ascend fabric is tested against) with gcc as `<home>/lib64/libascendcl.so`, for
/// `ASCEND_HOME_PATH=<home>`. The library is written under a temporary name and renamed, so a
/// concurrent run never loads a half-written one. Errors say what failed (gcc's output).
pub fn build_ascend_standin(home: &std::path::Path) -> Result<(), String> {
    build_ascend_standin_with(home, &[])
}

/// [`build_ascend_standin`] with C `defines` (`-D` flags), for the stand-in's variants (such as
/// `STANDIN_NO_SYNC_TIMEOUT`: a runtime without a bounded stream synchronize).
pub fn build_ascend_standin_with(home: &std::path::Path, defines: &[&str]) -> Result<(), String> {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let flags: Vec<String> = defines.iter().map(|d| format!("-D{d}")).collect();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    build_c_library(
        &home.join("lib64"),
        "libascendcl.so",
        &[repo.join("tests/ascend_standin/acl_standin.c")],
        &repo.join("xccl-sys/include"),
        &flags,
    )
}

/// Builds the CUDA stand-in driver (`tests/cuda_standin/cuda_standin.c` with the kernels of
/// `tests/cuda_standin/kernels.c`, the only driver the CUDA layer and the cuda fabric are tested
/// against) with gcc as `<dir>/libcuda.so.1`, for `XCCL_CUDA_LIBRARY=<dir>/libcuda.so.1`;
/// returns that path. Compiled with `-ffp-contract=off`, so the kernels' C does not fuse
/// `a*b+c` (as xccl's host path does not). Written under a temporary name and renamed, as
/// [`build_ascend_standin`]. Errors say what failed (gcc's output).
pub fn build_cuda_standin(dir: &std::path::Path) -> Result<std::path::PathBuf, String> {
    let crate_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = crate_dir.join("../tests/cuda_standin");
    // The kernels' per-element arithmetic is the header the CUDA kernels include.
    let abi = format!("-I{}", crate_dir.join("src/moe/dataplane").display());
    build_c_library(
        dir,
        "libcuda.so.1",
        &[src.join("cuda_standin.c"), src.join("kernels.c")],
        &src,
        &["-ffp-contract=off", &abi],
    )?;
    Ok(dir.join("libcuda.so.1"))
}

/// Compiles `sources` with gcc into the shared library `<dir>/<name>`, through a temporary
/// file renamed into place.
fn build_c_library(
    dir: &std::path::Path,
    name: &str,
    sources: &[std::path::PathBuf],
    include: &std::path::Path,
    flags: &[&str],
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    // One temporary file per build, also between threads of one process (tests of one binary
    // build the same library at once): each renames its own complete file into place.
    static BUILDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("{name}.{}.{n}.tmp", std::process::id()));
    let out = std::process::Command::new("gcc")
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-fvisibility=hidden"])
        .args(flags)
        .arg("-I")
        .arg(include)
        .arg("-o")
        .arg(&tmp)
        .args(sources)
        .args(["-lpthread", "-lrt"])
        .output()
        .map_err(|e| format!("running gcc (install gcc to build the stand-in): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "building the stand-in {name} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    std::fs::rename(&tmp, dir.join(name)).map_err(|e| format!("installing the stand-in: {e}"))
}
