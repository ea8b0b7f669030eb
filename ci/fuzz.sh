#!/usr/bin/env bash
# Builds the fuzz targets in fuzz/ (cargo-fuzz, libFuzzer, AddressSanitizer, overflow checks)
# and runs each for a bounded time, then prints one line per target: executions, corpus size,
# and whether it crashed.
#
#   ci/fuzz.sh [SECONDS] [TARGET...]    default: 60 s each, every target
#
# Targets: bootstrap (frame reader, payload decoders, unique id), record (metadata records and
# check_region against a window layout), row (A2E row metadata), routing (dispatch layout),
# config (string parsers, MoeConfig::validate), c_config (the C xcclConfig_t parse),
# handshake (the rank's side of the bootstrap handshake against arbitrary root replies).
#
# cargo-fuzz passes nightly-only flags to rustc (-Zsanitizer=address and friends). This
# machine has a stable toolchain only, so the script sets RUSTC_BOOTSTRAP=1, which makes the
# stable compiler accept them. cargo-fuzz is installed (cargo install cargo-fuzz --locked) when
# missing. The corpus grows in fuzz/corpus/<target> and crashing inputs are saved in
# fuzz/artifacts/<target>/ (neither is committed); reproduce one with
# `RUSTC_BOOTSTRAP=1 cargo fuzz run <target> <file>` in fuzz/, then add it as a regression test
# (xccl/src/fuzzing.rs, module tests). Exits 1 if any target crashed.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-60}
shift || true
all=(bootstrap record row routing config c_config handshake)
if [ $# -gt 0 ]; then targets=("$@"); else targets=("${all[@]}"); fi

command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1

cd fuzz
echo "== building ${targets[*]}"
for t in "${targets[@]}"; do
  cargo fuzz build "$t"
done

mkdir -p logs
failed=()
summary=()
for t in "${targets[@]}"; do
  echo "== $t: ${secs}s"
  mkdir -p "corpus/$t"
  log="logs/$t.log"
  start=$(date +%s)
  if cargo fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" -print_final_stats=1 \
      -use_value_profile=1 -timeout=10 >"$log" 2>&1; then
    verdict=ok
  else
    verdict=CRASHED
    failed+=("$t")
  fi
  took=$(( $(date +%s) - start ))
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  corpus=$(ls "corpus/$t" | wc -l)
  line=$(printf '%-10s %-7s %4ss %12s execs %6s corpus files' "$t" "$verdict" "$took" "${execs:-?}" "$corpus")
  echo "$line"
  summary+=("$line")
  if [ "$verdict" = CRASHED ]; then
    grep -E 'panicked at|ERROR: AddressSanitizer|ERROR: libFuzzer|Test unit written to' "$log" | head -5 || true
  fi
done

echo "== summary (${secs}s per target; logs in fuzz/logs/)"
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "ci/fuzz.sh: crashed: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
