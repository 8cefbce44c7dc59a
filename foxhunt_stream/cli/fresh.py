"""One load in a new process, timed as a server meets it: ``run(case, ...)`` starts this file as a
script (on a GPU its CUDA context made first, untimed), timed from the loader's import until the
tensors are on the device; the child prints one line of JSON. Cases: ``CASES`` (``tp_*``: rank 0 of
TP=8; ``ceiling``: a pinned host -> device copy of 1 GiB); a peer not installed is ``{"skipped": ...}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

RESULT = "RESULT "
LLAMA_COLUMNS = ("*.o_proj.weight", "*.down_proj.weight")
CASES = ("foxhunt", "tp_llama", "tp_rows", "safetensors", "instanttensor", "kvikio", "fastsafetensors", "ceiling")
PEERS = ("safetensors", "instanttensor", "kvikio", "fastsafetensors")
# the environment each peer is measured in (kvikio: its thread pool, not GPUDirect Storage)
PEER_ENV = {"kvikio": {"KVIKIO_COMPAT_MODE": "ON", "KVIKIO_NTHREADS": "16"}}


def stolen_seconds() -> float | None:
    """CPU seconds the hypervisor has taken from this machine's CPUs since boot (``/proc/stat``'s
    steal), None where unknown: on a shared virtual machine, what tells a slowed round apart."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def run(case: str, ckpt: str, device: str, files: list[str], timeout: float = 600,
        env: dict[str, str] | None = None) -> dict:
    """``case`` in a new process (``env``: more variables; its ``PYTHONPATH`` comes before this
    package's, so another version of the package is timed in the same rounds): what it reported,
    or ``{"error": ...}``; with ``stolen``, the CPU seconds the hypervisor took from the machine
    while it ran."""
    extra = dict(env or {})
    first = extra.pop("PYTHONPATH", None)
    env = dict(os.environ, **PEER_ENV.get(case, {}), **extra)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (first, package_root, os.environ.get("PYTHONPATH")) if p)
    before = stolen_seconds()
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), case, ckpt, device, *files],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    after = stolen_seconds()
    found = [x[len(RESULT):] for x in r.stdout.splitlines() if x.startswith(RESULT)]
    if r.returncode or not found:
        return {"error": f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-1200:]}"}
    out = json.loads(found[-1])
    if before is not None and after is not None:
        out["stolen"] = round(after - before, 3)
    return out


# ---------------------------------------------------------------- the child

def _sync(device: str) -> None:
    if device != "cpu":
        import torch
        torch.cuda.synchronize(device)


def _version(module: str) -> str:
    from importlib import metadata
    for name in (module, module.replace("_", "-"), f"{module}-cu13", f"{module}-cu12"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return ""


def check_sample(out: dict, files: list[str]) -> None:
    """The first tensor of the first file against its bytes, read with plain I/O."""
    import numpy as np
    with open(files[0], "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        name = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        lo, hi = header[name]["data_offsets"]
        f.seek(8 + n + lo)
        want = f.read(min(hi - lo, 1 << 20))
    v = out[name]
    if hasattr(v, "element_size"):
        import torch
        got = v.detach().reshape(-1).view(torch.uint8)[:len(want)].cpu().numpy().tobytes()
    else:
        got = np.ascontiguousarray(v).reshape(-1).view(np.uint8)[:len(want)].tobytes()
    if got != want:
        raise AssertionError(f"{name}: the landed bytes differ from the file")


def _foxhunt(case: str, ckpt: str, device: str, files: list[str]) -> dict:
    t0 = time.perf_counter()
    import foxhunt_stream as fs
    kw = {}
    if case.startswith("tp_"):
        dim = {**{p: 1 for p in LLAMA_COLUMNS}, "*": 0} if case == "tp_llama" else {"*": 0}
        kw["shard"] = fs.TPSlice(0, 8, dim=dim)
    fw = "pt" if device != "cpu" else "numpy"
    out = fs.load_file(ckpt, device=device, framework=fw, progress=False, **kw)
    _sync(device)
    result = {"seconds": time.perf_counter() - t0}
    if case == "foxhunt":
        check_sample(out, files)
        del out
        t1 = time.perf_counter()
        out = fs.load_file(ckpt, device=device, framework=fw, progress=False)
        _sync(device)
        result["second"] = time.perf_counter() - t1
    return result


def _dtypes(path: str) -> set[str]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {e["dtype"] for k, e in header.items() if k != "__metadata__"}


def _peer(case: str, device: str, files: list[str]) -> dict:
    # safetensors.numpy holds bf16 and fp8 only once ml_dtypes is imported (its cost, then)
    ml = device == "cpu" and case == "safetensors" and any(d == "BF16" or d.startswith("F8") for d in _dtypes(files[0]))
    t0 = time.perf_counter()
    out: dict = {}
    if case == "safetensors":
        if device == "cpu":
            if ml:
                import ml_dtypes  # noqa: F401
            from safetensors.numpy import load_file
            for p in files:
                out.update(load_file(p))
        else:
            from safetensors.torch import load_file
            for p in files:
                out.update(load_file(p, device=device))
    elif case == "instanttensor":
        import instanttensor as it
        with it.safe_open(files, framework="pt", device=int(device.split(":")[1]),
                          backend=it.BackendPolicy.BUFFERED) as f:
            out = dict(f.tensors())   # its default copies: tensors that own their memory
    elif case == "fastsafetensors":
        import fastsafetensors as fst
        with fst.fastsafe_open(files, framework="pt", device=device, nogds=True) as f:
            out = {k: f.get_tensor(k).clone() for k in f.keys()}   # its buffers go with the handle
    elif case == "kvikio":
        import torch
        import kvikio
        futures, handles, total = [], [], 0
        for p in files:
            with open(p, "rb") as f:
                start = 8 + int.from_bytes(f.read(8), "little")
            size = os.path.getsize(p) - start
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            h = kvikio.CuFile(p, "r")
            futures.append((h.pread(buf, size, start), buf))
            handles.append(h)
            total += size
        for fut, _ in futures:
            fut.get()
        _sync(device)
        seconds = time.perf_counter() - t0
        for h in handles:
            h.close()
        return {"seconds": seconds, "bytes": total, "version": _version("kvikio")}
    _sync(device)
    seconds = time.perf_counter() - t0
    check_sample(out, files)
    return {"seconds": seconds, "version": _version(case)}


def _ceiling(device: str) -> dict:
    import torch
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    times = []
    for _ in range(4):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dev.copy_(host, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return {"GBps": (1 << 30) / sorted(times[1:])[1] / 1e9}


def child(case: str, ckpt: str, device: str, files: list[str]) -> dict:
    if device != "cpu":   # the CUDA context a server has made by the time it loads
        import torch
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
    if case == "ceiling":
        return _ceiling(device)
    if case in ("foxhunt", "tp_llama", "tp_rows"):
        return _foxhunt(case, ckpt, device, files)
    if case in PEERS:
        return _peer(case, device, files)
    raise SystemExit(f"unknown case {case!r}; one of {', '.join(CASES)}")


def main(argv: list[str]) -> int:
    case, ckpt, device, *files = argv
    try:
        out = child(case, ckpt, device, files)
    except ModuleNotFoundError as e:
        out = {"skipped": f"{case}: {e.name} is not installed"}
    print(RESULT + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.pop(0)   # this folder, put first by running the file as a script: not a place to import from
    sys.exit(main(sys.argv[1:]))
