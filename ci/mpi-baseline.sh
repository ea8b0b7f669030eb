#!/usr/bin/env bash
# MPI baseline of xccl-bench. For each shape: xccl-bench writes the routing of the run
# (--routing-only), Open MPI collectives replay it (benches/baselines/moe_alltoallv.c), then
# xccl-bench runs the same routing with --mpi-baseline, so its table, JSON and plot hold xccl,
# the memcpy, the cross-process streaming limit, the one-row exchange floor and MPI side by side.
# With REPEAT > 1 the MPI and xccl runs alternate and the summary gives medians and ranges.
#
# The baseline is built and launched as an MPI user would tune it:
#   mpicc -O3 -march=native (the bf16 loops vectorise);
#   ranks <= cores: --bind-to core (one core per rank; the default mpi_yield_when_idle 0 spins);
#   ranks >  cores: --bind-to none --mca mpi_yield_when_idle 1 (measured best here: binding two
#   ranks to one core with overload-allowed, or spinning without yield, were slower).
#
# Env: TOKENS (default 1,128,512), SHAPES (default "1:1 2:2"), ITERS (200), WARMUP (20),
#      HIDDEN (7168), DTYPE (bf16), REPEAT (1), OUT (default target/mpi-baseline),
#      XCCL_ARGS (extra xccl-bench flags, e.g. "--layout view --buffers registered").
set -euo pipefail
cd "$(dirname "$0")/.."

TOKENS=${TOKENS:-1,128,512}
SHAPES=${SHAPES:-"1:1 2:2"}
ITERS=${ITERS:-200}
WARMUP=${WARMUP:-20}
HIDDEN=${HIDDEN:-7168}
DTYPE=${DTYPE:-bf16}
REPEAT=${REPEAT:-1}
OUT=${OUT:-target/mpi-baseline}
XCCL_ARGS=${XCCL_ARGS:-}
mkdir -p "$OUT"

if ! command -v mpicc >/dev/null 2>&1; then
    apt-get update && apt-get install -y openmpi-bin libopenmpi-dev
fi
mpicc -O3 -march=native -Wall -Wextra -o "$OUT/moe_alltoallv" benches/baselines/moe_alltoallv.c -lm
cargo build --release -p xccl-bench
BENCH=target/release/xccl-bench
CORES=$(nproc)

# Open MPI refuses root without these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

summary="$OUT/summary.txt"
: > "$summary"
for shape in $SHAPES; do
    M=${shape%%:*}
    N=${shape##*:}
    NP=$((M + N))
    tag="${M}a${N}e"
    if [ "$NP" -le "$CORES" ]; then
        MPIRUN=(mpirun --allow-run-as-root --bind-to core -np "$NP")
    else
        MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none
                --mca mpi_yield_when_idle 1 -np "$NP")
    fi
    common=(--attention "$M" --experts "$N" --hidden "$HIDDEN" --dtype "$DTYPE"
            --tokens "$TOKENS" --iters "$ITERS" --warmup "$WARMUP" --fabric shm)
    # shellcheck disable=SC2086
    "$BENCH" "${common[@]}" $XCCL_ARGS --routing-out "$OUT/routing-$tag.bin" --routing-only
    echo "== ${M}A:${N}E, H=$HIDDEN $DTYPE, tokens $TOKENS, iters $ITERS, $REPEAT run(s); mpirun ${MPIRUN[*]:1}" \
        | tee -a "$summary"
    for rep in $(seq 1 "$REPEAT"); do
        "${MPIRUN[@]}" "$OUT/moe_alltoallv" "$OUT/routing-$tag.bin" > "$OUT/mpi-$tag-$rep.txt"
        # shellcheck disable=SC2086
        "$BENCH" "${common[@]}" $XCCL_ARGS --mpi-baseline "$OUT/mpi-$tag-$rep.txt" \
            --json "$OUT/xccl-$tag-$rep.json" --plot "$OUT/xccl-$tag-$rep.svg" \
            | tee "$OUT/xccl-$tag-$rep.txt"
    done
    python3 - "$OUT" "$tag" "$REPEAT" <<'PY' | tee -a "$summary"
import json, statistics, sys
out, tag, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = [json.load(open(f"{out}/xccl-{tag}-{r}.json")) for r in range(1, reps + 1)]
lib = runs[0].get("mpi_baseline", {}).get("library")
print(f"MPI: {lib}")
f = [r["floor"]["p50_us"] for r in runs]
print(f"floor (one-row exchange, the T=1 call's graph) p50 us: median {statistics.median(f):.2f} [{min(f):.2f}, {max(f):.2f}]")
def med(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    m = statistics.median(vals)
    return f"{m:.3g} [{min(vals):.3g},{max(vals):.3g}]" if len(vals) > 1 else f"{m:.3g}"
print(f"{'op':>10} {'tokens':>6}  {'xccl p50 us':>24} {'limit p50 us':>24} {'vs_limit':>20} "
      f"{'mpi p50 us':>24} {'vs_mpi (x faster)':>20}")
for i, r0 in enumerate(runs[0]["results"]):
    rows = [r["results"][i] for r in runs]
    print(f"{r0['op']:>10} {r0['tokens']:>6}  {med([r['p50_us'] for r in rows]):>24} "
          f"{med([r['limit_us'] for r in rows]):>24} {med([r['vs_limit'] for r in rows]):>20} "
          f"{med([r['mpi_us'] for r in rows]):>24} {med([r['vs_mpi'] for r in rows]):>20}")
if not all(r.get("mpi_baseline", {}).get("checks_passed") for r in runs):
    print("MPI baseline combine check FAILED")
    sys.exit(1)
PY
done
echo "summary in $summary"
