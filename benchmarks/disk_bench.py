"""The disk under a cold start: how fast it fills the page cache, and how long one small read
waits while the checkpoint streams. Needs root (each case starts from a dropped page cache).

    python benchmarks/disk_bench.py rate CKPT [--readers 1,2,8] [--step 64MiB] [--out DIR]
    python benchmarks/disk_bench.py latency CKPT [--configs 0,2:64M,8:1M:r] [--seconds 3] [--out DIR]

rate: for each reader count, the page cache dropped, then every byte of the checkpoint's files
read by that many threads (``sendfile`` into /dev/null, ``--step`` bytes per call, the files
cut in 64 MiB pieces taken in turn): the disk's cold read rate.

latency: a cold start's imports make small reads of their own while a prefetch streams the
weights, and each waits behind what the stream has queued on the disk. For each configuration
``R:STEP[:FLAGS]`` (``0``: no stream), the page cache dropped, R threads stream the files (all
but the last), each its own sequential region, STEP bytes per call, while a probe reads 4 KiB at
a fresh random offset of the last file every 10 ms for ``--seconds``. FLAGS: ``r`` the
readers' files advised POSIX_FADV_RANDOM (no readahead beyond each call), ``i`` the readers in
the idle I/O class, ``p`` pread into a buffer instead of sendfile. Reported: the stream's GB/s
and the probe's latency percentiles, with the block queue's settings.
"""

from __future__ import annotations

import glob
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common
from common import GB, Results, ce

from foxhunt_stream.io.pagecache import sendfile_to_null
from foxhunt_stream.settings import parse_size

DEFAULT_CONFIGS = "0,2:64M,2:4M:i,2:1M:r,4:1M:r,8:1M:r,8:1M:rp"


def idle_io_priority() -> None:
    """This thread in the idle I/O class (ioprio_set; Linux x86-64), where the kernel allows it."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(251, 1, 0, 3 << 13)   # ioprio_set(IOPRIO_WHO_PROCESS, this thread, IOPRIO_CLASS_IDLE)


def rate(args, files: list[str], res: Results) -> None:
    total = sum(map(os.path.getsize, files))
    pieces = [(p, off, n) for p in files for off, n in ce.pieces(os.path.getsize(p), 64 << 20)]
    rows = [("readers", "step", "seconds", "GB/s")]
    data = {}
    for readers in (int(x) for x in args.readers.split(",")):
        ce.drop_caches(files, whole_cache=True)
        fds = {p: os.open(p, os.O_RDONLY) for p in files}
        try:
            t0 = time.perf_counter()
            ce.parallel(pieces, lambda w, it: sendfile_to_null(fds[it[0]], it[1], it[2], parse_size(args.step)),
                        readers)
            seconds = time.perf_counter() - t0
        finally:
            for fd in fds.values():
                os.close(fd)
        rows.append((str(readers), args.step, f"{seconds:.2f}", f"{total / seconds / GB:.2f}"))
        data[readers] = seconds
    res.say(f"cold read of {total / GB:.2f} GB in {len(files)} files on {common.filesystem(files[0])}", "")
    res.table(rows, right={0, 2, 3})
    res.data.update(bytes=total, seconds_by_readers=data)


def stream_and_probe(paths: list[str], probe_path: str, readers: int, step: int, flags: str,
                     seconds: float) -> dict:
    stop = threading.Event()
    done = [0] * max(readers, 1)
    sizes = [os.path.getsize(p) for p in paths]
    region = sum(sizes) // max(readers, 1)

    def reader(i: int) -> None:
        if "i" in flags:
            idle_io_priority()
        fds = [os.open(p, os.O_RDONLY) for p in paths]
        for fd in fds if "r" in flags else []:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        buf = bytearray(step) if "p" in flags else None
        pos = i * region   # a position in the files laid end to end
        try:
            while not stop.is_set() and pos < (i + 1) * region:
                k, off = 0, pos
                while off >= sizes[k]:
                    off, k = off - sizes[k], k + 1
                n = min(step, sizes[k] - off)
                n = os.preadv(fds[k], [memoryview(buf)[:n]], off) if buf is not None else \
                    sendfile_to_null(fds[k], off, n, step) or 0
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
    lat: list[float] = []
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
    for t in threads:
        t.join()
    os.close(fd)
    lat.sort()

    def q(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3
    return {"GBps": sum(done) / dt / GB, "n": len(lat), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "max": lat[-1] * 1e3, "mean": statistics.fmean(lat) * 1e3}


def block_settings() -> list[str]:
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
    return out


def latency(args, files: list[str], res: Results) -> None:
    paths, probe = files[:-1], files[-1]
    res.say(*block_settings())
    res.say(f"stream {len(paths)} files, {sum(map(os.path.getsize, paths)) / GB:.2f} GB; probe {probe}", "")
    rows = [("readers", "step", "flags", "stream GB/s", "probe reads", "p50 ms", "p90 ms", "p99 ms", "max ms")]
    data = {}
    for cfg in args.configs.split(","):
        parts = cfg.split(":")
        readers, step = int(parts[0]), parse_size(parts[1] + "iB") if len(parts) > 1 else 0
        flags = parts[2] if len(parts) > 2 else ""
        ce.drop_caches(files, whole_cache=True)
        r = stream_and_probe(paths, probe, readers, step, flags, args.seconds)
        data[cfg] = r
        rows.append((str(readers), parts[1] if len(parts) > 1 else "-", flags or "-", f"{r['GBps']:.2f}",
                     str(r["n"]), f"{r['p50']:.2f}", f"{r['p90']:.2f}", f"{r['p99']:.2f}", f"{r['max']:.2f}"))
    res.table(rows, right={0, 1, 3, 4, 5, 6, 7, 8})
    res.data.update(configs=data)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] not in (["rate"], ["latency"]):
        raise SystemExit("usage: disk_bench.py {rate,latency} CKPT [options]; see --help after the mode")
    mode = argv[0]
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--readers", default="1,2,8", help="rate: reader counts (default 1,2,8)")
    ap.add_argument("--step", default="64MiB", help="rate: bytes per sendfile (default 64MiB)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"latency: R:STEP[:FLAGS],... "
                                                                f"(default {DEFAULT_CONFIGS})")
    ap.add_argument("--seconds", type=float, default=3.0, help="latency: seconds per configuration")
    args = ap.parse_args(argv[1:])
    files = common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    res = Results("disk" if mode == "rate" else "disk_latency", args.out)
    (rate if mode == "rate" else latency)(args, files, res)
    res.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
