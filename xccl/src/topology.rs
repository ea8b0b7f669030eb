//! Roles and expert placement (stub, being written).
