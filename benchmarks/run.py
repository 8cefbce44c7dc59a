#!/usr/bin/env python
"""The benchmark runner: one command for the GPU machine, any subset of the suites.

    python benchmarks/run.py --out $OUT load restart save tp threads verify
    python benchmarks/run.py --out $OUT startup
    python benchmarks/run.py --out /tmp/o --device cpu --size 64MiB --ckpt /tmp/ck load tp   # any box

It writes the checkpoint once (``--ckpt``, on a disk: the cold figures need one; ``--size``
16GB: Llama-3-8B's shape, 32 layers, 16.06 GB, in ``--shards`` 4 files, with its config.json;
kept for the next command), byte-compiles the package and the suites (as an install does),
installs the peer loaders' wheels found in ``--peer-wheels`` (a
folder of .whl files, see shared/tools/peer-wheels) into a private folder, then runs each
suite asked for in its own process, one after the other. A suite that fails or runs out of
time prints why and the runner goes on to the next. In ``--out``: ``machine.json`` (hardware,
software, commit), and per suite ``<suite>.log`` (all it printed), ``<suite>.json`` (every
measurement) and ``<suite>.txt`` (its table); ``summary.txt`` gathers the tables, and the
runner prints it at the end. ``--until SECONDS`` fits the whole command in a time limit: each
suite gets at most what is left (the startup suite stops starting new runs in time).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common

HERE = common.HERE
PY = sys.executable


@dataclass
class Suite:
    what: str
    commands: list[list[str]]      # {ckpt} {out} {device} {deadline} filled in
    timeout: float                 # seconds it may take at most
    needs_ckpt: bool = True
    min_gpus: int = 0


def _script(name: str, *args: str) -> list[str]:
    return [PY, os.path.join(HERE, name), *args]


SUITES: dict[str, Suite] = {
    "tests": Suite("the test suite (its GPU tests run where a GPU is)",
                   [[PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "{xdist}", "tests"]], 300, needs_ckpt=False),
    "load": Suite("the first load in a fresh process and the second beside it, hot, against the H2D copy, the peer "
                  "loaders and TP=8 ranks; the host's import + load of 1 GiB (fresh_bench.py)",
                  [_script("fresh_bench.py", "{ckpt}", "--device", "{device}", "--out", "{out}", "--groups",
                           "hot,host", "--safetensors", "--suite", "load")], 420),
    "threads": Suite("the hot load by thread count: 8, 12, 16, 24, 32 (load_bench.py --threads)",
                     [_script("load_bench.py", "{ckpt}", "--device", "{device}", "--out", "{out}",
                              "--threads", "8,12,16,24,32")], 150),
    "chunks": Suite("the hot load and TP=8 rank 0 by slot and read size: 8 MiB slots with 8 or 4 MiB reads, 4 MiB (load_bench.py --chunks)",
                    [_script("load_bench.py", "{ckpt}", "--device", "{device}", "--out", "{out}",
                             "--chunks", "8MiB/8MiB,8MiB/4MiB,4MiB/4MiB", "--rounds", "7")], 200),
    "verify": Suite("what verify=True costs a hot load (load_bench.py --verify)",
                    [_script("load_bench.py", "{ckpt}", "--device", "{device}", "--out", "{out}", "--verify")], 150),
    "restart": Suite("the raw cold read, a cold load and the next process's load (fresh_bench.py --groups cold)",
                     [_script("fresh_bench.py", "{ckpt}", "--device", "{device}", "--out", "{out}", "--groups",
                              "cold", "--suite", "restart")], 300),
    "save": Suite("saving from the GPU into /dev/shm and to the disk, with RSS, against safetensors (save_bench.py)",
                  [_script("save_bench.py", "{ckpt}", "--device", "{device}", "--out", "{out}")], 300),
    "tp": Suite("TP=8 rank 0 under three plans against the full load, hot and cold (tp_bench.py)",
                [_script("tp_bench.py", "{ckpt}", "--device", "{device}", "--out", "{out}", "--cold")], 200),
    "startup": Suite("spawn to first forward, hot and cold: F, transformers, foxhunt (startup_bench.py)",
                     [_script("startup_bench.py", "{ckpt}", "--device", "{device}", "--out", "{out}",
                              "--deadline", "{deadline}", "--plot", "{out}/startup.png")], 570),
    "dist": Suite("several GPUs: process_group loads against one GPU, with the host's ceilings (dist_bench.py)",
                  [[PY, "-m", "torch.distributed.run", "--nproc-per-node", "{gpus}",
                    os.path.join(HERE, "dist_bench.py"), "{ckpt}", "--out", "{out}", "--shard-dim", "0"]], 240,
                  min_gpus=2),
    "device_map": Suite("one process, two GPUs: device_map's split against one GPU (device_map_bench.py)",
                        [_script("device_map_bench.py", "{ckpt}", "--out", "{out}")], 150, min_gpus=2),
    "host": Suite("the CPU path: numpy load and save against safetensors.numpy (host_bench.py)",
                  [_script("host_bench.py", "--bytes", "2GiB", "--out", "{out}")], 300, needs_ckpt=False),
    "targets": Suite("the ten first-load targets in one run: the hot and host groups (5 rounds), the cold group "
                     "(3 rounds, root) and the startup bench, hot (5 rounds), each figure against its bound (targets.py)",
                     [_script("fresh_bench.py", "{ckpt}", "--device", "{device}", "--out", "{out}", "--rounds", "5",
                              "--groups", "hot,host", "--suite", "targets_hot"),
                      _script("fresh_bench.py", "{ckpt}", "--device", "{device}", "--out", "{out}", "--rounds", "3",
                              "--groups", "cold", "--suite", "targets_cold"),
                      _script("startup_bench.py", "{ckpt}", "--device", "{device}", "--out", "{out}", "--modes", "hot",
                              "--rounds", "5", "--variants", "floor,transformers,foxhunt", "--deadline", "{deadline}"),
                      _script("targets.py", "{out}")], 580),
    "disk": Suite("the disk's cold read rate by reader count (disk_bench.py rate)",
                  [_script("disk_bench.py", "rate", "{ckpt}", "--out", "{out}")], 200),
}


# What the performance table of the project's README shows, on one GPU (the several-GPU rows need two).
ALIASES = {"table": ["load", "restart", "save", "tp", "verify", "startup", "dist", "device_map"],
           "all": [name for name in SUITES if name != "tests"] + ["tests"]}


def install_peers(wheels: str, target: str) -> str | None:
    """Install the .whl files of ``wheels`` (no index, no dependencies) into ``target``; returns
    the folder to put on PYTHONPATH, or None when there are none."""
    found = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if not found:
        return None
    r = subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", target, *found],
                       capture_output=True, text=True)
    print(f"peer wheels: {len(found)} installed into {target}" if r.returncode == 0
          else f"peer wheels: install failed ({r.stderr.strip()[-300:]})", flush=True)
    return target if r.returncode == 0 else None


def byte_compile(folders: list[str]) -> bool:
    """Write the bytecode of ``folders`` as ``pip install`` does for a package (and did for the peers).
    A source checkout run under ``PYTHONDONTWRITEBYTECODE=1`` otherwise compiles every module in
    every new process, which a first load pays: 0.05-0.08 s on an H100 host. True when all compiled."""
    import compileall
    return all([compileall.compile_dir(folder, quiet=1) for folder in folders])   # every folder, even after a failure


def run_logged(cmd: list[str], log_path: str, timeout: float, env: dict[str, str]) -> tuple[int | None, float]:
    """Run ``cmd`` in its own process group, its output echoed and appended to ``log_path``;
    returns (exit code, or None when it ran out of time and was stopped; seconds)."""
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             cwd=common.REPO, start_new_session=True)

        def pump() -> None:
            for line in p.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
                log.flush()
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
        reader.join(timeout=10)
    return rc, time.monotonic() - t0


def fill(cmd: list[str], values: dict[str, str]) -> list[str]:
    out = [part.format(**values) for part in cmd]
    return [part for part in out if part]


def run_suites(names: list[str], args, env: dict[str, str], gpus: int) -> list[tuple[str, str, float]]:
    """Each suite in turn; returns (suite, status, seconds)."""
    t_start = time.monotonic()
    results = []
    for name in names:
        suite = SUITES[name]
        print(f"\n==== {name}: {suite.what}", flush=True)
        if suite.min_gpus and gpus < suite.min_gpus:
            results.append((name, f"skipped: needs {suite.min_gpus} GPUs, this machine has {gpus}", 0.0))
            print(results[-1][1], flush=True)
            continue
        timeout = suite.timeout
        if args.until:
            left = args.until - (time.monotonic() - t_start)
            if left < 30:
                results.append((name, "skipped: no time left", 0.0))
                print(results[-1][1], flush=True)
                continue
            timeout = min(timeout, left - 5)
        status, total = "ok", 0.0
        for cmd in suite.commands:
            # deadline: what is left of the suite's time when this command starts, less a margin
            values = dict(ckpt=args.ckpt, out=args.out, device=args.device, gpus=str(gpus),
                          deadline=str(int(timeout - total - 45)), xdist=xdist())
            rc, seconds = run_logged(fill(cmd, values), os.path.join(args.out, f"{name}.log"),
                                     timeout - total, env)
            total += seconds
            if rc != 0:
                status = "stopped: out of time" if rc is None else f"failed: exit {rc}"
                print(f"==== {name}: {status} (see {name}.log)", flush=True)
                break
        results.append((name, status, total))
    return results


def xdist() -> str:
    """pytest's ``-n 8`` where pytest-xdist is installed (the tests in 8 processes)."""
    import importlib.util
    return "-n8" if importlib.util.find_spec("xdist") is not None else ""


def summary(names: list[str], results: list[tuple[str, str, float]], out: str, hardware: str) -> str:
    lines = [f"foxhunt-stream benchmarks on {hardware}", ""]
    lines += [f"{name:8s} {status} ({seconds:.0f} s)" for name, status, seconds in results]
    for name in names:
        table = os.path.join(out, f"{name}.txt")
        if os.path.exists(table):
            with open(table) as f:
                lines += ["", f"---- {name}", f.read().rstrip()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="suites: " + "; ".join(f"{k}: {s.what}" for k, s in SUITES.items()))
    ap.add_argument("suites", nargs="+", choices=list(SUITES) + list(ALIASES), metavar="SUITE",
                    help=", ".join(SUITES) + "; table: " + " ".join(ALIASES["table"]) + "; all: every suite")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"), help="output folder (default $OUT)")
    ap.add_argument("--ckpt", default="/var/tmp/foxhunt-bench", help="checkpoint folder, on a disk "
                                                                     "(default /var/tmp/foxhunt-bench)")
    ap.add_argument("--size", default="16GB", help="checkpoint size (default 16GB: Llama-3-8B)")
    ap.add_argument("--shards", type=int, default=4, help="checkpoint files (default 4)")
    ap.add_argument("--device", default="cuda:0", help="cuda:0, or cpu for a smoke run (default cuda:0)")
    ap.add_argument("--peer-wheels", default=os.path.join(common.REPO, ".whl"), help="folder of peer wheels")
    ap.add_argument("--until", type=float, default=None, help="seconds the whole command may take")
    args = ap.parse_args(argv)
    args.suites = list(dict.fromkeys(s for name in args.suites for s in ALIASES.get(name, [name])))
    t0 = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    machine = common.machine()
    machine["hardware"] = common.hardware(machine)
    machine["byte_compiled"] = byte_compile([os.path.join(common.REPO, "foxhunt_stream"), HERE])
    with open(os.path.join(args.out, "machine.json"), "w") as f:
        json.dump(machine, f, indent=1)
    print(f"{machine['hardware']}; commit {machine['commit']}; {machine['date']}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    peers = install_peers(args.peer_wheels, "/tmp/foxhunt-peers")
    paths = [common.REPO] + ([peers] if peers else []) + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if any(SUITES[n].needs_ckpt for n in args.suites):
        if common.filesystem(os.path.dirname(os.path.abspath(args.ckpt))) in ("tmpfs", "ramfs"):
            print(f"warning: {args.ckpt} is in memory (tmpfs): the cold figures will not be a disk's", flush=True)
        common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    if args.until:
        args.until -= time.monotonic() - t0
    results = run_suites(args.suites, args, env, len(machine["gpus"]))
    text = summary(args.suites, results, args.out, machine["hardware"])
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text)
    print("\n" + text, flush=True)
    return 0 if all(status == "ok" or status.startswith("skipped") for _, status, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
