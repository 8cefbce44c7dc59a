#!/usr/bin/env bash
# The next cold experiment for issue 6 (H200, root, ~4 min): is 2tw's slow `import transformers`
# (15-16 s while the weights stream in-process, 7.2-7.8 s after the same trace replay with an idle
# disk, +3-11% while another process streams) the GIL? Runs (1), then 2tw with the weights read in
# 1 GiB pieces and steps (the readers take the GIL back ~once per 0.7 s instead of once per 8 MiB),
# then 2tw as it is (8 MiB pieces), and prints the phases.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
common=(--no-hot --cold --repeat 1 --timeout 80)
python3 benchmarks/startup_bench.py /root/startup_ckpt --variants 1 "${common[@]}" --json "$OUT/cold_1.json" 2>&1 | grep -E "^\[|created|recorded"
python3 benchmarks/startup_bench.py /root/startup_ckpt --variants 2tw,2tw "${common[@]}" --prefetch-step $((1 << 30)) \
  --prefetch-options "chunk_bytes=$((1 << 30)), staging_bytes=$((1 << 30))" --json "$OUT/cold_2tw_1GiB_pieces.json" 2>&1 | grep -E "^\[|recorded"
python3 benchmarks/startup_bench.py /root/startup_ckpt --variants 2tw "${common[@]}" --json "$OUT/cold_2tw.json" 2>&1 | grep -E "^\[|\[cold\]"
python3 benchmarks/plot_startup_phases.py "$OUT/cold_gil.png" "$OUT"/cold_*.json
