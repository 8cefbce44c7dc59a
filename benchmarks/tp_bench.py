"""One tensor-parallel rank's load, as a fraction of the full hot load measured in the same run.

    python benchmarks/tp_bench.py CKPT [--tp 8] [--rounds 7] [--out DIR]
    python benchmarks/tp_bench.py /tmp/ck --size 64MiB --device cpu --rounds 3   # a smoke run

Rank 0 of TP=``--tp`` loads its slice of every tensor (``fs.Shard(0, tp, plan)``) under three
plans:

- Llama: what a Llama serving stack loads (Megatron style): the embedding, lm_head and the
  q/k/v, gate and up projections split along dim 0 (rows), o_proj and down_proj along dim 1
  (columns), the norms whole;
- rows: every 2-D tensor along dim 0, the norms whole;
- columns: every 2-D tensor along dim 1, the norms whole.

The full load and the three plans take turns in ``--rounds`` interleaved rounds (the order
rotated each round) after one untimed run each; medians. The default backend ("auto") gathers
the column slices of cached files out of a mapping; the Llama and columns plans also run with
``backend="pread"``, which reads each column slice's whole row span. The floor (``pipeline_floor``:
the plan's chunks moved by a bare pipeline into one preallocated buffer, no setup, allocation or
bookkeeping) of the full load and of the rows plan takes turns with them: what the hardware and a
Python pipeline give those bytes, against what the load adds. Reported per plan: the bytes landed
and the bytes read (a gather counts the pages its rows touch), GB/s landed, the median time over
the full load's (the fraction a rank pays; ideal 1/tp), and, untimed, the wait for the load's
mappings to be unmapped (on a background thread after the load). With ``--cold`` (root): the
Llama plan after drop_caches, the default against ``backend="pread"``, 3 rounds: a cold file keeps
positional reads either way.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common
from common import GB, Results, median
from pipeline_floor import Floor

import foxhunt_stream as fs
from foxhunt_stream.io import mapping
from foxhunt_stream.io.source import total_bytes_read

LLAMA_PLAN = {"*embed_tokens.weight": 0, "lm_head.weight": 0, "*.q_proj.weight": 0, "*.k_proj.weight": 0,
              "*.v_proj.weight": 0, "*.gate_proj.weight": 0, "*.up_proj.weight": 0, "*.o_proj.weight": 1,
              "*.down_proj.weight": 1, "*": None}


def plans(shapes: dict[str, tuple[int, ...]]) -> dict[str, object]:
    """Each plan's ``Shard.dim``: a glob mapping, or name -> dim (None: the tensor whole)."""
    return {"Llama (q/k/v, gate, up, embedding, lm_head by rows; o, down by columns)": LLAMA_PLAN,
            "rows (every 2-D tensor along dim 0)": lambda n: 0 if len(shapes[n]) >= 2 else None,
            "columns (every 2-D tensor along dim 1)": lambda n: 1 if len(shapes[n]) >= 2 else None}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=8, help="ranks (default 8); rank 0 is measured")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median; default 7)")
    ap.add_argument("--cold", action="store_true", help="also the Llama plan cold, the default against pread (root)")
    args = ap.parse_args(argv)
    files = common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    res = Results("tp", args.out)
    shapes = {t.name: tuple(t.shape) for p in files for t in fs.read_header(p).tensors}
    fw = common.framework(args.device)

    def load(dim=None, **options):
        shard = None if dim is None else fs.TPSlice(0, args.tp, dim)
        return lambda: fs.load_file(args.ckpt, device=args.device, framework=fw, shard=shard, **options)
    cases = {"full load": load()}
    cases.update({name: load(dim) for name, dim in plans(shapes).items()})
    for name, dim in plans(shapes).items():
        if not name.startswith("rows"):
            cases[name.split(" (")[0] + ', backend="pread"'] = load(dim, backend="pread")
    rows_dim = next(dim for name, dim in plans(shapes).items() if name.startswith("rows"))
    floors = {"full load, floor": Floor(args.ckpt, None, args.device),
              "rows, floor": Floor(args.ckpt, fs.TPSlice(0, args.tp, rows_dim), args.device)}
    cases.update(floors)
    common.ce.warm(files)
    landed, read = {}, {}
    for name, fn in cases.items():   # the untimed run: bytes landed and read, pools and caches filled
        before = total_bytes_read()
        out = fn()
        common.synchronize(args.device)
        read[name] = total_bytes_read() - before
        landed[name] = common.tensor_bytes(out) if name not in floors else floors[name].nbytes
        if name in floors:   # raw reads: not counted by the library
            read[name] = landed[name]
        del out
        mapping.wait_unmapped()
    unmap: dict[str, list[float]] = {k: [] for k in cases}

    def settle(name: str, _seconds: float) -> None:
        t0 = time.perf_counter()
        mapping.wait_unmapped()
        unmap[name].append(time.perf_counter() - t0)
    times = common.interleaved(cases, args.rounds, args.device, warmup=False, after=settle)
    full = median(times["full load"])
    res.say(f"TP={args.tp}, rank 0, to {args.device}: {landed['full load'] / GB:.2f} GB checkpoint in "
            f"{len(files)} files, hot; medians of {args.rounds} interleaved rounds; targets (of the full load): "
            f"Llama <= 0.2, columns <= 0.3, rows <= 0.15 (ideal {1 / args.tp:.3f})", "")
    rows = [("plan", "landed GB", "read GB", "GB/s", "median s", "of the full load", "best", "unmap s")]
    for name, ts in times.items():
        m = median(ts)
        rows.append((name, f"{landed[name] / GB:.3f}", f"{read[name] / GB:.3f}", f"{landed[name] / m / GB:.2f}",
                     f"{m:.4f}", "1" if name == "full load" else f"{m / full:.3f}",
                     "" if name == "full load" else f"{min(ts) / min(times['full load']):.3f}",
                     f"{median(unmap[name]):.4f}"))
    res.table(rows, right=set(range(1, 8)))
    floor_full, floor_rows = median(times["full load, floor"]), median(times["rows, floor"])
    res.say("", f"floor: the rows plan's chunks alone take {floor_rows / floor_full:.3f} of the full load's chunks "
            f"alone ({floor_rows * 1e3:.1f} of {floor_full * 1e3:.1f} ms); the rows load adds "
            f"{(median(times[next(k for k in times if k.startswith('rows ('))]) - floor_rows) * 1e3:.1f} ms, "
            f"the full load {(full - floor_full) * 1e3:.1f} ms")
    res.data.update(tp=args.tp, rounds=args.rounds, seconds=times, landed=landed, read=read, unmap=unmap,
                    fraction={k: median(v) / full for k, v in times.items()},
                    floor_fraction=floor_rows / floor_full)
    if args.cold and args.device.startswith("cuda"):   # drop_caches: not on a CPU smoke run
        llama = next(dim for name, dim in plans(shapes).items() if name.startswith("Llama"))
        cold = {"Llama, cold": load(llama), 'Llama, cold, backend="pread"': load(llama, backend="pread")}
        cold_times = {k: [] for k in cold}
        for _ in range(3):
            for name, fn in cold.items():
                common.ce.drop_caches(files)
                cold_times[name].append(common.timed(fn, args.device))
                mapping.wait_unmapped()
        res.say("", "cold (after drop_caches), 3 rounds:")
        res.table([("plan", "median s", "runs")] + [(k, f"{median(v):.3f}", ", ".join(f"{t:.3f}" for t in v))
                                                     for k, v in cold_times.items()], right={1})
        res.data.update(cold=cold_times)
    res.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
