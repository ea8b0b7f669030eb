//! xccl-bench (being written).
fn main() {}
