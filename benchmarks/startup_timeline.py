#!/usr/bin/env python
"""Where ``fs.transformers.from_pretrained`` spends its time beyond the load, step by step.

    python3 benchmarks/startup_timeline.py CKPT --device cuda:0 --rounds 3 --out DIR
    python3 benchmarks/startup_timeline.py /tmp/ck --device cpu --rounds 1   # anywhere (transformers needed)

``CKPT`` is a model directory (config.json and safetensors, as ``startup_bench.py`` writes it). Each
round runs two new processes, the order rotated from round to round. Each child imports torch and
transformers and makes its CUDA context (on a GPU), untimed; then the clock starts, before
``import foxhunt_stream``. ``model``: one ``fs.transformers.from_pretrained(CKPT, device=...)``,
its steps wrapped (no change to what they do), each reporting when it began (``>``) and ended
(``<``) in ms from the clock's start: ``prepare`` (the config and the model's class), ``load_file``
(the background load started), ``build_on_meta``, ``match``, ``finalize``,
``load_generation_config``, ``warm_up`` (the one-token forward beside the load, on a GPU), ``wait``
(the rest handed over); ``warm_up_waited`` (a duration: ms the warm forward's hooks spent waiting
for their weights, the rest of ``warm_up`` its own work) and ``warm_up_weights_in`` (when its last
wait returned); ``load_end`` (the load's last worker done), ``returned``, and ``forward``
(a first one-token forward after it; with ``--no-warm-forward``, ``from_pretrained(...,
warm_forward=False)``, the first forward of the process). ``load``: the same load alone,
``fs.load_file`` in the foreground (``loaded``), for what the load takes without the model around
it. The summary gives the medians and, from them, the background load's time, the load alone, how
long ``from_pretrained`` ran on after its load ended and the warm forward's own working time.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

MODES = ("model", "load")
STEPS = ("prepare", "build_on_meta", "match", "finalize", "load_generation_config", "warm_up")


def child(mode: str, ckpt: str, device: str, warm: str = "default") -> dict[str, float]:
    """One process: the clock, the wrapped steps, one ``from_pretrained`` (or one load)."""
    import torch
    import transformers  # noqa: F401 -- a server has imported it before it loads
    gpu = device != "cpu"
    if gpu:
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
    clock = time.perf_counter()
    stamps: dict[str, float] = {}

    def stamp(label: str) -> None:
        stamps.setdefault(label, round((time.perf_counter() - clock) * 1e3, 1))

    def wrap(owner, name: str) -> None:
        f = getattr(owner, name)

        def timed(*a, **k):
            stamp(name + ">")
            try:
                return f(*a, **k)
            finally:
                stamp(name + "<")
        setattr(owner, name, timed)

    import foxhunt_stream as fs
    from foxhunt_stream.engine import inflight
    end = inflight.LoadInFlight._end

    def ended(self, error):
        stamp("load_end")
        return end(self, error)
    inflight.LoadInFlight._end = ended
    if mode == "load":
        stamp("imported")
        fs.load_file(ckpt, device=device, framework="pt")
        if gpu:
            torch.cuda.synchronize(device)
        stamp("loaded")
        return stamps
    import foxhunt_stream.torch as fs_torch
    import foxhunt_stream.transformers as fs_transformers
    from foxhunt_stream.engine.handle import LoadHandle
    from foxhunt_stream.models import hf, torch_load
    for name in STEPS:
        wrap(hf, name)
    wait_one = LoadHandle.wait
    blocked = [0.0]

    def waited(self, name):   # the warm forward's hooks: how long they wait for their weights
        t = time.perf_counter()
        try:
            return wait_one(self, name)
        finally:
            if "warm_up>" in stamps and "warm_up<" not in stamps:
                blocked[0] += time.perf_counter() - t
                stamps["warm_up_waited"] = round(blocked[0] * 1e3, 1)
                stamps["warm_up_weights_in"] = round((time.perf_counter() - clock) * 1e3, 1)
    LoadHandle.wait = waited
    wrap(fs_torch, "load_file")
    wrap(torch_load.StreamedLoad, "wait")
    stamp("imported")
    model = fs_transformers.from_pretrained(ckpt, device=device, warm_forward=False if warm == "off" else None)
    if gpu:
        torch.cuda.synchronize(device)
    stamp("returned")
    with torch.no_grad():
        model(torch.ones((1, 1), dtype=torch.long, device=device))
    if gpu:
        torch.cuda.synchronize(device)
    stamp("forward")
    return stamps


def derived(model: dict[str, float], load: dict[str, float] | None) -> dict[str, float]:
    """From a ``model`` child's stamps (and a ``load`` child's): the background load's ms, the load
    alone, and how long ``from_pretrained`` ran on after the load ended."""
    out = {"background_load": model["load_end"] - model["load_file>"],
           "after_load": model["returned"] - model["load_end"]}
    if "warm_up<" in model:
        out["warm_up_working"] = model["warm_up<"] - model["warm_up>"] - model.get("warm_up_waited", 0.0)
    if load is not None:
        out["load_alone"] = load["loaded"] - load["imported"]
    return out


def main(argv: list[str]) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules
    import argparse

    import common
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="startup_timeline", help="the output files' name (<name>.json, <name>.txt)")
    ap.add_argument("--no-warm-forward", action="store_true",
                    help="from_pretrained(..., warm_forward=False): the first forward after the return pays its one-time costs")
    a = ap.parse_args(argv)
    res = common.Results(a.name, a.out)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for k in range(len(MODES)):
            mode = MODES[(k + r) % len(MODES)]
            stamps = common.run_child([os.path.abspath(__file__), "--child", mode, a.ckpt, a.device,
                                       "off" if a.no_warm_forward else "default"], timeout=900)
            if "error" in stamps:
                res.say(f"[{mode}] round {r + 1}: failed: {stamps['error']}")
                continue
            runs[mode].append(stamps)
            res.say(f"[{mode}] round {r + 1}: " + " ".join(f"{k} {x:.1f}" for k, x in stamps.items()))
    res.say("", "medians, ms from the clock's start (torch, transformers and CUDA started before it):")
    medians: dict[str, dict[str, float]] = {}
    for mode, rs in runs.items():
        if rs:
            keys = [k for k in rs[0] if all(k in x for x in rs)]
            medians[mode] = {k: statistics.median(x[k] for x in rs) for k in keys}
            res.say(f"{mode}: " + " ".join(f"{k} {x:.1f}" for k, x in medians[mode].items()) + f"  ({len(rs)} rounds)")
    if "model" in medians:
        res.say("ms: " + " ".join(f"{k} {x:.1f}" for k, x in derived(medians["model"], medians.get("load")).items()))
    res.data["runs"] = runs
    res.save()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        stamps = child(*sys.argv[2:6])   # common imports the package: only once the clock is done
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import common
        common.report_child(stamps)
    else:
        sys.exit(main(sys.argv[1:]))
