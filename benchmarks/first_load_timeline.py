#!/usr/bin/env python
"""Where a fresh process's first load spends its time, step by step, beside its second load.

    python3 benchmarks/first_load_timeline.py CKPT --device cuda:0 --rounds 3 --out DIR \
        [--variants plain,rows,swi,env:FOXHUNT_READ_BYTES=8MiB,...]
    python3 benchmarks/first_load_timeline.py /tmp/ck --device cpu --rounds 1   # anywhere

Each round runs every variant in a new process (the order rotated from round to round). The child
imports torch and makes its CUDA context (on a GPU), untimed; then the clock starts, before the
loader's import, as in ``fresh_bench.py``. The loader's steps are wrapped (no change to what they
do) and each reports when it ended, in ms from the clock's start: ``import`` (the loader's modules),
``placement``, ``headers`` (``open_checkpoint``), ``plan`` (``prepare``), ``workers`` (the load in
flight), pinning (``pin0``: the first slot begun; ``pin1``, ``pin16``, ``pinN``: the first, 16th and
last slot pinned), the first read into staging (``read0``) and the tensors on the device (``done``);
beside them the tensors' memory reserved (``reserve``), the last tensor made (``allocN``), the last
read and the last chunk landed (``readN``, ``landN``), and the mean microseconds of one chunk's
landing (``land_us``: its read and its copy queued) and of one tensor made (``alloc_us``). Then a
second load in the same process, timed from its own start. A variant is ``+``-joined parts:
``plain``; ``rows`` (rank 0 of TP=8, every tensor by rows); ``swi``
(``sys.setswitchinterval(0.0002)`` before the clock); ``prealloc`` (17 GB reserved in torch's
caching allocator before the clock); ``warm`` (``fs.warmup`` before the clock); ``preimport`` (the
loader imported before the clock); ``env:NAME=VALUE`` (the child's environment:
``env:PYTHONPATH=/other/checkout`` times another version of the package in the same rounds)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time

RESULT = "RESULT "
MILESTONES = {"import": "imported", "placement": "placement:end", "headers": "open_checkpoint:end",
              "plan": "prepare:end", "workers": "LoadInFlight:end"}


def child(variant: str, ckpt: str, device: str) -> dict:
    """One process: the clock, the wrapped loader, a first and a second load."""
    gpu = device != "cpu"
    if gpu:   # the CUDA context a server has made by the time it loads
        import torch
        torch.empty(1, device=device)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)
    sync()
    parts = set(variant.split("+"))
    if "prealloc" in parts and gpu:
        reserved = torch.empty(17 * 10**9, dtype=torch.uint8, device=device)
        del reserved
    if "preimport" in parts:   # the loader too: fs.load_file imports it inside the first call
        import foxhunt_stream.api  # noqa: F401
        import foxhunt_stream.engine.loader  # noqa: F401
    if "swi" in parts:
        sys.setswitchinterval(0.0002)
    if "warm" in parts:
        import foxhunt_stream
        foxhunt_stream.warmup(device)
    events: list[tuple[float, str]] = []
    spans: dict[str, list] = {}   # key -> [count, first start, last end, every end, seconds in it]
    lock = threading.Lock()
    clock = [time.perf_counter()]

    def stamp(label: str) -> None:
        events.append((round((time.perf_counter() - clock[0]) * 1e3, 3), label))

    import foxhunt_stream as fs
    import foxhunt_stream.api  # noqa: F401
    from foxhunt_stream.cuda import runtime
    from foxhunt_stream.engine import frameworks, loader, targets
    from foxhunt_stream.engine import placement as placement_module
    from foxhunt_stream.io import source
    stamp("imported")

    def steps(name: str, module=loader) -> None:   # a step of the caller's thread: when it ended
        f = getattr(module, name)

        def timed(*a, **k):
            try:
                return f(*a, **k)
            finally:
                stamp(name + ":end")
        setattr(module, name, timed)

    def spanned(cls, name: str, key: str, each=lambda a: 1) -> None:   # a step of any thread: count, first
        f = getattr(cls, name, None)                                  # start, last end (``each`` per call)
        if f is None:   # not in the version of the package being timed (env:PYTHONPATH=)
            return

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                end = time.perf_counter()
                with lock:
                    s = spans.setdefault(key, [0, t, end, [], 0.0])
                    s[0] += each(a)
                    s[1], s[2] = min(s[1], t), max(s[2], end)
                    s[3].extend([end] * each(a))
                    s[4] += end - t
        setattr(cls, name, timed)

    for name in ("placement", "open_checkpoint", "prepare", "LoadInFlight"):
        steps(name)
    steps("placement", placement_module)   # where fs.load_file places a load, before the loader's import
    if gpu:
        if hasattr(runtime.PinnedArena, "pin_slots"):   # slots pinned a range at a time
            spanned(runtime.PinnedArena, "pin_slots", "pin", each=lambda a: len(a[1]))
        else:
            spanned(runtime.PinnedArena, "pin", "pin")
    spanned(source.FileSource, "read_span", "read")
    fw_cls = frameworks.TorchFramework if gpu else frameworks.NumpyFramework
    spanned(fw_cls, "reserve", "reserve")
    spanned(fw_cls, "new", "alloc")
    spanned(targets.CudaTarget if gpu else targets.HostTarget, "land", "land")
    kw = {"shard": fs.TPSlice(0, 8, dim=0)} if "rows" in parts else {}
    loads = []
    for i in range(2):
        if i:
            events.clear()
            spans.clear()
            clock[0] = time.perf_counter()
        out = fs.load_file(ckpt, device=device, framework="pt" if gpu else "numpy", progress=False, **kw)
        sync()
        stamp("done")
        del out
        pins = sorted(spans["pin"][3]) if "pin" in spans else []
        marks = [("pin0", spans["pin"][1] if pins else None), ("pin1", pins[0] if pins else None),
                 ("pin16", pins[15] if len(pins) >= 16 else None), ("pinN", pins[-1] if pins else None),
                 ("read0", spans["read"][1] if "read" in spans else None)]
        marks += [(k, spans[key][2] if key in spans else None) for k, key in
                  (("reserve", "reserve"), ("allocN", "alloc"), ("readN", "read"), ("landN", "land"))]
        ms = {k: round((v - clock[0]) * 1e3, 3) for k, v in marks if v is not None}
        # the mean time of one chunk's landing (read, copy queued) and of one allocation, in microseconds
        ms.update({k: round(spans[key][4] / spans[key][0] * 1e6, 1) for k, key in
                   (("land_us", "land"), ("alloc_us", "alloc")) if key in spans})
        loads.append({"events": list(events), "spans": ms})
    return {"loads": loads}


def milestones(load: dict) -> dict[str, float]:
    first: dict[str, float] = {}
    for t, label in load["events"]:
        first.setdefault(label, t)
    out = {k: first[v] for k, v in MILESTONES.items() if v in first}
    out.update(load["spans"])
    out["done"] = first["done"]
    return out


def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="plain,rows")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="timeline", help="the output files' name (<name>.json, <name>.txt)")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    runs: dict[str, list] = {v: [] for v in variants}
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
    for r in range(a.rounds):
        for k in range(len(variants)):
            v = variants[(k + r) % len(variants)]
            env, parts = dict(os.environ), []
            for p in v.split("+"):
                if p.startswith("env:"):
                    name, _, value = p[4:].partition("=")
                    env[name] = value
                else:
                    parts.append(p)
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "+".join(parts) or "plain",
                                a.ckpt, a.device], capture_output=True, text=True, env=env, timeout=600)
            found = [x[len(RESULT):] for x in p.stdout.splitlines() if x.startswith(RESULT)]
            if not found:
                say(f"[{v}] round {r + 1}: failed: {p.stderr.strip()[-1500:]}")
                continue
            res = json.loads(found[-1])
            runs[v].append(res)
            first, second = (milestones(x) for x in res["loads"])
            say(f"[{v}] round {r + 1}: first " + " ".join(f"{k} {x:.1f}" for k, x in first.items())
                + f" | second done {second['done']:.1f} ms")
    say("")
    say("medians, ms from the clock's start (first load), and the second load's total:")
    for v, rs in runs.items():
        if not rs:
            continue
        firsts = [milestones(x["loads"][0]) for x in rs]
        keys = [k for k in firsts[0] if all(k in f for f in firsts)]
        seconds = [milestones(x["loads"][1]) for x in rs]
        later = [k for k in ("read0", "readN", "land_us", "alloc_us", "done") if all(k in f for f in seconds)]
        say(f"{v}: " + " ".join(f"{k} {statistics.median(f[k] for f in firsts):.1f}" for k in keys)
            + " | second " + " ".join(f"{k} {statistics.median(f[k] for f in seconds):.1f}" for k in later)
            + f"  ({len(rs)} rounds)")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, a.name + ".json"), "w") as f:
            json.dump({"command": sys.argv, "runs": runs}, f)
        with open(os.path.join(a.out, a.name + ".txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository, last in
        sys.path.append(sys.path.pop(0))   # line: a PYTHONPATH (env:PYTHONPATH=...) or an install comes first
        print(RESULT + json.dumps(child(*sys.argv[2:5])), flush=True)
    else:
        sys.exit(main(sys.argv[1:]))
