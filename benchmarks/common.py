"""What the benchmark scripts share: the checkpoint they measure, the machine's description,
timing helpers and the output folder.

Every suite script takes the checkpoint directory first (written there when missing, with
``--size``), ``--device`` (``cuda:0``, or ``cpu`` for a smoke run on any box) and ``--out DIR``,
where it writes ``<suite>.json`` (every measurement, the machine, the command) and
``<suite>.txt`` (the table it printed). The checkpoint is a Llama-style bf16 model with a
``config.json`` that transformers can build: Llama-3-8B's widths (32 layers: 16.06 GB) from
4 GB up, small widths below, as many layers as the size asks for.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from foxhunt_stream.cli import ceilings as ce  # noqa: E402
from foxhunt_stream.cli.text import table  # noqa: E402
from foxhunt_stream.settings import parse_size  # noqa: E402

GB = 1e9
STAMP = "foxhunt-bench-checkpoint.json"

# Llama-3-8B's widths; the small ones keep CPU smoke runs (and a CPU forward) quick.
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
SMALL = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2,
             vocab_size=4096, rope_theta=500000.0, max_position_embeddings=2048)


# ---------------------------------------------------------------- the checkpoint

def _layer_and_fixed_bytes(w: dict) -> tuple[int, int]:
    h, i, v = w["hidden_size"], w["intermediate_size"], w["vocab_size"]
    kv = w["num_key_value_heads"] * (h // w["num_attention_heads"])
    return 2 * (2 * h * h + 2 * kv * h + 3 * h * i + 2 * h), 2 * (2 * v * h + h)


def llama_config(size_bytes: int) -> dict[str, Any]:
    """The ``config.json`` of a Llama model of about ``size_bytes`` in bf16."""
    widths = LLAMA3_8B if size_bytes >= 4e9 else SMALL
    per_layer, fixed = _layer_and_fixed_bytes(widths)
    layers = max(1, round((size_bytes - fixed) / per_layer))
    return dict(widths, architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=layers,
                hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16",
                bos_token_id=1, eos_token_id=2, attention_bias=False, mlp_bias=False)


def config_shapes(config: dict[str, Any]) -> ce.Shapes:
    h = config["hidden_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    return ce.decoder_shapes(h, config["intermediate_size"], kv, config["vocab_size"], config["num_hidden_layers"])


def checkpoint_files(source: str) -> list[str]:
    """The .safetensors files of a checkpoint: a directory's, an index's neighbours, or the file itself."""
    if os.path.isfile(source):
        return [source] if source.endswith(".safetensors") else checkpoint_files(os.path.dirname(source) or ".")
    return sorted(glob.glob(os.path.join(source, "*.safetensors")))


def ensure_checkpoint(directory: str, size: int | str | None = None, shards: int = 4) -> list[str]:
    """The checkpoint's files in ``directory``, written first (config.json, ``shards`` files and
    the index) unless the same size and shards are already there; ``size`` None takes whatever
    checkpoint the directory holds (or the file, or the index, ``directory`` names)."""
    if size is None and os.path.isfile(directory):
        return checkpoint_files(directory)
    stamp_path = os.path.join(directory, STAMP)
    want = None if size is None else {"size": parse_size(size), "shards": shards}
    have = None
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            have = json.load(f)
    files = checkpoint_files(directory)
    if files and (want is None or (have is not None and {k: have.get(k) for k in want} == want)):
        return files
    if want is None:
        raise SystemExit(f"{directory} holds no checkpoint: pass --size (e.g. 16GB) to write one")
    if files and have is None:
        raise SystemExit(f"{directory} holds a checkpoint these benchmarks did not write: measure it without "
                         "--size, or give another directory")
    os.makedirs(directory, exist_ok=True)
    for p in files + [os.path.join(directory, n) for n in ("config.json", "model.safetensors.index.json", STAMP)]:
        if os.path.exists(p):
            os.unlink(p)
    config = llama_config(want["size"])
    t0 = time.perf_counter()
    print(f"writing a {config['num_hidden_layers']}-layer Llama bf16 checkpoint ({want['size'] / GB:.2f} GB "
          f"asked, {shards} files) in {directory} ...", flush=True)
    ce.make_synthetic(directory, shards=shards, shapes=config_shapes(config))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(stamp_path, "w") as f:
        json.dump(dict(want, config=config), f)
    files = checkpoint_files(directory)
    print(f"wrote {sum(map(os.path.getsize, files)) / GB:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
    return files


def filesystem(path: str) -> str:
    """The filesystem type holding ``path`` (from /proc/self/mountinfo; "" if unknown)."""
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount = left.split()[4]
                if os.path.realpath(path).startswith(mount.rstrip("/") + "/") or os.path.realpath(path) == mount:
                    if len(mount) >= len(best):
                        best, fstype = mount, right.split()[0]
    except OSError:
        pass
    return fstype


# ---------------------------------------------------------------- devices and timing

def framework(device: str) -> str:
    """What loads return here: torch tensors on a GPU (the frameworks users run), numpy on the CPU."""
    return "numpy" if device == "cpu" else "pt"


def synchronize(device: str | Iterable[str]) -> None:
    """Wait for ``device`` (or each of several devices); nothing to wait for on the CPU."""
    for d in [device] if isinstance(device, str) else device:
        if d != "cpu":
            import torch
            torch.cuda.synchronize(d)


def tensor_bytes(tensors: dict) -> int:
    return sum(int(t.nbytes) if hasattr(t, "nbytes") and not hasattr(t, "element_size")
               else t.numel() * t.element_size() for t in tensors.values())


def timed(fn: Callable[[], Any], device: str | Iterable[str]) -> float:
    """Seconds of one call of ``fn`` with the device(s) synchronized on both sides; its result freed."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    seconds = time.perf_counter() - t0
    del out
    return seconds


def interleaved(cases: dict[str, Callable[[], Any]], rounds: int, device: str, warmup: bool = True,
                after: Callable[[str, float], None] | None = None) -> dict[str, list[float]]:
    """Seconds of each case in each of ``rounds`` rounds, the cases taking turns within a round
    (the order rotated each round), so that the machine's drift touches all of them alike.
    ``after(name, seconds)``, untimed, follows each timed run (to settle what it left behind)."""
    if warmup:
        for fn in cases.values():
            timed(fn, device)
    out: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(timed(cases[name], device))
            if after is not None:
                after(name, out[name][-1])
    return out


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def cpu_usage() -> tuple[float, float, int]:
    """(user s, system s, involuntary context switches) of this process so far."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime, u.ru_stime, u.ru_nivcsw


def proc_status(key: str) -> int:
    """A byte count from /proc/self/status (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


# ---------------------------------------------------------------- the machine

def _run(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def machine() -> dict[str, Any]:
    """The hardware (as hardware: GPU model and link, CPUs, memory), the software and the commit."""
    out: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version()}
    with open("/proc/meminfo") as f:
        out["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    gpus = _run(["nvidia-smi", "--query-gpu=name,pcie.link.gen.max,pcie.link.width.max",
                 "--format=csv,noheader"]).splitlines()
    out["gpus"] = [g.strip() for g in gpus if g.strip()]
    for mod in ("numpy", "torch", "cupy", "safetensors", "transformers", "fastsafetensors", "instanttensor",
                "runai_model_streamer"):
        m = sys.modules.get(mod)
        if m is not None:
            out[mod] = str(getattr(m, "__version__", "?"))
    out["commit"] = _run(["git", "-C", REPO, "rev-parse", "--short=12", "HEAD"]) or None
    out["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
    return out


def hardware(m: dict[str, Any]) -> str:
    """One line: "1x NVIDIA H200, PCIe Gen5 x16; 16 CPUs, 125.8 GiB RAM"."""
    gpus = m.get("gpus") or []
    if gpus:
        parts = [p.strip() for p in gpus[0].split(",")]
        gpu = f"{len(gpus)}x {parts[0]}" + (f", PCIe Gen{parts[1]} x{parts[2]}" if len(parts) == 3 else "")
    else:
        gpu = "no GPU"
    return f"{gpu}; {m['cpus']} CPUs, {m['mem_gib']} GiB RAM"


# ---------------------------------------------------------------- arguments and output

def parser(description: str) -> argparse.ArgumentParser:
    """The arguments every suite takes: the checkpoint directory, --size, --shards, --device, --out."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", help="checkpoint directory (written there first when missing and --size is given)")
    ap.add_argument("--size", default=None, help="checkpoint size to write, e.g. 16GB (Llama-3-8B) or 64MiB")
    ap.add_argument("--shards", type=int, default=4, help="files of a checkpoint written here (default 4)")
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a smoke run (default cuda:0)")
    ap.add_argument("--out", default=None, help="folder for <suite>.json and <suite>.txt")
    return ap


class Results:
    """A suite's printed lines and data, saved as ``<out>/<suite>.txt`` and ``<out>/<suite>.json``."""

    def __init__(self, suite: str, out: str | None) -> None:
        self.suite, self.out = suite, out
        self.lines: list[str] = []
        self.data: dict[str, Any] = {"suite": suite, "machine": machine()}

    def say(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            self.lines.append(line)

    def table(self, rows: list[tuple[str, ...]], right: set[int]) -> None:
        self.say(*table(rows, right))

    def save(self) -> None:
        if not self.out:
            return
        os.makedirs(self.out, exist_ok=True)
        self.data["machine"]["hardware"] = hardware(self.data["machine"])
        with open(os.path.join(self.out, f"{self.suite}.json"), "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        with open(os.path.join(self.out, f"{self.suite}.txt"), "w") as f:
            f.write("\n".join(self.lines) + "\n")


# ---------------------------------------------------------------- child processes

RESULT = "RESULT "


def report_child(obj: dict[str, Any]) -> None:
    """What a child process hands back: one line, read by ``run_child``."""
    print(RESULT + json.dumps(obj), flush=True)


def run_child(args: list[str], timeout: float = 600, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python ARGS`` (the repository on its path) and return what it reported, or
    ``{"error": ...}`` with the end of its output when it failed."""
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = REPO + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
    try:
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    found = [line[len(RESULT):] for line in r.stdout.splitlines() if line.startswith(RESULT)]
    if r.returncode != 0 or not found:
        tail = (r.stderr.strip() or r.stdout.strip())[-1500:]
        return {"error": f"exit {r.returncode}: {tail}"}
    return json.loads(found[-1])


def free_space(path: str) -> int:
    return shutil.disk_usage(path).free
