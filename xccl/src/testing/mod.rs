//! Test tools, behind the `testing` feature: the single-process reference of dispatch and
//! combine ([`mod@reference`]) and deterministic workloads driven through a real communicator and
//! checked against it bit for bit ([`harness`]); fault injection points and their census
//! ([`fault`]). Used by the crate's tests, the multi-process
//! tests and `xccl-bench --check`; not part of the library's default API.

pub mod fault;
pub mod harness;
pub mod reference;
