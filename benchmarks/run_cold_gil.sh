#!/usr/bin/env bash
# The next cold experiment for issue 6 (H200, root, ~5 min): is 2tw's slow `import transformers`
# (15-16 s while the weights stream in-process, 7.2-7.8 s after the same trace replay with an idle
# disk, +3-11% while another process streams) the GIL that the in-process readers take back after
# every step? Runs (1); 2tx twice (the weights read by a helper process: no GIL shared);
# 2tw with 1 GiB pieces and steps (the readers take the GIL back ~once per 0.7 s instead of once
# per 8 MiB); 2tw as it is; then 2tx and (1) again, so each 2tx has an (1) next to it. Prints the phases and writes a plot.
#   CKPT (default /root/startup_ckpt, built if missing), BENCH_ARGS (e.g. "--device cpu --tiny --layers 2"
#   for a dry run on a box without a GPU)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CKPT=${CKPT:-/root/startup_ckpt}
common=(--no-hot --cold --repeat 1 --timeout 80 ${BENCH_ARGS:-})
python3 benchmarks/startup_bench.py "$CKPT" --variants 1,2tx,2tx "${common[@]}" --json "$OUT/cold_1_2tx.json" 2>&1 \
  | grep -E "^\[|created|recorded|\[cold\]"
python3 benchmarks/startup_bench.py "$CKPT" --variants 2tw "${common[@]}" --prefetch-step $((1 << 30)) \
  --prefetch-options "chunk_bytes=$((1 << 30)), staging_bytes=$((1 << 30))" --json "$OUT/cold_2tw_1GiB.json" 2>&1 | grep -E "^\[|\[cold\]"
python3 benchmarks/startup_bench.py "$CKPT" --variants 2tw "${common[@]}" --json "$OUT/cold_2tw.json" 2>&1 | grep -E "^\[|\[cold\]"
python3 benchmarks/startup_bench.py "$CKPT" --variants 2tx,1 "${common[@]}" --json "$OUT/cold_2tx_1.json" 2>&1 | grep -E "^\[|\[cold\]"
python3 benchmarks/plot_startup_phases.py "$OUT/cold_next.png" "$OUT"/cold_*.json --variants 1,2tw,2tx
