#!/usr/bin/env bash
# Session 7's last H200 call for issue 6: the whole GPU suite; then hot rounds of F, 1, 2b, 2bk with
# the background restore on BG_OPTIONS (default "threads=4": 16 readers beside import transformers
# slowed it by ~0.7 s in call 2) until HOT_UNTIL seconds; then COLD_ROUNDS (2) cold rounds of
# (1), 2tw and 2tb. ~9 min.   CKPT, TESTS ("none" skips), BG_OPTIONS, HOT_UNTIL (330), COLD_ROUNDS
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CKPT=${CKPT:-/root/startup_ckpt}
BG=${BG_OPTIONS-threads=4}
t0=$(date +%s)
if [ "${TESTS:-}" != none ]; then
  timeout 220 python3 -m pytest -q -p no:cacheprovider --timeout=120 ${TESTS:--n 8 tests} 2>&1 \
    | tee "$OUT/pytest.log" | tail -3
fi
J="$OUT/hot_s7c.json"
for round in $(seq 12); do
  [ "$round" = 1 ] && app=() || app=(--append)
  python3 benchmarks/startup_bench.py "$CKPT" --variants F,1,2b,2bk --repeat 1 --timeout 60 --bg-options "$BG" \
    --json "$J" "${app[@]}" 2>&1 | grep -E "^\[|created|failed" | tee -a "$OUT/hot_s7c.log"
  [ $(( $(date +%s) - t0 )) -gt ${HOT_UNTIL:-330} ] && break
done
C="$OUT/cold_s7c.json"
for round in $(seq ${COLD_ROUNDS:-2}); do
  [ "$round" = 1 ] && app=() || app=(--append)
  python3 benchmarks/startup_bench.py "$CKPT" --variants 1,2tw,2tb --no-hot --cold --repeat 1 --timeout 80 \
    --bg-options "$BG" --json "$C" "${app[@]}" 2>&1 | grep -E "^\[|recorded|failed" | tee -a "$OUT/cold_s7c.log"
done
python3 benchmarks/print_runs.py "$J" "$C" | tee "$OUT/runs_s7c.log"
