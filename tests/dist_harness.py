"""Harness of the distributed-load tests (tests/distributed/test_distributed.py over gloo,
tests/distributed/test_gpu_distributed.py over NCCL).

Parent side: ``make_checkpoint``, ``start_world`` / ``collect`` (processes forked from a
forkserver that imported torch once), ``check_reports``. Rank side: ``main``, also runnable as

    python tests/dist_harness.py RANK WORLD INIT_FILE CKPT_DIR OUT_JSON BACKEND DEVICE

A rank runs every scenario on one process group and writes a JSON report: per scenario, whether this
rank's result equals a plain single-process load (compared byte for byte), the bytes this rank
read from disk during the distributed load, and the error it raised, if any. The parent asserts
on the reports of all ranks together (e.g. the bytes read add up to the selection exactly once).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import sys
import time
import traceback

import pytest


def main(rank: int, world: int, init_file: str, ckpt: str, out: str, backend: str, device: str) -> None:
    import torch
    import torch.distributed as dist

    import foxhunt_stream as fs
    from foxhunt_stream.io import source
    from foxhunt_stream.io.checkpoint import open_checkpoint
    from foxhunt_stream.distributed.load import DistributedLoadError

    torch.set_num_threads(1)
    device = device.replace("{rank}", str(rank))
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
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
            entry["bytes"] = sum(t.numel() * t.element_size() for t in ref.values())
        except DistributedLoadError as e:
            entry["error"] = str(e)
            entry["failures"] = sorted(e.failures)
        except Exception as e:   # anything else is a bug the parent reports
            entry["unexpected"] = traceback.format_exc()
            entry["type"] = type(e).__name__
        report[key] = entry

    scenario("full", rotated, None, exchange_bytes=1000)
    scenario("default_window", files, None)
    scenario("mixed_window", files, None, exchange_bytes=500 + 300 * rank)   # the group takes the smallest
    mine = [n for i, n in enumerate(names) if i % (world + 1) == rank]   # the last slice: nobody's
    scenario("subset", rotated, mine, exchange_bytes=777)
    scenario("shard", rotated, None, shard=fs.TPSlice(rank, world, TP_RULE), exchange_bytes=4096)
    # the last rank replicates everything the others slice: owners read whole and slice their own part
    scenario("tp_mixed", files, None, shard=fs.TPSlice(rank, world, None if rank == world - 1 else TP_RULE),
             exchange_bytes=300)
    # a file only the last rank cannot see
    bad = rotated if rank != world - 1 else rotated + [os.path.join(ckpt, "missing.safetensors")]
    scenario("missing", bad, None)
    scenario("unknown", files, ["w.big", "no.such.tensor"] if rank == world - 1 else None)
    # a read error injected on rank 0 only, while it loads what it owns
    if rank == 0:
        def hook(src, offset, length):
            raise OSError(5, "injected read error")
        source.fault_hook = hook
    try:
        scenario("fault", files, None)
        scenario("tp_fault", rotated, None, shard=fs.TPSlice(rank, world, TP_RULE))   # in its own slices too
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


# -- parent side ---------------------------------------------------------------------------------

TP_RULE = {"b.*": 1, "s.*": None, "*": 0}   # the "shard" scenario: column and row slices, a replicated scalar


def expected_tp_reads(ckpt: str, world: int) -> list[int]:
    """Bytes each rank should read in the "shard" scenario: the spans of its own slices (a column
    slice reads the row span it covers, as ``indexing.slice_runs`` plans it) plus its share of the
    replicated tensors (split by bytes with ``assign_owners``), each replicated byte read once."""
    import foxhunt_stream as fs
    from foxhunt_stream.distributed.ownership import assign_owners
    from foxhunt_stream.format.indexing import slice_runs
    from foxhunt_stream.format.tp import shard_index
    from foxhunt_stream.io.checkpoint import open_checkpoint
    ck = open_checkpoint(sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".safetensors")))
    reads = [0] * world
    replicated = []
    for name, (f, info) in ck.names.items():
        if fs.TPSlice(0, world, TP_RULE).dim_for(name) is None:
            replicated.append((name, info.nbytes, ck.paths[f]))
            continue
        for r in range(world):
            _, runs = slice_runs(info, ck.headers[f].data_start, shard_index(info.shape, fs.TPSlice(r, world, TP_RULE),
                                                                            name))
            reads[r] += sum(run.span for run in runs)
    for name, rank in assign_owners(replicated, world).items():
        reads[rank] += next(n for m, n, _ in replicated if m == name)
    return reads

def make_checkpoint(d) -> int:
    """Three files of mixed dtypes (a scalar, an empty tensor, odd sizes); returns total bytes."""
    import torch

    import foxhunt_stream as fs
    g = torch.Generator().manual_seed(0)
    files = {
        "a.safetensors": {"w.big": torch.randn(96, 70, generator=g),
                          "w.ints": torch.randint(-9, 9, (33, 5), generator=g, dtype=torch.int64),
                          "s.scalar": torch.tensor(3.5, dtype=torch.float64)},
        "b.safetensors": {"b.half": torch.randn(10, 24, generator=g).to(torch.bfloat16),
                          "w.bool": torch.rand(17, 3, generator=g) > 0.5,
                          "w.empty": torch.empty(0, 4, dtype=torch.float16)},
        "c.safetensors": {"w.u8": torch.randint(0, 255, (300,), generator=g, dtype=torch.uint8),
                          "b.f16": torch.randn(4, 1000, generator=g).to(torch.float16),
                          "w.small": torch.arange(7, dtype=torch.int32)},
    }
    total = 0
    for f, ts in files.items():
        fs.save_file(ts, os.path.join(d, f))
        total += sum(t.numel() * t.element_size() for t in ts.values())
    return total


def _context():
    """Workers fork from a forkserver that imported torch once: importing torch is most of the cost
    of a rank here (seconds each on this box), and a fork of the test process itself is unsafe."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "foxhunt_stream", "dist_harness"])
    return ctx


def start_world(tmp_path, world: int, backend: str = "gloo", device: str = "cpu"):
    """Start the WORLD ranks of one group (its own checkpoint and rendezvous file under tmp_path)."""
    base = tmp_path / f"world{world}"
    ckpt = base / "ckpt"
    ckpt.mkdir(parents=True)
    total = make_checkpoint(str(ckpt))
    ctx = _context()
    procs = [ctx.Process(target=run, args=(r, world, str(base / "init"), str(ckpt), str(base / f"r{r}.json"),
                                           backend, device))
             for r in range(world)]
    for p in procs:
        p.start()
    return world, base, procs, total


def collect(started, timeout: float = 120):
    """Wait for every rank of every started group; kill them all on a hang. -> [(world, reports, total)]"""
    out = []
    deadline = time.monotonic() + timeout
    try:
        for world, base, procs, total in started:
            for r, p in enumerate(procs):
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    pytest.fail(f"world {world} rank {r} still running after {timeout} s (deadlock)")
                err = base / f"r{r}.json.err"
                assert p.exitcode == 0, f"world {world} rank {r} exited {p.exitcode}:\n" + (
                    err.read_text() if err.exists() else "")
            out.append((world, [json.loads((base / f"r{r}.json").read_text()) for r in range(world)], total))
    finally:
        for _, _, procs, _ in started:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    return out


def check_reports(reports, world: int, total: int, ckpt: str | None = None) -> None:
    """Assert on the reports of every rank of one group; with ``ckpt`` (the checkpoint directory)
    also that each rank of the tensor-parallel scenario read exactly its own bytes."""
    for r, rep in enumerate(reports):
        for key, e in rep.items():
            assert "unexpected" not in e, f"rank {r} {key}: {e['unexpected']}"
    for key in ("full", "default_window", "mixed_window", "subset", "shard", "tp_mixed", "after"):
        for r, rep in enumerate(reports):
            assert "error" not in rep[key], f"rank {r} {key}: {rep[key]['error']}"
            assert rep[key]["mismatch"] is None, f"rank {r} {key}: {rep[key]['mismatch']}"
    # loaded once: the group read every selected byte exactly once, not once per rank
    for key in ("full", "default_window", "mixed_window", "after"):
        assert sum(rep[key]["read"] for rep in reports) == total, key
    # tensor parallel: each rank reads its own slices, and its share of the replicated tensors
    if ckpt is not None:
        want = expected_tp_reads(ckpt, world)
        assert [rep["shard"]["read"] for rep in reports] == want, (
            f"bytes read per rank {[rep['shard']['read'] for rep in reports]}, expected {want} "
            "(own slices + a share of the replicated tensors)")
    assert reports[0]["full"]["n"] == 9
    # ranks asked for different names (some names by nobody): each got exactly its own
    assert sum(rep["subset"]["n"] for rep in reports) == sum(1 for i in range(9) if i % (world + 1) < world)
    assert sum(rep["subset"]["read"] for rep in reports) == sum(rep["subset"]["bytes"] for rep in reports) < total
    # an error seen by one rank is raised on every rank, naming that rank
    for key, culprit in (("missing", world - 1), ("unknown", world - 1), ("fault", 0), ("tp_fault", 0)):
        for r, rep in enumerate(reports):
            assert "error" in rep[key], f"rank {r} did not raise in {key}"
            assert rep[key]["failures"] == [culprit], (key, rep[key])
    assert "missing.safetensors" in reports[0]["missing"]["error"]
    assert "injected read error" in reports[0]["fault"]["error"]
    assert "injected read error" in reports[0]["tp_fault"]["error"]
    assert "no.such.tensor" in reports[0]["unknown"]["error"]


if __name__ == "__main__":
    a = sys.argv[1:]
    run(int(a[0]), int(a[1]), a[2], a[3], a[4], a[5], a[6])
