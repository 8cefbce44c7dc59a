#!/usr/bin/env bash
# Session 5's second H200 call: the row-shard variants again (threads), then the cold call.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
python3 -c "import sys; sys.path.insert(0,'benchmarks'); import gpu_bench as g; g.build_checkpoint('/dev/shm/tpb', 15, 4)" 2>&1 | tail -1
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_import_trace.py tests/test_gpu_sharded.py tests/test_cuda_target_fake.py 2>&1 | tail -2
timeout 200 python3 benchmarks/tp_rows.py /dev/shm/tpb --rounds ${ROUNDS:-9} --json "$OUT/tp_rows.json" 2>&1 | tee "$OUT/tp_rows.log"
rm -rf /dev/shm/tpb
OUT=$OUT bash benchmarks/run_session5_cold.sh
