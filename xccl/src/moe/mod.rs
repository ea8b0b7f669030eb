//! The MoE wire protocol (stub, being written).
