"""How long does one cold read wait while the checkpoint streams? (issue 6). Needs root.

    python3 benchmarks/disk_latency.py /root/startup_ckpt [--seconds 3] [--configs 0,2:64M,2:1M:r]

A cold start's imports still make a few reads of their own while the prefetch streams the
weights; each waits behind what the stream has queued on the disk. For each configuration:
drop the page cache, stream the checkpoint's files (all but the last) for ``--seconds`` with
R reader threads, each reading its own sequential region ``STEP`` bytes per call, while a probe
thread reads 4 KiB at a fresh random offset of the last file every 10 ms. Prints the stream's
GB/s and the probe's latency percentiles.

A configuration is ``R:STEP[:FLAGS]`` (``0`` = the probe alone); FLAGS: ``r`` the readers'
files ``POSIX_FADV_RANDOM`` (no readahead beyond each call), ``i`` idle I/O class
(``warm.set_idle_io_priority``), ``p`` ``pread`` into a buffer instead of ``sendfile``.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from foxhunt_stream.io.pagecache import sendfile_to_null  # noqa: E402
from foxhunt_stream.startup.prefetch import set_idle_io_priority  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import drop_caches  # noqa: E402

DEFAULT = "0,2:64M,2:4M:i,2:4M:r,2:1M:r,1:1M:r,4:1M:r,2:256K:r,4:256K:r,8:256K:r,2:1M"


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def block_settings() -> str:
    out = []
    for dev in sorted(glob.glob("/sys/block/*/queue")):
        name = dev.split("/")[3]
        if name.startswith(("loop", "ram")):
            continue
        vals = []
        for key in ("scheduler", "nr_requests", "max_sectors_kb", "read_ahead_kb", "rotational"):
            try:
                with open(os.path.join(dev, key)) as f:
                    vals.append(f"{key}={f.read().strip()}")
            except OSError:
                pass
        out.append(f"{name}: " + " ".join(vals))
    return "\n".join(out)


def run(paths: list[str], probe_path: str, readers: int, step: int, flags: str, seconds: float) -> dict:
    stop = threading.Event()
    done = [0] * max(readers, 1)
    size = sum(os.path.getsize(p) for p in paths)
    region = size // max(readers, 1)

    def reader(i: int) -> None:
        if "i" in flags:
            set_idle_io_priority()
        fds = [os.open(p, os.O_RDONLY) for p in paths]
        if "r" in flags:
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        buf = bytearray(step) if "p" in flags else None
        pos = i * region   # a position in the files laid end to end
        try:
            while not stop.is_set() and pos < (i + 1) * region:
                k, off = 0, pos
                while off >= os.path.getsize(paths[k]):
                    off -= os.path.getsize(paths[k])
                    k += 1
                n = min(step, os.path.getsize(paths[k]) - off)
                if buf is not None:
                    n = os.preadv(fds[k], [memoryview(buf)[:n]], off)
                else:
                    n = sendfile_to_null(fds[k], off, n, step) or 0
                if n <= 0:
                    break
                pos += n
                done[i] += n
        finally:
            for fd in fds:
                os.close(fd)

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(readers)]
    fd = os.open(probe_path, os.O_RDONLY)
    pages = os.path.getsize(probe_path) // 4096
    rng = random.Random(readers * 1000 + step)
    lat = []
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(0.3)   # the stream's queue builds up first
    while time.perf_counter() - t0 < seconds:
        off = rng.randrange(pages) * 4096
        a = time.perf_counter()
        os.pread(fd, 4096, off)
        lat.append(time.perf_counter() - a)
        time.sleep(0.01)
    stop.set()
    dt = time.perf_counter() - t0
    streamed = sum(done)
    for t in threads:
        t.join()
    os.close(fd)
    lat.sort()
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3   # noqa: E731
    return {"gbps": streamed / dt / 1e9, "n": len(lat), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "max": lat[-1] * 1e3, "mean": statistics.fmean(lat) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--configs", default=DEFAULT)
    args = ap.parse_args(argv)
    files = sorted(glob.glob(os.path.join(args.directory, "*.safetensors")))
    paths, probe = files[:-1], files[-1]
    print(block_settings(), flush=True)
    print(f"stream {len(paths)} files, {sum(map(os.path.getsize, paths)) / 1e9:.2f} GB; probe {probe}")
    print("| readers | step | flags | stream GB/s | probe reads | p50 ms | p90 ms | p99 ms | max ms | mean ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for cfg in args.configs.split(","):
        parts = cfg.split(":")
        readers = int(parts[0])
        step = parse_size(parts[1]) if len(parts) > 1 else 0
        flags = parts[2] if len(parts) > 2 else ""
        drop_caches()
        r = run(paths, probe, readers, step, flags, args.seconds)
        print(f"| {readers} | {parts[1] if len(parts) > 1 else '-'} | {flags or '-'} | {r['gbps']:.2f} | {r['n']} | "
              f"{r['p50']:.2f} | {r['p90']:.2f} | {r['p99']:.2f} | {r['max']:.2f} | {r['mean']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
