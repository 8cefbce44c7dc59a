"""Where does a cold start's main thread wait? A sampler thread for the startup benchmark's child.

Every ``interval`` seconds it reads the main thread's scheduler state (``/proc/self/task/T/stat``),
and when the thread is in uninterruptible sleep (``D``: waiting for the disk) also its kernel wait
channel, the system call it is in (with the file it names: the fd's path, or the path argument read
from ``/proc/self/mem``; or, outside a system call, the mapping holding the faulting instruction)
and the Python frame it is running, with the module whose top level it is importing. At exit it
writes everything to ``path`` as JSON; ``summarize`` (``python benchmarks/stall_sampler.py F.json``)
tells per phase of the benchmark's stamps where the D time went.

Linux only; started by ``startup_bench.py --stall-sample DIR`` as the child's first statement.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import threading
import time

# x86-64 system calls whose first argument is an fd, or whose path is argument 1 or 2
FD_CALLS = {0: "read", 17: "pread64", 19: "readv", 295: "preadv", 5: "fstat", 9: "mmap", 217: "getdents64",
            78: "getdents", 40: "sendfile", 8: "lseek", 221: "fadvise64", 3: "close"}
PATH1_CALLS = {2: "open", 4: "stat", 6: "lstat", 21: "access", 89: "readlink", 59: "execve"}
PATH2_CALLS = {257: "openat", 262: "newfstatat", 332: "statx", 269: "faccessat", 439: "faccessat2",
               267: "readlinkat"}


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("utf-8", "replace")
    except OSError:
        return ""


def _c_string(addr: int) -> str:
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY)
        try:
            raw = os.pread(fd, 512, addr)
        finally:
            os.close(fd)
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")
    except (OSError, OverflowError, ValueError):
        return "?"


def _mapping(addr: int) -> str:
    with open("/proc/self/maps") as f:
        lines = f.read().splitlines()
    for line in lines:
        parts = line.split(None, 5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= addr < hi:
            return parts[5] if len(parts) > 5 else "[anon]"
    return "?"


def _syscall(tid: int) -> str:
    text = _read(f"/proc/self/task/{tid}/syscall").split()
    if not text:
        return "?"
    if text[0] == "running":
        return "running"
    nr = int(text[0])
    if nr == -1:   # not in a system call: a page fault; the pc is the last field
        try:
            return "fault@" + _mapping(int(text[-1], 16))
        except (ValueError, OSError):
            return "fault@?"
    args = [int(a, 16) for a in text[1:7]]
    if nr in FD_CALLS:
        try:
            target = os.readlink(f"/proc/self/fd/{args[0]}")
        except OSError:
            target = f"fd{args[0]}"
        return f"{FD_CALLS[nr]}({target})"
    if nr in PATH1_CALLS:
        return f"{PATH1_CALLS[nr]}({_c_string(args[0])})"
    if nr in PATH2_CALLS:
        return f"{PATH2_CALLS[nr]}({_c_string(args[1])})"
    return f"sys{nr}"


def _frames(ident: int) -> tuple[str, str]:
    frame = sys._current_frames().get(ident)
    leaf = module = ""
    if frame is not None:
        leaf = f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
        f = frame
        while f is not None:
            if f.f_code.co_name == "<module>":
                module = f.f_code.co_filename
                break
            f = f.f_back
    return leaf, module


def start(path: str, interval: float = 0.005) -> None:
    """Sample the calling (main) thread until the process exits; write the samples to ``path``."""
    tid, ident = threading.get_native_id(), threading.get_ident()
    samples: list[list] = []
    stop = threading.Event()

    def run() -> None:
        stat = f"/proc/self/task/{tid}/stat"
        while not stop.wait(interval):
            s = _read(stat)
            state = s[s.rfind(")") + 2:][:1] if s else "?"
            t = time.time()
            if state != "R":   # D: the disk; S: a futex (the GIL, a lock) or another sleep
                wchan = _read(f"/proc/self/task/{tid}/wchan")
                samples.append([t, state, wchan, _syscall(tid), *_frames(ident)])
            else:
                samples.append([t, state])

    th = threading.Thread(target=run, name="stall-sampler", daemon=True)
    th.start()

    def dump() -> None:
        stop.set()
        th.join(1.0)
        stamps = getattr(sys.modules.get("__main__"), "T", {})
        with open(path, "w") as f:
            json.dump({"interval": interval, "stamps": stamps, "samples": samples}, f)

    atexit.register(dump)


def summarize(report: dict, top: int = 12) -> str:
    """Per phase (the stamps in order): samples by state, and where the D and S samples were."""
    stamps = sorted(((v, k) for k, v in report["stamps"].items() if isinstance(v, float)))
    out = []
    for (t0, _), (t1, name) in zip(stamps, stamps[1:]):
        inside = [s for s in report["samples"] if t0 <= s[0] < t1]
        states = collections.Counter(s[1] for s in inside)
        out.append(f"{name}: {t1 - t0:.2f} s, {len(inside)} samples "
                   + " ".join(f"{k}={v}" for k, v in states.most_common()))
        for st in ("D", "S"):
            d = [s for s in inside if s[1] == st and len(s) > 2]
            for label, key in (("syscall", lambda s: s[3]), ("wchan", lambda s: s[2]),
                               ("module", lambda s: s[5]), ("leaf", lambda s: s[4])):
                c = collections.Counter(key(s) for s in d)
                if c:
                    out.append(f"    {st} by {label}: " + "; ".join(f"{v} {k}" for k, v in c.most_common(top)))
    return "\n".join(out)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        with open(p) as f:
            print(p)
            print(summarize(json.load(f)))
