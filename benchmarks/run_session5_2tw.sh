#!/usr/bin/env bash
# Session 5's last H200 call (~4 min, root): cold, transformers' from_pretrained (1) against 2tw
# (the import trace read first, the imports after PF.wait_imports(), the weights streaming
# meanwhile), twice. Builds /root/startup_ckpt and records the trace first.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
python3 benchmarks/startup_bench.py /root/startup_ckpt --variants ${VARIANTS:-1,2tw,2tw} --no-hot --cold --repeat 1 \
  --timeout 80 --json "$OUT/cold_2tw.json" 2>&1 | grep -vE "^\s*$" | tail -14
