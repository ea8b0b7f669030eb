#!/usr/bin/env bash
# Runs the local-fabric tests under Miri: the in-process fabric's windows, the slices the
# communicator lends out of them (`a2e_input`, a view's rows and reply) and the signals that
# order every access. Miri reports a data race or an aliasing violation as an error, which is
# how a fabric that writes a lent range (the `Fabric` contract, `docs/DESIGN.md`) shows.
#
#   ci/miri.sh [FILTER...]    default: the local fabric and the communicator and C ABI tests
#                             named below (about 3 minutes on 2 cores; not in ci/test.sh). The
#                             local fabric's conformance suite passes too but takes 10 minutes:
#                             ci/miri.sh fabric::conformance::tests::local_fabric_passes_conformance_with_2_ranks
#
# Needs a nightly toolchain with Miri: `rustup toolchain install nightly --component miri`
# (and `rust-src`). Isolation is off (the tests read the clock and /dev/urandom); the build
# goes to target/miri, so the normal build is not invalidated.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo +nightly miri --version >/dev/null 2>&1; then
  echo "ci/miri.sh: no Miri on the nightly toolchain" \
    "(rustup toolchain install nightly --component miri)" >&2
  exit 2
fi

if [ $# -gt 0 ]; then
  filters=("$@")
else
  filters=(
    fabric::local::
    capi::tests::get_stats_on_a_header_only_struct_reads_no_byte_past_it
    comm_tests::one_attention_three_experts_pull_only
    comm_tests::a_view_reply_rejected_before_sending_keeps_the_view
  )
fi

export MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation -Zmiri-many-seeds=0..2}"
status=0
for f in "${filters[@]}"; do
  echo "== miri: $f"
  start=$(date +%s)
  if ! cargo +nightly miri test -p xccl --lib --target-dir target/miri -- "$f"; then
    status=1
  fi
  echo "== $f: $(( $(date +%s) - start )) s"
done
exit $status
