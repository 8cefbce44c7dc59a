"""What this machine allows, measured in the same run as the figures it bounds (a threaded memcpy,
``preadv`` of whole files, new-file writes, pinned host <-> device copies), and the synthetic
checkpoint that the benchmarks load."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..engine.pipeline import Job
from ..format.plan import in_turn
from ..io.checkpoint import INDEX_NAME
from ..io.pagecache import resident_fraction
from ..io.sink import AtomicFile, copy_mapped
from ..io.source import stream_of

Shapes = list[tuple[str, tuple[int, ...]]]


# ---------------------------------------------------------------- the synthetic checkpoint

def decoder_shapes(hidden: int, intermediate: int, kv_dim: int, vocab: int, layers: int) -> Shapes:
    """Tensor names and shapes of a Llama-style decoder (the names transformers' Llama uses)."""
    h = hidden
    out: Shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv_dim, h)),
                (p + "self_attn.v_proj.weight", (kv_dim, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (intermediate, h)), (p + "mlp.up_proj.weight", (intermediate, h)),
                (p + "mlp.down_proj.weight", (h, intermediate)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def llama_shapes(size_bytes: int) -> Shapes:
    """A Llama-like model of about ``size_bytes`` in bf16: the widest hidden size that still gives
    at least eight layers, grouped-query attention (kv = h/4), MLP width ~8h/3, as many layers as
    fit, and a vocabulary (32000 to 128256) filling the rest."""
    def layer_elems(h: int) -> int:
        return h * h * 2 + 2 * (h // 4) * h + 3 * h * _inter(h) + 2 * h

    h = next((c for c in (8192, 4096, 2048, 1024, 512, 256, 128) if 8 * 2 * layer_elems(c) <= size_bytes), 64)
    vocab = max(64, min(32000, size_bytes // 8 // (2 * h) // 64 * 64))
    layers = max(1, (size_bytes - 2 * (2 * vocab * h) - 2 * h) // (2 * layer_elems(h)))
    # Then the vocabulary takes up the rest (up to Llama 3's 128256), to land close to the size asked.
    rest = size_bytes - layers * 2 * layer_elems(h) - 2 * h
    vocab = max(vocab, min(128256, rest // (4 * h) // 64 * 64))
    return decoder_shapes(h, _inter(h), h // 4, vocab, layers)


def _inter(h: int) -> int:
    return -(-8 * h // 3 // 256) * 256 if h >= 256 else 8 * h // 3 // 8 * 8


def split_evenly(sizes: Sequence[tuple[str, int]], parts: int) -> list[list[str]]:
    """Consecutive groups of about total/parts bytes (a tensor joins the group its middle falls
    in); no group is empty, so a tensor larger than a share can leave fewer than ``parts``."""
    total = max(1, sum(n for _, n in sizes))
    groups: list[list[str]] = [[] for _ in range(max(1, parts))]
    offset = 0
    for name, n in sizes:
        groups[min(len(groups) - 1, (offset + n // 2) * len(groups) // total)].append(name)
        offset += n
    return [g for g in groups if g]


def make_synthetic(directory: str, size_bytes: int | None = None, shards: int = 1, fsync: bool = False,
                   shapes: Shapes | None = None) -> str:
    """Write a synthetic bf16 checkpoint into ``directory``; returns the source to load (the file, or
    the directory when sharded). ``shapes``: (name, shape) pairs, by default ``llama_shapes(size_bytes)``;
    values are N(0, 0.02) draws from one pool each tensor views (memory: the largest tensor)."""
    from .. import save_file

    shapes = shapes if shapes is not None else llama_shapes(int(size_bytes or 0))
    by_name = dict(shapes)
    sizes = [(n, 2 * math.prod(s)) for n, s in shapes]
    groups = split_evenly(sizes, shards)
    pool = _value_pool(max(math.prod(s) for _, s in shapes))
    offsets = {n: (i * 4099) % _BLOCK for i, (n, _) in enumerate(shapes)}

    def view(name: str) -> np.ndarray:
        n = math.prod(by_name[name])
        return pool[offsets[name]:offsets[name] + n].reshape(by_name[name])

    names = ["model.safetensors"] if len(groups) == 1 else \
        [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    for group, fname in zip(groups, names):
        save_file({n: view(n) for n in group}, os.path.join(directory, fname), metadata={"format": "pt"},
                  fsync=fsync, progress=False)
    if len(groups) == 1:
        return os.path.join(directory, names[0])
    weight_map = {n: fname for group, fname in zip(groups, names) for n in group}
    with open(os.path.join(directory, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": sum(n for _, n in sizes)}, "weight_map": weight_map}, f, indent=2)
    return directory


_BLOCK = 8 << 20   # elements of random values, tiled


def _value_pool(elements: int) -> np.ndarray:
    import ml_dtypes
    block = (np.random.default_rng(0).standard_normal(_BLOCK, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    pool = np.empty(elements + _BLOCK, ml_dtypes.bfloat16)
    for off in range(0, pool.size, _BLOCK):
        n = min(_BLOCK, pool.size - off)
        pool[off:off + n] = block[:n]
    return pool


# ---------------------------------------------------------------- the page cache

def drop_caches(paths: Iterable[str] = (), whole_cache: bool = False) -> str:
    """Evict ``paths`` from the page cache and return how: ``fsync`` and
    ``posix_fadvise(DONTNEED)`` per file, then ``/proc/sys/vm/drop_caches`` (root only) when pages
    stayed resident, or always with ``whole_cache`` (PermissionError without root)."""
    paths = [os.fspath(p) for p in paths]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    method = "fadvise DONTNEED" if paths and hasattr(os, "posix_fadvise") else "none"
    stayed = bool(paths) and max(resident_fraction(p) for p in paths) > 0.01
    if whole_cache or (stayed and hasattr(os, "geteuid") and os.geteuid() == 0):
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            method = "drop_caches"
        except OSError as e:
            if whole_cache:
                raise PermissionError(f"dropping the whole page cache needs root and a writable "
                                      f"/proc/sys/vm/drop_caches ({e})") from None
    return method


def warm(paths: Iterable[str], threads: int = 8, chunk: int = 64 << 20) -> None:
    """Read every byte of ``paths`` once, so they are in the page cache."""
    paths = [os.fspath(p) for p in paths]
    read_ceiling(paths, threads, 1, chunk, [np.empty(chunk, np.uint8) for _ in range(threads)], warmup=0)


def resident(paths: Sequence[str]) -> float:
    """The fraction of the bytes of ``paths`` in the page cache (sampled with mincore)."""
    sizes = [os.path.getsize(p) for p in paths]
    return sum(resident_fraction(p) * n for p, n in zip(paths, sizes)) / max(1, sum(sizes))


# ---------------------------------------------------------------- measuring

def measure(fn: Callable[[], Any], reps: int, before: Callable[[], Any] | None = None,
            warmup: int = 0) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` (after ``warmup`` untimed ones), ``before`` run
    untimed ahead of every call."""
    times = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        del out
        if i >= warmup:
            times.append(t1 - t0)
    return times


def parallel(items: Sequence[Any], work: Callable[[int, Any], None], threads: int) -> None:
    """``work(worker, item)`` for every item on ``threads`` worker threads (a ``pipeline.Job``),
    each taking the next item as it finishes one; the first error is raised once all have stopped."""
    Job(items, work, max(1, threads), name="foxhunt-ceiling").start().wait()


def pieces(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, total - off)) for off in range(0, total, chunk)]


# ---------------------------------------------------------------- host ceilings

def memcpy_ceiling(nbytes: int, threads: int, reps: int, chunk: int) -> list[float]:
    """Copies between two anonymous buffers of ``nbytes`` by ``threads`` threads."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    items = pieces(nbytes, chunk)

    def work(worker: int, item: tuple[int, int]) -> None:
        off, n = item
        np.copyto(dst[off:off + n], src[off:off + n])

    return measure(lambda: parallel(items, work, threads), reps, warmup=1)


def read_ceiling(paths: Sequence[str], threads: int, reps: int, chunk: int, slots: Sequence[np.ndarray],
                 before: Callable[[], Any] | None = None, warmup: int | None = None, streams: int = 1) -> list[float]:
    """``preadv`` of every byte of ``paths``, each worker into its own reused buffer (``slots``:
    pinned ones for a GPU); one untimed warm-up unless ``before`` drops the cache. ``streams``:
    each file read as that many stretches, a descriptor each, taken in turn (as a cold load)."""
    streams = max(1, streams)
    items = []
    for p in paths:
        size = os.path.getsize(p)
        parts: list[list] = [[] for _ in range(streams)]
        for off, n in pieces(size, chunk):
            k = stream_of(off, size, streams)
            parts[k].append((p, k, off, n))
        items += in_turn(parts)

    def once() -> None:
        fds = {(p, k): os.open(p, os.O_RDONLY) for p in paths for k in range(streams)}
        try:
            parallel(items, lambda w, it: _read_all(fds[it[0], it[1]], slots[w][:it[3]], it[2]), threads)
        finally:
            for fd in fds.values():
                os.close(fd)

    return measure(once, reps, before, warmup=(0 if before else 1) if warmup is None else warmup)


def _read_all(fd: int, buf: np.ndarray, offset: int) -> None:
    view, done = memoryview(buf), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read at offset {offset + done}")
        done += n


WRITE_METHODS = ("pwrite", "mapped")


def write_method(directory: str, nbytes: int, threads: int) -> str:
    """How ``save_file`` writes ``nbytes`` into ``directory`` with ``threads``: "mapped" or "pwrite"."""
    sink = AtomicFile(os.path.join(directory, "write-method-probe"), nbytes, fsync=False, writers=threads)
    try:
        return "mapped" if sink.backend == "mmap" else "pwrite"
    finally:
        sink.abort()


def write_ceiling(directory: str, nbytes: int, threads: int, reps: int, chunk: int, method: str = "pwrite",
                  fsync: bool = False) -> list[float]:
    """A new file of ``nbytes`` written by ``threads`` threads from reused buffers (``pwrite``, or
    copies into a mapping of each chunk's window), then ``fsync`` if asked; each run ``settle``d."""
    if method not in WRITE_METHODS:
        raise ValueError(f"write method must be one of {WRITE_METHODS}, got {method!r}")
    bufs = [np.full(chunk, 7, np.uint8) for _ in range(threads)]
    items = pieces(nbytes, chunk)
    path = os.path.join(directory, f"ceiling-{method}.bin")

    def once() -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if method == "mapped":
                os.posix_fallocate(fd, 0, nbytes)
                parallel(items, lambda w, it: copy_mapped(fd, bufs[w][:it[1]], it[0]), threads)
            else:
                os.ftruncate(fd, nbytes)
                parallel(items, lambda w, it: os.pwrite(fd, bufs[w][:it[1]], it[0]), threads)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    try:
        return measure(once, reps, lambda: settle(path))
    finally:
        settle(path)


def writer_counts(threads: int, method: str) -> list[int]:
    """The writer counts a write ceiling tries (pwrite: 1 and ``threads``; mapped: ``threads``, half and
    a quarter): the kernel serializes writes to one file, so fewer writers can be faster."""
    if method == "pwrite":
        return sorted({1, threads})
    return sorted({threads, max(1, threads // 2), max(1, threads // 4)})


def best_write_ceiling(directory: str, nbytes: int, threads: int, reps: int, chunk: int, method: str = "pwrite",
                       fsync: bool = False) -> tuple[list[float], str]:
    """``write_ceiling`` by each of ``writer_counts``: the fastest's times, and who wrote them."""
    def median(t: list[float]) -> float:
        return sorted(t)[len(t) // 2]
    counts = writer_counts(threads, method)
    runs = {n: write_ceiling(directory, nbytes, n, reps, chunk, method, fsync) for n in counts}
    best = min(counts, key=lambda n: median(runs[n]))
    who = f"{best} thread{'s' if best > 1 else ''}"
    return runs[best], who if len(counts) == 1 else f"{who}, the best of {', '.join(map(str, counts))}"


def settle(path: str) -> None:
    """Before a timed write: remove the last one's output and flush dirty pages, so the write
    pays neither for deleting its predecessor nor for anyone's writeback."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.sync()


# ---------------------------------------------------------------- GPU ceilings (cupy)

def pinned_buffer(cp, nbytes: int) -> np.ndarray:
    """Page-locked host memory as a numpy array (kept alive by the array's base)."""
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, np.uint8, nbytes)


def copy_ceiling(cp, index: int, nbytes: int, reps: int, to_device: bool = True) -> list[float]:
    """One ``cudaMemcpyAsync`` of ``nbytes`` between pinned host memory and GPU ``index``
    (host -> device, or back), timed with CUDA events; one untimed copy first."""
    with cp.cuda.Device(index):
        host = pinned_buffer(cp, nbytes)
        host[:] = 1
        dev = cp.empty(nbytes, cp.uint8)
        stream = cp.cuda.Stream(non_blocking=True)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        rt = cp.cuda.runtime
        dst, src, kind = ((dev.data.ptr, host.ctypes.data, rt.memcpyHostToDevice) if to_device
                          else (host.ctypes.data, dev.data.ptr, rt.memcpyDeviceToHost))
        times = []
        for i in range(reps + 1):
            start.record(stream)
            rt.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
            end.record(stream)
            end.synchronize()
            if i:
                times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        del dev
        return times
