#!/usr/bin/env bash
# Session 7, issue 6 cold: three rounds of cold (1), 2tw (the prefetch defaults) and 2tb (2tw, and
# the restore started before import transformers, as 2b); then the whole GPU suite. ~6 min.
# CKPT, ROUNDS (3), TESTS (pytest args; "none" skips)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CKPT=${CKPT:-/root/startup_ckpt}
J="$OUT/cold_s7.json"
for round in $(seq ${ROUNDS:-3}); do
  [ "$round" = 1 ] && app=() || app=(--append)
  python3 benchmarks/startup_bench.py "$CKPT" --variants 1,2tw,2tb --no-hot --cold --repeat 1 --timeout 80 \
    --json "$J" "${app[@]}" 2>&1 | grep -E "^\[|created|recorded|failed" | tee -a "$OUT/cold_s7.log"
done
python3 benchmarks/startup_bench.py "$CKPT" --variants F --repeat 0 --no-hot --cold --json "$J" --append 2>&1 \
  | tail -12 | tee -a "$OUT/cold_s7.log"
python3 - "$J" <<'PY' | tee -a "$OUT/cold_s7.log"
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    ph = r.get("phases_s", {})
    extra = {k: round(r[k] / 1e9 if "bytes" in k else r[k], 3) for k in ("bg_load_s", "prefetch_bytes_at_load") if k in r}
    print(r["variant"], round(r.get("total_s", 0), 2), " ".join(f"{k} {v:.2f}" for k, v in ph.items()), extra,
          r.get("error", "")[-300:])
PY
if [ "${TESTS:-}" != none ]; then
  timeout ${TEST_TIMEOUT:-220} python3 -m pytest -q -p no:cacheprovider --timeout=120 ${TESTS:--n 8 tests} 2>&1 \
    | tee "$OUT/pytest.log" | tail -3
fi
