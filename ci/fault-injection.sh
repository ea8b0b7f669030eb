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
# Then RUNS / 10 runs of kills during a shrink (tests/tests/shrink.rs): one rank dies inside a
# call, a second when its shrink reaches a random step (XCCL_SHRINK_FAULT_SEED to replay); every
# survivor must shrink past both and match the reference.
#
# Then RUNS / 100 runs (at least 4) of strangers (tests/tests/bootstrap_hostile.rs): a process of
# uid 65534 that knows the root's port and the job id but not the key sends hostile input, forged
# hellos for the taken ranks, holds up to 700 connections, or squats the guessable /dev/shm
# names, before the ranks start or while they run (XCCL_STRANGER_SEED to replay); every job must
# complete its checked rounds and no answer may carry the key.
#
# CI runs 100 + 8 + 4 runs as part of `cargo test` (tests/tests/faults.rs, tests/tests/shrink.rs,
# tests/tests/bootstrap_hostile.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-10000}"
XCCL_FAULT_RUNS="$runs" cargo test --release -p xccl-tests --test faults \
    random_sigkills_are_named_by_every_survivor_and_leave_nothing_behind -- --exact --nocapture
XCCL_SHRINK_FAULT_RUNS="$(( (runs + 9) / 10 ))" cargo test --release -p xccl-tests --test shrink \
    random_kills_during_the_shrink_are_survived_by_every_other_rank -- --exact --nocapture
XCCL_STRANGER_RUNS="$(( runs / 100 > 4 ? runs / 100 : 4 ))" cargo test --release -p xccl-tests \
    --test bootstrap_hostile random_strangers_neither_join_nor_stop_a_job -- --exact --nocapture
