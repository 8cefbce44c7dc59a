#!/usr/bin/env bash
# Session 6: issue 6's hot criterion on the current code, medians of rounds of F, 1, 2, 2w
# (one run each per round, --append), stopping after ~230 s. CKPT, BENCH_ARGS, ROUNDS (3)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CKPT=${CKPT:-/root/startup_ckpt}
J="$OUT/hot_s6.json"
t0=$(date +%s)
for round in $(seq ${ROUNDS:-3}); do
  [ "$round" = 1 ] && app=() || app=(--append)
  python3 benchmarks/startup_bench.py "$CKPT" --variants F,1,2,2w --repeat 1 --timeout 60 --json "$J" "${app[@]}" \
    ${BENCH_ARGS:-} 2>&1 | grep -E "^\[|created"
  [ $(( $(date +%s) - t0 )) -gt ${STOP_AFTER:-230} ] && break
done
python3 benchmarks/startup_bench.py "$CKPT" --variants F --repeat 0 --json "$J" --append ${BENCH_ARGS:-} 2>&1 | tail -14
