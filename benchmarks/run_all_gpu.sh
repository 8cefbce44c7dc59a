#!/usr/bin/env bash
# Every GPU check of issues 3-7 in one device call (about 6-9 minutes): GPU tests, the load /
# verify benchmark, tensor-parallel slices, the per-chunk probe and the startup benchmark (F, 2).
# Logs and JSON land in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
python3 -c "import sys; sys.path.insert(0,'benchmarks'); import gpu_bench as g; g.build_checkpoint('/dev/shm/tpb', 15, 4)" 2>&1 | tail -1
TEST_TIMEOUT=${TEST_TIMEOUT:-160} GPU_TESTS=${GPU_TESTS:-"-n 8 tests"} \
  FH_SWEEP=${FH_SWEEP:-pread:16:8:256,pread:16:8:512,mmap:16:8:256} BENCH_TIMEOUT=150 \
  bash benchmarks/run_gpu.sh --dir /dev/shm/tpb --size-gib 15 --shards 4 --sweep --no-cold --no-save \
  > "$OUT/run_gpu.out" 2>&1
tail -45 "$OUT/run_gpu.out"
timeout 100 python3 benchmarks/tp_bench.py /dev/shm/tpb --device cuda:0 --framework pt --repeat 3 2>&1 | tee "$OUT/tp.log" | tail -14
rm -f /dev/shm/tpb.single.safetensors
if [ "${PROBE:-1}" != 0 ]; then
  timeout 60 python3 benchmarks/probe_gpu.py /dev/shm/tpb --json "$OUT/probe.json" > "$OUT/probe.log" 2>&1
  grep -v '"case"' "$OUT/probe.log" | tail -5
fi
if [ "${STARTUP_VARIANTS:-F,1,2,2w}" != none ]; then
  timeout ${STARTUP_TIMEOUT:-220} python3 benchmarks/startup_bench.py /dev/shm/startup --variants ${STARTUP_VARIANTS:-F,1,2,2w} \
    --repeat ${STARTUP_REPEAT:-1} --timeout 60 --json "$OUT/startup.json" 2>&1 | tail -12
fi
