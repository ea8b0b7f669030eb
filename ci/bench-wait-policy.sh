#!/usr/bin/env bash
# Compares wait policies (XCCL_WAIT) at one shape, interleaved with the MPI baseline, REPEAT
# times, and prints per policy and token count the median p50 round trip (A2E, E2A) and its
# range. Used for the "Wait policy" table of xccl-bench/README.md.
#
# Env: SHAPE (default 2:2), TOKENS (1,128,512), ITERS (200), WARMUP (20), REPEAT (3),
#      POLICIES (default "spin sleep yield 64:200 1000:2000"), OUT (target/wait-policy),
#      MPI (1: also run the MPI baseline as ci/mpi-baseline.sh launches it; 0: skip),
#      BIND (xccl-bench --bind: auto, core or none; default auto).
set -euo pipefail
cd "$(dirname "$0")/.."

SHAPE=${SHAPE:-2:2}
TOKENS=${TOKENS:-1,128,512}
ITERS=${ITERS:-200}
WARMUP=${WARMUP:-20}
REPEAT=${REPEAT:-3}
POLICIES=${POLICIES:-"spin sleep yield 64:200 1000:2000"}
OUT=${OUT:-target/wait-policy}
MPI=${MPI:-1}
BIND=${BIND:-auto}
mkdir -p "$OUT"
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
