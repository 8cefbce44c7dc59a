#!/usr/bin/env bash
# Session 5's cold call (~6 min, root): the disk's own cold rate (benchmarks/disk_rate.py), then
# benchmarks/run_cold_sweep.sh (transformers' from_pretrained, then variant 2t at each SWEEP point).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CKPT=${CKPT:-/root/startup_ckpt}
if [ ! -e "$CKPT/config.json" ]; then   # startup_bench builds it (transformers save_pretrained)
  python3 benchmarks/startup_bench.py "$CKPT" --variants F --no-hot 2>&1 | tail -2
fi
timeout 120 python3 benchmarks/disk_rate.py "$CKPT" --readers ${READERS:-2,8} 2>&1 | tee "$OUT/disk_rate.log"
OUT=$OUT timeout ${SWEEP_TIMEOUT:-420} bash benchmarks/run_cold_sweep.sh 2>&1 | tee "$OUT/sweep.log"
