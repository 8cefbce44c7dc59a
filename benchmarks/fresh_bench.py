#!/usr/bin/env python
"""Loads as a server meets them: every load in a new process, the peers measured the same way.

    python3 benchmarks/fresh_bench.py CKPT --device cuda:0 --rounds 5 --out DIR [--groups hot,cold,host]
    python3 benchmarks/fresh_bench.py /tmp/ck --size 64MiB --device cpu --rounds 2   # a smoke run anywhere

An inference server loads its weights once per process, and each tensor-parallel rank is a
process of its own, so the figure that counts is the first load in a fresh process. Every case
below runs in a new Python process. On a GPU the child imports torch and makes its CUDA context
first, untimed; then the clock starts, before the loader's own import, and stops once the
tensors are on the device (``torch.cuda.synchronize``). The parent imports no CUDA library.

Groups, each case once per round, the order rotated from round to round (interleaved rounds:
the shared machine's drift touches every case alike); medians over the rounds:

- ``hot`` (the checkpoint read into the page cache first): the ceiling (one pinned host ->
  device copy of 1 GiB, CUDA events, median of 3, in a child of its own); ``foxhunt``
  (``fs.load_file(CKPT, framework="pt")``, then a second load in the same process: the one-time
  cost is the first minus the second); ``instanttensor`` (0.2.2, buffered backend,
  ``safe_open(...).tensors()`` with its default copies); ``kvikio`` (raw file bytes: each file's
  data region read into one GPU buffer by ``CuFile.pread``, ``KVIKIO_COMPAT_MODE=ON``, 16
  threads: a C++ reference for moving the bytes, no tensors made); ``tp_llama`` and ``tp_rows``
  (rank 0 of TP=8: o/down by columns and the rest by rows, or every tensor by rows); with
  ``--safetensors``, ``safetensors.torch.load_file`` per file;
- ``cold`` (root: ``drop_caches``): the raw cold read (every byte preadv'd by 16 threads, each
  file as one sequential stream per thread), a cold load in a new process, then a new process's
  load right after it (the restart: is the second start hot?);
- ``host``: a 1 GiB F32 file in the page cache loaded to numpy, the clock started before the
  first import: ``foxhunt_stream`` against ``safetensors.numpy``.

Peers that are not installed are left out and named. Each figure is GB/s of tensor bytes (raw
file bytes for kvikio and the raw read) and a ratio to the ceiling or peer of the same run.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common  # noqa: E402  (puts the repository on the path)
from common import GB, ce, median  # noqa: E402

from foxhunt_stream.cli import fresh  # noqa: E402

def rotated(cases: list[str], r: int) -> list[str]:
    k = r % len(cases)
    return cases[k:] + cases[:k]


def main(argv: list[str]) -> int:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--suite", default="fresh", help="the name of its output files (<suite>.json, <suite>.txt)")
    ap.add_argument("--groups", default="hot,cold,host", help="comma-separated: hot, cold, host")
    ap.add_argument("--safetensors", action="store_true", help="also safetensors.torch in the hot group (slow)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VALUE,...",
                    help="also foxhunt's cases with these environment variables (e.g. "
                         "small:FOXHUNT_CHUNK_BYTES=4MiB,FOXHUNT_STAGING_BYTES=128MiB; other:PYTHONPATH=DIR "
                         "times the package in DIR), as CASE@NAME")
    ap.add_argument("--host-file", default=None, help="the 1 GiB F32 file of the host group (written when missing; "
                                                       "default: CKPT/../foxhunt-host-f32.safetensors)")
    args = ap.parse_args(argv)
    files = common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    res = common.Results(args.suite, args.out)
    groups = [g for g in args.groups.split(",") if g]
    gpu = args.device != "cpu"
    import foxhunt_stream as fs
    nbytes = sum(t.nbytes for p in files for t in fs.read_header(p).tensors)
    raw_bytes = sum(os.path.getsize(p) - fs.read_header(p).data_start for p in files)
    runs: dict[str, list[dict]] = {}

    def record(case: str, r: dict) -> None:
        runs.setdefault(case, []).append(r)
        if "error" in r or "skipped" in r:
            print(f"  {case}: {r.get('error') or r.get('skipped')}", flush=True)

    t_start = time.perf_counter()
    if "hot" in groups:
        cases = (["ceiling", "foxhunt", "instanttensor", "kvikio", "tp_llama", "tp_rows"] if gpu
                 else ["foxhunt", "tp_llama", "tp_rows"]) + (["safetensors"] if args.safetensors and gpu else [])
        variants = {}
        for spec in args.variant:
            name, _, assigns = spec.partition(":")
            variants[name] = dict(a.split("=", 1) for a in assigns.split(",") if a)
            cases += [f"{c}@{name}" for c in ("foxhunt", "tp_llama", "tp_rows")]
        for r in range(args.rounds):
            ce.warm(files)
            for case in rotated(cases, r):
                base, _, variant = case.partition("@")
                record(case, fresh.run(base, args.ckpt, args.device, files, env=variants.get(variant)))
            print(f"hot round {r + 1} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    if "cold" in groups:
        import numpy as np
        size = sum(map(os.path.getsize, files))
        s = fs.settings.merge()
        slots = [np.empty(s.chunk_bytes, np.uint8) for _ in range(s.threads)]
        for r in range(args.rounds):
            raw = ce.read_ceiling(files, s.threads, 1, s.chunk_bytes, slots, before=lambda: ce.drop_caches(files),
                                  streams=s.threads)
            record("raw_cold_read", {"seconds": raw[0], "bytes": size})
            drop = ce.drop_caches(files)
            cold = fresh.run("foxhunt", args.ckpt, args.device, files)   # its second load is a hot one
            cold.update(drop=drop, resident_after=ce.resident(files))
            record("cold", cold)
            record("restart", fresh.run("foxhunt", args.ckpt, args.device, files))
            print(f"cold round {r + 1} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    host_bytes = 0
    if "host" in groups:
        path = args.host_file or os.path.join(os.path.dirname(os.path.abspath(args.ckpt)), "foxhunt-host-f32.safetensors")
        if not os.path.exists(path):
            import numpy as np
            fs.save_file({f"t{i}": np.random.default_rng(i).standard_normal((16, 1 << 20), dtype=np.float32)
                          for i in range(16)}, path, fsync=False)
        host_bytes = sum(t.nbytes for t in fs.read_header(path).tensors)
        for r in range(args.rounds):
            ce.warm([path])
            for case in rotated(["foxhunt", "safetensors"], r):
                record("host_" + case, fresh.run(case, path, "cpu", [path]))

    def med(case: str, key: str = "seconds") -> float | None:
        return median([x[key] for x in runs.get(case, []) if key in x])

    def gbps(case: str, key: str = "seconds", n: int | None = None) -> float | None:
        t = med(case, key)
        return (n or nbytes) / t / GB if t else None

    def f(x, fmt="{:.2f}"):
        return fmt.format(x) if x is not None else "-"

    def ratio(a, b):
        return f(a / b) if a and b else "-"

    ceiling = median([x["GBps"] for x in runs.get("ceiling", []) if "GBps" in x])
    host_first = median([x["seconds"] for x in runs.get("host_foxhunt", []) if "seconds" in x])
    res.say(f"{nbytes / GB:.2f} GB of tensors in {len(files)} files, to {args.device}, each load in a new process "
            f"(clock from before the loader's import to the tensors on the device); medians of {args.rounds} "
            f"interleaved rounds ({time.perf_counter() - t_start:.0f} s)", "")
    rows = [("case", "median s", "GB/s", "x H2D", "note")]
    first, second = gbps("foxhunt"), gbps("foxhunt", "second")
    it_rate = gbps("instanttensor")
    if "hot" in groups:
        if ceiling:
            rows.append(("ceiling: pinned host -> device copy (1 GiB)", "", f(ceiling), "1.00", ""))
        rows.append(("foxhunt_stream, first load in the process", f(med("foxhunt"), "{:.3f}"), f(first),
                     ratio(first, ceiling), f"/ InstantTensor {ratio(first, it_rate)}"))
        rows.append(("foxhunt_stream, second load, same process", f(med("foxhunt", "second"), "{:.3f}"), f(second),
                     ratio(second, ceiling), ""))
        for case, label in (("instanttensor", "InstantTensor, buffered backend"),
                            ("kvikio", "kvikio, raw file bytes (compat mode, 16 threads)"),
                            ("safetensors", "safetensors.torch")):
            if case in runs:
                n = med(case, "bytes") if case == "kvikio" else None
                rate = gbps(case, n=int(n) if n else None)
                version = next((x.get("version") for x in runs[case] if x.get("version")), "")
                rows.append((f"{label} {version}".strip(), f(med(case), "{:.3f}"), f(rate), ratio(rate, ceiling), ""))
        one_time = (med("foxhunt") - med("foxhunt", "second")) if first and second else None
        for case, label in (("tp_llama", "rank 0 of TP=8, Llama plan"), ("tp_rows", "rank 0 of TP=8, rows plan")):
            t = med(case)
            rows.append((label, f(t, "{:.3f}"), "", "", f"/ full first load {ratio(t, med('foxhunt'))}"))
        for name in variants:
            t, t2 = med(f"foxhunt@{name}"), med(f"foxhunt@{name}", "second")
            rows.append((f"foxhunt_stream with {args.variant[list(variants).index(name)]}", f(t, "{:.3f}"),
                         f(nbytes / t / GB if t else None), ratio(nbytes / t / GB if t else None, ceiling),
                         f"second {f(t2, '{:.3f}')} s; TP llama {ratio(med(f'tp_llama@{name}'), t)}, "
                         f"rows {ratio(med(f'tp_rows@{name}'), t)}"))
        res.table(rows, right={1, 2, 3})
        res.say("", f"one-time cost of the first load (first minus second, medians): {f(one_time, '{:.3f}')} s")
        stolen = {case: [x["stolen"] for x in rs if "stolen" in x] for case, rs in runs.items()}
        if any(stolen.values()):   # a shared machine: the rounds its host slowed
            res.say("", "CPU seconds the host took from this machine (steal) while each case ran, median / most: "
                    + ", ".join(f"{case} {median(v):.2f} / {max(v):.2f}" for case, v in stolen.items() if v))
    if "cold" in groups:
        raw = median([x["bytes"] / x["seconds"] / GB for x in runs.get("raw_cold_read", [])])
        cold, restart = gbps("cold"), gbps("restart")
        res.say("", f"raw cold read {f(raw)} GB/s (file bytes); cold load {f(cold)} GB/s, cold / raw "
                    f"{ratio(cold, raw)}; restart {f(restart)} GB/s, restart / hot first load {ratio(restart, first)}")
    if "host" in groups:
        ours, ref = host_first, med("host_safetensors")
        res.say("", f"host, 1 GiB F32 to numpy, import + load in a new process: foxhunt_stream {f(ours, '{:.3f}')} s, "
                    f"safetensors.numpy {f(ref, '{:.3f}')} s, ours / theirs {ratio(ours, ref)}")
    res.data.update(bytes=nbytes, raw_bytes=raw_bytes, host_bytes=host_bytes, rounds=args.rounds, runs=runs,
                    ceiling_GBps=ceiling)
    res.save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
