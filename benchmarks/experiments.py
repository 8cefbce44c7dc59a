"""Experiments behind design choices (run on the GPU machine; results quoted in RESULTS.md).

1. register: can the GPU DMA straight out of the page cache (cudaHostRegister of a read-only
   file mapping, per chunk) instead of bouncing through pinned buffers?
2. writes: what limits writing one file in /dev/shm: fresh pages, the per-inode write lock
   (one file, several threads), or neither (mmap + parallel memcpy)?

    python benchmarks/experiments.py --file .bench/model-00001-of-00005.safetensors
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time

import numpy as np

GB = 1e9


def run_threads(n, fn):
    ts = [threading.Thread(target=fn, args=(w,)) for w in range(n)]
    t0 = time.perf_counter()
    [t.start() for t in ts]
    [t.join() for t in ts]
    return time.perf_counter() - t0


def jobs_iter(total, chunk):
    offs = list(range(0, total, chunk))
    lock = threading.Lock()
    it = iter(offs)

    def nxt():
        with lock:
            return next(it, None)
    return nxt


def exp_register(path, threads_list=(8, 16), chunks=(16 << 20, 64 << 20)):
    import cupy as cp
    rt = cp.cuda.runtime
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    base = np.frombuffer(m, np.uint8).ctypes.data
    buf = bytearray(64 << 20)
    with open(path, "rb", buffering=0) as f:   # hot page cache
        while f.readinto(buf):
            pass
    dev = cp.cuda.alloc(size)
    READONLY = 8
    for threads in threads_list:
        for chunk in chunks:
            nxt = jobs_iter(size, chunk)
            streams = [cp.cuda.Stream(non_blocking=True) for _ in range(threads)]
            err = []

            def work(w):
                s = streams[w]
                try:
                    while (off := nxt()) is not None:
                        n = min(chunk, size - off)
                        lo = off - off % 4096
                        ln = -(-(off + n - lo) // 4096) * 4096
                        rt.hostRegister(base + lo, ln, READONLY | 1)
                        rt.memcpyAsync(dev.ptr + off, base + off, n, rt.memcpyHostToDevice, s.ptr)
                        s.synchronize()
                        rt.hostUnregister(base + lo)
                except Exception as e:  # noqa: BLE001
                    err.append(e)
            try:
                dt = run_threads(threads, work)
                print(f"register   threads={threads:2d} chunk={chunk >> 20:3d}MiB  {size / dt / GB:6.2f} GB/s"
                      f"{'  ERR ' + repr(err[0]) if err else ''}", flush=True)
            except Exception as e:  # noqa: BLE001
                print("register failed:", e, flush=True)
    del dev


def exp_writes(nbytes=8 << 30, threads=8, chunk=16 << 20):
    src = np.full(chunk, 7, np.uint8)
    path = "/dev/shm/fh_exp"

    def pwrite_one(fresh=True, nthreads=threads, files=1):
        paths = [f"{path}.{i}" for i in range(files)]
        for p in paths:
            if fresh and os.path.exists(p):
                os.unlink(p)
        fds = [os.open(p, os.O_WRONLY | os.O_CREAT, 0o644) for p in paths]
        per = nbytes // files
        for fd in fds:
            os.ftruncate(fd, per)
        nxt = jobs_iter(nbytes, chunk)

        def work(w):
            while (off := nxt()) is not None:
                i = off // per
                os.pwrite(fds[min(i, files - 1)], memoryview(src)[:min(chunk, nbytes - off)], off - i * per)
        dt = run_threads(nthreads, work)
        [os.close(fd) for fd in fds]
        return dt

    def mmap_write(fresh=True, nthreads=threads, fallocate=False):
        if fresh and os.path.exists(path):
            os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        t0 = time.perf_counter()
        if fallocate:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
        t_alloc = time.perf_counter() - t0
        m = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        dst = np.frombuffer(m, np.uint8)
        nxt = jobs_iter(nbytes, chunk)

        def work(w):
            while (off := nxt()) is not None:
                n = min(chunk, nbytes - off)
                np.copyto(dst[off:off + n], src[:n])
        dt = run_threads(nthreads, work)
        del dst
        m.close()
        os.close(fd)
        return dt + t_alloc, t_alloc

    for name, fn in [
        ("pwrite 1 thread, fresh file", lambda: pwrite_one(True, 1)),
        (f"pwrite {threads} threads, fresh file", lambda: pwrite_one(True)),
        (f"pwrite {threads} threads, same file overwritten", lambda: pwrite_one(False)),
        (f"pwrite {threads} threads into {threads} separate fresh files", lambda: pwrite_one(True, threads, threads)),
        (f"mmap memcpy {threads} threads, fresh file (ftruncate)", lambda: mmap_write(True)[0]),
        (f"mmap memcpy 16 threads, fresh file (ftruncate)", lambda: mmap_write(True, 16)[0]),
        (f"mmap memcpy {threads} threads, same file overwritten", lambda: mmap_write(False)[0]),
        (f"mmap memcpy {threads} threads, fresh file (posix_fallocate first, included)",
         lambda: mmap_write(True, fallocate=True)[0]),
    ]:
        try:
            dt = fn()
            print(f"write      {name:66s} {nbytes / dt / GB:6.2f} GB/s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"write      {name}: failed {e!r}", flush=True)
    for p in os.listdir("/dev/shm"):
        if p.startswith("fh_exp"):
            os.unlink(os.path.join("/dev/shm", p))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--file")
    ap.add_argument("--write-gib", type=float, default=8)
    a = ap.parse_args()
    if a.file:
        exp_register(a.file)
    exp_writes(int(a.write_gib * 2**30))
