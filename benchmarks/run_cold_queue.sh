#!/usr/bin/env bash
# Issue 6, after run_cold_gil.sh showed the helper process (no GIL shared) does not speed up the
# cold `import transformers` (15.7-16.5 s beside the stream, in 2tw and 2tx alike): where does the
# importing thread wait, and how deep a queue does the stream keep in front of its reads?
#   1. 2tx and (1) cold with the main thread sampled (benchmarks/stall_sampler.py; builds the
#      checkpoint and records the import trace first when missing)
#   2. disk_latency.py: a 4 KiB cold read's wait behind each way of streaming
#   3. 2tx with the idle readers in "pread" mode (POSIX_FADV_RANDOM, one step queued each):
#      4 readers x 1 MiB, then 8 x 512 KiB; then (1) again
# H200, root, ~5 min. CKPT (default /root/startup_ckpt), BENCH_ARGS (e.g. "--device cpu --tiny
# --layers 2" for a dry run without a GPU).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/ss"
CKPT=${CKPT:-/root/startup_ckpt}
J="$OUT/cold_queue.json"
common=(--no-hot --cold --repeat 1 --timeout 80 --json "$J" --stall-sample "$OUT/ss" ${BENCH_ARGS:-})
python3 benchmarks/startup_bench.py "$CKPT" --variants 2tx,1 "${common[@]}" 2>&1 | grep -E "^\[|created|recorded|\[cold\]"
python3 benchmarks/disk_latency.py "$CKPT" --seconds 3
python3 benchmarks/startup_bench.py "$CKPT" --variants 2tx "${common[@]}" --append --prefetch-options "threads=4" \
  --prefetch-set "IDLE_READ='pread'; PACED_BYTES=1<<20" 2>&1 | grep -E "^\[|\[cold\]"
python3 benchmarks/startup_bench.py "$CKPT" --variants 2tx "${common[@]}" --append --prefetch-options "threads=8" \
  --prefetch-set "IDLE_READ='pread'; PACED_BYTES=512<<10" 2>&1 | grep -E "^\[|\[cold\]"
python3 benchmarks/startup_bench.py "$CKPT" --variants 1 "${common[@]}" --append 2>&1 | grep -E "^\[|\[cold\]"
for f in "$OUT"/ss/*.json; do python3 benchmarks/stall_sampler.py "$f" | cut -c1-1500; done
tar czf "$OUT/stall_samples.tar.gz" -C "$OUT" ss && rm -rf "$OUT/ss"
