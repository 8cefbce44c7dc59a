"""How fast this machine's disk fills the page cache, cold (issue 6's floor). Needs root.

    python3 benchmarks/disk_rate.py /root/startup_ckpt [--readers 1,2,8] [--step-mib 64]

For each reader count: drop the page cache, then read every ``*.safetensors`` file of the
directory with that many threads (``sendfile`` into /dev/null, ``step`` bytes per call, the files
split into 64 MiB pieces taken in turn), and print GB/s. Also checks MemTotal before and after
(the lent VMs grow their memory as it is first used).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from foxhunt_stream.io.pagecache import sendfile_to_null  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import drop_caches, run_jobs  # noqa: E402


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) << 10
    return 0


def read_all(paths: list[str], readers: int, step: int, piece: int = 64 << 20) -> float:
    jobs = [(p, off, min(piece, os.path.getsize(p) - off)) for p in paths
            for off in range(0, os.path.getsize(p), piece)]
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    try:
        return run_jobs(jobs, readers, lambda job: sendfile_to_null(fds[job[0]], job[1], job[2], step))
    finally:
        for fd in fds.values():
            os.close(fd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--readers", default="1,2,8")
    ap.add_argument("--step-mib", type=int, default=64)
    args = ap.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.directory, "*.safetensors")))
    total = sum(os.path.getsize(p) for p in paths)
    print(f"{len(paths)} files, {total / 1e9:.2f} GB; MemTotal {meminfo('MemTotal') / 2**30:.1f} GiB", flush=True)
    for readers in (int(x) for x in args.readers.split(",")):
        drop_caches()
        dt = read_all(paths, readers, args.step_mib << 20)
        print(f"cold read, {readers} reader(s), {args.step_mib} MiB per sendfile: {dt:.2f} s = "
              f"{total / dt / 1e9:.2f} GB/s (MemTotal now {meminfo('MemTotal') / 2**30:.1f} GiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
