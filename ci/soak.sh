#!/usr/bin/env bash
# The soak of the reliability issue: CALLS (default 1,000,000) A2E+E2A calls on the local fabric
# with random token counts, every result checked bit for bit, and the resident set measured after
# warm-up and at the end (the example fails if it grows by more than 16 MiB). CI runs 2,000 calls
# (xccl/tests/example_job.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release -p xccl --features testing --example soak -- "${1:-1000000}"
