#!/usr/bin/env bash
# Session 6's H200 call for issue 6: the GPU suite, then the cold start with the idle readers'
# shallow queue (warm.IDLE_READ="shallow": sendfile of 1 MiB steps, files POSIX_FADV_RANDOM, 8
# readers, in the helper process) and the RECORD files' stats warmed beside the imports:
# 2tx (imports after wait_imports) and 2ty (imports at once) against (1), two rounds; and a
# short disk_latency table for the readers' settings. ~7 min.
#   TESTS (pytest args, default "-n 8 tests"; "none" skips), CKPT, BENCH_ARGS, ROUNDS (2)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CKPT=${CKPT:-/root/startup_ckpt}
if [ "${TESTS:-}" != none ]; then
  timeout ${TEST_TIMEOUT:-220} python3 -m pytest -q -p no:cacheprovider --timeout=120 ${TESTS:--n 8 tests} 2>&1 \
    | tee "$OUT/pytest.log" | tail -3
fi
J="$OUT/cold_s6.json"
SET=${SET:-"IDLE_READ='shallow'; PACED_BYTES=1<<20"}
common=(--no-hot --cold --repeat 1 --timeout 80 --json "$J" ${BENCH_ARGS:-})
python3 benchmarks/startup_bench.py "$CKPT" --variants 1 "${common[@]}" 2>&1 | grep -E "^\[|created|recorded|\[cold\]"
python3 benchmarks/disk_latency.py "$CKPT" --seconds 3 --configs ${LAT:-4:1M:r,8:1M:r,8:1M:pr,8:512K:r}
for round in $(seq ${ROUNDS:-2}); do
  python3 benchmarks/startup_bench.py "$CKPT" --variants 2tx,2ty "${common[@]}" --append \
    --prefetch-options "threads=8" --prefetch-set "$SET" 2>&1 | grep -E "^\[|\[cold\]"
  python3 benchmarks/startup_bench.py "$CKPT" --variants 1 "${common[@]}" --append 2>&1 | grep -E "^\[|\[cold\]"
done
python3 - "$J" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    ph = r.get("phases_s", {})
    print(r["variant"], round(r.get("total_s", 0), 2), " ".join(f"{k} {v:.2f}" for k, v in ph.items()))
PY
python3 benchmarks/plot_startup_phases.py "$OUT/cold_s6.png" "$J" --variants 1,2tx,2ty
