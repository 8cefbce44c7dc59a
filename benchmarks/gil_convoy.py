#!/usr/bin/env python
"""How much reader threads slow a main thread that makes many small system calls (an import).

    python benchmarks/gil_convoy.py FILE [--rounds 4]

FILE: a big file in the page cache. Times 3 passes of ``os.stat`` over up to 20 000 files of this
Python's standard library and site-packages, alone and beside two threads that read FILE over
and over, either by 1 MiB ``preadv`` calls (each return takes the GIL back) or by 64 MiB
``sendfile`` calls into /dev/null (the way ``fs.prefetch`` warms). Prints microseconds per
``stat`` per case and round. Session 4 on the 2-core dev box: 2.2-4.0 us alone, 3.0-34.9 with
preadv readers (7-10x in 3 of 4 rounds), 3.3-6.1 with sendfile readers.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import threading
import time


def readers(path: str, how: str, stop: threading.Event) -> list[threading.Thread]:
    def preadv() -> None:
        fd = os.open(path, os.O_RDONLY)
        buf = memoryview(bytearray(1 << 20))
        while not stop.is_set():
            off = 0
            while not stop.is_set() and os.preadv(fd, [buf], off) > 0:
                off += 1 << 20
        os.close(fd)

    def sendfile() -> None:
        fd, null = os.open(path, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY)
        while not stop.is_set():
            off = 0
            while not stop.is_set():
                n = os.sendfile(null, fd, off, 64 << 20)
                if n <= 0:
                    break
                off += n
        os.close(fd)
        os.close(null)
    target = {"preadv": preadv, "sendfile": sendfile}[how]
    return [threading.Thread(target=target, daemon=True) for _ in range(2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    files: list[str] = []
    for root in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]):
        for d, _, names in os.walk(root):
            files += [os.path.join(d, n) for n in names]
            if len(files) >= 20_000:
                break
    files = files[:20_000]
    for r in range(args.rounds):
        for how in ("alone", "preadv", "sendfile"):
            stop = threading.Event()
            ts = [] if how == "alone" else readers(args.file, how, stop)
            for t in ts:
                t.start()
            time.sleep(0.2)
            t0 = time.perf_counter()
            for _ in range(3):
                for f in files:
                    os.stat(f)
            dt = time.perf_counter() - t0
            stop.set()
            for t in ts:
                t.join()
            print(f"round {r + 1} {how:<8} {dt / (3 * len(files)) * 1e6:6.1f} us per stat")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
