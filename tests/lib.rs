//! Helpers shared by xccl's multi-process tests (being written).
