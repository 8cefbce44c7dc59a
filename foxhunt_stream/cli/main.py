"""The ``foxhunt-stream`` command (also ``python -m foxhunt_stream``).

    foxhunt-stream inspect SOURCE [--json]        tensors, sizes, metadata, validation verdict
    foxhunt-stream verify SOURCE                  headers, index, every byte, checksums
    foxhunt-stream bench [SOURCE] [options]       the built-in benchmark
    foxhunt-stream reshard SOURCE OUT --max-shard-size 5GB

Exit codes: 0 success, 1 invalid checkpoint or failed operation, 2 usage error. Errors are one
line on stderr naming the file, tensor and rule; ``--debug`` shows the traceback and debug logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Sequence

from .. import __version__
from .. import settings as _settings
from ..io.checkpoint import INDEX_NAME, Checkpoint, open_checkpoint
from ..errors import FormatError
from .text import describe_error, fmt_bytes, table

PROG = "foxhunt-stream"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# ---------------------------------------------------------------- helpers

def _size(text: str) -> int:
    """argparse type for sizes: ``5GB``, ``500MiB``, ``1048576``."""
    try:
        return _settings.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _source_kind(source: str) -> str:
    if os.path.isdir(source):
        return "index" if os.path.isfile(os.path.join(source, INDEX_NAME)) else "directory"
    return "index" if source.endswith(".json") else "file"


# ---------------------------------------------------------------- inspect

def checkpoint_summary(source: str, ck: Checkpoint) -> dict[str, Any]:
    """What ``inspect --json`` prints: every tensor in file order, per-file and total figures."""
    tensors, dtypes = [], {}
    files = sorted(zip(ck.paths, ck.headers), key=lambda ph: ph[0])   # an index lists them by tensor name
    for path, h in files:
        fname = os.path.basename(path)
        for t in h.tensors:
            tensors.append({"name": t.name, "dtype": t.dtype.name, "shape": list(t.shape), "bytes": t.nbytes,
                            "file": fname, "data_offsets": [t.start, t.end]})
            d = dtypes.setdefault(t.dtype.name, {"tensors": 0, "bytes": 0})
            d["tensors"] += 1
            d["bytes"] += t.nbytes
    return {
        "source": source,
        "kind": _source_kind(source),
        "valid": True,
        "files": [{"path": p, "size": h.file_size, "header_bytes": h.data_start, "tensors": len(h.tensors),
                   "metadata": h.metadata} for p, h in files],
        "tensors": tensors,
        "total_tensors": len(tensors),
        "total_bytes": sum(t["bytes"] for t in tensors),
        "dtypes": dtypes,
        "metadata": ck.metadata(),
        "index_metadata": ck.index_metadata,
    }


def _json_text(info: dict[str, Any]) -> str:
    """Indented JSON with one compact line per tensor (quick for 100k tensors)."""
    head = {k: v for k, v in info.items() if k != "tensors"}
    text = json.dumps(head, indent=2, ensure_ascii=False)
    rows = ",\n".join("    " + json.dumps(t, ensure_ascii=False) for t in info["tensors"])
    return text[:-2] + ',\n  "tensors": [' + ("\n" + rows + "\n  " if rows else "") + "]\n}\n"


def _error_json(source: str, e: BaseException) -> dict[str, Any]:
    err = {"message": describe_error(e), "type": type(e).__name__}
    if isinstance(e, FormatError):
        err.update(rule=e.rule, path=e.path, tensor=e.tensor)
    return {"source": source, "valid": False, "error": err}


def cmd_inspect(args) -> int:
    try:
        ck = open_checkpoint(args.source)
    except Exception as e:
        if args.json and not args.debug:
            print(json.dumps(_error_json(args.source, e), indent=2))
            print(f"{PROG} inspect: error: {describe_error(e)}", file=sys.stderr)
            return EXIT_FAILED
        raise
    info = checkpoint_summary(args.source, ck)
    if args.json:
        sys.stdout.write(_json_text(info))
        return EXIT_OK
    out = [f"source: {args.source} ({info['kind']}, {len(ck.paths)} file{'s' if len(ck.paths) != 1 else ''})", ""]
    rows = [("name", "dtype", "shape", "bytes", "file")]
    rows += [(t["name"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]", f"{t['bytes']:,}", t["file"])
             for t in info["tensors"]]
    out += table(rows, right={3})
    out.append("")
    if len(ck.paths) > 1:
        frows = [("file", "tensors", "bytes", "header")]
        frows += [(os.path.basename(f["path"]), str(f["tensors"]), f"{f['size']:,}", f"{f['header_bytes']:,}")
                  for f in info["files"]]
        out += table(frows, right={1, 2, 3}) + [""]
    by_dtype = ", ".join(f"{k} {v['tensors']} ({fmt_bytes(v['bytes'])})" for k, v in info["dtypes"].items())
    out.append(f"total: {info['total_tensors']:,} tensors, {fmt_bytes(info['total_bytes'])} "
               f"({info['total_bytes']:,} bytes){'; ' + by_dtype if by_dtype else ''}")
    meta = info["metadata"]
    if meta is not None:   # long values (checksum tables) are in --json; here, only their length
        meta = {k: v if len(v) <= 100 else f"<{len(v):,} characters>" for k, v in meta.items()}
    out.append(f"metadata: {json.dumps(meta, ensure_ascii=False) if meta is not None else 'none'}")
    checked = "headers" + (" and index" if info["kind"] == "index" else "")
    out.append(f"valid: yes ({checked} follow every format rule)")
    sys.stdout.write("\n".join(out) + "\n")
    return EXIT_OK


# ---------------------------------------------------------------- verify

def cmd_verify(args) -> int:
    checks = "headers" + (", index" if _source_kind(args.source) == "index" else "")
    if args.headers_only:
        ck = open_checkpoint(args.source)
        total = sum(info.nbytes for _, info in ck.names.values())
        print(f"OK {args.source}: {len(ck.paths)} file(s), {len(ck.names):,} tensors, {fmt_bytes(total)}; "
              f"checked: {checks} (no data read)")
        return EXIT_OK
    from ..integrity.verify import verify
    r = verify(args.source, require_checksums=args.require_checksums)   # raises the first problem
    if r.checked:
        digests = f"{r.checked:,} of {r.tensors:,} tensors match their {'/'.join(r.algorithms)} digests"
    else:
        digests = "no checksums stored (save with checksum='xxh3-64' to have them)"
    print(f"OK {args.source}: {len(r.files)} file(s), {r.tensors:,} tensors, {fmt_bytes(r.bytes_read)} read; "
          f"{checks}, every byte readable; {digests}")
    return EXIT_OK


# ---------------------------------------------------------------- bench

def cmd_bench(args) -> int:
    from . import bench
    if args.plot:
        bench.require_matplotlib()   # fail before a long run, not after it
    say = (lambda msg: print(msg, file=sys.stderr)) if not args.quiet else None
    warn = lambda msg: print(f"{PROG} bench: {msg}", file=sys.stderr)   # noqa: E731 - even with --quiet
    options = {"threads": args.threads} if args.threads else {}
    report = bench.run(args.source, device=args.device, size=args.size, shards=args.shards, cold=args.cold,
                       peers=args.peers, reps=args.reps, saves=not args.no_save, workdir=args.workdir, log=say,
                       warn=warn, **options)
    print(report.table())
    if args.json:
        bench.write_json(report, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        bench.plot(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return EXIT_OK


# ---------------------------------------------------------------- reshard

def cmd_reshard(args) -> int:
    from ..engine.reshard import reshard
    written = reshard(args.source, args.out, args.max_shard_size, fsync=not args.no_fsync, checksum=args.checksum,
                      progress=False if args.quiet else None)
    shards = [p for p in written if p.endswith(".safetensors")]
    total = sum(os.path.getsize(p) for p in shards)
    print(f"wrote {len(shards)} shard(s), {fmt_bytes(total)}, to {args.out}"
          + (f" (index: {INDEX_NAME})" if len(written) > len(shards) else ""))
    return EXIT_OK


# ---------------------------------------------------------------- parser and main

def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks and debug logs (backend, threads, staging, GB/s)")
    p = argparse.ArgumentParser(
        prog=PROG, parents=[common],
        description="Inspect, verify, benchmark and reshard safetensors checkpoints with foxhunt_stream.",
        epilog="SOURCE is a .safetensors file, a model.safetensors.index.json, or a directory holding "
               "either. Exit codes: 0 ok, 1 invalid or failed, 2 usage error.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    q = sub.add_parser("inspect", parents=[common], help="list tensors, sizes, metadata; validate",
                       description="List the tensors of a checkpoint (name, dtype, shape, bytes, shard file) "
                                   "with totals and metadata, after validating every header and the index.")
    q.add_argument("source", metavar="SOURCE")
    q.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    q.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", parents=[common], help="verify headers, index, every byte and checksums",
                       description="Validate every header and the index, then read every byte once and check it "
                                   "against the stored digests (foxhunt_stream.verify). Exits 1 with a message "
                                   "on the first problem.")
    v.add_argument("source", metavar="SOURCE")
    v.add_argument("--headers-only", action="store_true", help="check headers and index only; read no data")
    v.add_argument("--require-checksums", action="store_true", help="a tensor without a stored digest is an error")
    v.set_defaults(func=cmd_verify)

    b = sub.add_parser("bench", parents=[common], help="the built-in benchmark",
                       description="Measure ceilings, foxhunt_stream and safetensors load/save on the best "
                                   "device present. Without SOURCE, a synthetic bf16 checkpoint is written "
                                   "to a temporary directory first.")
    b.add_argument("source", metavar="SOURCE", nargs="?", help="checkpoint to load (default: synthetic)")
    b.add_argument("--device", default="auto", help="cuda:N or cpu (default: cuda:0 if usable, else cpu)")
    b.add_argument("--size", type=_size, default=None,
                   help="synthetic checkpoint size, e.g. 512MiB (default: 1GiB on the CPU, 8GiB on a GPU)")
    b.add_argument("--shards", type=_positive_int, default=1, help="synthetic checkpoint shards (default 1)")
    b.add_argument("--reps", type=_positive_int, default=3, help="repetitions per figure (median; default 3)")
    b.add_argument("--threads", type=_positive_int, default=None, help="worker threads (default: per CPU)")
    b.add_argument("--cold", action="store_true", help="drop the page cache before every read")
    b.add_argument("--peers", action="store_true",
                   help="also run InstantTensor, kvikio and fastsafetensors where installed (each load in a new process)")
    b.add_argument("--no-save", action="store_true", help="skip the save figures")
    b.add_argument("--workdir", default=None, help="directory for temporary files (default: system temp)")
    b.add_argument("--json", metavar="OUT.json", default=None, help="also write the results as JSON")
    b.add_argument("--plot", metavar="OUT.png", default=None, help="also draw a bar chart (needs matplotlib)")
    b.add_argument("-q", "--quiet", action="store_true", help="print only the table")
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("reshard", parents=[common], help="rewrite a checkpoint into new shards",
                       description="Rewrite SOURCE into OUT as shards of at most --max-shard-size bytes, one "
                                   "shard in memory at a time; tensors stay byte-identical; the index is "
                                   "written last.")
    r.add_argument("source", metavar="SOURCE")
    r.add_argument("out", metavar="OUT", help="output directory (created; must not hold a checkpoint)")
    r.add_argument("--max-shard-size", type=_size, required=True, help="e.g. 5GB, 500MiB, 1048576")
    r.add_argument("--checksum", choices=("xxh3-64", "crc32c"), default=None,
                   help="store per-tensor digests in the new shards")
    r.add_argument("--no-fsync", action="store_true", help="skip fsync (faster, not crash-safe)")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    r.set_defaults(func=cmd_reshard)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.debug = getattr(args, "debug", False)
    logging.basicConfig(format=f"{PROG}: %(name)s: %(message)s", stream=sys.stderr)
    if args.debug:
        logging.getLogger("foxhunt_stream").setLevel(logging.DEBUG)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into `head` and the like: not an error worth a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    except Exception as e:
        if args.debug:
            raise
        print(f"{PROG} {args.command}: error: {describe_error(e)}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
