#!/usr/bin/env bash
# Session 7, issue 6's hot criterion: does starting the restore before `import transformers`
# (2b: fs.torch.load_file(..., background=True), then fs.torch.load_model(model, handle)) and
# warming the first forward's kernels meanwhile (2bk) bring (2) - F under 0.25 x ((1) - F)?
# The torch tests first; one forward probe with and without the kernel warm; then rounds of hot
# F, 1, 2, 2b, 2bk (one run each per round, --append) until STOP_AFTER seconds. ~7 min.
# CKPT, ROUNDS (5), STOP_AFTER (400), VARIANTS, TESTS=none (skip the tests), PROBE=0 (skip the probe)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CKPT=${CKPT:-/root/startup_ckpt}
t0=$(date +%s)
if [ "${TESTS:-}" != none ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout=120 tests/test_gpu_torch.py \
    tests/test_torch_integration.py tests/test_startup_bench.py 2>&1 | tee "$OUT/pytest.log" | tail -3
fi
J="$OUT/hot_s7.json"
for round in $(seq ${ROUNDS:-5}); do
  [ "$round" = 1 ] && app=() || app=(--append)
  python3 benchmarks/startup_bench.py "$CKPT" --variants ${VARIANTS:-F,1,2,2b,2bk} --repeat 1 --timeout 60 \
    --json "$J" "${app[@]}" 2>&1 | grep -E "^\[|created|failed" | tee -a "$OUT/hot_s7.log"
  if [ "$round" = 1 ] && [ "${PROBE:-1}" != 0 ]; then
    for w in --warm ""; do python3 benchmarks/forward_probe.py "$CKPT" $w 2>&1 | grep PROBE | tee -a "$OUT/probe.log"; done
  fi
  [ $(( $(date +%s) - t0 )) -gt ${STOP_AFTER:-400} ] && break
done
python3 benchmarks/startup_bench.py "$CKPT" --variants F --repeat 0 --json "$J" --append 2>&1 | tail -16 | tee -a "$OUT/hot_s7.log"
python3 - "$J" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    ph = r.get("phases_s", {})
    extra = {k: round(r[k], 3) for k in ("bg_load_s", "kernels_warm_s") if k in r}
    print(r["variant"], round(r.get("total_s", 0), 2), " ".join(f"{k} {v:.3f}" for k, v in ph.items()), extra,
          r.get("error", "")[-300:])
PY
