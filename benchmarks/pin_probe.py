#!/usr/bin/env python
"""How fast a fresh process can get pinned staging memory, and what else a first load pays once.

    python3 benchmarks/pin_probe.py [--out DIR]        # on a GPU machine, with torch (CUDA build)

Each variant runs in a new process (torch imported and its CUDA context made first, untimed):

- ``hostalloc_slots``: 32 ``cudaHostAlloc`` calls of 8 MiB, one after the other;
- ``hostalloc_big``: one ``cudaHostAlloc`` of 256 MiB;
- ``hostalloc_parallel``: 16 threads, each two ``cudaHostAlloc`` calls of 8 MiB;
- ``register_4k`` / ``register_thp``: one anonymous mapping of 256 MiB (4 KiB pages, or
  ``MADV_HUGEPAGE`` on a 2 MiB-aligned mapping), then one ``cudaHostRegister`` of all of it;
- ``register_thp_slots``: the same mapping, one ``cudaHostRegister`` per 8 MiB slot in turn;
- ``register_thp_parallel`` / ``register_4k_parallel``: 16 threads, each registering its 16 MiB;
- ``touch_thp_parallel``: 16 threads, each touching its 16 MiB (``memset``) and then registering it;
- ``populate_thp_parallel``: the same, faulting in by ``madvise(MADV_POPULATE_WRITE)`` instead.

While the threads of a parallel variant run, the main thread maps and unmaps 64 KiB over and over
(as a loader's allocations and imports do beside the pinning) and reports how long each took.

Then, from the memory each variant made, 1 GiB of host -> device copies in 4 MiB pieces on one
stream (GB/s): pinned memory made either way must copy as fast. A last child times the imports
a first load pays (``import foxhunt_stream`` with ``fs.load_file``; ``ml_dtypes``; cupy's lone
runtime module; binding the CUDA runtime torch loaded through ctypes).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time

SLOT = 8 << 20
SLOTS = 32
THREADS = 16
HUGE = 2 << 20
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 14, 15, 23
VARIANTS = ("hostalloc_slots", "hostalloc_big", "hostalloc_parallel", "register_4k", "register_thp",
            "register_thp_slots", "register_thp_parallel", "register_4k_parallel", "touch_thp_parallel",
            "populate_thp_parallel")


def _cudart():
    with open("/proc/self/maps") as f:
        paths = [line.split()[-1] for line in f if "libcudart" in line and line.split()[-1].startswith("/")]
    lib = ctypes.CDLL(paths[0])
    for name, args in (("cudaHostAlloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]),
                       ("cudaHostRegister", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]),
                       ("cudaMalloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]),
                       ("cudaMemcpyAsync", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                            ctypes.c_void_p]),
                       ("cudaStreamCreateWithFlags", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
                       ("cudaStreamSynchronize", [ctypes.c_void_p])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, args
    return lib


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.memset.restype = ctypes.c_void_p
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return libc


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what} failed: cudaError {rc}")


def _anon(nbytes: int, huge: bool) -> int:
    libc = _libc()
    addr = libc.mmap(None, nbytes + HUGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                     -1, 0)
    base = addr + (-addr) % HUGE
    libc.madvise(base, nbytes, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    return base


def _parallel(work, out: dict) -> None:
    """``work(w)`` on THREADS threads; the main thread's mmap + munmap latencies beside them."""
    times = [0.0] * THREADS
    def run(w):
        t = time.perf_counter()
        work(w)
        times[w] = time.perf_counter() - t
    ts = [threading.Thread(target=run, args=(w,)) for w in range(THREADS)]
    for t in ts:
        t.start()
    libc, lat = _libc(), []
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    while any(t.is_alive() for t in ts):
        t = time.perf_counter()
        libc.munmap(libc.mmap(None, 1 << 16, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0), 1 << 16)
        lat.append(time.perf_counter() - t)
    for t in ts:
        t.join()
    lat.sort()
    out["thread_s"] = times
    out["mmap_beside_us"] = {"n": len(lat), "median": lat[len(lat) // 2] * 1e6, "max": lat[-1] * 1e6} if lat else {}


def variant(name: str) -> dict:
    import torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    rt = _cudart()
    total = SLOT * SLOTS
    out: dict = {"variant": name}
    t0 = time.perf_counter()
    slots: list[int] = []
    if name == "hostalloc_slots":
        for _ in range(SLOTS):
            p = ctypes.c_void_p()
            _check(rt.cudaHostAlloc(ctypes.byref(p), SLOT, 1), "cudaHostAlloc")
            slots.append(p.value)
            out.setdefault("first_slot_s", time.perf_counter() - t0)
    elif name == "hostalloc_big":
        p = ctypes.c_void_p()
        _check(rt.cudaHostAlloc(ctypes.byref(p), total, 1), "cudaHostAlloc")
        slots = [p.value + i * SLOT for i in range(SLOTS)]
    elif name == "hostalloc_parallel":
        got = [[] for _ in range(THREADS)]
        def work(w):
            for _ in range(SLOTS // THREADS):
                p = ctypes.c_void_p()
                _check(rt.cudaHostAlloc(ctypes.byref(p), SLOT, 1), "cudaHostAlloc")
                got[w].append(p.value)
        _parallel(work, out)
        slots = [p for g in got for p in g]
    else:
        base = _anon(total, huge="thp" in name)
        slots = [base + i * SLOT for i in range(SLOTS)]
        per = total // THREADS
        if name in ("register_4k", "register_thp"):
            _check(rt.cudaHostRegister(base, total, 1), "cudaHostRegister")
        elif name == "register_thp_slots":
            for i, s in enumerate(slots):
                _check(rt.cudaHostRegister(s, SLOT, 1), "cudaHostRegister")
                if i == 0:
                    out["first_slot_s"] = time.perf_counter() - t0
        else:
            libc = _libc()
            def work(w):
                if name.startswith("touch"):
                    libc.memset(base + w * per, 0, per)
                elif name.startswith("populate") and libc.madvise(base + w * per, per, MADV_POPULATE_WRITE):
                    raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE failed")
                _check(rt.cudaHostRegister(base + w * per, per, 1), "cudaHostRegister")
            _parallel(work, out)
    out["pin_s"] = time.perf_counter() - t0
    out["pin_gbps"] = total / out["pin_s"] / 1e9
    # 1 GiB of 4 MiB host -> device copies out of the slots, one stream
    dev, stream = ctypes.c_void_p(), ctypes.c_void_p()
    _check(rt.cudaMalloc(ctypes.byref(dev), total), "cudaMalloc")
    _check(rt.cudaStreamCreateWithFlags(ctypes.byref(stream), 1), "cudaStreamCreate")
    piece = 4 << 20
    for rep in range(2):
        t = time.perf_counter()
        for _ in range(4):
            for i in range(total // piece):
                src = slots[i * piece // SLOT] + (i * piece) % SLOT
                _check(rt.cudaMemcpyAsync(dev.value + i * piece, src, piece, 1, stream), "cudaMemcpyAsync")
        _check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        out["h2d_gbps"] = 4 * total / (time.perf_counter() - t) / 1e9
    return out


def floor(staging: str, ckpt: str) -> dict:
    """A bare pipeline's first load in this fresh process: headers read, 291 torch tensors made,
    16 threads each with two 8 MiB slots (``staging``: cudaHostAlloc, or a registered huge-page
    mapping) reading 4 MiB pieces with preadv, one async copy and one event per piece."""
    import glob
    import itertools
    import torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rt = _cudart()
    for name, args in (("cudaEventCreateWithFlags", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
                       ("cudaEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
                       ("cudaEventSynchronize", [ctypes.c_void_p])):
        fn = getattr(rt, name)
        fn.restype, fn.argtypes = ctypes.c_int, args
    files = sorted(glob.glob(os.path.join(ckpt, "*.safetensors")))
    chunks, tensors, total = [], [], 0
    for fi, p in enumerate(files):
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            lo, hi = e["data_offsets"]
            t = torch.empty(hi - lo, dtype=torch.uint8, device="cuda")
            tensors.append(t)
            for off in range(0, hi - lo, 4 << 20):
                chunks.append((fi, 8 + n + lo + off, min(4 << 20, hi - lo - off), t.data_ptr() + off))
            total += hi - lo
    fds = [os.open(p, os.O_RDONLY) for p in files]
    t_setup = time.perf_counter() - t0
    claim = itertools.count()
    first_copy = []

    def work(w):
        if staging == "hostalloc":
            slots = []
            for _ in range(2):
                p = ctypes.c_void_p()
                _check(rt.cudaHostAlloc(ctypes.byref(p), SLOT, 1), "cudaHostAlloc")
                slots.append(p.value)
        else:
            base = _anon(2 * SLOT, huge=True)
            _check(rt.cudaHostRegister(base, 2 * SLOT, 1), "cudaHostRegister")
            slots = [base, base + SLOT]
        views = [memoryview((ctypes.c_ubyte * SLOT).from_address(s)).cast("B") for s in slots]
        stream, events = ctypes.c_void_p(), [ctypes.c_void_p(), ctypes.c_void_p()]
        _check(rt.cudaStreamCreateWithFlags(ctypes.byref(stream), 1), "stream")
        for e in events:
            _check(rt.cudaEventCreateWithFlags(ctypes.byref(e), 2), "event")
        pending = [False, False]
        k = 0
        for i in claim:
            if i >= len(chunks):
                break
            fi, off, nb, dst = chunks[i]
            if pending[k]:
                rt.cudaEventSynchronize(events[k])
            got = os.preadv(fds[fi], [views[k][:nb]], off)
            assert got == nb
            rt.cudaMemcpyAsync(dst, slots[k], nb, 1, stream)
            rt.cudaEventRecord(events[k], stream)
            if not first_copy:
                first_copy.append(time.perf_counter() - t0)
            pending[k] = True
            k ^= 1
        rt.cudaStreamSynchronize(stream)

    ts = [threading.Thread(target=work, args=(w,)) for w in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"floor": staging, "seconds": seconds, "GBps": total / seconds / 1e9, "setup_s": t_setup,
            "first_copy_s": first_copy[0] if first_copy else None}


def imports() -> dict:
    import torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    out = {}
    t = time.perf_counter()
    import foxhunt_stream as fs
    fs.load_file   # noqa: B018 - the lazy import a first load pays
    out["import foxhunt_stream + load_file"] = time.perf_counter() - t
    out["ml_dtypes already imported by then"] = "ml_dtypes" in sys.modules
    t = time.perf_counter()
    try:
        from cupy_backends.cuda.api import runtime  # noqa: F401
        out["import cupy_backends.cuda.api.runtime"] = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001
        out["import cupy_backends.cuda.api.runtime"] = repr(e)
    t = time.perf_counter()
    from foxhunt_stream.cuda import libcudart
    lib = libcudart.open_loaded()
    out["bind torch's libcudart (ctypes)"] = time.perf_counter() - t
    out["libcudart path"] = lib.path if lib else None
    return out


def lone(module: str) -> dict:
    t = time.perf_counter()
    __import__(module)
    return {f"import {module} (fresh process)": time.perf_counter() - t}


def child(args: list[str]) -> dict:
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode or not lines:
        return {"args": args, "error": (r.stderr or r.stdout)[-800:]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ckpt", default=None, help="a checkpoint directory in the page cache: also time a bare "
                                                 "pipeline's first load with each kind of staging")
    ap.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        print(json.dumps({"variant": variant, "imports": imports, "lone": lone, "floor": floor}[kind](*rest)), flush=True)
        return
    results: dict = {"thp": {}, "kernel": os.uname().release}
    for f in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{f}") as fh:
                results["thp"][f] = fh.read().strip()
        except OSError as e:
            results["thp"][f] = repr(e)
    runs = []
    for r in range(a.rounds):
        for v in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
            runs.append(child(["--child", "variant", v]))
            print(json.dumps(runs[-1]), flush=True)
    results["variants"] = runs
    if a.ckpt:
        results["floor"] = []
        for r in range(3):
            for staging in (("hostalloc", "register_thp") if r % 2 == 0 else ("register_thp", "hostalloc")):
                results["floor"].append(child(["--child", "floor", staging, a.ckpt]))
                print(json.dumps(results["floor"][-1]), flush=True)
    results["imports"] = [child(["--child", "imports"]) for _ in range(2)]
    results["lone"] = [child(["--child", "lone", m]) for m in ("ml_dtypes", "numpy", "cupy_backends.cuda.api.runtime")]
    print(json.dumps(results["thp"]), results["kernel"])
    for x in results["imports"] + results["lone"]:
        print(json.dumps(x))
    print(f"{'variant':24} {'pin s':>8} {'GB/s':>7} {'first slot s':>12} {'H2D GB/s':>9} {'mmap beside: median, max us':>28}")
    for x in runs:
        if "error" in x:
            print(x["args"], x["error"][-300:])
            continue
        m = x.get("mmap_beside_us", {})
        print(f"{x['variant']:24} {x['pin_s']:8.4f} {x['pin_gbps']:7.2f} {x.get('first_slot_s', float('nan')):12.4f} "
              f"{x['h2d_gbps']:9.2f} {m.get('median', float('nan')):14.1f} {m.get('max', float('nan')):12.1f}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "pin_probe.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
