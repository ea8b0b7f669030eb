#!/usr/bin/env bash
# Fault injection (issue 12): RUNS (default 10,000) runs of a 3- or 4-rank A2E/E2A job over shm in
# which one random rank SIGKILLs itself at a random fault point (during init, inside an A2E or an
# E2A after some but not all puts and signals, inside a relay, or between calls), drawn from a
# seed. Every run must end with every survivor reporting the dead rank by number within the
# detection bound, every process exited and nothing of the job in /dev/shm. Prints the seed, the
# counts per point and outcome, and the detection-time distribution (min, median, p99, max).
#
#   ci/fault-injection.sh [RUNS]            # XCCL_FAULT_SEED=<seed> to replay a campaign or a run
#
# CI runs 100 runs as part of `cargo test` (tests/tests/faults.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-10000}"
XCCL_FAULT_RUNS="$runs" cargo test --release -p xccl-tests --test faults \
    random_sigkills_are_named_by_every_survivor_and_leave_nothing_behind -- --exact --nocapture
