//! xccl: token exchange between attention and expert ranks for disaggregated Mixture-of-Experts
//! serving.
//!
//! Layers, bottom up (each can be read alone):
//! - [`fabric`]: one-sided memory-semantic transport (`put`, `get`, `signal`, `wait`) over
//!   shared memory ([`fabric::shm`]) or threads in one process ([`fabric::local`]).
//! - [`bootstrap`]: rendezvous of the ranks of one job (unique id or launcher environment),
//!   allgather, barrier, out-of-band abort.
//! - [`topology`]: roles, expert placement with replicas; pure data.
//! - [`moe`]: the A2E (dispatch) and E2A (combine) wire protocol.
//! - [`Communicator`]: ties them together.

pub mod bootstrap;
pub mod comm;
pub mod error;
pub mod fabric;
pub mod harness;
pub mod moe;
pub mod topology;

pub use comm::Communicator;
pub use error::{Error, Result};
pub use moe::batch::{A2eHandle, ExpertBatch};
pub use moe::dtype::{DType, Element};
pub use moe::tokens::TokenBatch;
pub use moe::view::TokenView;
pub use moe::wire::{MoeConfig, TransferMode};
pub use topology::{Role, Topology, TopologyBuilder};

/// The README's Rust example, compiled and run as a doc-test.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
