#!/usr/bin/env bash
# Session 8, issue 6's hot criterion with the streamed forward (load_model(model, handle, wait=False)):
# the GPU suite first (TESTS="none" skips; default the whole suite, -n 8), then hot rounds of
# HOT_VARIANTS (F,1,2,2s,2sw,2wk), one run each per round, until HOT_UNTIL seconds (420) have passed
# since the start; then COLD_ROUNDS (0) cold rounds of COLD_VARIANTS (1,2tw,2ts). Prints every run.
# CKPT (/root/startup_ckpt), OUT (gpu-out), TAG (s8: the json/log names).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CKPT=${CKPT:-/root/startup_ckpt}
TAG=${TAG:-s8}
t0=$(date +%s)
if [ "${TESTS:-}" != none ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider --timeout=120 ${TESTS:--n 8 tests} 2>&1 \
    | tee "$OUT/pytest_$TAG.log" | tail -3
fi
J="$OUT/hot_$TAG.json"
if [ -n "${HOT_VARIANTS-F,1,2,2s,2sw,2wk}" ]; then
  for round in $(seq 20); do
    [ "$round" = 1 ] && app=() || app=(--append)
    python3 benchmarks/startup_bench.py "$CKPT" --variants "${HOT_VARIANTS-F,1,2,2s,2sw,2wk}" --repeat 1 \
      --timeout 60 --json "$J" "${app[@]}" 2>&1 | grep -E "^\[|created|failed" | tee -a "$OUT/hot_$TAG.log"
    [ $(( $(date +%s) - t0 )) -gt ${HOT_UNTIL:-420} ] && break
  done
fi
C="$OUT/cold_$TAG.json"
for round in $(seq ${COLD_ROUNDS:-0}); do
  [ "$round" = 1 ] && app=() || app=(--append)
  python3 benchmarks/startup_bench.py "$CKPT" --variants "${COLD_VARIANTS:-1,2tw,2ts}" --no-hot --cold --repeat 1 \
    --timeout 80 --json "$C" "${app[@]}" 2>&1 | grep -E "^\[|recorded|failed" | tee -a "$OUT/cold_$TAG.log"
done
python3 benchmarks/print_runs.py "$J" "$C" | tee "$OUT/runs_$TAG.log"
