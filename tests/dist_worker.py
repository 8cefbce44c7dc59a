"""One rank of the distributed-load tests (tests/test_distributed.py, tests/test_gpu_distributed.py).

    python tests/dist_worker.py RANK WORLD INIT_FILE CKPT_DIR OUT_JSON BACKEND DEVICE

Runs every scenario on one process group and writes a JSON report: per scenario, whether this
rank's result equals a plain single-process load (compared byte for byte), the bytes this rank
read from disk during the distributed load, and the error it raised, if any. The parent asserts
on the reports of all ranks together (e.g. the bytes read add up to the selection exactly once).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback


def main(rank: int, world: int, init_file: str, ckpt: str, out: str, backend: str, device: str) -> None:
    import torch
    import torch.distributed as dist

    import foxhunt_stream as fs
    from foxhunt_stream import source
    from foxhunt_stream.checkpoint import open_checkpoint
    from foxhunt_stream.distributed import DistributedLoadError

    torch.set_num_threads(1)
    device = device.replace("{rank}", str(rank))
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    pg = dist.group.WORLD
    files = sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    names = sorted(open_checkpoint(files).names)
    k = rank % len(files)
    rotated = files[k:] + files[:k]   # every rank lists the files in a different order
    report: dict = {}

    def same(got: dict, want: dict) -> str | None:
        if list(got) != list(want):
            return f"names {list(got)} != {list(want)}"
        for n in want:
            a, b = got[n], want[n]
            if a.dtype != b.dtype or a.shape != b.shape or str(a.device) != str(torch.device(device)):
                return f"{n}: {a.dtype} {tuple(a.shape)} {a.device} != {b.dtype} {tuple(b.shape)}"
            if not a.is_contiguous():
                return f"{n}: not contiguous"
            if not torch.equal(a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu()):
                return f"{n}: bytes differ"
        return None

    def scenario(key: str, src, want_names, shard=None, **kw):
        before = source.total_bytes_read()
        entry: dict = {}
        try:
            got = fs.load_file(src, device=device, framework="pt", names=want_names, shard=shard,
                               process_group=pg, threads=2, **kw)
            entry["read"] = source.total_bytes_read() - before
            ref = fs.load_file(src, framework="pt", names=want_names, shard=shard, threads=2)
            entry["mismatch"] = same(got, ref)
            entry["n"] = len(got)
        except DistributedLoadError as e:
            entry["error"] = str(e)
            entry["failures"] = sorted(e.failures)
        except Exception as e:   # anything else is a bug the parent reports
            entry["unexpected"] = traceback.format_exc()
            entry["type"] = type(e).__name__
        report[key] = entry

    scenario("full", rotated, None, exchange_bytes=1000)
    scenario("default_window", files, None)
    mine = [n for i, n in enumerate(names) if i % (world + 1) == rank]   # the last slice: nobody's
    scenario("subset", rotated, mine, exchange_bytes=777)
    scenario("shard", rotated, None, shard=fs.Shard(rank, world, {"b.*": 1, "s.*": None, "*": 0}),
             exchange_bytes=4096)
    # a file only the last rank cannot see
    bad = rotated if rank != world - 1 else rotated + [os.path.join(ckpt, "missing.safetensors")]
    scenario("missing", bad, None)
    # a read error injected on rank 0 only, while it loads what it owns
    if rank == 0:
        def hook(src, offset, length):
            raise OSError(5, "injected read error")
        source.fault_hook = hook
    try:
        scenario("fault", files, None)
    finally:
        source.fault_hook = None
    scenario("after", files, None, exchange_bytes=1 << 16)   # the group still works after errors
    with open(out, "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def run(*args) -> None:
    """Process entry point: a failure leaves its traceback next to the report (OUT_JSON.err)."""
    try:
        main(*args)
    except BaseException:
        with open(args[4] + ".err", "w") as f:
            f.write(traceback.format_exc())
        raise


if __name__ == "__main__":
    a = sys.argv[1:]
    run(int(a[0]), int(a[1]), a[2], a[3], a[4], a[5], a[6])
