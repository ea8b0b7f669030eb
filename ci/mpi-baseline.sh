#!/usr/bin/env bash
# MPI baseline of xccl-bench: runs xccl-bench (release, shm) with --routing-out and --json, replays
# the same routing with Open MPI collectives (benches/baselines/moe_alltoallv.c) and prints the
# ratio xccl/MPI of the p50 latencies per token count (< 1 means xccl is faster).
#
# Env: TOKENS (default 1,128,512), SHAPES (default "1:1 2:2"), ITERS (100), WARMUP (10),
#      HIDDEN (7168), DTYPE (bf16), OUT (default target/mpi-baseline).
set -euo pipefail
cd "$(dirname "$0")/.."

TOKENS=${TOKENS:-1,128,512}
SHAPES=${SHAPES:-"1:1 2:2"}
ITERS=${ITERS:-100}
WARMUP=${WARMUP:-10}
HIDDEN=${HIDDEN:-7168}
DTYPE=${DTYPE:-bf16}
OUT=${OUT:-target/mpi-baseline}
mkdir -p "$OUT"

if ! command -v mpicc >/dev/null 2>&1; then
    apt-get update && apt-get install -y openmpi-bin libopenmpi-dev
fi
mpicc -O2 -Wall -o "$OUT/moe_alltoallv" benches/baselines/moe_alltoallv.c -lm
cargo build --release -p xccl-bench
BENCH=target/release/xccl-bench

# Open MPI refuses root without these; oversubscribe lets M+N exceed the cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none)

summary="$OUT/summary.txt"
: > "$summary"
for shape in $SHAPES; do
    M=${shape%%:*}
    N=${shape##*:}
    tag="${M}a${N}e"
    echo "== ${M}A:${N}E, H=$HIDDEN $DTYPE, tokens $TOKENS, iters $ITERS" | tee -a "$summary"
    "$BENCH" --attention "$M" --experts "$N" --hidden "$HIDDEN" --dtype "$DTYPE" \
        --tokens "$TOKENS" --iters "$ITERS" --warmup "$WARMUP" --fabric shm \
        --routing-out "$OUT/routing-$tag.bin" --json "$OUT/xccl-$tag.json" | tee "$OUT/xccl-$tag.txt"
    "${MPIRUN[@]}" -np $((M + N)) "$OUT/moe_alltoallv" "$OUT/routing-$tag.bin" \
        | tee "$OUT/mpi-$tag.txt"
    python3 - "$OUT/xccl-$tag.json" "$OUT/mpi-$tag.txt" <<'PY' | tee -a "$summary"
import json, sys
x = json.load(open(sys.argv[1]))
mpi = {}
for line in open(sys.argv[2]):
    if line.startswith("MPIBASE"):
        kv = dict(f.split("=", 1) for f in line.split()[1:])
        mpi[int(kv["tokens"])] = kv
print(f"{'op':>10} {'tokens':>7} {'bytes/rank':>11} {'xccl p50':>10} {'mpi p50':>10} {'xccl/mpi':>9} {'xccl p99':>10} {'mpi p99':>10}")
for r in x["results"]:
    m = mpi.get(r["tokens"])
    if m is None:
        continue
    mp50, mp99 = float(m[r["op"] + "_p50_us"]), float(m[r["op"] + "_p99_us"])
    ratio = r["p50_us"] / mp50 if mp50 > 0 else float("nan")
    print(f"{r['op']:>10} {r['tokens']:>7} {r['bytes_per_rank']:>11} {r['p50_us']:>10.1f} {mp50:>10.1f} {ratio:>9.2f} {r['p99_us']:>10.1f} {mp99:>10.1f}")
bad = [t for t, m in mpi.items() if m.get("check") != "passed"]
if bad:
    print(f"MPI baseline combine check FAILED for tokens {bad}")
    sys.exit(1)
PY
done
echo "summary in $summary"
