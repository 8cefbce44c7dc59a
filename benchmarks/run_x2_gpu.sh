#!/usr/bin/env bash
# Issue 9's GPU checks on a 2-GPU machine (nvidia-h200-x2), in one device call: topology, the NCCL
# and device_map GPU tests, the single-GPU load time, the 2-rank distributed load (full and TP
# shards) and device_map across both GPUs. Logs in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv; nvidia-smi topo -m; nproc; git log -1 --format=%H; } 2>&1 | tee "$OUT/env.log"
python3 -c "import sys; sys.path.insert(0,'benchmarks'); import gpu_bench as g; g.build_checkpoint('/dev/shm/tpb', 15, 4)" 2>&1 | tail -1
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout=120 tests/test_gpu_distributed.py tests/test_gpu_device_map.py tests/test_gpu.py 2>&1 | tee "$OUT/pytest.log" | tail -8
timeout 60 python3 benchmarks/single_load.py /dev/shm/tpb 2>&1 | tee "$OUT/single.log"
timeout 150 torchrun --nproc-per-node 2 benchmarks/dist_bench.py /dev/shm/tpb --baseline --repeat 3 --out "$OUT/dist.json" 2>&1 | tee "$OUT/dist.log" | tail -25
timeout 90 torchrun --nproc-per-node 2 benchmarks/dist_bench.py /dev/shm/tpb --shard-dim 0 --repeat 3 2>&1 | tee "$OUT/dist_tp.log" | tail -15
timeout 90 python3 benchmarks/device_map_bench.py /dev/shm/tpb --repeat 3 2>&1 | tee "$OUT/device_map.log" | tail -15
