//! The MoE exchange protocol: A2E (dispatch) and E2A (combine), as a layer of its own.
//!
//! The protocol's state lives in one type per role and direction, each working on a shared
//! `context::Context` (fabric, topology, config, window layout, slots); the
//! [`crate::Communicator`] builds them, checks that peers agree, and delegates. A row can be
//! followed from `a2e_send` down to `Fabric::put` without leaving these files:
//!
//! | file | owns |
//! |---|---|
//! | [`config`] | [`MoeConfig`] (what ranks agree on) and [`TransferMode`] |
//! | [`routing`] | routing (`topk_idx`, `topk_weights`) -> one entry per (token, destination rank) |
//! | [`record`] | the 32-byte metadata record and [`record::WireMode`] |
//! | [`progress`] | progress signals and wrap-safe epoch comparison |
//! | [`rows`] | the A2E row codec (payload, local-expert bitmask, weights) |
//! | [`quant`] | INT8 per-token quantization: the specified quantizer, its inverse, the payload format |
//! | [`slots`] | which signal slot means what |
//! | [`window_layout`] | where every region lies in every rank's window |
//! | `dispatch` | A2E: `DispatchSender` (attention), `DispatchReceiver` (expert) |
//! | `relay` | A2E and E2A through relays: the relay's forwarding and its exact reduction |
//! | [`stats`] | [`Stats`]: records, rows, bytes and waits per peer, per call and in total |
//! | `combine` | E2A: `CombineSender` (expert), `CombineReceiver` (attention); the exact arithmetic |
//! | `view` | rows read in place until the E2A reply: where they are, receiving them, the reply (the view itself, `crate::TokenView`, is the communicator's) |
//! | [`batch`] | what the calls hand back |
//! | `regions` | the only borrows of window memory as slices, each justified by a protocol step |
//! | [`dtype`] | element types and their f32 conversions |
//! | [`dataplane`] | who moves and sums row bytes: the host backend, the CUDA kernels and NVRTC |
//! | `device_rows` | on the cuda fabric: the device-buffer calls' data plane, window addresses, scratch |

pub mod batch;
pub(crate) mod combine;
pub mod config;
pub(crate) mod context;
pub mod dataplane;
pub(crate) mod device_rows;
pub(crate) mod dispatch;
pub mod dtype;
mod hash;
pub mod progress;
pub mod quant;
pub mod record;
mod regions;
pub(crate) mod relay;
pub mod routing;
pub mod rows;
pub mod slots;
pub mod stats;
pub(crate) mod view;
pub mod window_layout;

pub use batch::{A2eHandle, ExpertBatch, SourceInfo, TokenBatch};
pub use config::{MoeConfig, TransferMode};
pub use quant::Quant;
pub use stats::{PeerStats, Stats};
