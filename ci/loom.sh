#!/usr/bin/env bash
# Model-checks the control area's signal, credit, epoch, doorbell and abort protocol with loom
# (tests in xccl/src/fabric/signals_loom.rs; the facade that switches to loom is xccl/src/sync.rs).
# ci/test.sh runs it at LOOM_MAX_PREEMPTIONS=2. A loom build is a separate build of the library
# (`--cfg loom`, in its own target directory so the normal build is not invalidated) and runs
# only these tests.
#
#   ci/loom.sh            run the loom tests (LOOM_MAX_PREEMPTIONS defaults to 3)
#   ci/loom.sh --mutate   then build the mutation build (`--cfg xccl_loom_mutant`) and check
#                         that weakening each ordering of `sync::Mutant` makes its test fail
#
# Prints each model's time and the number of interleavings loom explored. To read a failure, run
# the one test with LOOM_LOG=trace and LOOM_LOCATION=1 (see loom's docs).
set -euo pipefail
cd "$(dirname "$0")/.."

mutate=0
case "${1:-}" in
  "") ;;
  --mutate) mutate=1 ;;
  *) echo "usage: ci/loom.sh [--mutate]" >&2; exit 2 ;;
esac

export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}"
module=fabric::signals::loom_tests

# Runs the loom tests of the build with the given extra cfg flags in target dir $1.
loom_test() {
  local dir=$1 flags=$2
  shift 2
  RUSTFLAGS="--cfg loom $flags" CARGO_TARGET_DIR="$dir" \
    cargo test --release -p xccl --lib --quiet -- "$@"
}

# ci/test.sh's clippy never sees code behind `cfg(loom)`: lint it here.
echo "== clippy (--cfg loom)"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
  cargo clippy --quiet -p xccl --lib --tests -- -D warnings

echo "== loom (LOOM_MAX_PREEMPTIONS=$LOOM_MAX_PREEMPTIONS)"
# Build first, so that the times below are the models' own.
tests=$(loom_test target/loom "" --list --format terse "$module" | sed -n 's/: test$//p')
[ -n "$tests" ] || { echo "no loom tests found under $module" >&2; exit 1; }
mkdir -p target/loom
log=target/loom/run.log
total_start=$(date +%s%N)
for test in $tests; do
  start=$(date +%s%N)
  # loom::model=info makes loom print how many interleavings it explored.
  if ! LOOM_LOG=loom::model=info loom_test target/loom "" --exact "$test" --nocapture >"$log" 2>&1; then
    cat "$log"
    echo "FAILED $test" >&2
    exit 1
  fi
  ms=$((($(date +%s%N) - start) / 1000000))
  runs=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | sed -n 's/.*Completed in \([0-9]*\) iterations.*/\1/p' | paste -sd+ -)
  printf 'ok  %6d ms  %8s interleavings  %s\n' "$ms" "${runs:-?}" "${test#"$module"::}"
done
printf 'loom: every model passed in %d ms\n' $((($(date +%s%N) - total_start) / 1000000))

[ "$mutate" = 1 ] || exit 0

echo "== loom mutation run: each mutant must make its test fail"
# mutant name (sync::Mutant::name) and the test that must catch it.
mutants=(
  "signal-store loom_two_back_to_back_calls_through_one_buffer_deliver_each_calls_data_and_wait_for_its_credit"
  "signal-load loom_two_back_to_back_calls_through_one_buffer_deliver_each_calls_data_and_wait_for_its_credit"
  "signaller-fence loom_a_waiter_going_to_sleep_as_the_signal_arrives_is_always_woken"
  "sleeper-fence loom_a_waiter_going_to_sleep_as_the_signal_arrives_is_always_woken"
  "waker-fence loom_a_waiter_always_sees_a_concurrent_abort_with_its_whole_reason"
  "abort-store loom_a_waiter_always_sees_a_concurrent_abort_with_its_whole_reason"
)
dir=target/loom-mutant
mkdir -p "$dir"
log=$dir/mutant.log
RUSTFLAGS="--cfg loom --cfg xccl_loom_mutant" CARGO_TARGET_DIR="$dir" \
  cargo clippy --quiet -p xccl --lib --tests -- -D warnings
loom_test "$dir" "--cfg xccl_loom_mutant" --list "$module" >/dev/null
survived=0
for entry in "${mutants[@]}"; do
  read -r name test <<<"$entry"
  # The unweakened build passes the test, so a failure below is the mutant's doing.
  if ! loom_test "$dir" "--cfg xccl_loom_mutant" --exact "$module::$test" >"$log" 2>&1; then
    cat "$log"
    echo "the mutation build fails $test without a mutant" >&2
    exit 1
  fi
  if XCCL_LOOM_MUTANT=$name loom_test "$dir" "--cfg xccl_loom_mutant" --exact "$module::$test" \
      >"$log" 2>&1; then
    echo "SURVIVED  $name: $test still passes"
    survived=1
  elif grep -q 'panicked at' "$log"; then
    echo "killed    $name by $test: $(grep -m1 -A1 'panicked at' "$log" | tail -n1)"
  else
    cat "$log"
    echo "mutant $name: $test failed without a model failure" >&2
    exit 1
  fi
done
if [ "$survived" = 1 ]; then
  echo "a weakened ordering went unnoticed: the loom tests miss it" >&2
  exit 1
fi
echo "every mutant was caught"
