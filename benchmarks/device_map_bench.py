"""One process, two GPUs: the checkpoint all on one GPU against split by ``device_map`` across two.

    python benchmarks/device_map_bench.py CKPT [--repeat 3] [--out DIR]
    python benchmarks/device_map_bench.py /tmp/ck --size 64MiB --device-a cpu --device-b cpu   # any box

Cases, each run once untimed (the page cache warm, pools and allocator caches filled; one
landed tensor per device compared with the file's bytes), then ``--repeat`` timed runs, best
and median:

- all on A: ``load_file(ckpt, device=A)``;
- split: ``load_file(ckpt, device_map=...)`` with the embedding and the first half of the
  layers on A, the rest (the norm and lm_head too) on B; "x all on A" is its rate over all on A's.

Also measured in the same run: the pinned host -> device copy (1 GiB) on each GPU, the ceiling
of a load onto it. GB/s = tensor bytes / seconds.
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common
from common import GB, Results, ce, median

import foxhunt_stream as fs


def split_map(names: list[str], a: str, b: str) -> dict[str, str]:
    """The embedding and the first half of the layers on ``a``, everything else on ``b``."""
    layers = sorted({int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))})
    first = layers[:len(layers) // 2]
    return {"model.embed_tokens": a, **{f"model.layers.{i}": a for i in first}, "": b}


def placement(names: list[str], device_map: dict[str, str]) -> dict[str, str]:
    """Where ``device_map`` puts each tensor: its longest module prefix in the map ("" matches all)."""
    def where(name: str) -> str:
        keys = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
        return device_map[max(keys, key=len)]
    return {n: where(n) for n in names}


def check_bytes(out: dict, files: list[str]) -> dict[str, int]:
    """Per device the bytes landed there; the middle tensor of each device equals the file's bytes."""
    import torch
    where: dict[str, list[str]] = {}
    for name, t in out.items():
        where.setdefault(str(t.device), []).append(name)
    headers = {t.name: (p, h, t) for p in files for h in [fs.read_header(p)] for t in h.tensors}
    for device, names in where.items():
        path, h, info = headers[names[len(names) // 2]]
        with open(path, "rb") as f:
            f.seek(h.data_start + info.start)
            want = f.read(info.nbytes)
        got = out[info.name].detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        assert got == want, f"landed bytes of {info.name} on {device} differ from the file"
    return {d: sum(out[n].numel() * out[n].element_size() for n in names) for d, names in where.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--device-a", default="cuda:0")
    ap.add_argument("--device-b", default="cuda:1")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per case (default 3)")
    args = ap.parse_args(argv)
    files = common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    res = Results("device_map", args.out)
    names = [t.name for p in files for t in fs.read_header(p).tensors]
    a, b = args.device_a, args.device_b
    dm = split_map(names, a, b)
    ce.warm(files)
    ceilings = {}
    for d in dict.fromkeys((a, b)):
        if d != "cpu":
            import cupy as cp
            ceilings[d] = (1 << 30) / median(ce.copy_ceiling(cp, int(d.split(":")[1]), 1 << 30, 3)) / GB
    cases = {f"all on {a}": (lambda: fs.load_file(args.ckpt, device=a, framework="pt"), {a}),
             f"split: first half on {a}, the rest on {b}": (lambda: fs.load_file(args.ckpt, device_map=dm,
                                                                                 framework="pt"), {a, b})}
    rows = [("case", "best s", "median s", "GB/s (best)", "x all on A", "GB per device")]
    data = {}
    for name, (load, devices) in cases.items():
        out = load()
        common.synchronize(devices)
        placed = check_bytes(out, files)
        nbytes = sum(placed.values())
        del out
        times = []
        for _ in range(args.repeat):
            times.append(common.timed(load, devices))
        first = min(data[next(iter(data))]["seconds"]) if data else min(times)
        rows.append((name, f"{min(times):.3f}", f"{median(times):.3f}", f"{nbytes / min(times) / GB:.2f}",
                     f"{first / min(times):.2f}", ", ".join(f"{d} {n / GB:.2f}" for d, n in sorted(placed.items()))))
        data[name] = {"seconds": times, "placed": placed}
    res.say(f"{nbytes / GB:.2f} GB in {len(files)} files, hot; best and median of {args.repeat}; pinned "
            "host -> device ceilings: " + (", ".join(f"{d} {g:.2f} GB/s" for d, g in ceilings.items()) or "none"), "")
    res.table(rows, right={1, 2, 3, 4})
    # the same as one Markdown row, for RESULTS.md
    halves = placement(names, split_map(names, "A", "B"))   # which half, even where A and B are one device
    on_a = sum(t.nbytes for p in files for t in fs.read_header(p).tensors if halves[t.name] == "A")
    all_s, split_s = (min(d["seconds"]) for d in data.values())
    h2d = " / ".join(f"{ceilings[d]:.2f}" if d in ceilings else "-" for d in (a, b))
    res.say("", "| checkpoint GB | all on A GB/s | split A+B GB/s | split / all | H2D ceiling A / B GB/s "
                "| GB on A / B (split) | A, B |", "|---|---|---|---|---|---|---|",
            f"| {nbytes / GB:.2f} | {nbytes / all_s / GB:.2f} | {nbytes / split_s / GB:.2f} | {all_s / split_s:.2f}x "
            f"| {h2d} | {on_a / GB:.2f} / {(nbytes - on_a) / GB:.2f} | {a}, {b} |")
    res.data.update(bytes=nbytes, ceilings_GBps=ceilings, cases=data, on_a=on_a)
    res.save()
    return {"bytes": nbytes, "GB/s": {k: nbytes / min(v["seconds"]) / GB for k, v in data.items()},
            "h2d": ceilings, "on_a": on_a}


if __name__ == "__main__":
    main()
