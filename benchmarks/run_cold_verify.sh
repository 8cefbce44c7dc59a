#!/usr/bin/env bash
# Session 3's second H200 call: GPU tests, the load/verify benchmark (verify hashed on the GPU by
# default), and the cold startup runs (1, 2p with the idle-priority prefetch, 2) on a checkpoint
# on the local disk (tmpfs is not evicted by drop_caches). Logs in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
for d in /sys/block/*/queue/scheduler; do echo "$d: $(cat $d)"; done 2>/dev/null | tee "$OUT/sched.log"
df -h / /root 2>/dev/null | tee -a "$OUT/sched.log"
python3 -c "import sys; sys.path.insert(0,'benchmarks'); import gpu_bench as g; g.build_checkpoint('/dev/shm/tpb', 15, 4)" 2>&1 | tail -1
timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout=100 -n 8 tests 2>&1 | tee "$OUT/pytest.log" | tail -4
timeout 150 python3 benchmarks/gpu_bench.py --dir /dev/shm/tpb --size-gib 15 --shards 4 --no-cold --no-save \
  --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
grep -E "ceiling|verify|hot, framework" "$OUT/bench.log"
rm -rf /dev/shm/tpb /dev/shm/tpb.single.safetensors
timeout ${STARTUP_TIMEOUT:-300} python3 benchmarks/startup_bench.py /root/startup_ckpt --variants ${COLD_VARIANTS:-1,2p,2} --no-hot --cold \
  --repeat 1 --timeout 70 --json "$OUT/startup_cold.json" 2>&1 | tail -14
