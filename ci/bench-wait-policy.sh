#!/usr/bin/env bash
# The wait-policy matrix (issue 20, "A wait policy that never degrades to milliseconds"): RUNS
# consecutive runs of `xccl-bench -t 1` for every load x shape x policy, and a table of the T=1
# round trip p50 against the same run's floor (xccl-bench's `# floor:`, the one-row exchange with
# the call's graph; docs/performance.md, "Wait policy") with min and max per cell, the pair floor
# ratio beside it, and how many runs were within 2x.
#
#   ci/bench-wait-policy.sh                 # the full matrix: 10 runs x {quiet, 2 busy loops}
#                                           #   x {1:1, 2:2} x {default, spin, yield, sleep}
#   QUICK=1 ci/bench-wait-policy.sh         # 3 runs, 500 iterations: a few minutes
#   BENCHES="old=/tmp/xccl-bench-old new=target/release/xccl-bench" QUICK=1 ci/bench-wait-policy.sh
#                                           # A/B: the binaries alternate within every cell
#
# Env: RUNS (10; QUICK: 3), ITERS (2000; QUICK: 500), WARMUP (200; QUICK: 50),
#      LOADS ("quiet busy2": busy2 runs two busy loops, one per core of a 2-core host, for the
#      whole of its runs), SHAPES ("1:1 2:2"), POLICIES ("default spin yield sleep"; default
#      leaves XCCL_WAIT unset, any other value is passed as XCCL_WAIT, e.g. 64:200),
#      BENCHES ("label=path ...", default: this tree's release build, built first),
#      OUT (target/wait-policy), BIND (xccl-bench --bind, default auto).
#
# MODE=sweep runs the older comparison instead: the policies at one shape and several token
# counts, interleaved with the MPI baseline (env SHAPE 2:2, TOKENS 1,128,512, ITERS 200,
# WARMUP 20, REPEAT 3, POLICIES "spin sleep yield 64:200 1000:2000", MPI 1), printing per
# policy the median p50 and its range (xccl-bench/README.md, "Wait policy").
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${MODE:-matrix}
OUT=${OUT:-target/wait-policy}
BIND=${BIND:-auto}
mkdir -p "$OUT"

if [ "$MODE" = sweep ]; then
    SHAPE=${SHAPE:-2:2}
    TOKENS=${TOKENS:-1,128,512}
    ITERS=${ITERS:-200}
    WARMUP=${WARMUP:-20}
    REPEAT=${REPEAT:-3}
    POLICIES=${POLICIES:-"spin sleep yield 64:200 1000:2000"}
    MPI=${MPI:-1}
    M=${SHAPE%%:*}
    N=${SHAPE##*:}
    NP=$((M + N))
    cargo build --release -p xccl-bench
    BENCH=target/release/xccl-bench
    common=(--attention "$M" --experts "$N" --tokens "$TOKENS" --iters "$ITERS" --warmup "$WARMUP"
            --bind "$BIND")
    "$BENCH" "${common[@]}" --routing-out "$OUT/routing.bin" --routing-only
    if [ "$MPI" = 1 ]; then
        command -v mpicc >/dev/null 2>&1 || { apt-get update && apt-get install -y openmpi-bin libopenmpi-dev; }
        mpicc -O3 -march=native -o "$OUT/moe_alltoallv" benches/baselines/moe_alltoallv.c -lm
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        if [ "$NP" -le "$(nproc)" ]; then
            MPIRUN=(mpirun --allow-run-as-root --bind-to core -np "$NP")
        else
            MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np "$NP")
        fi
    fi
    for rep in $(seq 1 "$REPEAT"); do
        for p in $POLICIES; do
            XCCL_WAIT=$p "$BENCH" "${common[@]}" --json "$OUT/$p-$rep.json" > /dev/null
        done
        if [ "$MPI" = 1 ]; then
            "${MPIRUN[@]}" "$OUT/moe_alltoallv" "$OUT/routing.bin" > "$OUT/mpi-$rep.txt"
        fi
    done
    python3 - "$OUT" "$REPEAT" "$POLICIES" "$MPI" <<'PY'
import json, statistics, sys
out, reps, policies, mpi = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4] == "1"
def fmt(v):
    m = statistics.median(v)
    return f"{m:.1f} [{min(v):.1f}-{max(v):.1f}]"
table = {}
for p in policies:
    runs = [json.load(open(f"{out}/{p}-{r}.json")) for r in range(1, reps + 1)]
    table[p] = {}
    for i, r0 in enumerate(runs[0]["results"]):
        table[p][(r0["op"], r0["tokens"])] = [r["results"][i]["p50_us"] for r in runs]
    table[p][("policy", 0)] = runs[0]["config"]["wait_policy"]
if mpi:
    table["mpi"] = {}
    for r in range(1, reps + 1):
        for line in open(f"{out}/mpi-{r}.txt"):
            if line.startswith("MPIBASE"):
                kv = dict(f.split("=", 1) for f in line.split()[1:])
                for op in ("a2e", "e2a", "roundtrip"):
                    table["mpi"].setdefault((op, int(kv["tokens"])), []).append(float(kv[op + "_p50_us"]))
keys = sorted(k for k in table[policies[0]] if k[0] != "policy")
print(f"p50 us, median [min-max] of {reps} runs")
print("| XCCL_WAIT | policy | " + " | ".join(f"{op} T={t}" for op, t in keys) + " |")
print("|---" * (len(keys) + 2) + "|")
for p, row in table.items():
    pol = row.get(("policy", 0), "Open MPI, yield_when_idle" if p == "mpi" else "")
    print(f"| {p} | {pol} | " + " | ".join(fmt(row[k]) if k in row else "-" for k in keys) + " |")
PY
    exit 0
fi

if [ "${QUICK:-0}" = 1 ]; then
    RUNS=${RUNS:-3}
    ITERS=${ITERS:-500}
    WARMUP=${WARMUP:-50}
else
    RUNS=${RUNS:-10}
    ITERS=${ITERS:-2000}
    WARMUP=${WARMUP:-200}
fi
LOADS=${LOADS:-"quiet busy2"}
SHAPES=${SHAPES:-"1:1 2:2"}
POLICIES=${POLICIES:-"default spin yield sleep"}
if [ -z "${BENCHES:-}" ]; then
    cargo build --release -p xccl-bench
    BENCHES="xccl=target/release/xccl-bench"
fi

# Busy loops of the "busy2" load, ended by pid when its runs are done or the script exits.
BUSY=()
stop_busy() {
    for pid in "${BUSY[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    BUSY=()
}
trap stop_busy EXIT

: > "$OUT/index.tsv"
for load in $LOADS; do
    case $load in
        quiet) ;;
        busy2)
            for _ in 1 2; do
                bash -c 'while :; do :; done' &
                BUSY+=($!)
            done
            ;;
        *) echo "unknown load $load (quiet, busy2)" >&2; exit 2 ;;
    esac
    for run in $(seq 1 "$RUNS"); do
        for shape in $SHAPES; do
            M=${shape%%:*}
            N=${shape##*:}
            for p in $POLICIES; do
                for b in $BENCHES; do
                    label=${b%%=*}
                    bin=${b#*=}
                    json="$OUT/$label-$load-${M}x$N-$p-$run.json"
                    if [ "$p" = default ]; then
                        env -u XCCL_WAIT "$bin" -a "$M" -e "$N" -t 1 --iters "$ITERS" \
                            --warmup "$WARMUP" --bind "$BIND" --json "$json" > /dev/null
                    else
                        XCCL_WAIT=$p "$bin" -a "$M" -e "$N" -t 1 --iters "$ITERS" \
                            --warmup "$WARMUP" --bind "$BIND" --json "$json" > /dev/null
                    fi
                    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$label" "$load" "$shape" "$p" "$run" \
                        "$json" >> "$OUT/index.tsv"
                done
            done
        done
    done
    stop_busy
done

python3 - "$OUT/index.tsv" "$ITERS" <<'PY'
import json, statistics, sys
from collections import OrderedDict
cells = OrderedDict()
for line in open(sys.argv[1]):
    label, load, shape, policy, run, path = line.rstrip("\n").split("\t")
    doc = json.load(open(path))
    rt = next(r["p50_us"] for r in doc["results"] if r["op"] == "roundtrip" and r["tokens"] == 1)
    floor = doc["floor"]["p50_us"]
    # Binaries before the exchange floor had only the pair floor, under "floor".
    pair = (doc.get("pair_floor") or doc["floor"])["p50_us"]
    la = doc["machine"].get("load_average_1min")
    cells.setdefault((label, load, shape, policy), []).append((rt, rt / floor, rt / pair, la))
def rng(v, f="{:.2f}"):
    return f"{f.format(statistics.median(v))} [{f.format(min(v))}-{f.format(max(v))}]"
print(f"T=1 round trip p50 / the same run's floor, median [min-max] over the runs "
      f"({sys.argv[2]} iterations each); within 2x: runs whose ratio is at most 2")
print("| build | load | shape | XCCL_WAIT | runs | p50 us | x floor | within 2x | x pair floor | load avg |")
print("|---|---|---|---|---|---|---|---|---|---|")
bad = 0
for (label, load, shape, policy), v in cells.items():
    rts, ratios, pairs, las = zip(*v)
    ok = sum(r <= 2.0 for r in ratios)
    bad += ok < len(ratios)
    las = [l for l in las if l is not None]
    la = f"{min(las):.1f}-{max(las):.1f}" if las else "?"
    print(f"| {label} | {load} | {shape} | {policy} | {len(v)} | {rng(rts, '{:.1f}')} | "
          f"{rng(ratios)} | {ok}/{len(ratios)} | {rng(pairs)} | {la} |")
print(f"cells with a run over 2x the floor: {bad} of {len(cells)}")
PY
