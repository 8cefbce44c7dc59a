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
rotated each round) after one untimed run each; medians. Reported per plan: the bytes landed
and the bytes read (a column slice of a row-major tensor spans every row, so its whole rows
are read), GB/s landed, and the median time over the full load's: the fraction a rank pays.
The ideal is 1/tp (the target is 1.2/tp); a plan's read bytes over the full bytes bound what
it can reach with positional reads.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common
from common import GB, Results, median

import foxhunt_stream as fs
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
    args = ap.parse_args(argv)
    files = common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    res = Results("tp", args.out)
    shapes = {t.name: tuple(t.shape) for p in files for t in fs.read_header(p).tensors}
    fw = common.framework(args.device)

    def load(dim=None):
        shard = None if dim is None else fs.Shard(0, args.tp, dim)
        return lambda: fs.load_file(args.ckpt, device=args.device, framework=fw, shard=shard)
    cases = {"full load": load()}
    cases.update({name: load(dim) for name, dim in plans(shapes).items()})
    common.ce.warm(files)
    landed, read = {}, {}
    for name, fn in cases.items():   # the untimed run: bytes landed and read, pools and caches filled
        before = total_bytes_read()
        out = fn()
        common.synchronize(args.device)
        read[name] = total_bytes_read() - before
        landed[name] = common.tensor_bytes(out)
        del out
    times = common.interleaved(cases, args.rounds, args.device, warmup=False)
    full = median(times["full load"])
    res.say(f"TP={args.tp}, rank 0, to {args.device}: {landed['full load'] / GB:.2f} GB checkpoint in "
            f"{len(files)} files, hot; medians of {args.rounds} interleaved rounds; target <= "
            f"{1.2 / args.tp:.3f} of the full load (ideal {1 / args.tp:.3f})", "")
    rows = [("plan", "landed GB", "read GB", "GB/s", "median s", "of the full load", "best")]
    for name, ts in times.items():
        m = median(ts)
        rows.append((name, f"{landed[name] / GB:.3f}", f"{read[name] / GB:.3f}", f"{landed[name] / m / GB:.2f}",
                     f"{m:.4f}", "1" if name == "full load" else f"{m / full:.3f}",
                     "" if name == "full load" else f"{min(ts) / min(times['full load']):.3f}"))
    res.table(rows, right=set(range(1, 7)))
    res.data.update(tp=args.tp, rounds=args.rounds, seconds=times, landed=landed, read=read,
                    fraction={k: median(v) / full for k, v in times.items()})
    res.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
