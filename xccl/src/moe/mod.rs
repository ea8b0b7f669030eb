//! The MoE exchange protocol: A2E (dispatch) and E2A (combine).
//!
//! - [`layout`]: routing (`topk_idx`, `topk_weights`) -> one entry per (token, destination rank)
//!   with a local-expert bitmask and weights.
//! - [`wire`]: records, row formats, window layout, signal slots, [`wire::MoeConfig`].
//! - [`a2e`], [`e2a`]: the two directions, as methods of [`crate::Communicator`].
//! - [`batch`]: what A2E hands back ([`batch::ExpertBatch`], [`batch::A2eHandle`]).
//! - [`tokens`]: the token-major receive path ([`tokens::TokenBatch`]), no expert-major expansion.
//! - [`view`]: token rows read in place until the E2A reply ([`view::TokenView`]).
//! - [`dtype`]: element types and f32 conversions.
//! - [`mod@reference`]: a single-process oracle of dispatch + combine for tests.

pub mod a2e;
pub mod batch;
pub mod dtype;
pub mod e2a;
pub mod layout;
pub mod reference;
pub mod tokens;
pub mod view;
pub mod wire;

#[cfg(test)]
mod tests;
