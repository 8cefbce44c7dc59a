"""Distributed load: every rank of a torchrun group loads a checkpoint with process_group=.

    torchrun --nproc-per-node 2 benchmarks/dist_bench.py CKPT [--exchange-bytes 64MiB] [--repeat 3]
    torchrun --nproc-per-node 2 benchmarks/dist_bench.py /dev/shm/dist --make 8GiB      # build one first
    torchrun --nproc-per-node 2 benchmarks/dist_bench.py CKPT --shard-dim 0             # TP shards
    torchrun --nproc-per-node 3 benchmarks/dist_bench.py /tmp/d --make 64MiB --device cpu   # CPU box, gloo

Per rank and per run: wall time of the load (from a barrier to the tensors being on the device),
tensor bytes this rank read from disk (foxhunt_stream.io.source.total_bytes_read), bytes it ended
with. ``--baseline`` also times the plain load (no process_group: every rank reads everything).
Rank 0 prints the table and, with ``--out``, writes it as JSON. The page-cache residency of the
files before the first run is printed too: a warm cache makes disk reads look free.
NCCL on CUDA devices (cuda:LOCAL_RANK), gloo on the CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import foxhunt_stream as fs  # noqa: E402
from foxhunt_stream.io import pagecache, source as fsource  # noqa: E402
from foxhunt_stream.io.checkpoint import open_checkpoint  # noqa: E402
from foxhunt_stream.settings import parse_size  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def one_run(fn, device: str) -> dict:
    dist.barrier()
    before = fsource.total_bytes_read()
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    got = sum(t.numel() * t.element_size() for t in out.values())
    del out
    return {"seconds": seconds, "read": fsource.total_bytes_read() - before, "bytes": got}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--device", default="auto", help="auto: cuda:LOCAL_RANK when CUDA is there, else cpu")
    ap.add_argument("--exchange-bytes", default="64MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shard-dim", type=int, default=None, help="load Shard(rank, world, dim) slices")
    ap.add_argument("--baseline", action="store_true", help="also time the plain per-rank load")
    ap.add_argument("--make", default=None, help="build a Llama-shaped checkpoint of this size at CKPT first")
    ap.add_argument("--shards", type=int, default=4, help="files of the --make checkpoint")
    ap.add_argument("--out", default=None, help="JSON file for the table (rank 0)")
    ap.add_argument("-v", "--verbose", action="store_true", help="per-rank phase times (debug log)")
    a = ap.parse_args()
    if a.verbose:
        logging.basicConfig(format="%(message)s")
        logging.getLogger("foxhunt_stream").setLevel(logging.DEBUG)

    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = a.device.startswith("cuda") or (a.device == "auto" and torch.cuda.is_available())
    device = (f"cuda:{local}" if a.device == "auto" else a.device) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if cuda else "gloo")
    pg, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()

    if a.make and rank == 0 and not os.path.exists(a.ckpt):
        from tp_bench import make_checkpoint
        make_checkpoint(a.ckpt, parse_size(a.make), a.shards)
    dist.barrier()
    ck = open_checkpoint(a.ckpt)
    total = sum(info.nbytes for _, info in ck.names.values())
    resident = [round(pagecache.resident_fraction(p), 3) for p in ck.paths]
    shard = fs.Shard(rank, world, a.shard_dim) if a.shard_dim is not None else None
    window = parse_size(a.exchange_bytes)

    cases = {"distributed": lambda: fs.load_file(a.ckpt, device=device, framework="pt", shard=shard,
                                                 process_group=pg, exchange_bytes=window)}
    if a.baseline:
        cases["per-rank"] = lambda: fs.load_file(a.ckpt, device=device, framework="pt", shard=shard)
    mine = {name: [one_run(fn, device) for _ in range(a.repeat)] for name, fn in cases.items()}
    everyone = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "device": device, "runs": mine})
    if rank == 0:
        print(f"checkpoint {a.ckpt}: {len(ck.paths)} file(s), {len(ck.names)} tensors, {total / 1e9:.3f} GB; "
              f"world {world}, {'nccl' if cuda else 'gloo'}, exchange window {window} B, "
              f"shard dim {a.shard_dim}; page-cache residency before: {resident}")
        print(f"{'case':12} {'rank':>4} {'device':8} {'run':>3} {'seconds':>8} {'read GB':>8} {'got GB':>7} {'GB/s':>6}")
        for name in cases:
            for r in everyone:
                for i, run in enumerate(r["runs"][name]):
                    print(f"{name:12} {r['rank']:>4} {r['device']:8} {i:>3} {run['seconds']:8.3f} "
                          f"{run['read'] / 1e9:8.3f} {run['bytes'] / 1e9:7.3f} {run['bytes'] / 1e9 / run['seconds']:6.2f}")
            reads = [sum(run["read"] for run in r["runs"][name]) / a.repeat for r in everyone]
            best = min(max(r["runs"][name][i]["seconds"] for r in everyone) for i in range(a.repeat))
            print(f"{name}: group read {sum(reads) / 1e9:.3f} GB per load ({sum(reads) / total:.2f}x the "
                  f"checkpoint), slowest rank best run {best:.3f} s")
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"ckpt": a.ckpt, "total": total, "world": world, "window": window,
                           "shard_dim": a.shard_dim, "resident": resident, "ranks": everyone}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
