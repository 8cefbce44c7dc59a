"""A cold load and the restart after it: is the second start of a server hot?

    python benchmarks/restart_bench.py CKPT [--out DIR] [--rounds 1]
    python benchmarks/restart_bench.py /tmp/ck --size 64MiB --device cpu     # a smoke run

The checkpoint must sit on a disk (not tmpfs) for the cold figures to mean anything. Each round:

1. raw cold read: the checkpoint dropped from the page cache (fsync + POSIX_FADV_DONTNEED, or
   /proc/sys/vm/drop_caches as root), then every byte preadv'd by the loader's threads in its
   chunk size into reused buffers, each file as one sequential stream per thread, each stream
   through a descriptor of its own (as the loader reads a cold file): the disk's rate, the cold
   load's ceiling;
2. cold load: dropped again, a fresh process loads the checkpoint (timed inside the process,
   after the imports and CUDA start);
3. second load: another fresh process loads it again, as a restarted server would;
4. hot load: every file read once more (resident), a fresh process loads it (its first load,
   the same kind of run as the second) and twice more (a process's steady hot rate).

Reported: each load's GB/s and the page-cache residency it left; cold / raw cold read (the
target is >= 0.95) and second / hot in a fresh process (the target is >= 0.9), per round and
for the medians.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common
from common import GB, Results, ce, median

import foxhunt_stream as fs


def child_main(argv: list[str]) -> None:
    """A fresh process: imports, CUDA start, then ``--loads`` timed loads, each with the
    residency it leaves."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--loads", type=int, default=1)
    a = ap.parse_args(argv)
    files = common.checkpoint_files(a.ckpt)
    fw = common.framework(a.device)
    if a.device != "cpu":
        import torch
        torch.empty(1, device=a.device)
        torch.cuda.synchronize(a.device)
    loads = []
    for _ in range(a.loads):
        seconds = common.timed(lambda: fs.load_file(a.ckpt, device=a.device, framework=fw), a.device)
        loads.append({"seconds": seconds, "resident_after": ce.resident(files)})
    common.report_child({"loads": loads})


def one_round(args, files: list[str], threads: int, chunk: int) -> dict:
    import numpy as np
    size = sum(map(os.path.getsize, files))
    slots = [np.empty(chunk, np.uint8) for _ in range(threads)]
    out: dict = {}
    raw = ce.read_ceiling(files, threads, 1, chunk, slots, before=lambda: ce.drop_caches(files), streams=threads)
    out["raw_cold_read_GBps"] = size / raw[0] / GB
    child = [__file__, "child", args.ckpt, "--device", args.device]
    out["drop"] = ce.drop_caches(files)
    out["resident_before_cold"] = ce.resident(files)
    out["cold"] = common.run_child(child, timeout=args.timeout)
    out["second"] = common.run_child(child, timeout=args.timeout)
    ce.warm(files)
    out["hot"] = common.run_child(child + ["--loads", "3"], timeout=args.timeout)
    return out


def rates(r: dict, nbytes: int) -> dict[str, float | None]:
    """GB/s of each load of one round: cold, second, hot (fresh process), hot (steady)."""
    def gbps(key: str, i: int) -> float | None:
        loads = r.get(key, {}).get("loads")
        return nbytes / loads[i]["seconds"] / GB if loads and len(loads) > i else None
    steady = [x for x in (gbps("hot", 1), gbps("hot", 2)) if x]
    return {"cold": gbps("cold", 0), "second": gbps("second", 0), "hot_fresh": gbps("hot", 0),
            "hot_steady": median(steady), "raw_cold_read": r["raw_cold_read_GBps"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        child_main(argv[1:])
        return 0
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="rounds (default 1; each reads the checkpoint "
                                                           "cold twice)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per load process (default 300)")
    args = ap.parse_args(argv)
    files = common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    res = Results("restart", args.out)
    fstype = common.filesystem(args.ckpt)
    if fstype in ("tmpfs", "ramfs"):
        res.say(f"warning: {args.ckpt} is on {fstype}: a cold read there is not a disk read")
    s = fs.settings.merge()
    nbytes = sum(t.nbytes for p in files for t in fs.read_header(p).tensors)
    rounds, t0 = [], time.perf_counter()
    for i in range(args.rounds):
        r = one_round(args, files, s.threads, s.chunk_bytes)
        rounds.append(r)
        for key in ("cold", "second", "hot"):
            if "error" in r[key]:
                res.say(f"round {i + 1}, {key} load failed: {r[key]['error']}")
    table = [("round", "raw cold read", "cold", "cold / raw", "second", "hot, fresh process", "second / hot",
              "hot, steady", "resident after cold")]
    per = [rates(r, nbytes) for r in rounds]
    for i, (r, g) in enumerate(zip(rounds, per)):
        table.append((str(i + 1), *row(g), _resident(r)))
    if len(per) > 1:
        table.append(("median", *row({k: median([g[k] for g in per if g[k]]) for k in per[0]}), ""))
    res.say(f"{nbytes / GB:.2f} GB in {len(files)} files on {fstype or 'an unknown filesystem'}, to {args.device}; "
            f"GB/s; targets: cold >= 0.95x the raw cold read, second >= 0.9x hot in a fresh process "
            f"({time.perf_counter() - t0:.0f} s)", "")
    res.table(table, right=set(range(9)))
    res.data.update(bytes=nbytes, files=len(files), filesystem=fstype, rounds=rounds, GBps=per)
    res.save()
    return 0


def row(g: dict) -> tuple[str, ...]:
    def f(x):
        return f"{x:.2f}" if x else "-"

    def ratio(a, b):
        return f"{g[a] / g[b]:.2f}" if g[a] and g[b] else "-"
    return (f(g["raw_cold_read"]), f(g["cold"]), ratio("cold", "raw_cold_read"), f(g["second"]),
            f(g["hot_fresh"]), ratio("second", "hot_fresh"), f(g["hot_steady"]))


def _resident(r: dict) -> str:
    loads = r.get("cold", {}).get("loads")
    return f"{100 * loads[0]['resident_after']:.0f}%" if loads else "-"


if __name__ == "__main__":
    sys.exit(main())
