"""The built-in benchmark (``python -m foxhunt_stream bench``).

It measures, in one run and on the best device present (a CUDA GPU when cupy finds one, else
the CPU): the physical ceilings (host memcpy; page cache -> host or pinned buffers; on a GPU,
pinned host -> device copies; page-cache writes), foxhunt_stream's load and save, and
safetensors' (plus the peer loaders that happen to be installed, with ``peers=True``).
Each figure is the median of ``reps`` runs; GB/s = bytes / seconds / 1e9. With no source it
writes a synthetic bf16 checkpoint with Llama-like tensor shapes in a temporary directory.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from .. import __version__
from .. import settings as _settings
from ..io.checkpoint import Checkpoint, open_checkpoint
from ..cuda.devices import Device, check_device, cupy, parse_device
from ..format.dtypes import DTYPES
from ..engine.pipeline import Job
from ..engine.reshard import save_sharded
from ..engine.saver import split_shards
from ..io.sink import AtomicFile
from .main import fmt_bytes
from ..io.pagecache import resident_fraction
from ..io.source import FileSource

DEFAULT_SIZE = {"cpu": 1 << 30, "cuda": 8 << 30}   # GPU figures want >= 8 GiB (DESIGN.md)


# ---------------------------------------------------------------- results

@dataclass
class Row:
    group: str                 # "ceiling" | "load" | "save"
    name: str
    nbytes: int
    seconds: list[float] = field(default_factory=list)
    ceiling: str | None = None  # name of the ceiling row this one is compared with
    note: str = ""

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None

    @property
    def gbps(self) -> float | None:
        m = self.median_s
        return self.nbytes / m / 1e9 if m else None


@dataclass
class Report:
    device: str
    cache: str                 # "warm" or how caches were dropped
    reps: int
    threads: int
    checkpoint: dict[str, Any]
    versions: dict[str, str]
    machine: dict[str, Any]
    date: str
    rows: list[Row] = field(default_factory=list)

    def row(self, name: str) -> Row | None:
        return next((r for r in self.rows if r.name == name), None)

    def ratio(self, r: Row) -> float | None:
        c = self.row(r.ceiling) if r.ceiling else None
        if c is None or not c.gbps or not r.gbps:
            return None
        return r.gbps / c.gbps

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for d, r in zip(out["rows"], self.rows):
            d.update(median_s=r.median_s, gbps=r.gbps, ratio_to_ceiling=self.ratio(r))
        return out

    def table(self) -> str:
        ck = self.checkpoint
        lines = [f"foxhunt-stream {__version__} bench: {self.device}, "
                 f"{self.threads} threads, {self.cache} page cache, median of {self.reps}",
                 f"checkpoint: {ck['description']}, {fmt_bytes(ck['bytes'])} in {ck['tensors']} tensors, "
                 f"{ck['files']} file(s)", ""]
        width = max([len(r.name) for r in self.rows] + [20]) + 2
        lines.append(f"{'':{width}}{'GB/s':>8}  {'x ceiling':>9}  {'median s':>9}  note")
        titles = {"ceiling": "ceilings", "load": "load", "save": "save"}
        group = None
        for r in self.rows:
            if r.group != group:
                group = r.group
                lines.append(titles.get(group, group))
            g = f"{r.gbps:8.2f}" if r.gbps else f"{'-':>8}"
            ratio = self.ratio(r)
            x = f"{ratio:9.2f}" if ratio is not None else f"{'':9}"
            m = f"{r.median_s:9.3f}" if r.median_s is not None else f"{'-':>9}"
            lines.append(f"  {r.name:{width - 2}}{g}  {x}  {m}  {r.note}".rstrip())
        return "\n".join(lines)


# ---------------------------------------------------------------- the synthetic checkpoint

def llama_shapes(size_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of a Llama-like model of about ``size_bytes`` in bf16: the widest
    hidden size that still gives at least eight layers, grouped-query attention (kv = h/4),
    MLP width ~8h/3, as many layers as fit, and a vocabulary (32000 to 128256) filling the rest."""
    def layer_elems(h: int) -> int:
        inter = _inter(h)
        return h * h * 2 + 2 * (h // 4) * h + 3 * h * inter + 2 * h

    h = 64
    for cand in (8192, 4096, 2048, 1024, 512, 256, 128, 64):
        if 8 * 2 * layer_elems(cand) <= size_bytes:
            h = cand
            break
    vocab = max(64, min(32000, size_bytes // 8 // (2 * h) // 64 * 64))
    layers = max(1, (size_bytes - 2 * (2 * vocab * h) - 2 * h) // (2 * layer_elems(h)))
    # Then the vocabulary takes up the rest (up to Llama 3's 128256), to land close to the size asked.
    rest = size_bytes - layers * 2 * layer_elems(h) - 2 * h
    vocab = max(vocab, min(128256, rest // (4 * h) // 64 * 64))
    kv, inter = h // 4, _inter(h)
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def _inter(h: int) -> int:
    return -(-8 * h // 3 // 256) * 256 if h >= 256 else 8 * h // 3 // 8 * 8


def make_synthetic(directory: str, size_bytes: int, shards: int = 1, fsync: bool = False) -> str:
    """Write a synthetic bf16 checkpoint into ``directory`` (one shard at a time, so memory stays
    at one shard); returns the source to load (the file, or the directory when sharded)."""
    bf16 = DTYPES["BF16"]
    shapes = llama_shapes(size_bytes)
    sizes = [(n, 2 * math.prod(s)) for n, s in shapes]
    by_name = dict(shapes)
    pool = np.random.default_rng(0).integers(0, 1 << 16, size=8 << 20, dtype=np.uint16)
    limit = _shard_limit(sizes, shards)

    def make(shape: tuple[int, ...]) -> np.ndarray:
        # Random bits from a repeated random pool: realistic for I/O, cheap to make.
        out = np.empty(math.prod(shape), np.uint16)
        for off in range(0, out.size, pool.size):
            n = min(pool.size, out.size - off)
            out[off:off + n] = pool[:n]
        return out.reshape(shape).view(bf16.numpy)

    def fetch(names: list[str]) -> dict[str, np.ndarray]:
        return {n: make(by_name[n]) for n in names}

    written = save_sharded(sizes, fetch, directory, limit, {"format": "pt"}, fsync=fsync, progress=False)
    return written[0] if len(written) == 1 else directory


def _shard_limit(sizes: list[tuple[str, int]], shards: int) -> int:
    """The smallest round-ish max_shard_size that makes the greedy split give ``shards`` files."""
    limit = max(1, -(-sum(n for _, n in sizes) // max(1, shards)))
    while len(split_shards(sizes, limit)) > shards:
        limit += max(1, limit // 64)
    return limit


# ---------------------------------------------------------------- page cache

def drop_caches(paths: list[str]) -> str:
    """Evict ``paths`` from the page cache; returns how. First ``posix_fadvise(DONTNEED)`` per file
    (only these files; it drops clean pages, hence the fsync first); if pages stay resident and
    we are root, ``/proc/sys/vm/drop_caches`` (the whole machine's cache)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    method = "fadvise DONTNEED" if hasattr(os, "posix_fadvise") else "none"
    if max(resident_fraction(p) for p in paths) > 0.01 and hasattr(os, "geteuid") and os.geteuid() == 0:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            method = "drop_caches"
        except OSError:
            pass
    return method


def _warm(paths: list[str], chunk: int = 64 << 20) -> None:
    buf = np.empty(chunk, np.uint8)
    for p in paths:
        with FileSource(p) as src:
            size = src.size()
            for off in range(0, size, chunk):
                src.read_into(buf[:min(chunk, size - off)], off)


# ---------------------------------------------------------------- measurement helpers

def _measure(fn: Callable[[], Any], reps: int, before: Callable[[], None] | None = None,
             warmup: int = 0) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` (after ``warmup`` untimed ones); ``before``
    runs untimed ahead of every call (dropping caches); whatever ``fn`` returns is freed first."""
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


def _pieces(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, total - off)) for off in range(0, total, chunk)]


def _run_job(items, work, threads: int) -> None:
    Job(items, work, threads, name="foxhunt-bench").start().wait()


def memcpy_ceiling(nbytes: int, threads: int, reps: int, chunk: int) -> list[float]:
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    items = _pieces(nbytes, chunk)

    def work(worker, item):
        off, n = item
        np.copyto(dst[off:off + n], src[off:off + n])

    return _measure(lambda: _run_job(items, work, threads), reps, warmup=1)


def read_ceiling(paths: list[str], threads: int, reps: int, chunk: int, slots: list[np.ndarray],
                 before=None) -> tuple[list[float], int]:
    """Positional reads of whole files, each worker into its own reused buffer: what the page
    cache (or the disk, cold) gives, with no destination page faults."""
    sizes = [os.path.getsize(p) for p in paths]
    items = [(i, off, n) for i, size in enumerate(sizes) for off, n in _pieces(size, chunk)]

    def once():
        sources = [FileSource(p) for p in paths]
        try:
            _run_job(items, lambda w, it: sources[it[0]].read_into(slots[w][:it[2]], it[1]), threads)
        finally:
            for s in sources:
                s.close()

    return _measure(once, reps, before, warmup=0 if before else 1), sum(sizes)


def write_ceiling(directory: str, nbytes: int, threads: int, reps: int, chunk: int) -> list[float]:
    """Positional writes of ``nbytes`` into a new file (no fsync): page-cache write bandwidth."""
    bufs = [np.full(chunk, 7, np.uint8) for _ in range(threads)]
    items = _pieces(nbytes, chunk)
    path = os.path.join(directory, "bench-write-ceiling.bin")

    def once():
        sink = AtomicFile(path, nbytes, fsync=False)
        try:
            _run_job(items, lambda w, it: sink.write_at(bufs[w][:it[1]], it[0]), threads)
            sink.commit()
        except BaseException:
            sink.abort()
            raise

    try:
        return _measure(once, reps, lambda: _settle(path))
    finally:
        _settle(path)


def _settle(path: str) -> None:
    """Before a timed write: remove the last one's output and flush dirty pages, so the write
    pays neither for deleting its predecessor nor for its writeback."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.sync()


# ---------------------------------------------------------------- GPU pieces (cupy)

def pinned_buffer(cp, nbytes: int) -> np.ndarray:
    """Page-locked host memory as a numpy array (kept alive by the array's base)."""
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, np.uint8, nbytes)


def h2d_ceiling(cp, index: int, nbytes: int, reps: int) -> list[float]:
    """One cudaMemcpyAsync of ``nbytes`` from pinned memory, timed with CUDA events."""
    with cp.cuda.Device(index):
        host = pinned_buffer(cp, nbytes)
        host[:] = 1
        dst = cp.empty(nbytes, cp.uint8)
        stream = cp.cuda.Stream(non_blocking=True)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        rt = cp.cuda.runtime
        times = []
        for i in range(reps + 1):
            start.record(stream)
            rt.memcpyAsync(dst.data.ptr, host.ctypes.data, nbytes, rt.memcpyHostToDevice, stream.ptr)
            end.record(stream)
            end.synchronize()
            if i:
                times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        del dst
        return times


def _gpu_sync(device: Device) -> None:
    if device.is_cuda:
        cupy().cuda.Device(device.index).synchronize()


def _free_gpu(device: Device) -> None:
    if not device.is_cuda:
        return
    cp = cupy()
    cp.get_default_memory_pool().free_all_blocks()
    torch = _optional("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _optional(module: str):
    try:
        return importlib.import_module(module)
    except Exception:   # ImportError, or a broken install (missing shared library...)
        return None


def _torch_cuda(device: Device):
    """torch when it can reach ``device`` (a GPU); None on the CPU, so CPU runs never import it."""
    if not device.is_cuda:
        return None
    torch = _optional("torch")
    return torch if torch is not None and torch.cuda.is_available() else None


# ---------------------------------------------------------------- loaders under test

def _loaders(paths: list[str], source, device: Device, peers: bool) -> Iterator[tuple[str, Callable[[], Any], str]]:
    """(name, load function, note) for every loader runnable here; foxhunt_stream first."""
    import foxhunt_stream as fs
    dev = str(device)

    def fs_load():
        out = fs.load_file(source, device=dev, progress=False)
        _gpu_sync(device)
        return out

    yield "foxhunt_stream load_file", fs_load, ""
    torch = _torch_cuda(device)
    if device.is_cuda:
        if torch is not None and _optional("safetensors.torch") is not None:
            import safetensors.torch as stt

            def st_load():
                out = {}
                for p in paths:
                    out.update(stt.load_file(p, device=dev))
                torch.cuda.synchronize(device.index)
                return out
            yield f"safetensors.torch load_file ({dev})", st_load, ""
    elif _optional("safetensors.numpy") is not None:
        import safetensors.numpy as stn

        def st_load():
            out = {}
            for p in paths:
                out.update(stn.load_file(p))
            return out
        yield "safetensors.numpy load_file", st_load, ""
    if not peers:
        return
    if not device.is_cuda:
        torch = _optional("torch")
    if torch is None:   # every peer loader hands out torch tensors
        return

    def sync():
        if device.is_cuda:
            torch.cuda.synchronize(device.index)

    fst = _optional("fastsafetensors")
    if fst is not None:
        def fst_load():
            with fst.fastsafe_open(list(paths), framework="pt", device=dev, nogds=True) as f:
                out = {k: f.get_tensor(k) for k in f.keys()}
                sync()
            return out
        yield f"fastsafetensors {getattr(fst, '__version__', '')}".strip(), fst_load, "nogds"
    it = _optional("instanttensor")
    if it is not None and device.is_cuda:
        def it_load():
            with it.safe_open(list(paths), framework="pt", device=device.index) as f:
                out = dict(f.tensors())
                sync()
            return out
        yield "instanttensor", it_load, ""
    runai = _optional("runai_model_streamer")
    if runai is not None:
        def runai_load():
            with runai.SafetensorsStreamer() as s:
                s.stream_files(list(paths))
                out = {n: (t.to(dev) if device.is_cuda else t) for n, t in s.get_tensors()}
                sync()
            return out
        yield "runai_model_streamer", runai_load, "host ring, then .to(device)"


# ---------------------------------------------------------------- the run

@contextlib.contextmanager
def _workdir(parent: str | None) -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="foxhunt-bench-", dir=parent)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def pick_device(device: str | None) -> Device:
    """``None``/``"auto"``: cuda:0 when cupy and a CUDA device are present, else the CPU."""
    if device in (None, "auto"):
        try:
            dev = Device("cuda", 0)
            check_device(dev)
            return dev
        except Exception:   # DeviceError, or a broken CUDA install
            return Device("cpu")
    dev = parse_device(device)
    check_device(dev)
    return dev


def run(source=None, *, device: str | None = None, size: int | str | None = None, shards: int = 1,
        cold: bool = False, peers: bool = False, reps: int = 3, saves: bool = True, workdir: str | None = None,
        log: Callable[[str], None] | None = None, **options) -> Report:
    """Run the benchmark and return its Report (``Report.table()`` prints it). ``size`` (synthetic
    checkpoint only) defaults to 1 GiB on the CPU and 8 GiB on a GPU."""
    say = log or (lambda msg: None)
    dev = pick_device(device)
    s = _settings.merge(**options)
    threads, chunk = s.threads, s.chunk_bytes
    if reps < 1:
        raise ValueError("reps must be at least 1")
    with _workdir(workdir) as tmp, _settings.override(**options):
        if source is None:
            size_b = _settings.parse_size(size) if size is not None else DEFAULT_SIZE[dev.kind]
            say(f"writing a synthetic {fmt_bytes(size_b)} bf16 checkpoint in {tmp} ...")
            ckpt_dir = os.path.join(tmp, "ckpt")
            os.makedirs(ckpt_dir)
            source = make_synthetic(ckpt_dir, size_b, shards, fsync=cold)
            description = "synthetic Llama-like bf16"
        else:
            description = "given"
        ck = open_checkpoint(source)
        nbytes = sum(info.nbytes for _, info in ck.names.values())
        report = Report(device=str(dev), cache="warm", reps=reps, threads=threads,
                        checkpoint=dict(path=os.fspath(source), description=description, bytes=nbytes,
                                        tensors=len(ck.names), files=len(ck.paths),
                                        file_bytes=sum(h.file_size for h in ck.headers)),
                        versions={}, machine=_machine(dev),
                        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        before = None
        if cold:
            report.cache = "cold (" + drop_caches(ck.paths) + ")"
            before = lambda: drop_caches(ck.paths)   # noqa: E731
            say(f"{report.cache}: {100 * _resident(ck):.0f}% of the checkpoint still cached after a drop")
        else:
            _warm(ck.paths)
        load_ceiling = _ceilings(report, ck, dev, threads, chunk, reps, before, say)
        for name, fn, note in _loaders(ck.paths, source, dev, peers):
            say(f"measuring {name} ...")
            row = Row("load", name, nbytes, ceiling=load_ceiling, note=note)
            try:
                row.seconds = _measure(fn, reps, before, warmup=0 if cold else 1)
            except Exception as e:   # a peer that fails here is reported, not fatal
                if name.startswith("foxhunt_stream"):
                    raise
                row.note = f"failed: {type(e).__name__}: {e}"[:120]
            _free_gpu(dev)
            report.rows.append(row)
        if saves:
            save_ceiling = Row("ceiling", f"page cache write (pwrite, {threads} threads)", nbytes,
                               write_ceiling(tmp, nbytes, threads, reps, chunk))
            # Listed with the other ceilings, measured just before the saves (same page-cache state).
            report.rows.insert(sum(r.group == "ceiling" for r in report.rows), save_ceiling)
            _saves(report, source, dev, reps, tmp, nbytes, save_ceiling.name, say)
    report.versions = _versions()
    return report


def _resident(ck: Checkpoint) -> float:
    sizes = [h.file_size for h in ck.headers]
    return sum(resident_fraction(p) * n for p, n in zip(ck.paths, sizes)) / max(1, sum(sizes))


def _ceilings(report: Report, ck: Checkpoint, dev: Device, threads: int, chunk: int, reps: int, before,
              say) -> str:
    """Measure the load ceilings; returns the name of the one a load is compared with."""
    nbytes = report.checkpoint["bytes"]
    say("measuring ceilings ...")
    copy_bytes = max(chunk, min(nbytes, 256 << 20))
    report.rows.append(Row("ceiling", f"host memcpy ({threads} threads, {fmt_bytes(copy_bytes)})", copy_bytes,
                           memcpy_ceiling(copy_bytes, threads, reps, chunk)))
    if dev.is_cuda:
        cp = cupy()
        h2d_bytes = max(chunk, min(nbytes, 1 << 30))
        report.rows.append(Row("ceiling", f"pinned host -> {dev} (cudaMemcpyAsync, {fmt_bytes(h2d_bytes)})",
                               h2d_bytes, h2d_ceiling(cp, dev.index, h2d_bytes, reps)))
        with cp.cuda.Device(dev.index):
            slots = [pinned_buffer(cp, chunk) for _ in range(threads)]
        what = "page cache" if before is None else "disk"
        name = f"{what} -> pinned (preadv, {threads} threads)"
    else:
        slots = [np.ones(chunk, np.uint8) for _ in range(threads)]
        what = "page cache" if before is None else "disk"
        name = f"{what} -> host (preadv, {threads} threads)"
    seconds, file_bytes = read_ceiling(ck.paths, threads, reps, chunk, slots, before)
    read = Row("ceiling", name, file_bytes, seconds)
    report.rows.append(read)
    if dev.is_cuda:
        # A load to the GPU can go no faster than the slower of its two legs.
        h2d = report.rows[-2]
        if h2d.gbps and read.gbps and h2d.gbps < read.gbps:
            return h2d.name
    return read.name


def _saves(report: Report, source, dev: Device, reps: int, tmp: str, nbytes: int, ceiling: str, say) -> None:
    import foxhunt_stream as fs
    torch = _torch_cuda(dev)
    framework = "pt" if (dev.is_cuda and torch is not None) else None
    tensors = fs.load_file(source, device=str(dev), framework=framework, progress=False)
    out = os.path.join(tmp, "bench-save.safetensors")
    rows = [("foxhunt_stream save_file", lambda: fs.save_file(tensors, out, fsync=False, progress=False),
             "no fsync")]
    if dev.is_cuda:
        if torch is not None and _optional("safetensors.torch") is not None:
            import safetensors.torch as stt
            rows.append((f"safetensors.torch save_file (from {dev})", lambda: stt.save_file(tensors, out),
                         "no fsync"))
        elif framework is None:
            rows[0] = (rows[0][0], rows[0][1], "no fsync; cupy arrays (bf16 as U16)")
    elif _optional("safetensors.numpy") is not None:
        import safetensors.numpy as stn
        rows.append(("safetensors.numpy save_file", lambda: stn.save_file(tensors, out), "no fsync"))
    rows.append(("foxhunt_stream save_file (fsync)", lambda: fs.save_file(tensors, out, progress=False),
                 "fsync + rename"))
    for name, fn, note in rows:
        say(f"measuring {name} ...")
        report.rows.append(Row("save", name, nbytes, _measure(fn, reps, lambda: _settle(out)), ceiling=ceiling,
                               note=note))
    _settle(out)
    del tensors
    _free_gpu(dev)


def _versions() -> dict[str, str]:
    out = {"foxhunt_stream": __version__, "python": platform.python_version(), "numpy": np.__version__}
    for mod in ("safetensors", "torch", "cupy", "fastsafetensors", "instanttensor", "runai_model_streamer"):
        m = sys.modules.get(mod)
        if m is not None and getattr(m, "__version__", None):
            out[mod] = str(m.__version__)
    return out


def _machine(dev: Device) -> dict[str, Any]:
    out: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            out["mem_total_kb"] = int(f.readline().split()[1])
    if dev.is_cuda:
        with contextlib.suppress(Exception):
            props = cupy().cuda.runtime.getDeviceProperties(dev.index)
            name = props.get("name", b"")
            out["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
    return out


# ---------------------------------------------------------------- outputs

def write_json(report: Report, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2)
        f.write("\n")


def require_matplotlib():
    """matplotlib.pyplot on the non-interactive backend, or a RuntimeError saying how to get it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'foxhunt-stream[plot]'") from None
    return plt


def plot(report: Report, path: str) -> None:
    """A horizontal bar chart of every figure (matplotlib: the ``plot`` extra)."""
    plt = require_matplotlib()
    rows = [r for r in report.rows if r.gbps]
    colors = {"ceiling": "#9e9e9e"}
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    names = [r.name for r in rows][::-1]
    values = [r.gbps for r in rows][::-1]
    cols = [colors.get(r.group) or ("#2e7d32" if r.name.startswith("foxhunt_stream") else "#1565c0")
            for r in rows][::-1]
    bars = ax.barh(names, values, color=cols)
    for b, v in zip(bars, values):
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {v:.2f}", va="center", fontsize=8)
    ax.set_xlabel("GB/s (median)")
    ck = report.checkpoint
    ax.set_title(f"foxhunt-stream bench: {report.device}, {fmt_bytes(ck['bytes'])}, {report.cache} cache",
                 fontsize=10)
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
