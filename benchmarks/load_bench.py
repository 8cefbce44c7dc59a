"""Hot loads (the checkpoint in the page cache) in one process, to choose the defaults: a thread
sweep, a chunk-size sweep, and what verify=True costs. (The hot load against its ceiling and the
peer loaders, each load in a new process as a server meets it, is ``fresh_bench.py``.)

    python benchmarks/load_bench.py CKPT --threads 8,12,16,24,32 [--out DIR] # suite "threads"
    python benchmarks/load_bench.py CKPT --chunks 8MiB,8MiB/4MiB,4MiB [--out DIR]   # suite "chunks"
    python benchmarks/load_bench.py CKPT --verify [--out DIR]                # suite "verify"
    python benchmarks/load_bench.py /tmp/ck --size 64MiB --device cpu --threads 1,2   # a smoke run on any box

threads: foxhunt_stream's hot load with each thread count, beside the page cache -> pinned read
with the same threads, in ``--rounds`` interleaved rounds (medians), with the CPU seconds and
involuntary context switches each load cost: where more threads than CPUs stop paying.

chunks: by chunk size, each with the default two pinned slots per worker (staging = chunk x 2 x
threads); "8MiB/4MiB" is 8 MiB slots with contiguous runs read in 4 MiB pieces (``read_bytes``),
in ``--rounds`` interleaved rounds in one process (medians): the full hot load and rank 0 of TP=8
under tp_bench's rows, Llama and columns plans, in seconds and as fractions of the full load at
the same size. One process, because the machine's speed drifts between processes by as
much as the sizes differ. The process holds one pinned pool per GPU and a new size replaces it, so
within a round each size's loads run together after an untimed ``fs.warmup`` that pins its pool.

verify: the checkpoint saved once with checksum="xxh3-64" into /dev/shm, then loaded with
verify off, on (hashed on the GPU where the tensors land) and on as read (hashed on the host),
in interleaved rounds; the cost is each median over the unverified median.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common  # noqa: F401  (puts the repository on the path)
from common import GB, Results, ce, median

import foxhunt_stream as fs
from foxhunt_stream.cuda.devices import parse_device



def nbytes_of(files: list[str]) -> int:
    return sum(t.nbytes for p in files for t in fs.read_header(p).tensors)


def load_ceilings(files: list[str], device: str, threads: int, chunk: int, reps: int) -> dict[str, float]:
    """GB/s of what a hot load cannot beat, measured now."""
    out = {}
    slots = None
    if device != "cpu":
        import cupy as cp
        index = parse_device(device).index
        out["pinned host -> device (1 GiB copy)"] = (1 << 30) / median(ce.copy_ceiling(cp, index, 1 << 30, reps)) / GB
        with cp.cuda.Device(index):
            slots = [ce.pinned_buffer(cp, chunk) for _ in range(threads)]
    import numpy as np
    slots = slots or [np.empty(chunk, np.uint8) for _ in range(threads)]
    size = sum(os.path.getsize(p) for p in files)
    where = "pinned" if device != "cpu" else "host"
    out[f"page cache -> {where} (preadv, {threads} threads)"] = size / median(
        ce.read_ceiling(files, threads, reps, chunk, slots)) / GB
    return out


def suite_threads(args, files: list[str], res: Results) -> None:
    import numpy as np
    counts = [int(x) for x in args.threads.split(",")]
    s = fs.settings.merge()
    nbytes, size = nbytes_of(files), sum(os.path.getsize(p) for p in files)
    fw = common.framework(args.device)
    ce.warm(files)
    slots = [np.empty(s.chunk_bytes, np.uint8) for _ in range(max(counts))]
    if args.device != "cpu":
        import cupy as cp
        with cp.cuda.Device(parse_device(args.device).index):
            slots = [ce.pinned_buffer(cp, s.chunk_bytes) for _ in range(max(counts))]
    usage: dict[int, list[tuple[float, int]]] = {n: [] for n in counts}

    def load(n: int):
        def run():
            u0 = common.cpu_usage()
            out = fs.load_file(args.ckpt, device=args.device, framework=fw, threads=n)
            u1 = common.cpu_usage()
            usage[n].append((u1[0] + u1[1] - u0[0] - u0[1], u1[2] - u0[2]))
            return out
        return run
    cases = {}
    for n in counts:
        cases[f"load {n}"] = load(n)
        cases[f"read {n}"] = lambda n=n: ce.read_ceiling(files, n, 1, s.chunk_bytes, slots, warmup=0)
    times = common.interleaved(cases, args.rounds, args.device)
    res.say(f"hot load of {nbytes / GB:.2f} GB to {args.device} by thread count, {os.cpu_count()} CPUs; "
            f"medians of {args.rounds} interleaved rounds", "")
    rows = [("threads", "load GB/s", "x read", "read GB/s", "load s", "CPU s per load", "invol. switches")]
    for n in counts:
        load_s, read_s = median(times[f"load {n}"]), median(times[f"read {n}"])
        cpu = median([c for c, _ in usage[n]])
        switches = median([float(v) for _, v in usage[n]])
        rows.append((str(n), f"{nbytes / load_s / GB:.2f}", f"{(nbytes / load_s) / (size / read_s):.2f}",
                     f"{size / read_s / GB:.2f}", f"{load_s:.3f}", f"{cpu:.2f}", f"{switches:.0f}"))
    res.table(rows, right=set(range(7)))
    res.data.update(bytes=nbytes, counts=counts, seconds=times, usage=usage)


def _chunk_variant(text: str) -> tuple[int, int]:
    """"8MiB" (slots and reads of 8 MiB) or "8MiB/4MiB" (8 MiB slots, contiguous reads of 4 MiB)."""
    slot, _, read = text.partition("/")
    return fs.settings.parse_size(slot), fs.settings.parse_size(read or slot)


def _variant_label(slot: int, read: int) -> str:
    return f"{slot >> 20} MiB" if read == slot else f"{slot >> 20} MiB, reads {read >> 20} MiB"


def suite_chunks(args, files: list[str], res: Results) -> None:
    from tp_bench import LLAMA_PLAN

    from foxhunt_stream.io import mapping
    variants = [_chunk_variant(x) for x in args.chunks.split(",")]
    threads = fs.settings.merge().threads
    nbytes = nbytes_of(files)
    fw = common.framework(args.device)
    shapes = {t.name: tuple(t.shape) for p in files for t in fs.read_header(p).tensors}
    plans = {"full load": None, "rows": lambda n: 0 if len(shapes[n]) >= 2 else None, "Llama plan": LLAMA_PLAN,
             "columns": lambda n: 1 if len(shapes[n]) >= 2 else None}
    ce.warm(files)

    def options(slot: int, read: int) -> dict:
        return dict(chunk_bytes=slot, read_bytes=read, staging_bytes=2 * slot * threads)

    def load(variant, dim):
        shard = None if dim is None else fs.TPSlice(0, 8, dim)
        return lambda: fs.load_file(args.ckpt, device=args.device, framework=fw, shard=shard, **options(*variant))
    # the process keeps one pinned pool per GPU and a new size replaces it: each variant's loads run
    # together, after an untimed warmup that pins its pool, so no load times the pinning; after each
    # load, untimed, the wait for its mappings to be unmapped (a gathering plan's), as tp_bench does
    times: dict[str, list[float]] = {f"{plan}, {_variant_label(*v)}": [] for v in variants for plan in plans}
    for r in range(args.rounds + 1):   # round 0: a warmup round, not kept
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            fs.warmup(args.device, **options(*v))
            names = list(plans)
            for plan in names[r % len(names):] + names[:r % len(names)]:
                seconds = common.timed(load(v, plans[plan]), args.device)
                mapping.wait_unmapped()
                if r:
                    times[f"{plan}, {_variant_label(*v)}"].append(seconds)
    res.say(f"hot loads of a {nbytes / GB:.2f} GB checkpoint to {args.device} by chunk size ({threads} threads, "
            f"2 pinned slots each); rank 0 of TP=8; medians of {args.rounds} interleaved rounds", "")
    rows = [("chunk", *(f"{plan} s" for plan in plans), *(f"{plan} / full" for plan in list(plans)[1:]),
             "full GB/s")]
    for v in variants:
        t = {plan: median(times[f"{plan}, {_variant_label(*v)}"]) for plan in plans}
        rows.append((_variant_label(*v), *(f"{t[plan]:.4f}" for plan in plans),
                     *(f"{t[plan] / t['full load']:.3f}" for plan in list(plans)[1:]),
                     f"{nbytes / t['full load'] / GB:.2f}"))
    res.table(rows, right=set(range(1, len(rows[0]))))
    res.data.update(bytes=nbytes, chunks=[v[0] for v in variants], reads=[v[1] for v in variants], threads=threads,
                    seconds=times)


def suite_verify(args, files: list[str], res: Results) -> None:
    fw = common.framework(args.device)
    dst = os.path.join(args.verify_dir, "foxhunt-bench-verify.safetensors")
    tensors = fs.load_file(args.ckpt, device=args.device, framework=fw)
    nbytes = common.tensor_bytes(tensors)
    try:
        fs.save_file(tensors, dst, checksum="xxh3-64", fsync=False)
        del tensors
        ce.warm([dst])
        cases = {"verify off": lambda: fs.load_file(dst, device=args.device, framework=fw),
                 "verify on (default: on the GPU where tensors land)":
                     lambda: fs.load_file(dst, device=args.device, framework=fw, verify=True),
                 "verify on, hashed as read (verify_on='read')":
                     lambda: fs.load_file(dst, device=args.device, framework=fw, verify=True, verify_on="read")}
        times = common.interleaved(cases, args.rounds, args.device)
    finally:
        if os.path.exists(dst):
            os.unlink(dst)
    base = median(times["verify off"])
    res.say(f"hot load of one {nbytes / GB:.2f} GB file (saved with checksum='xxh3-64' in {args.verify_dir}) "
            f"to {args.device}; medians of {args.rounds} interleaved rounds", "")
    rows = [("case", "GB/s", "median s", "cost")]
    for name, ts in times.items():
        rows.append((name, f"{nbytes / median(ts) / GB:.2f}", f"{median(ts):.3f}",
                     "" if name == "verify off" else f"{100 * (median(ts) / base - 1):+.1f}%"))
    res.table(rows, right={1, 2, 3})
    res.data.update(bytes=nbytes, seconds=times)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="timed loads per case for the ceilings (median; default 5)")
    ap.add_argument("--threads", default=None, help="thread sweep instead: a comma list, e.g. 8,12,16,24,32")
    ap.add_argument("--chunks", default=None, help="chunk size sweep instead: a comma list of SLOT or SLOT/READ, "
                                                       "e.g. 8MiB,8MiB/4MiB,4MiB")
    ap.add_argument("--verify", action="store_true", help="the cost of verify=True instead")
    ap.add_argument("--verify-dir", default="/dev/shm", help="where the checksummed copy goes (default /dev/shm)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds of --threads / --chunks / --verify (default 5)")
    args = ap.parse_args(argv)
    files = common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    if not (args.threads or args.chunks or args.verify):
        ap.error("give --threads, --chunks or --verify (the hot load against its ceiling and the peers, each "
                 "load in a new process, is fresh_bench.py)")
    suite, run = (("threads", suite_threads) if args.threads else ("chunks", suite_chunks) if args.chunks
                  else ("verify", suite_verify))
    res = Results(suite, args.out)
    run(args, files, res)
    res.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
