"""GPU benchmark: ceilings, foxhunt_stream and safetensors, hot and cold, load and save.

Builds a Llama-3-8B-shaped bf16 checkpoint (random bytes) in --dir, measures in the same run:
  ceilings   pinned host->device, pinned device->host, page cache -> pinned (16 threads),
             cold sequential read (buffered and O_DIRECT), raw pwrite into /dev/shm (fresh and
             re-touched pages), raw write + fsync to disk;
  load       foxhunt_stream (pt, cupy), safetensors.torch.load_file(device="cuda:0"), hot and cold;
             time to first tensor from safe_open(...).tensors();
  save       foxhunt_stream vs safetensors.torch.save_file into /dev/shm and to disk with fsync,
             with peak RSS growth measured in a fresh subprocess.
Prints a table and writes JSON (--out). Every section is guarded: a failure is reported, the rest runs.

    python benchmarks/gpu_bench.py --dir .bench --size-gib 15 --shards 4 --out $OUT/bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import foxhunt_stream as fs  # noqa: E402
from foxhunt_stream.format.dtypes import DTYPES  # noqa: E402
from foxhunt_stream.format.header import layout, serialize_header  # noqa: E402
from foxhunt_stream.engine.saver import split_shards, shard_names  # noqa: E402

GB = 1e9
RESULTS: dict = {"rows": [], "errors": []}


def log(*a):
    print(*a, flush=True)


def row(section, what, nbytes, seconds, ceiling=None, note=""):
    gbps = nbytes / seconds / GB if seconds > 0 else float("nan")
    r = {"section": section, "what": what, "bytes": nbytes, "seconds": round(seconds, 4), "GB/s": round(gbps, 2),
         "ceiling": ceiling, "note": note}
    RESULTS["rows"].append(r)
    log(f"  {section:8s} {what:58s} {gbps:7.2f} GB/s  {seconds:8.3f} s  {note}")
    return gbps


def guarded(fn):
    def wrapper(*a, **k):
        try:
            return fn(*a, **k)
        except Exception as e:  # noqa: BLE001
            log(f"!! {fn.__name__} failed: {type(e).__name__}: {e}")
            traceback.print_exc()
            RESULTS["errors"].append(f"{fn.__name__}: {type(e).__name__}: {e}")
    return wrapper


# ------------------------------------------------------------------ checkpoint

def llama_specs(layers: int, hidden=4096, inter=14336, vocab=128256, kv=1024):
    specs = [("model.embed_tokens.weight", (vocab, hidden)), ("lm_head.weight", (vocab, hidden)),
             ("model.norm.weight", (hidden,))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                  (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                  (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                  (p + "mlp.down_proj.weight", (hidden, inter)),
                  (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    return specs


def build_checkpoint(directory: str, size_gib: float, shards: int) -> tuple[list[str], int]:
    os.makedirs(directory, exist_ok=True)
    per_layer = 2 * (4096 * 4096 * 2 + 1024 * 4096 * 2 + 3 * 14336 * 4096 + 2 * 4096)
    fixed = 2 * (2 * 128256 * 4096 + 4096)
    layers = max(1, round((size_gib * 2**30 - fixed) / per_layer))
    specs = llama_specs(layers)
    sizes = [(n, 2 * int(np.prod(s))) for n, s in specs]
    total = sum(b for _, b in sizes)
    groups = split_shards(sizes, -(-total // shards))
    names = shard_names(len(groups))
    shape_of = dict(specs)
    paths = [os.path.join(directory, n) for n in names]
    stamp = os.path.join(directory, f"built-{layers}-{len(groups)}")
    if os.path.exists(stamp) and all(os.path.exists(p) for p in paths):
        return paths, total
    rng = np.random.default_rng(0)
    block = rng.integers(0, 2**16, 32 << 20, dtype=np.uint16)
    block = block[(block & 0x7F80) != 0x7F80].tobytes()   # no bf16 NaN/Inf patterns
    weight_map = {}
    t0 = time.perf_counter()
    for group, path in zip(groups, paths):
        infos = layout([(n, DTYPES["BF16"], shape_of[n]) for n in group])
        with open(path, "wb") as f:
            f.write(serialize_header(infos, {"format": "pt"}))
            data_len = infos[-1].end
            pos = 0
            k = 0
            mv = memoryview(block)
            while pos < data_len:
                off = (k * 7919 * 2) % len(block)   # vary the content between blocks
                for piece in (mv[off:], mv[:off]):
                    n = min(len(piece), data_len - pos)
                    f.write(piece[:n])
                    pos += n
                k += 1
        weight_map.update((n, os.path.basename(path)) for n in group)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    os.sync()
    open(stamp, "w").close()
    log(f"built {len(paths)} shards, {total / 2**30:.2f} GiB, {layers} layers in {time.perf_counter() - t0:.1f} s")
    return paths, total


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def warm(paths):
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# ------------------------------------------------------------------ ceilings

@guarded
def ceiling_h2d_d2h(cp, nbytes=4 << 30):
    out = {}
    for chunk in (16 << 20, 64 << 20):
        pinned = cp.cuda.PinnedMemory(chunk * 4, cp.cuda.runtime.hostAllocPortable)
        dev = cp.cuda.alloc(nbytes)
        s = cp.cuda.Stream(non_blocking=True)
        rt = cp.cuda.runtime
        for kind, name in ((rt.memcpyHostToDevice, "h2d"), (rt.memcpyDeviceToHost, "d2h")):
            best = 0
            for _ in range(3):
                s.synchronize()
                t0 = time.perf_counter()
                for off in range(0, nbytes, chunk):
                    src = pinned.ptr + (off // chunk % 4) * chunk
                    if kind == rt.memcpyHostToDevice:
                        rt.memcpyAsync(dev.ptr + off, src, chunk, kind, s.ptr)
                    else:
                        rt.memcpyAsync(src, dev.ptr + off, chunk, kind, s.ptr)
                s.synchronize()
                best = max(best, nbytes / (time.perf_counter() - t0) / GB)
            out[f"{name}_{chunk >> 20}MiB"] = best
            row("ceiling", f"pinned {name} copy, {chunk >> 20} MiB chunks (best of 3)", nbytes, nbytes / best / GB)
        del dev
    RESULTS["h2d"] = max(v for k, v in out.items() if k.startswith("h2d"))
    RESULTS["d2h"] = max(v for k, v in out.items() if k.startswith("d2h"))


def parallel_read(paths, threads, chunk, direct=False, pinned=None, mmap_copy=False):
    """Read every byte of the files with `threads` threads into per-thread buffers; returns seconds."""
    import mmap as _mmap
    jobs = []
    for p in paths:
        size = os.path.getsize(p)
        jobs += [(p, off, min(chunk, size - off)) for off in range(0, size, chunk)]
    fds = {p: os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for p in paths}
    maps = {p: np.frombuffer(_mmap.mmap(fds[p], 0, prot=_mmap.PROT_READ), np.uint8) for p in paths} if mmap_copy else {}
    it = iter(range(len(jobs)))
    lock = threading.Lock()

    def worker(w):
        if pinned is not None:
            buf = pinned[w]
        else:
            raw = np.empty(chunk + 8192, np.uint8)
            pad = (-raw.ctypes.data) % 4096
            buf = raw[pad:pad + chunk]
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                return
            p, off, n = jobs[i]
            if mmap_copy:
                np.copyto(buf[:n], maps[p][off:off + n])
            else:
                want = -(-n // 4096) * 4096 if direct else n
                os.preadv(fds[p], [memoryview(buf)[:want]], off)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    t0 = time.perf_counter()
    [t.start() for t in ts]
    [t.join() for t in ts]
    dt = time.perf_counter() - t0
    maps.clear()
    for fd in fds.values():
        os.close(fd)
    return dt


@guarded
def ceiling_pagecache(cp, paths, total, threads=16, chunk=16 << 20):
    warm(paths)
    pinned = []
    for _ in range(threads):
        mem = cp.cuda.PinnedMemory(chunk, cp.cuda.runtime.hostAllocPortable)
        pinned.append(np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), np.uint8, chunk))
    best = {}
    for mode in ("preadv", "mmap"):
        ts = [parallel_read(paths, threads, chunk, pinned=pinned, mmap_copy=(mode == "mmap")) for _ in range(2)]
        best[mode] = total / min(ts) / GB
        row("ceiling", f"page cache -> pinned, {threads} threads, {mode} (best of 2)", total, min(ts))
    RESULTS["pagecache"] = max(best.values())


@guarded
def ceiling_cold_read(paths, total, threads=16, chunk=16 << 20):
    best = 0
    for direct in (False, True):
        drop_caches()
        dt = parallel_read(paths, threads, chunk, direct=direct)
        best = max(best, total / dt / GB)
        row("ceiling", f"cold read, {threads} threads x {chunk >> 20} MiB, {'O_DIRECT' if direct else 'buffered'}",
            total, dt)
    RESULTS["cold_read"] = best


# ------------------------------------------------------------------ loads

def check_sample(out, paths, framework):
    """Compare one tensor's landed bytes with the file's bytes (not with the library)."""
    import torch
    hdr = fs.read_header(paths[0])
    t = hdr.tensors[len(hdr.tensors) // 2]
    with open(paths[0], "rb") as f:
        f.seek(hdr.data_start + t.start)
        want = f.read(t.nbytes)
    arr = out[t.name]
    if framework == "pt":
        got = arr.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    else:
        import cupy as cp
        got = cp.asnumpy(arr).view(np.uint8).tobytes()
    assert got == want, f"landed bytes differ for {t.name}"


def timed_load(src, framework, reps=3, **opts):
    import cupy as cp
    import torch
    times = []
    out = None
    for _ in range(reps):
        out = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fs.load_file(src, device="cuda:0", framework=framework, **opts)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return out, times


@guarded
def bench_hot_loads(paths, total, directory, sweep):
    import torch
    warm(paths)
    src = os.path.join(directory, "model.safetensors.index.json")
    # first load in this process: includes pinned staging allocation and stream creation
    t0 = time.perf_counter()
    out = fs.load_file(src, device="cuda:0", framework="pt")
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    check_sample(out, paths, "pt")
    del out
    RESULTS["fs_first"] = row("load", "foxhunt first load in process (incl. pinned alloc, streams)", total, first)
    RESULTS["fs_hot"] = {}
    for fw in ("pt", "cupy"):
        out, ts = timed_load(src, fw)
        check_sample(out, paths, fw)
        del out
        g = row("load", f"foxhunt hot, framework={fw}, defaults (median of 3)", total, statistics.median(ts),
                note=f"{total / statistics.median(ts) / GB / RESULTS.get('h2d', float('nan')):.2f}x h2d")
        RESULTS["fs_hot"][fw] = g
    if sweep:
        best = (0, None)
        grid = os.environ.get("FH_SWEEP", "pread:16:8,pread:16:16,pread:12:16,mmap:16:8,mmap:16:16")
        for spec in grid.split(","):   # backend:threads:chunk MiB[:staging MiB (default 2 slots per thread)]
            backend, threads, chunk, *staging = spec.split(":")
            threads, chunk = int(threads), int(chunk)
            staging = int(staging[0]) if staging else 2 * threads * chunk
            opts = dict(backend=backend, threads=threads, chunk_bytes=chunk << 20,
                        staging_bytes=staging << 20, direct_io="off")
            out, ts = timed_load(src, "pt", reps=2, **opts)
            del out
            g = row("sweep", f"{backend} threads={threads} chunk={chunk}MiB staging={opts['staging_bytes'] >> 20}MiB",
                    total, min(ts))
            if g > best[0]:
                best = (g, opts)
        RESULTS["sweep_best"] = {"GB/s": best[0], "opts": best[1]}
        log(f"  best sweep config: {best}")


@guarded
def bench_safetensors_hot(paths, total):
    import safetensors.torch as stt
    import torch
    warm(paths)
    ts = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = {}
        for p in paths:
            out.update(stt.load_file(p, device="cuda:0"))
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
        del out
    RESULTS["st_hot"] = row("load", "safetensors.torch.load_file(device='cuda:0') hot (best of 2)", total, min(ts))


@guarded
def bench_ttft(paths, directory):
    import torch
    warm(paths)
    src = os.path.join(directory, "model.safetensors.index.json")
    res = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with fs.safe_open(src, framework="pt", device="cuda:0") as f:
            it = f.tensors()
            name, first = next(it)
            t_first = time.perf_counter() - t0
            n = 1
            for _name, _t in it:
                n += 1
        res.append(t_first)
        del first, _t
    log(f"  ttft     time to first tensor ({name}, incl. open): {[round(x * 1e3, 1) for x in res]} ms")
    RESULTS["ttft_ms"] = [round(x * 1e3, 2) for x in res]
    res2 = []
    for _ in range(3):
        with fs.safe_open(src, framework="pt", device="cuda:0") as f:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            it = f.tensors()
            name, first = next(it)
            res2.append(time.perf_counter() - t0)
            for _name, _t in it:
                pass
        del first, _t
    log(f"  ttft     time to first tensor ({name}, handle already open): {[round(x * 1e3, 1) for x in res2]} ms")
    RESULTS["ttft_open_handle_ms"] = [round(x * 1e3, 2) for x in res2]


@guarded
def bench_cold_loads(paths, total, directory):
    import torch
    src = os.path.join(directory, "model.safetensors.index.json")
    RESULTS["fs_cold"] = {}
    for mode in ("auto", "off", "on"):
        drop_caches()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fs.load_file(src, device="cuda:0", framework="pt", direct_io=mode)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        check_sample(out, paths, "pt")
        del out
        RESULTS["fs_cold"][mode] = row("cold", f"foxhunt cold, direct_io={mode}", total, dt,
                                       note=f"{total / dt / GB / RESULTS.get('cold_read', float('nan')):.2f}x cold read")


@guarded
def bench_verify(paths, total, directory):
    """Cost of verify=True (checksums hashed on the worker threads) on the hot GPU load."""
    import torch
    src = os.path.join(directory, "model.safetensors.index.json")
    out = fs.load_file(src, device="cuda:0", framework="pt")
    dst = "/dev/shm/fh_verify.safetensors"
    t0 = time.perf_counter()
    fs.save_file(out, dst, checksum="xxh3-64", fsync=False)
    row("save", "foxhunt save_file -> /dev/shm with checksum=xxh3-64", total, time.perf_counter() - t0)
    try:   # the hashing kernel alone, over every loaded tensor (8 MiB blocks, one launch each)
        import cupy as cp
        from foxhunt_stream.cuda import digest as dd
        dd.block_digests(out[next(iter(out))].data_ptr(), 8 << 20, 8 << 20, 0)   # compile outside the timing
        for _ in range(2):
            cp.cuda.Device(0).synchronize()
            t0 = time.perf_counter()
            for t in out.values():
                if t.numel():
                    dd.block_digests(t.data_ptr(), t.numel() * t.element_size(), 8 << 20, 0)
            cp.cuda.Device(0).synchronize()
            dt = time.perf_counter() - t0
        row("verify", "GPU xxh3-64 kernel alone, every tensor, 8 MiB blocks (2nd run)", total, dt)
    except Exception as e:  # noqa: BLE001
        log(f"  verify   kernel alone: {type(e).__name__}: {e}")
    del out
    warm([dst])
    res = {}
    cases = (("verify=False", {}), ("verify=True (default verify_on=auto: hashed on the GPU)", {"verify": True}),
             ("verify=True, verify_on=read (hashed on the host as read)", {"verify": True, "verify_on": "read"}))
    for _ in range(5):
        for label, opts in cases:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                out = fs.load_file(dst, device="cuda:0", framework="pt", **opts)
            except Exception as e:  # noqa: BLE001 - a failing variant is reported, the others still run
                log(f"  verify   {label}: {type(e).__name__}: {e}")
                continue
            torch.cuda.synchronize()
            res.setdefault(label, []).append(time.perf_counter() - t0)
            del out
    for label, ts in res.items():
        row("verify", f"foxhunt hot load, one file in /dev/shm, {label} (best of 5)", total, min(ts))
        row("verify", f"foxhunt hot load, one file in /dev/shm, {label} (median of 5)", total, sorted(ts)[len(ts) // 2])
    base, base_med = min(res["verify=False"]), sorted(res["verify=False"])[2]
    for key, label in (("verify_cost", cases[1][0]), ("verify_cost_read", cases[2][0])):
        ts = res.get(label)
        if ts:
            RESULTS[key] = min(ts) / base - 1
            RESULTS[key + "_median"] = sorted(ts)[len(ts) // 2] / base_med - 1
            log(f"  verify   cost of {label}: best {RESULTS[key] * 100:+.1f}%, median {RESULTS[key + '_median'] * 100:+.1f}%")
    os.unlink(dst)


# ------------------------------------------------------------------ saves

SAVE_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
import torch, foxhunt_stream as fs
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1]) * 1024
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) * 1024
src, dst, which, fsync, wb = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == '1', sys.argv[5]
t = fs.load_file(src, device='cuda:0', framework='pt')
torch.cuda.synchronize()
if which == 'fs':   # warm the staging pool and streams outside the timed region
    fs.save_file({{'w': torch.zeros(1 << 20, device='cuda:0')}}, dst + '.warm', fsync=False); os.unlink(dst + '.warm')
base = rss()
open('/proc/self/clear_refs', 'w').write('5')
t0 = time.perf_counter()
if which == 'fs':
    fs.save_file(t, dst, metadata={{'format': 'pt'}}, fsync=fsync, write_backend=wb)
elif which == 'st':
    import safetensors.torch as stt
    stt.save_file(t, dst, metadata={{'format': 'pt'}})
    if fsync:
        fd = os.open(dst, os.O_RDONLY); os.fsync(fd); os.close(fd)
dt = time.perf_counter() - t0
print(json.dumps({{'seconds': dt, 'rss_growth': hwm() - base, 'bytes': sum(v.numel() * v.element_size() for v in t.values())}}))
"""


def run_save_child(src, dst, which, fsync, write_backend="auto"):
    code = SAVE_CHILD.format(root=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", code, src, dst, which, "1" if fsync else "0", write_backend],
                       capture_output=True, text=True, timeout=400)
    if p.returncode != 0:
        raise RuntimeError(f"save child failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def raw_pwrite(path, nbytes, threads, chunk=16 << 20, fsync=False, pinned=None, fresh=True):
    import cupy as cp
    if fresh and os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    os.ftruncate(fd, nbytes)
    bufs = pinned or [np.frombuffer(cp.cuda.PinnedMemoryPointer(cp.cuda.PinnedMemory(chunk), 0), np.uint8, chunk)
                      for _ in range(threads)]
    for b in bufs:
        b[:] = 7
    offs = list(range(0, nbytes, chunk))
    it = iter(offs)
    lock = threading.Lock()

    def worker(w):
        while True:
            with lock:
                off = next(it, None)
            if off is None:
                return
            n = min(chunk, nbytes - off)
            os.pwrite(fd, memoryview(bufs[w])[:n], off)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    t0 = time.perf_counter()
    [t.start() for t in ts]
    [t.join() for t in ts]
    if fsync:
        os.fsync(fd)
    dt = time.perf_counter() - t0
    os.close(fd)
    return dt, bufs


def check_saved(path, paths):
    """The saved file holds the source's bytes for a sample tensor (compared with the source file)."""
    src_hdr = fs.read_header(paths[0])
    t = src_hdr.tensors[len(src_hdr.tensors) // 2]
    out_hdr = fs.read_header(path)
    o = out_hdr.by_name[t.name]
    with open(paths[0], "rb") as f, open(path, "rb") as g:
        f.seek(src_hdr.data_start + t.start)
        g.seek(out_hdr.data_start + o.start)
        assert f.read(t.nbytes) == g.read(o.nbytes), f"saved bytes differ for {t.name}"


@guarded
def bench_saves(paths, total, directory, to_disk, st_shm, st_disk):
    src = os.path.join(directory, "model.safetensors.index.json")
    shm = "/dev/shm/fh_save.safetensors"
    RESULTS["save"] = {}
    # raw pwrite ceilings into /dev/shm: fresh pages vs pages already touched once
    dt, bufs = raw_pwrite(shm + ".raw", total, 8, fresh=True)
    row("ceiling", "raw pwrite -> /dev/shm, 8 threads, fresh file", total, dt)
    dt2, _ = raw_pwrite(shm + ".raw", total, 8, pinned=bufs, fresh=False)
    row("ceiling", "raw pwrite -> /dev/shm, 8 threads, overwrite (pages exist)", total, dt2)
    os.unlink(shm + ".raw")
    dt3, _ = raw_pwrite(shm + ".raw", total, 8, pinned=bufs, fresh=True)
    row("ceiling", "raw pwrite -> /dev/shm, 8 threads, fresh file again (guest memory touched)", total, dt3)
    os.unlink(shm + ".raw")
    RESULTS["pwrite_shm"] = total / min(dt, dt3) / GB
    for wb in ("pwrite", "mmap"):
        r = run_save_child(src, shm, "fs", False, wb)
        RESULTS["save"][f"fs_shm_{wb}"] = row("save", f"foxhunt save_file -> /dev/shm, write_backend={wb}", total,
                                              r["seconds"], note=f"RSS +{r['rss_growth'] / 2**20:.0f} MiB")
        RESULTS["save"][f"fs_shm_{wb}_rss"] = r["rss_growth"]
        back = fs.read_header(shm)
        assert back.file_size == os.path.getsize(shm)
        if wb == "mmap":
            check_saved(shm, paths)
        os.unlink(shm)
    if st_shm:
        r = run_save_child(src, shm, "st", False)
        RESULTS["save"]["st_shm"] = row("save", "safetensors.torch.save_file -> /dev/shm", total, r["seconds"],
                                        note=f"RSS +{r['rss_growth'] / 2**20:.0f} MiB")
        os.unlink(shm)
    if to_disk:
        dpath = os.path.join(directory, "save_out.safetensors")
        dt, _ = raw_pwrite(dpath + ".raw", total, 8, pinned=bufs, fresh=True, fsync=True)
        os.unlink(dpath + ".raw")
        RESULTS["pwrite_disk"] = row("ceiling", "raw pwrite + fsync -> disk, 8 threads", total, dt)
        for wb in ("pwrite", "mmap"):
            r = run_save_child(src, dpath, "fs", True, wb)
            RESULTS["save"][f"fs_disk_{wb}"] = row("save", f"foxhunt save_file -> disk + fsync, write_backend={wb}",
                                                   total, r["seconds"], note=f"RSS +{r['rss_growth'] / 2**20:.0f} MiB")
            os.unlink(dpath)
        if st_disk:
            r = run_save_child(src, dpath, "st", True)
            RESULTS["save"]["st_disk"] = row("save", "safetensors.torch.save_file -> disk + fsync", total, r["seconds"],
                                             note=f"RSS +{r['rss_growth'] / 2**20:.0f} MiB")
            os.unlink(dpath)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=".bench")
    ap.add_argument("--size-gib", type=float, default=15)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--out", default="bench.json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--no-disk-save", action="store_true")
    ap.add_argument("--st-save", default="shm,disk")
    args = ap.parse_args()
    import cupy as cp
    import torch
    log(f"GPU {torch.cuda.get_device_name(0)}, cpus {os.cpu_count()}, torch {torch.__version__}, cupy {cp.__version__}")
    paths, total = build_checkpoint(args.dir, args.size_gib, args.shards)
    RESULTS.update(total_bytes=total, shards=len(paths), started=time.strftime("%Y-%m-%d %H:%M:%S"))
    ceiling_h2d_d2h(cp)
    ceiling_pagecache(cp, paths, total)
    bench_hot_loads(paths, total, args.dir, args.sweep)
    bench_ttft(paths, args.dir)
    bench_safetensors_hot(paths, total)
    if not args.no_verify:
        bench_verify(paths, total, args.dir)
    if not args.no_cold:
        ceiling_cold_read(paths, total)
        bench_cold_loads(paths, total, args.dir)
    if not args.no_save:
        bench_saves(paths, total, args.dir, not args.no_disk_save, "shm" in args.st_save, "disk" in args.st_save)
    with open(args.out, "w") as f:
        json.dump(RESULTS, f, indent=1)
    log("\n== summary ==")
    h2d = RESULTS.get("h2d")
    for k in ("h2d", "d2h", "pagecache", "cold_read", "fs_first", "fs_hot", "st_hot", "ttft_ms", "ttft_open_handle_ms",
              "verify_cost", "verify_cost_median", "verify_cost_read", "verify_cost_read_median", "fs_cold", "pwrite_shm",
              "pwrite_disk", "save", "sweep_best"):
        if k in RESULTS:
            log(f"{k:12s} {RESULTS[k]}")
    if h2d and RESULTS.get("fs_hot"):
        log(f"hot pt / h2d ceiling = {RESULTS['fs_hot']['pt'] / h2d:.2f}; vs safetensors = "
            f"{RESULTS['fs_hot']['pt'] / RESULTS.get('st_hot', float('nan')):.1f}x")
    if RESULTS["errors"]:
        log("ERRORS:", RESULTS["errors"])


if __name__ == "__main__":
    main()
