"""Saving a checkpoint held on a GPU: foxhunt_stream against safetensors, into /dev/shm and to a
disk with fsync, with the host memory each save takes, against ceilings of the same writes.

    python benchmarks/save_bench.py CKPT [--out DIR] [--shm /dev/shm] [--disk DIR]
    python benchmarks/save_bench.py /tmp/ck --size 64MiB --device cpu      # a smoke run

Each save runs in a fresh process that loads the checkpoint onto the device (torch tensors; numpy
with --device cpu), warms the saver with a small save, then saves every tensor into one new
file once; "RSS" is that process's peak resident-set growth during the save (VmHWM after
/proc/self/clear_refs). safetensors' save to the disk is followed by an fsync of the file, as
foxhunt_stream's default save does.

The ceilings, measured in this process: the pinned device -> host copy (1 GiB), and a new file of
the checkpoint's size written the way each save writes it: by the method foxhunt_stream's saver
takes there (copies into a shared mapping on tmpfs with 8 or more threads, pwrite elsewhere),
by pwrite for safetensors (pwrite: the faster of one writer and the saver's threads), with fsync
on the disk. Each save is compared with the slower of the
device -> host copy and the write by its own method, so none can beat its ceiling by design.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common
from common import GB, Results, ce, median

import foxhunt_stream as fs
from foxhunt_stream.cuda.devices import parse_device

WHO = ("foxhunt_stream", "safetensors")


def child_main(argv: list[str]) -> None:
    """A fresh process: load, warm the saver, then one timed save with its peak RSS growth."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("who", choices=WHO)
    ap.add_argument("ckpt")
    ap.add_argument("dest")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--fsync", action="store_true")
    a = ap.parse_args(argv)
    tensors = fs.load_file(a.ckpt, device=a.device, framework=common.framework(a.device))
    common.synchronize(a.device)
    if a.who == "foxhunt_stream":
        save = lambda t, p: fs.save_file(t, p, metadata={"format": "pt"}, fsync=a.fsync)   # noqa: E731
    else:
        if a.device != "cpu":
            import safetensors.torch as st
        else:
            import safetensors.numpy as st

        def save(t, p):
            st.save_file(t, p, metadata={"format": "pt"})
            if a.fsync:
                fd = os.open(p, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
    save({k: tensors[k] for k in list(tensors)[:1]}, a.dest + ".warm")   # imports, threads, staging
    os.unlink(a.dest + ".warm")
    ce.settle(a.dest)
    base = common.proc_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    seconds = common.timed(lambda: save(tensors, a.dest), a.device)
    growth = common.proc_status("VmHWM") - base
    try:
        same = same_bytes(common.checkpoint_files(a.ckpt), a.dest)
    finally:
        os.unlink(a.dest)
    common.report_child({"seconds": seconds, "bytes": common.tensor_bytes(tensors), "rss_growth": growth,
                         "same_bytes": same})


def same_bytes(sources: list[str], saved: str) -> bool:
    """The middle tensor of the first source file has the same bytes in the saved file (plain reads)."""
    src = fs.read_header(sources[0])
    t = src.tensors[len(src.tensors) // 2]
    out = fs.read_header(saved)
    o = next(x for x in out.tensors if x.name == t.name)
    with open(sources[0], "rb") as f, open(saved, "rb") as g:
        f.seek(src.data_start + t.start)
        g.seek(out.data_start + o.start)
        return f.read(t.nbytes) == g.read(o.nbytes)


def ceilings(args, nbytes: int, threads: int, chunk: int) -> dict[str, float]:
    """GB/s of the writes (and the device -> host copy) the saves are compared with."""
    out = {}
    if args.device != "cpu":
        import cupy as cp
        out["d2h"] = (1 << 30) / median(ce.copy_ceiling(cp, parse_device(args.device).index, 1 << 30, 3,
                                                        to_device=False)) / GB
    for where, directory, fsync in (("shm", args.shm, False), ("disk", args.disk, True)):
        for method in sorted({ce.write_method(directory, nbytes, threads), "pwrite"}):
            t, _ = ce.best_write_ceiling(directory, nbytes, threads, args.reps, chunk, method, fsync)
            out[f"{where} {method}"] = nbytes / median(t) / GB
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        child_main(argv[1:])
        return 0
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--shm", default="/dev/shm", help="the in-memory destination (default /dev/shm)")
    ap.add_argument("--disk", default=None, help="the disk destination (default: the checkpoint's directory)")
    ap.add_argument("--reps", type=int, default=1, help="saves of each kind (median; default 1)")
    ap.add_argument("--timeout", type=float, default=400, help="seconds per save process (default 400)")
    args = ap.parse_args(argv)
    files = common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    args.disk = args.disk or args.ckpt
    res = Results("save", args.out)
    s = fs.settings.merge()
    nbytes = sum(t.nbytes for p in files for t in fs.read_header(p).tensors)
    for d in (args.shm, args.disk):
        if common.free_space(d) < 1.1 * nbytes:
            raise SystemExit(f"{d} has {common.free_space(d) / GB:.1f} GB free; the saves need {nbytes / GB:.1f}")
    ceil = ceilings(args, nbytes, s.threads, s.chunk_bytes)
    d2h = ceil.get("d2h", float("inf"))
    cases = []
    for where, directory, fsync in (("shm", args.shm, False), ("disk", args.disk, True)):
        method = ce.write_method(directory, nbytes, s.threads)
        for who in WHO:
            bound = min(d2h, ceil[f"{where} {method if who == 'foxhunt_stream' else 'pwrite'}"])
            dest = os.path.join(directory, f"foxhunt-bench-save-{who}.safetensors")
            runs = [common.run_child([__file__, "child", who, args.ckpt, dest, "--device", args.device]
                                     + (["--fsync"] if fsync else []), timeout=args.timeout)
                    for _ in range(args.reps)]
            cases.append((who, where, directory, fsync, bound, runs))
    report(res, args, nbytes, s.threads, ceil, cases)
    res.save()
    return 0


def report(res: Results, args, nbytes: int, threads: int, ceil: dict[str, float], cases: list) -> None:
    res.say(f"save of {nbytes / GB:.2f} GB from {args.device} into one new file, each in a fresh process; "
            f"{threads} threads; ceilings in GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in ceil.items()), "")
    rows = [("save", "to", "GB/s", "x ceiling", "seconds", "RSS growth", "bytes checked")]
    data = []
    for who, where, directory, fsync, bound, runs in cases:
        ok = [r for r in runs if "seconds" in r]
        for r in runs:
            if "error" in r:
                res.say(f"{who} -> {directory} failed: {r['error']}")
        if not ok:
            continue
        sec = median([r["seconds"] for r in ok])
        rss = max(r["rss_growth"] for r in ok)
        rows.append((who, f"{directory}{' + fsync' if fsync else ''}", f"{nbytes / sec / GB:.2f}",
                     f"{nbytes / sec / GB / bound:.2f}", f"{sec:.2f}", f"{rss / 2**30:+.2f} GiB",
                     "same" if all(r["same_bytes"] for r in ok) else "DIFFERENT"))
        data.append(dict(who=who, to=directory, fsync=fsync, ceiling_GBps=bound, runs=runs))
    res.table(rows, right={2, 3, 4, 5})
    res.data.update(bytes=nbytes, threads=threads, ceilings_GBps=ceil, saves=data)


if __name__ == "__main__":
    sys.exit(main())
