#!/usr/bin/env python
"""What reading a hostile header costs: wall time and peak RSS, ours against safetensors.

    python tools/header_cost.py DIR [--as-limit-gb 1.5] [--shapes empty-arrays,million,...]

Writes each shape's file into DIR once (a ~100 MB header; kept for later runs), then reads it in
a fresh child process per reader and prints the seconds the read took and the child's peak RSS
(``resource.getrusage``, which includes the interpreter and the file's bytes). Readers:
``foxhunt_stream.read_header``; ``foxhunt_stream.load_file`` (shapes with many tensors); and
safetensors' ``safe_open`` and ``safetensors.numpy.load_file``. ``--as-limit-gb`` caps each
child's address space (``RLIMIT_AS``): a reader that needs more fails with its MemoryError.

Shapes: ``empty-arrays``, one tensor whose unknown field holds 33 million empty arrays;
``million``, 1,000,000 one-byte tensors; and, as ``--shapes`` names them, unknown fields holding
other values back to back (``objects``, ``two-member-objects``, ``depth-7``, ``spaced``...).
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = 100_000_000
ENTRY = '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":['

# the values an unknown field holds, back to back, for a 100 MB header
FILLERS = {"empty-arrays": "[]", "objects": "{}", "two-member-objects": '{"a":0,"b":1}', "one-element": "[0]",
           "strings": '"ab"', "floats": "1.5", "spaced": "[ ]", "depth-6": "[" * 6 + "]" * 6,
           "depth-7": "[" * 7 + "]" * 7, "depth-60": "[" * 60 + "]" * 60, "object-chain-7": '{"a":' * 7 + "0" + "}" * 7}


def write_filled(path: str, filler: str) -> None:
    tail = "]}}"
    k = (HEADER - len(ENTRY) - len(tail) + 1) // (len(filler) + 1)
    body = (ENTRY + ",".join([filler] * k) + tail).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + bytes(8))


def write_million(path: str, n: int = 1_000_000) -> None:
    parts = [f'"t{i:07d}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(n)]
    body = ("{" + ",".join(parts) + "}").encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + bytes(n))


CHILD = r"""
import resource, sys, time
reader, path, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (int(limit * 2**30),) * 2)
t0 = None
try:
    if reader.startswith("ours"):
        import foxhunt_stream as fs
        read_header, load_file = fs.read_header, fs.load_file   # (the package imports its modules on first use)
        read = (lambda: read_header(path).tensors) if reader == "ours-header" else (lambda: load_file(path))
    elif reader == "safetensors":
        import safetensors
        def read():
            with safetensors.safe_open(path, "numpy") as f:
                return f.keys()
    else:
        import safetensors.numpy
        read = lambda: safetensors.numpy.load_file(path)
    t0 = time.perf_counter()
    result = f"{len(read())} tensors"
except BaseException as e:
    result = f"{type(e).__name__}: {str(e)[:80]}"
seconds = time.perf_counter() - t0 if t0 else 0.0
print(f"{seconds:.2f} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} {result}")
"""


def measure(reader: str, path: str, limit_gb: float) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", CHILD, reader, path, str(limit_gb)], capture_output=True, text=True,
                         env=env)
    if out.returncode:
        return f"exit {out.returncode}: {out.stderr.strip()[-200:]}"
    seconds, gib, result = out.stdout.split(" ", 2)
    return f"{float(seconds):7.2f} s  {float(gib):6.2f} GiB peak RSS  {result.strip()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="where the files are written (about 100 MB each)")
    p.add_argument("--as-limit-gb", type=float, default=0.0, help="address-space limit per child (0: none)")
    p.add_argument("--shapes", default="empty-arrays,million", help=f"million, {', '.join(FILLERS)}")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    for shape in args.shapes.split(","):
        path = os.path.join(args.dir, shape + ".safetensors")
        if not os.path.exists(path):
            write_million(path) if shape == "million" else write_filled(path, FILLERS[shape])
        readers = ["ours-header", "ours-load", "safetensors", "safetensors-load"] if shape == "million" else [
            "ours-header", "safetensors"]
        print(f"{shape}: {os.path.getsize(path):,} bytes", flush=True)
        for reader in readers:
            print(f"  {reader:17s} {measure(reader, path, args.as_limit_gb)}", flush=True)


if __name__ == "__main__":
    main()
