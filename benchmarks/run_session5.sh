#!/usr/bin/env bash
# Session 5's first H200 call (~4-5 min): the GPU tests, then where a tensor-parallel row shard's
# time goes (benchmarks/tp_rows.py: interleaved variants against the full load, the host pass that
# bounds a column shard, the fixed costs). Logs and JSON in $OUT.
#   TESTS (default "-n 8 tests"), ROUNDS (default 9)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv; nproc; lscpu | grep -iE "numa|model name"; } > "$OUT/env.log" 2>&1
python3 -c "import sys; sys.path.insert(0,'benchmarks'); import gpu_bench as g; g.build_checkpoint('/dev/shm/tpb', 15, 4)" 2>&1 | tail -1
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --timeout=120 ${TESTS:--n 8 tests} 2>&1 \
  | tee "$OUT/pytest.log" | tail -4
timeout 240 python3 benchmarks/tp_rows.py /dev/shm/tpb --rounds ${ROUNDS:-9} --json "$OUT/tp_rows.json" 2>&1 | tee "$OUT/tp_rows.log"
