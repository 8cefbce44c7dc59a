"""The built-in benchmark (``python -m foxhunt_stream bench``).

Measures this machine's ceilings (``ceilings``) and the loads and saves of foxhunt_stream and
safetensors (``peers=True``: other loaders too), each load in a new process (``fresh``), each figure
the median of ``reps`` runs beside the ceiling that does the same work. GB/s = bytes / s / 1e9.
Without a source it writes a synthetic bf16 checkpoint with Llama-like shapes.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import importlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from .. import __version__
from .. import settings as _settings
from ..cuda.devices import CPU, Device, check_device, cupy, parse_device
from ..io.checkpoint import Checkpoint, open_checkpoint
from . import ceilings as ce
from . import fresh
from .text import describe_error, fmt_bytes

DEFAULT_SIZE = {"cpu": 1 << 30, "cuda": 8 << 30}   # GPU figures want >= 8 GiB (DESIGN.md)
GPU_FIX = "pip install cupy-cuda13x (or cupy-cuda12x for a CUDA 12 driver)"
SAFETENSORS_HINT = "pip install safetensors (or the checkout's test extra: pip install -e '.[test]')"


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
    device_note: str = ""      # why a GPU this machine has is not used, or that it has none
    notes: list[str] = field(default_factory=list)   # comparisons left out, and how to get them

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
        return "\n".join(report_lines(self))


def report_lines(report: Report) -> list[str]:
    """The printed table: ceilings lettered [a], [b]...; each other figure with its ratio to one."""
    ck = report.checkpoint
    device = report.device + (f" ({report.device_note})" if report.device_note else "")
    lines = [f"foxhunt-stream {__version__} bench: {device}, {report.threads} threads, "
             f"{report.cache} page cache, median of {report.reps}",
             f"checkpoint: {ck['description']}, {fmt_bytes(ck['bytes'])} in {ck['tensors']} tensors, "
             f"{ck['files']} file(s)", ""]
    letters = {r.name: f"[{chr(ord('a') + i)}]" for i, r in enumerate(x for x in report.rows if x.group == "ceiling")}
    width = max([len(r.name) + 4 for r in report.rows] + [24]) + 2
    lines.append(f"{'':{width}}{'GB/s':>8}  {'x ceiling':>11}  {'median s':>9}  note")
    group = None
    for r in report.rows:
        if r.group != group:
            group = r.group
            lines.append("ceilings" if group == "ceiling" else group)
        name = f"{letters[r.name]} {r.name}" if r.name in letters else r.name
        g = f"{r.gbps:8.2f}" if r.gbps else f"{'-':>8}"
        ratio = report.ratio(r)
        x = f"{ratio:6.2f} {letters.get(r.ceiling or '', '')}" if ratio is not None else ""
        m = f"{r.median_s:9.3f}" if r.median_s is not None else f"{'-':>9}"
        lines.append(f"  {name:{width - 2}}{g}  {x:>11}  {m}  {r.note}".rstrip())
    lines += [f"note: {n}" for n in report.notes]
    return lines


# ---------------------------------------------------------------- the device and the optional packages

def optional(module: str):
    """The module, or None when it is absent or its install is broken (a missing shared library)."""
    try:
        return importlib.import_module(module)
    except Exception:
        return None


def torch_cuda(device: Device):
    """torch when it can reach ``device`` (a GPU); None on the CPU, so CPU runs never import it."""
    if not device.is_cuda:
        return None
    torch = optional("torch")
    return torch if torch is not None and torch.cuda.is_available() else None


def gpu_present() -> bool:
    """Whether the machine shows an NVIDIA GPU (driver files), whatever Python can reach."""
    return bool(glob.glob("/proc/driver/nvidia/gpus/*") or glob.glob("/dev/nvidia[0-9]*"))


def why_no_gpu(error: BaseException) -> str:
    """Why the GPU this machine shows cannot be used, and what fixes it."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return f"GPU not used: no GPU runtime (cupy is not installed): {GPU_FIX}"
    return f"GPU not used: {describe_error(error)}"


def pick_device(device: str | None) -> tuple[Device, str]:
    """The device to measure and a note on it (``None``/``"auto"``: cuda:0 if usable, else the CPU)."""
    if device in (None, "auto"):
        try:
            dev = Device("cuda", 0)
            check_device(dev)
            return dev, ""
        except Exception as e:   # DeviceError, or a broken CUDA install
            return CPU, why_no_gpu(e) if gpu_present() else "no GPU found"
    dev = parse_device(device)
    check_device(dev)
    return dev, ""


def _free_gpu(device: Device) -> None:
    if not device.is_cuda:
        return
    cupy().get_default_memory_pool().free_all_blocks()
    torch = torch_cuda(device)
    if torch is not None:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the run

@contextlib.contextmanager
def _workdir(parent: str | None) -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="foxhunt-bench-", dir=parent)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run(source=None, *, device: str | None = None, size: int | str | None = None, shards: int = 1,
        cold: bool = False, peers: bool = False, reps: int = 3, saves: bool = True, workdir: str | None = None,
        log: Callable[[str], None] | None = None, warn: Callable[[str], None] | None = None,
        **options) -> Report:
    """Run the benchmark and return its Report. ``size`` (synthetic checkpoint only): 1 GiB on the
    CPU, 8 GiB on a GPU by default. ``warn`` receives what must not be missed, ``log`` progress."""
    say = log or (lambda msg: None)
    alert = warn or (lambda msg: None)
    dev, device_note = pick_device(device)
    if device_note.startswith("GPU not used"):
        alert(device_note)
    s = _settings.merge(**options)
    if reps < 1:
        raise ValueError("reps must be at least 1")
    with _workdir(workdir) as tmp, _settings.override(**options):
        source, description = _source(source, tmp, dev, size, shards, cold, say)
        ck = open_checkpoint(source)
        report = _new_report(ck, source, description, dev, device_note, reps, s.threads)
        before = None
        if cold:
            report.cache = "cold (" + ce.drop_caches(ck.paths) + ")"
            before = lambda: ce.drop_caches(ck.paths)   # noqa: E731
            say(f"{report.cache}: {100 * ce.resident(ck.paths):.0f}% of the checkpoint still cached after a drop")
        else:
            ce.warm(ck.paths)
        _loads(report, ck, source, dev, peers, reps, before, s.chunk_bytes, say)
        if saves:
            _saves(report, source, dev, reps, tmp, s.chunk_bytes, say)
    for note in report.notes:
        alert(note)
    report.versions = _versions()
    return report


def _source(source, tmp: str, dev: Device, size, shards: int, cold: bool, say) -> tuple[Any, str]:
    if source is not None:
        return source, "given"
    size_b = _settings.parse_size(size) if size is not None else DEFAULT_SIZE[dev.kind]
    say(f"writing a synthetic {fmt_bytes(size_b)} bf16 checkpoint in {tmp} ...")
    ckpt_dir = os.path.join(tmp, "ckpt")
    os.makedirs(ckpt_dir)
    return ce.make_synthetic(ckpt_dir, size_b, shards, fsync=cold), "synthetic Llama-like bf16"


def _new_report(ck: Checkpoint, source, description: str, dev: Device, device_note: str, reps: int,
                threads: int) -> Report:
    nbytes = sum(info.nbytes for _, info in ck.names.values())
    return Report(device=str(dev), cache="warm", reps=reps, threads=threads,
                  checkpoint=dict(path=os.fspath(source), description=description, bytes=nbytes,
                                  tensors=len(ck.names), files=len(ck.paths),
                                  file_bytes=sum(h.file_size for h in ck.headers)),
                  versions={}, machine=_machine(dev), device_note=device_note,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _loads(report: Report, ck: Checkpoint, source, dev: Device, peers: bool, reps: int, before, chunk: int,
           say) -> None:
    """Every load in a new process (``fresh``): foxhunt_stream's first load and a second in the
    same process, then safetensors and, with ``peers``, the peer loaders installed here; the
    cases take turns within each rep."""
    ceiling = _load_ceilings(report, ck, dev, chunk, reps, before, say)
    nbytes = report.checkpoint["bytes"]
    cases = ["foxhunt", "safetensors"] + ([c for c in fresh.PEERS if c != "safetensors"] if peers and dev.is_cuda else [])
    absent = [c for c in cases[1:] if optional(c) is None]   # the children see what this process sees
    for c in absent:
        report.notes.append(f"safetensors is not installed: its comparison rows are left out ({SAFETENSORS_HINT})"
                            if c == "safetensors" else f"{c} is not installed")
    cases = [c for c in cases if c not in absent]
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    for r in range(reps):
        for case in cases[r % len(cases):] + cases[:r % len(cases)]:
            if before is not None:
                before()
            say(f"{case}, rep {r + 1} of {reps}, in a new process ...")
            runs[case].append(fresh.run(case, os.fspath(source), str(dev), list(ck.paths)))
    first = [x["seconds"] for x in runs["foxhunt"] if "seconds" in x]
    if not first:
        raise RuntimeError(f"foxhunt_stream's load failed: {runs['foxhunt'][0].get('error', '')}")
    report.rows.append(Row("load", "foxhunt_stream load_file, first load in a new process", nbytes, first,
                           ceiling=ceiling, note="the figure that counts: a server loads once per process"))
    report.rows.append(Row("load", "foxhunt_stream load_file, second load in that process", nbytes,
                           [x["second"] for x in runs["foxhunt"] if "second" in x], ceiling=ceiling))
    for case in cases[1:]:
        done = [x for x in runs[case] if "seconds" in x]
        skipped = next((x.get("skipped") or x.get("error") for x in runs[case] if "seconds" not in x), None)
        if not done:
            report.notes.append(f"{case} left out: {skipped}")
            continue
        version = next((x["version"] for x in done if x.get("version")), "")
        name = {"safetensors": "safetensors.torch load_file" if dev.is_cuda else "safetensors.numpy load_file",
                "instanttensor": "InstantTensor, buffered backend", "kvikio": "kvikio, raw file bytes",
                "fastsafetensors": "fastsafetensors, no GDS"}[case]
        report.rows.append(Row("load", f"{name} {version}".strip(), done[0].get("bytes", nbytes),
                               [x["seconds"] for x in done], ceiling=ceiling, note="first load in a new process"))


def _load_ceilings(report: Report, ck: Checkpoint, dev: Device, chunk: int, reps: int, before, say) -> str:
    """Measure the load ceilings; returns the name of the one a load is compared with."""
    nbytes, threads = report.checkpoint["bytes"], report.threads
    say("measuring ceilings ...")
    copy_bytes = max(chunk, min(nbytes, 256 << 20))
    report.rows.append(Row("ceiling", f"host memcpy ({threads} threads, {fmt_bytes(copy_bytes)})", copy_bytes,
                           ce.memcpy_ceiling(copy_bytes, threads, reps, chunk)))
    # cold: each file read as one sequential stream per thread, as a load reads a cold file
    what = "page cache" if before is None else "disk"
    how = f"preadv, {threads} threads" if before is None else f"preadv, {threads} threads, a stream each"
    h2d = None
    if dev.is_cuda:
        cp = cupy()
        h2d_bytes = max(chunk, min(nbytes, 1 << 30))
        h2d = Row("ceiling", f"pinned host -> {dev} (cudaMemcpyAsync, {fmt_bytes(h2d_bytes)})", h2d_bytes,
                  ce.copy_ceiling(cp, dev.index, h2d_bytes, reps))
        report.rows.append(h2d)
        with cp.cuda.Device(dev.index):
            slots = [ce.pinned_buffer(cp, chunk) for _ in range(threads)]
        name = f"{what} -> pinned ({how})"
    else:
        slots = [np.ones(chunk, np.uint8) for _ in range(threads)]
        name = f"{what} -> host ({how})"
    read = Row("ceiling", name, sum(h.file_size for h in ck.headers),
               ce.read_ceiling(ck.paths, threads, reps, chunk, slots, before,
                               streams=1 if before is None else threads))
    report.rows.append(read)
    # A load to the GPU can go no faster than the slower of its two legs.
    return h2d.name if h2d is not None and h2d.gbps and read.gbps and h2d.gbps < read.gbps else read.name


def _save_ceilings(report: Report, tmp: str, dev: Device, chunk: int, reps: int, say) -> tuple[str, str, str]:
    """The save ceilings' names for foxhunt_stream's save, safetensors' and foxhunt_stream's with fsync."""
    nbytes, threads = report.checkpoint["bytes"], report.threads
    say("measuring write ceilings ...")
    method = ce.write_method(tmp, nbytes, threads)

    def add(row: Row) -> Row:   # listed with the other ceilings
        report.rows.insert(sum(r.group == "ceiling" for r in report.rows), row)
        return row

    def write(m: str, fsync: bool) -> Row:
        what = "mapped copies" if m == "mapped" else "pwrite"
        times, who = ce.best_write_ceiling(tmp, nbytes, threads, reps, chunk, m, fsync)
        return add(Row("ceiling", f"new file, {what}{' + fsync' if fsync else ''} ({who})", nbytes, times))
    d2h = None
    if dev.is_cuda:
        d2h_bytes = max(chunk, min(nbytes, 1 << 30))
        d2h = add(Row("ceiling", f"{dev} -> pinned host (cudaMemcpyAsync, {fmt_bytes(d2h_bytes)})", d2h_bytes,
                      ce.copy_ceiling(cupy(), dev.index, d2h_bytes, reps, to_device=False)))

    def slower(row: Row) -> str:   # a save from a GPU can go no faster than the slower of its legs
        return d2h.name if d2h is not None and d2h.gbps and row.gbps and d2h.gbps < row.gbps else row.name
    plain = write("pwrite", False)
    return (slower(plain if method == "pwrite" else write(method, False)), slower(plain),
            slower(write(method, True)))


def _saves(report: Report, source, dev: Device, reps: int, tmp: str, chunk: int, say) -> None:
    import foxhunt_stream as fs
    torch = torch_cuda(dev)
    framework = "pt" if (dev.is_cuda and torch is not None) else None
    tensors = fs.load_file(source, device=str(dev), framework=framework, progress=False)
    fs_ceiling, st_ceiling, sync_ceiling = _save_ceilings(report, tmp, dev, chunk, reps, say)
    out = os.path.join(tmp, "bench-save.safetensors")
    note = "no fsync" + ("; cupy arrays (bf16 as U16)" if dev.is_cuda and framework is None else "")
    rows = [("foxhunt_stream save_file", lambda: fs.save_file(tensors, out, fsync=False, progress=False),
             fs_ceiling, note)]
    st = optional("safetensors.torch" if dev.is_cuda else "safetensors.numpy")
    if st is not None and (torch is not None or not dev.is_cuda):
        where = f" (from {dev})" if dev.is_cuda else ""
        rows.append((f"{st.__name__} save_file{where}", lambda: st.save_file(tensors, out), st_ceiling, "no fsync"))
    rows.append(("foxhunt_stream save_file (fsync)", lambda: fs.save_file(tensors, out, progress=False),
                 sync_ceiling, "fsync + rename"))
    nbytes = report.checkpoint["bytes"]
    for name, fn, ceiling, note in rows:
        say(f"measuring {name} ...")
        report.rows.append(Row("save", name, nbytes, ce.measure(fn, reps, lambda: ce.settle(out)), ceiling=ceiling,
                               note=note))
    ce.settle(out)
    tensors.clear()   # the rows' functions hold the dict: empty it to free the device memory
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
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
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
