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
