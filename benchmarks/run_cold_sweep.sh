#!/usr/bin/env bash
# Cold-start sweep of the prefetch's pace (for issue 6; H200 machine, root, ~4-5 min):
# transformers' from_pretrained once, then variant 2t (import trace + weights) once per SWEEP point
# "STEP:THREADS" - bytes per call of the idle readers (warm.PACED_BYTES) and their count. Each point
# writes its own JSON (the file name is its label in the plot); the plot shows every run's phases.
#   SWEEP (default "4:2 8:2 16:2 4:4"), REPEAT (default 1), CKPT (default /root/startup_ckpt), DEVICE (cuda:0)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CKPT=${CKPT:-/root/startup_ckpt}
common=(--no-hot --cold --repeat "${REPEAT:-1}" --timeout 80 --device "${DEVICE:-cuda:0}")
python3 benchmarks/startup_bench.py "$CKPT" --variants 1 "${common[@]}" --json "$OUT/cold_1.json" 2>&1 | grep -E "^\[|built|wrote"
for point in ${SWEEP:-4:2 8:2 16:2 4:4}; do
  step=${point%%:*}; threads=${point##*:}
  python3 benchmarks/startup_bench.py "$CKPT" --variants 2t "${common[@]}" --prefetch-step $((step << 20)) \
    --prefetch-options "threads=$threads" --json "$OUT/cold_2t-${step}M-${threads}r.json" 2>&1 | grep -E "^\[|recorded|wrote"
done
python3 benchmarks/plot_startup_phases.py "$OUT/cold_sweep.png" "$OUT"/cold_*.json
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "cold_*.json"))):
    for r in json.load(open(path))["runs"]:
        ph = r.get("phases_s", {})
        at = r.get("prefetch_bytes_at_load")
        print(f"{os.path.basename(path):<24} {r['variant']:<4} total {r.get('total_s', float('nan')):6.2f}  "
              f"import_transformers {ph.get('import_transformers', float('nan')):6.2f}  load {ph.get('load', float('nan')):6.2f}"
              + (f"  resident at load {at / 1e9:5.1f} GB" if at else ""))
PY
