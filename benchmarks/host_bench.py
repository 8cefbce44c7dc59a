"""Host (CPU, numpy) benchmark: foxhunt_stream against safetensors.numpy, load and save, page cache.

Builds a Llama-shaped float16 checkpoint of --bytes in memory (float16, because
safetensors.numpy cannot load bf16), writes it with the reference serializer, and measures in
the same run, interleaving the contenders round by round so that both see the same machine:

  ceiling  raw preadv of the file (page cache -> memory, same threads) into one reused buffer and
           into a freshly allocated one (what any loader that returns new arrays pays: page faults);
           raw pwrite of the same bytes into a new file (memory -> page cache, no fsync)
  load     fs.load_file(path)  vs  safetensors.numpy.load_file(path)   (file in page cache)
  save     fs.save_file(t, p, fsync=False)  vs  safetensors.numpy.save_file(t, p)  (neither syncs),
           into a new path and over an existing file;
           fs.save_file(t, p) (fsync + rename)  vs  safetensors.numpy.save_file + os.fsync
  backend  fs.save_file(fsync=False) with write_backend "mmap" and "pwrite" forced, into --dir and
           into /dev/shm (when it is a tmpfs with room)
  memory   peak RSS growth of each save, in a fresh subprocess (VmHWM after - VmRSS before)

Each save round starts after ``os.sync()`` (and, for "new path", with nothing at the path), so no
round pays for the previous round's writeback. Prints a Markdown table.

    python benchmarks/host_bench.py --bytes 2GiB --dir /tmp --rounds 5 [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common  # noqa: E402  (puts the repository on the path)
import safetensors.numpy as stn  # noqa: E402

import foxhunt_stream as fs  # noqa: E402
from foxhunt_stream.settings import parse_size  # noqa: E402


def make_tensors(nbytes: int) -> dict[str, np.ndarray]:
    """Llama-shaped float16 layers (attention, MLP, norms) plus an embedding that makes up the
    rest, about ``nbytes`` in all. Contents are constant per tensor: speed does not depend on them."""
    hidden = 4096 if nbytes >= 1 << 30 else 1024
    inter = hidden * 11008 // 4096
    shapes: list[tuple[str, tuple[int, ...]]] = []
    layer = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    n_layers = max(1, nbytes // layer)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes += [(p + f"self_attn.{w}_proj.weight", (hidden, hidden)) for w in "qkvo"]
        shapes += [(p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter)),
                   (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    rest = nbytes - n_layers * layer
    if rest >= 2 * hidden:
        shapes.append(("model.embed_tokens.weight", (rest // (2 * hidden), hidden)))
    return {name: np.full(shape, i % 251, np.float16) for i, (name, shape) in enumerate(shapes)}


def nbytes_of(tensors) -> int:
    return sum(a.nbytes for a in tensors.values())


def fresh_path(directory: str, name: str) -> str:
    """A path with nothing at it, after flushing dirty pages: each save round starts alike."""
    path = os.path.join(directory, name)
    if os.path.exists(path):
        os.unlink(path)
    os.sync()
    return path


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str, buf: np.ndarray, threads: int, chunk: int = 16 << 20) -> None:
    """preadv of the whole file into ``buf`` by ``threads`` threads, ``chunk`` bytes at a time."""
    fd = os.open(path, os.O_RDONLY)
    size = buf.nbytes
    mv = memoryview(buf).cast("B")
    offsets = iter(range(0, size, chunk))
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                off = next(offsets, None)
            if off is None:
                return
            os.preadv(fd, [mv[off:off + chunk]], off)
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os.close(fd)


def raw_write(path: str, tensors, threads: int) -> None:
    """pwrite of every tensor's bytes, back to back, by ``threads`` threads (no header, no fsync)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    jobs, pos = [], 0
    for a in tensors.values():
        jobs.append((a.reshape(-1).view(np.uint8), pos))
        pos += a.nbytes
    it = iter(jobs)
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            os.pwrite(fd, job[0], job[1])
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os.close(fd)


def _tmpfs_with_room(path: str, nbytes: int) -> bool:
    if not os.path.isdir(path) or common.filesystem(path) not in ("tmpfs", "ramfs"):
        return False
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize > nbytes


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(contenders: dict, rounds: int, setup=None) -> dict[str, list[float]]:
    """Seconds per round for each contender, taking turns (A B A B ...) so drift hits both."""
    out: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(rounds):
        order = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        for name in order:
            if setup is not None:
                setup()
            out[name].append(timed(contenders[name]))
    return out


# ------------------------------------------------------------------ peak RSS of a save, in a fresh process

def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def rss_child(lib: str, nbytes: int, path: str) -> None:
    tensors = make_tensors(nbytes)
    warm = {"w": np.ones((64, 64), np.float16)}
    (fs.save_file if lib == "foxhunt" else stn.save_file)(warm, path)     # imports, threads
    os.unlink(path)
    before = _status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                                  # reset VmHWM
    except OSError:
        pass
    if lib == "foxhunt":
        fs.save_file(tensors, path)
    else:
        stn.save_file(tensors, path)
    print(nbytes_of(tensors), _status("VmHWM") - before)


def rss_growth(lib: str, nbytes: int, path: str) -> tuple[int, int]:
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-child", lib, "--bytes", str(nbytes),
                        "--path", path], capture_output=True, text=True, check=True)
    total, growth = map(int, r.stdout.split())
    if os.path.exists(path):
        os.unlink(path)
    return total, growth


# ------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", default="2GiB", help="checkpoint size (default 2GiB)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go (default: the temp dir)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rss-child", choices=["foxhunt", "safetensors"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="folder for host.json and host.txt")
    args = ap.parse_args()
    nbytes = parse_size(args.bytes)
    if args.rss_child:
        rss_child(args.rss_child, nbytes, args.path)
        return

    work = tempfile.mkdtemp(prefix="foxhunt-host-bench-", dir=args.dir)
    res = common.Results("host", args.out)
    try:
        run(nbytes, work, args.rounds, res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res.save()


def run(nbytes: int, work: str, rounds: int, res: common.Results) -> None:
    threads = fs.settings.merge().threads
    tensors = make_tensors(nbytes)
    total = nbytes_of(tensors)
    n_tensors = len(tensors)
    src = os.path.join(work, "model.safetensors")
    stn.save_file(tensors, src)
    file_size = os.path.getsize(src)
    load_start = os.getloadavg()[0]
    print(f"# {total / 2**30:.2f} GiB in {n_tensors} float16 tensors, {threads} threads, {rounds} rounds, "
          f"load average {load_start:.1f}", flush=True)
    buf = np.empty(file_size, np.uint8)
    raw_read(src, buf, threads)                          # page cache warm, buffer faulted in

    rows: list[tuple[str, str, list[float], float | None]] = []

    def add(section, what, seconds, ref=None):
        ratio = statistics.median(ref) / statistics.median(seconds) if ref else None
        rows.append((section, what, seconds, ratio))
        gbps = sorted(total / x / 1e9 for x in seconds)
        print(f"  {section:8s} {what:52s} {statistics.median(gbps):6.2f} GB/s  [{gbps[0]:.2f}-{gbps[-1]:.2f}]"
              + (f"  x{ratio:.2f}" if ratio else ""), flush=True)

    # load from page cache; every contender allocates its result, the ceilings show what that costs
    keep = {}
    r = interleaved({"reused": lambda: raw_read(src, buf, threads),
                     "fresh": lambda: raw_read(src, np.empty(file_size, np.uint8), threads),
                     "foxhunt": lambda: keep.update(a=fs.load_file(src)),
                     "safetensors": lambda: keep.update(a=stn.load_file(src))}, rounds, setup=keep.clear)
    del buf
    add("ceiling", f"raw preadv into a reused buffer ({threads} threads)", r["reused"])
    add("ceiling", f"raw preadv into a fresh buffer ({threads} threads)", r["fresh"])
    add("load", "safetensors.numpy.load_file", r["safetensors"])
    add("load", "fs.load_file", r["foxhunt"], ref=r["safetensors"])
    check = fs.load_file(src, names=lambda n: n.endswith("q_proj.weight"))
    assert check and all(np.array_equal(v, tensors[k]) for k, v in check.items())
    del keep, check

    # save into a new path, no fsync: the same work as the reference
    out = os.path.join(work, "out.safetensors")
    raw = os.path.join(work, "raw.bin")

    def setup():
        fresh_path(work, "out.safetensors")
        fresh_path(work, "raw.bin")
    r = interleaved({"raw": lambda: raw_write(raw, tensors, threads),
                     "foxhunt": lambda: fs.save_file(tensors, out, fsync=False),
                     "safetensors": lambda: stn.save_file(tensors, out)}, rounds, setup=setup)
    add("ceiling", f"raw pwrite into a new file, no fsync ({threads} threads)", r["raw"])
    add("save", "safetensors.numpy.save_file, new path", r["safetensors"])
    add("save", "fs.save_file(fsync=False), new path", r["foxhunt"], ref=r["safetensors"])
    fs.save_file(tensors, out, fsync=False)            # untimed: our bytes = the reference's
    with open(out, "rb") as f1, open(src, "rb") as f2:
        assert f1.read(1 << 20) == f2.read(1 << 20)

    # save over an existing file, no fsync: the reference truncates in place, we rename a temp over
    other = os.path.join(work, "out2.safetensors")
    stn.save_file(tensors, other)
    r = interleaved({"foxhunt": lambda: fs.save_file(tensors, other, fsync=False),
                     "safetensors": lambda: stn.save_file(tensors, out)}, rounds, setup=os.sync)
    os.unlink(other)
    add("save", "safetensors.numpy.save_file, over an existing file", r["safetensors"])
    add("save", "fs.save_file(fsync=False), over an existing file", r["foxhunt"], ref=r["safetensors"])

    # durable save: ours fsyncs the file and its directory around the rename
    def ref_durable():
        stn.save_file(tensors, out)
        fsync_path(out)
    r = interleaved({"foxhunt": lambda: fs.save_file(tensors, out), "safetensors": ref_durable}, rounds,
                    setup=lambda: fresh_path(work, "out.safetensors"))
    add("save", "safetensors.numpy.save_file + os.fsync, new path", r["safetensors"])
    add("save", "fs.save_file (fsync + rename), new path", r["foxhunt"], ref=r["safetensors"])

    # the two write backends, forced, into --dir and (if it is a tmpfs with room) /dev/shm
    places = [("--dir", work)]
    if _tmpfs_with_room("/dev/shm", 3 * total):
        places.append(("/dev/shm", tempfile.mkdtemp(prefix="foxhunt-host-bench-", dir="/dev/shm")))
    for label, where in places:
        dst = os.path.join(where, "wb.safetensors")
        try:
            r = interleaved({"safetensors": lambda: stn.save_file(tensors, dst),
                             "mmap": lambda: fs.save_file(tensors, dst, fsync=False, write_backend="mmap"),
                             "pwrite": lambda: fs.save_file(tensors, dst, fsync=False, write_backend="pwrite")},
                            rounds, setup=lambda: fresh_path(where, "wb.safetensors"))
        finally:
            if where != work:
                shutil.rmtree(where, ignore_errors=True)
        add("backend", f"safetensors.numpy.save_file into {label}", r["safetensors"])
        add("backend", f"fs.save_file(fsync=False, write_backend='mmap') into {label}", r["mmap"],
            ref=r["safetensors"])
        add("backend", f"fs.save_file(fsync=False, write_backend='pwrite') into {label}", r["pwrite"],
            ref=r["safetensors"])
    del tensors

    # peak RSS growth of a save, fresh process each
    mem = {lib: rss_growth(lib, nbytes, os.path.join(work, f"rss-{lib}.safetensors"))
           for lib in ("safetensors", "foxhunt")}

    res.say("")
    res.say(f"{total / 2**30:.2f} GiB ({total} bytes) of float16 in {n_tensors} Llama-shaped tensors; "
            f"{threads} threads (the default); median of {rounds} interleaved rounds, [min-max]; "
            f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.")
    res.say("")
    res.say("| section | what | GB/s median | [min-max] | vs safetensors (median) |")
    res.say("|---|---|---:|---:|---:|")
    for section, what, seconds, ratio in rows:
        gbps = sorted(total / x / 1e9 for x in seconds)
        res.say(f"| {section} | {what} | {statistics.median(gbps):.2f} | {gbps[0]:.2f}-{gbps[-1]:.2f} | "
                f"{'' if ratio is None else f'{ratio:.2f}x'} |")
    res.say("")
    res.say("| save, in a fresh process | input | peak RSS growth during the save (target: <= 64 MiB) |")
    res.say("|---|---:|---:|")
    res.data.update(bytes=total, threads=threads, rounds=rounds,
                    rows=[{"section": a, "what": b, "seconds": c} for a, b, c, _ in rows], rss=mem)
    for lib, label in (("safetensors", "safetensors.numpy.save_file"), ("foxhunt", "fs.save_file")):
        inp, growth = mem[lib]
        res.say(f"| {label} | {inp / 2**20:.0f} MiB | {growth / 2**20:.1f} MiB |")
    res.say("")
    res.say(f"python {platform.python_version()}, numpy {np.__version__}, safetensors "
            f"{__import__('safetensors').__version__}, {platform.machine()}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
