"""Several GPUs on one host: every rank of a torchrun group loads the checkpoint with
``process_group=``, against one GPU loading it alone and every rank loading it all itself,
beside the host's ceilings measured by the same ranks.

    torchrun --nproc-per-node 2 benchmarks/dist_bench.py CKPT [--repeat 3] [--out DIR]
    torchrun --nproc-per-node 2 benchmarks/dist_bench.py CKPT --shard-dim 0     # TP slices too
    torchrun --nproc-per-node 3 benchmarks/dist_bench.py /tmp/ck --size 64MiB --device cpu   # gloo, any box

Every case starts after a barrier; each is run once untimed, then ``--repeat`` times, and a
run's time is its slowest rank's (the group is done when the last rank is); best and median.

- ceilings: page cache -> host buffers (preadv, the loader's threads) by rank 0 alone, then by
  every rank at once, each reading its 1/world share of the files: what the host's memory
  gives one process and the group; pinned host -> device copies (2 GiB) on rank 0's GPU
  alone, then on every rank's GPU at once;
- one GPU: rank 0 alone loads every tensor onto its GPU while the others wait;
- process_group: every rank ends with every tensor, the group reading each byte once;
- every rank alone: each rank loads everything itself, no process group;
- with ``--shard-dim D``: process_group with each rank's ``fs.Shard(rank, world, D)`` slices.

Reported per case: seconds, GB/s per rank (tensor bytes a rank ends with / seconds), the
time over the one-GPU load, and the bytes the group read from the files over the checkpoint's
(``foxhunt_stream.io.source.total_bytes_read``). NCCL between GPUs, gloo on the CPU.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common
from common import GB, Results, ce, median

import foxhunt_stream as fs
from foxhunt_stream.io.source import total_bytes_read


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.set_defaults(device="auto")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per case (default 3)")
    ap.add_argument("--shard-dim", type=int, default=None, help="also load fs.Shard(rank, world, DIM) slices")
    ap.add_argument("--exchange-bytes", default="64MiB", help="process_group's exchange window (default 64MiB)")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    device = f"cuda:{local}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    dist.barrier()
    files = common.checkpoint_files(args.ckpt)
    nbytes = sum(t.nbytes for p in files for t in fs.read_header(p).tensors)
    if rank == 0:
        ce.warm(files)
    dist.barrier()
    mine = {**ceilings(files, device, rank, world, dist), **loads(args, files, device, rank, world, dist)}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        report(args, everyone, nbytes, files, world, "nccl" if cuda else "gloo")
    dist.destroy_process_group()
    return 0


def timed_case(fn, device: str, dist, runs: int, active: bool = True) -> list[dict]:
    """Each run after a barrier: this rank's seconds and bytes read (an inactive rank only waits)."""
    out = []
    for i in range(runs + 1):
        dist.barrier()
        if not active:
            continue
        before = total_bytes_read()
        seconds = common.timed(fn, device)
        if i:
            out.append({"seconds": seconds, "read": total_bytes_read() - before})
    return out


def ceilings(files: list[str], device: str, rank: int, world: int, dist) -> dict[str, list[dict]]:
    import numpy as np
    s = fs.settings.merge()
    slots = [np.empty(s.chunk_bytes, np.uint8) for _ in range(s.threads)]
    pieces = [(p, off, n) for p in files for off, n in ce.pieces(os.path.getsize(p), s.chunk_bytes)]

    def read(share):
        def run():
            fds = {p: os.open(p, os.O_RDONLY) for p in files}
            try:
                ce.parallel(share, lambda w, it: os.preadv(fds[it[0]], [memoryview(slots[w])[:it[2]]], it[1]),
                            s.threads)
            finally:
                for fd in fds.values():
                    os.close(fd)
            return sum(n for _, _, n in share)
        return run
    out = {"read, rank 0 alone": timed_case(read(pieces), "cpu", dist, 3, active=rank == 0),
           "read, every rank its share": timed_case(read(pieces[rank::world]), "cpu", dist, 3)}
    for r in out["read, every rank its share"]:
        r["bytes"] = sum(n for _, _, n in pieces[rank::world])
    for r in out["read, rank 0 alone"]:
        r["bytes"] = sum(n for _, _, n in pieces)
    if device != "cpu":
        import cupy as cp
        index = int(device.split(":")[1])
        for name, active in (("pinned H2D, rank 0 alone", rank == 0), ("pinned H2D, every rank at once", True)):
            dist.barrier()
            out[name] = [{"seconds": t, "bytes": 2 << 30} for t in ce.copy_ceiling(cp, index, 2 << 30, 3)] \
                if active else []
    return out


def loads(args, files: list[str], device: str, rank: int, world: int, dist) -> dict[str, list[dict]]:
    fw = "pt"   # a process group shares torch tensors
    pg = dist.group.WORLD
    window = fs.settings.parse_size(args.exchange_bytes)

    def load(shard=None, group=True):
        return lambda: fs.load_file(args.ckpt, device=device, framework=fw, shard=shard,
                                    **({"process_group": pg, "exchange_bytes": window} if group else {}))
    cases = {"one GPU (rank 0 alone)": (load(group=False), rank == 0),
             "process_group": (load(), True),
             "every rank alone": (load(group=False), True)}
    if args.shard_dim is not None:
        cases[f"process_group, Shard(rank, {world}, {args.shard_dim})"] = (load(fs.Shard(rank, world, args.shard_dim)),
                                                                           True)
    out = {}
    for name, (fn, active) in cases.items():
        runs = timed_case(fn, device, dist, args.repeat, active)
        if active:
            got = fn()
            common.synchronize(device)
            for r in runs:
                r["bytes"] = common.tensor_bytes(got)
            del got
        dist.barrier()
        out[name] = runs
    return out


def report(args, everyone: list[dict], nbytes: int, files: list[str], world: int, backend: str) -> None:
    res = Results("dist", args.out)
    res.say(f"{nbytes / GB:.2f} GB in {len(files)} files, hot; {world} ranks ({backend}); a run takes its slowest "
            f"rank's time; best and median of {args.repeat}. GB/s: the group's for the ceilings, per rank for "
            "the loads", "")
    single = None
    rows = [("case", "best s", "median s", "GB/s", "x one GPU", "read / checkpoint")]
    for name in everyone[0]:
        per_run = list(zip(*[r[name] for r in everyone if r[name]]))   # runs x active ranks
        if not per_run:
            continue
        secs = [max(x["seconds"] for x in run) for run in per_run]
        best, med = min(secs), median(secs)
        ceiling = name.startswith(("read,", "pinned"))
        moved = [sum(x["bytes"] for x in run) / (1 if ceiling else len(run)) for run in per_run]
        rate = median([b / s for b, s in zip(moved, secs)])
        if name.startswith("one GPU"):
            single = best
        rows.append((("ceiling: " if ceiling else "") + name, f"{best:.3f}", f"{med:.3f}", f"{rate / GB:.2f}",
                     f"{best / single:.2f}" if single and not ceiling else "",
                     "" if ceiling else f"{sum(x['read'] for x in per_run[0]) / nbytes:.2f}"))
    res.table(rows, right={1, 2, 3, 4, 5})
    res.data.update(bytes=nbytes, world=world, backend=backend, ranks=everyone)
    res.save()


if __name__ == "__main__":
    sys.exit(main())
