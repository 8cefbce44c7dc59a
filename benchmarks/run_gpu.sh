#!/usr/bin/env bash
# The whole GPU check in one call (device machine): environment, GPU tests, benchmark table.
#   bash benchmarks/run_gpu.sh [extra gpu_bench.py args]
# Logs go to $OUT (or ./gpu-out when OUT is unset).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/peers .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/peers
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  nproc; free -g; df -h . /dev/shm /tmp; git log -1 --format='commit %H %s' 2>/dev/null
  python3 -c "import torch, cupy, safetensors, numpy; print('torch', torch.__version__, 'cupy', cupy.__version__, 'safetensors', safetensors.__version__, 'numpy', numpy.__version__)"
} 2>&1 | tee "$OUT/env.log"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --timeout=120 ${GPU_TESTS:-tests/test_gpu.py tests/test_smoke.py} 2>&1 | tee "$OUT/pytest.log" | tail -40
timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/gpu_bench.py --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
