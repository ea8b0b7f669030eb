//! Shared helpers for xccl's criterion benchmarks (being written).
