"""Does a disk streaming in the background slow a process that never touches the disk? (issue 6)

    python3 benchmarks/import_interference.py [--file /root/interference.bin] [--gib 16]

On a cold start the imports and the checkpoint's reads overlap; measured, ``import transformers``
then ran 15-19 s instead of 10-13. If the imports were waiting for their own files, a complete
import trace would fix that; if the streaming itself takes CPU from them (the VM's disk emulation,
interrupts, page-cache fills), nothing the prefetch does can, except not streaming. This tells
the two apart: a hot ``import torch, transformers`` (every file cached, so no disk I/O of its own)
and a pure-Python loop, each timed idle and while other threads stream a cold file off the disk
(evicted with ``POSIX_FADV_DONTNEED`` first; the imports' files stay cached). The CPU steal
time over each measurement comes from /proc/stat. Needs a writable disk path.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from foxhunt_stream.io.pagecache import sendfile_to_null  # noqa: E402

IMPORT = ("import time; t=time.perf_counter(); import torch; a=time.perf_counter(); import transformers; "
          "from transformers import LlamaForCausalLM; b=time.perf_counter(); print(f'{a-t:.3f} {b-a:.3f}')")


def steal_jiffies() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def python_loop() -> float:
    t = time.perf_counter()
    x = 0
    for i in range(20_000_000):
        x += i & 7
    return time.perf_counter() - t


def import_once() -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, timeout=120)
    a, b = out.stdout.split()
    return float(a), float(b)


class Stream:
    """Read ``path`` cold with 2 sendfile readers (64 MiB per call) until done or stopped."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        self.fd, self.read, self.stop = fd, 0, False
        self.started = time.perf_counter()
        offsets = iter(range(0, size, 64 << 20))
        lock = threading.Lock()

        def work():
            while not self.stop:
                with lock:
                    off = next(offsets, None)
                if off is None:
                    return
                n = sendfile_to_null(fd, off, min(64 << 20, size - off)) or 0
                with lock:
                    self.read += n
        self.threads = [threading.Thread(target=work, daemon=True) for _ in range(2)]
        for t in self.threads:
            t.start()

    def close(self) -> float:
        self.stop = True
        for t in self.threads:
            t.join()
        os.close(self.fd)
        return self.read / (time.perf_counter() - self.started) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default="/root/interference.bin")
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    if not os.path.exists(args.file) or os.path.getsize(args.file) < args.gib << 30:
        t = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={args.file}", "bs=64M", f"count={args.gib * 16}", "oflag=direct",
                        "status=none"], check=True)
        print(f"wrote {args.file}: {args.gib} GiB in {time.perf_counter() - t:.1f} s", flush=True)
    import_once()   # the imports' files cached
    hz = os.sysconf("SC_CLK_TCK")
    for what, fn in (("hot import torch | transformers (s)", import_once), ("python loop, 20M steps (s)", python_loop)):
        for streaming in (False, True, False, True)[:2 * args.repeat]:
            st = Stream(args.file) if streaming else None
            s0 = steal_jiffies()
            r = fn()
            steal = (steal_jiffies() - s0) / hz
            rate = st.close() if st else 0.0
            shown = " | ".join(f"{x:.2f}" for x in r) if isinstance(r, tuple) else f"{r:.2f}"
            print(f"{what:38} {'streaming' if streaming else 'idle':9} {shown:>14}   steal {steal:5.2f} CPU-s"
                  + (f"   disk {rate:.2f} GB/s" if streaming else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
