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
    let lib64 = home.join("lib64");
    std::fs::create_dir_all(&lib64).map_err(|e| format!("creating {}: {e}", lib64.display()))?;
    let tmp = lib64.join(format!("libascendcl.so.{}.tmp", std::process::id()));
    let out = std::process::Command::new("gcc")
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-fvisibility=hidden"])
        .args(defines.iter().map(|d| format!("-D{d}")))
        .arg("-I")
        .arg(repo.join("xccl-sys/include"))
        .arg("-o")
        .arg(&tmp)
        .arg(repo.join("tests/ascend_standin/acl_standin.c"))
        .args(["-lpthread", "-lrt"])
        .output()
        .map_err(|e| format!("running gcc (install gcc to build the stand-in): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "building the stand-in runtime failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    std::fs::rename(&tmp, lib64.join("libascendcl.so"))
        .map_err(|e| format!("installing the stand-in: {e}"))
}
