//! Fabric layer (stub, being written).
