//! xccl: token exchange between attention and expert ranks for disaggregated Mixture-of-Experts
//! serving.
//!
//! Layers, bottom up (each imports only the ones below it):
//! - [`cuda`]: the safe layer over the CUDA driver (opened at run time): devices, device
//!   memory, streams, events, IPC handles, modules and kernel launches.
//! - [`fabric`]: one-sided memory-semantic transport (`put`, `get`, `signal`, `wait`) over
//!   shared memory ([`fabric::shm`]) or threads in one process ([`fabric::local`]).
//! - [`bootstrap`]: rendezvous of the ranks of one job (unique id or launcher environment),
//!   allgather, barrier, out-of-band abort.
//! - [`topology`]: roles, expert placement with replicas, relay plan; pure data.
//! - [`moe`]: the A2E (dispatch) and E2A (combine) wire protocol, one type per role and
//!   direction.
//! - [`Communicator`]: builds and checks everything, delegates, and owns the failure state.
//! - [`capi`]: the C ABI of `include/xccl.h` (`libxccl.so`, `libxccl.a`); the only module with
//!   `extern "C"` functions.
//! - `testing` (feature `testing`): the single-process reference and the workloads that tests
//!   and `xccl-bench --check` compare against, bit for bit.
//!
//! The library logs through the [`tracing`] facade (init summary, peer failures, timeouts,
//! aborts; nothing per call above `debug`); install a subscriber to see it.

/// Marks a fault-injection point named `$name` (see `testing::fault`): with the `testing`
/// feature a test can have the process killed or stopped here; without it this is nothing.
macro_rules! fault_point {
    ($name:literal) => {
        #[cfg(any(test, feature = "testing"))]
        $crate::testing::fault::point($name);
    };
}

pub mod bootstrap;
pub mod capi;
pub mod comm;
pub mod cuda;
pub mod error;
pub mod fabric;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod moe;
mod sync;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod topology;

#[cfg(test)]
mod api_tests;
#[cfg(test)]
mod comm_tests;

pub use comm::{AbortHandle, Communicator, Routing, ShrinkOptions, ShrinkStep, TokenView};
pub use cuda::{DeviceSlice, DeviceSliceMut};
pub use error::{AbortNotice, Error, Result};
pub use moe::batch::{A2eHandle, ExpertBatch, SourceInfo, TokenBatch};
pub use moe::config::{MoeConfig, TransferMode};
pub use moe::dtype::{DType, Element};
pub use moe::quant::Quant;
pub use moe::stats::{PeerStats, Stats};
pub use topology::{RelayPlan, Role, ShrunkTopology, Topology, TopologyBuilder};

/// The README's Rust example, compiled and run as a doc-test.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
