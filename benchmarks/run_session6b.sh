#!/usr/bin/env bash
# Session 6's last H200 call for issue 6: the prefetch's new defaults, untuned. 2tw is
# `fs.prefetch(dir, imports=trace)` + `PF.wait_imports()` before `import torch`: now 8 shallow
# readers (1 MiB, POSIX_FADV_RANDOM) in the helper process and the RECORDs' stats beside the
# imports. Three cold rounds of 2tw and (1); then hot F, 1, 2 once each (the hot criterion);
# the prefetch / startup tests first. ~6 min.   CKPT, BENCH_ARGS, ROUNDS (3), TESTS
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CKPT=${CKPT:-/root/startup_ckpt}
if [ "${TESTS:-}" != none ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout=120 ${TESTS:-tests/test_prefetch_helper.py \
    tests/test_import_trace.py tests/test_torch_integration.py tests/test_startup_bench.py} 2>&1 | tee "$OUT/pytest.log" | tail -3
fi
J="$OUT/cold_s6b.json"
common=(--no-hot --cold --repeat 1 --timeout 80 --json "$J" ${BENCH_ARGS:-})
for round in $(seq ${ROUNDS:-3}); do
  [ "$round" = 1 ] && app=() || app=(--append)
  python3 benchmarks/startup_bench.py "$CKPT" --variants 1,2tw "${common[@]}" "${app[@]}" 2>&1 \
    | grep -E "^\[|created|recorded"
done
python3 benchmarks/startup_bench.py "$CKPT" --variants F,1,2 --repeat 1 --timeout 80 --json "$OUT/hot_s6b.json" \
  ${BENCH_ARGS:-} 2>&1 | tail -14
python3 - "$J" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    ph = r.get("phases_s", {})
    print(r["variant"], round(r.get("total_s", 0), 2), " ".join(f"{k} {v:.2f}" for k, v in ph.items()))
PY
python3 benchmarks/plot_startup_phases.py "$OUT/cold_s6b.png" "$J" --variants 1,2tw
