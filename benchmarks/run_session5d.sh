#!/usr/bin/env bash
# Session 5's fourth H200 call: the whole GPU suite with workers held back while the allocator
# runs, the row-shard variants, then whether a streaming disk slows imports that do no I/O.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
python3 -c "import sys; sys.path.insert(0,'benchmarks'); import gpu_bench as g; g.build_checkpoint('/dev/shm/tpb', 15, 4)" 2>&1 | tail -1
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --timeout=120 ${TESTS:--n 8 tests} 2>&1 \
  | tee "$OUT/pytest.log" | tail -3
timeout 200 python3 benchmarks/tp_rows.py /dev/shm/tpb --rounds ${ROUNDS:-11} --json "$OUT/tp_rows.json" 2>&1 | tee "$OUT/tp_rows.log"
rm -rf /dev/shm/tpb
timeout 240 python3 benchmarks/import_interference.py --file /root/interference.bin --gib 16 2>&1 | tee "$OUT/interference.log"
