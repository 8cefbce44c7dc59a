#!/usr/bin/env bash
# Session 5's nvidia-h200-x2 call (~5 min): topology and NUMA, what the host can feed two GPUs
# (benchmarks/host_bandwidth.py), the two-GPU tests, then the single-GPU and 2-rank loads.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
{ date -u; nvidia-smi topo -m; nproc; lscpu | grep -iE "numa|model name|socket"; ls /sys/devices/system/node/ | grep node;
  nvidia-smi --query-gpu=index,pci.bus_id --format=csv; } > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
python3 -c "import sys; sys.path.insert(0,'benchmarks'); import gpu_bench as g; g.build_checkpoint('/dev/shm/tpb', 15, 4)" 2>&1 | tail -1
timeout 150 python3 benchmarks/host_bandwidth.py /dev/shm/tpb --gpus 2 2>&1 | tee "$OUT/host_bandwidth.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout=120 tests/test_gpu_distributed.py tests/test_gpu_device_map.py 2>&1 \
  | tee "$OUT/pytest.log" | tail -4
timeout 60 python3 benchmarks/single_load.py /dev/shm/tpb 2>&1 | tee "$OUT/single.log"
timeout 150 torchrun --nproc-per-node 2 benchmarks/dist_bench.py /dev/shm/tpb --baseline --repeat 3 --out "$OUT/dist.json" 2>&1 | tee "$OUT/dist.log" | tail -25
