#!/usr/bin/env bash
# Session 4's H200 call: the GPU tests, then the cold startup with an import trace (variant 2t:
# fs.prefetch(dir, imports=trace) replays the files an earlier start loaded, then the weights)
# against transformers' from_pretrained, on a checkpoint on the local disk. Logs in $OUT.
#   COLD_VARIANTS (default 1,2t), COLD_REPEAT (default 2), TESTS (default "-n 8 tests")
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
git log -1 --format='%H %s' 2>/dev/null | tee "$OUT/commit.log"
for d in /sys/block/*/queue/scheduler; do echo "$d: $(cat $d)"; done 2>/dev/null > "$OUT/sched.log"
nproc; free -g | head -2; ls -la /root/startup_ckpt 2>&1 | head -3
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --timeout=120 ${TESTS:--n 8 tests} 2>&1 \
  | tee "$OUT/pytest.log" | tail -4
rm -f /tmp/foxhunt_startup_imports.txt
timeout ${STARTUP_TIMEOUT:-420} python3 benchmarks/startup_bench.py /root/startup_ckpt --variants ${COLD_VARIANTS:-1,2t} \
  --no-hot --cold --repeat ${COLD_REPEAT:-2} --timeout 80 --json "$OUT/startup_cold.json" ${STARTUP_ARGS:-} 2>&1 | tail -16
cp /tmp/foxhunt_startup_imports.txt "$OUT/imports_trace.txt" 2>/dev/null
python3 - <<'PY'
import os
p = "/tmp/foxhunt_startup_imports.txt"
if os.path.exists(p):
    files = [l.strip() for l in open(p) if l.strip() and not l.startswith("#")]
    sizes = sorted(((os.path.getsize(f), f) for f in files if os.path.exists(f)), reverse=True)
    print(f"trace: {len(files)} files, {sum(s for s, _ in sizes) / 1e9:.2f} GB; biggest:")
    for s, f in sizes[:8]:
        print(f"  {s / 1e6:9.1f} MB  {f}")
PY
