#!/usr/bin/env python
"""Inference startup: seconds from spawning python to the first forward pass finished.

    python benchmarks/startup_bench.py CKPT [--size 16GB] [--modes hot,cold] [--rounds 5]
        [--variants floor,transformers,foxhunt] [--deadline 540] [--out DIR] [--plot FILE.png]
    python benchmarks/startup_bench.py /tmp/ck --size 32MiB --device cpu --modes hot --rounds 1

CKPT holds a Llama model (config.json and bf16 safetensors shards; ``--size 16GB`` writes a
Llama-3-8B-shaped one first, see ``common.py``); transformers builds the model from its config.
Every start is a fresh process, ``python benchmarks/startup_bench.py child VARIANT CKPT
[--device D] [--prefetch] [--trace T]``, timed from the spawn (in this process) to its first one-token
forward finished on the device, with stamps along the way (reported as phases). The variants:

    floor         imports (torch, transformers), CUDA start, the model built on the meta
                  device from config.json: F, what every start pays before any weight moves
    transformers  AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16,
                  device_map=device), then the forward
    foxhunt       fs.transformers.from_pretrained(dir, device=device), then the forward; in a
                  cold start preceded, as the program's first statements, by
                  pf = fs.prefetch(dir, imports=TRACE) and pf.wait_imports(): TRACE is the
                  import trace fs.record_imports wrote at an earlier start (``--trace``; the
                  parent records it in one untimed hot start when it is missing)
    foxhunt_no_trace      (cold only) foxhunt after fs.prefetch(dir) alone: what the trace buys
    foxhunt_no_prefetch   (cold only) foxhunt without the prefetch: what the prefetch buys
    foxhunt_no_warm_forward   foxhunt with warm_forward=False: what the one-token forward run
                  inside from_pretrained while the weights land buys
    empty_forward the floor, the model's storage allocated on the device, the forward (no
                  weights): the least a start that runs a forward can take

Rounds are interleaved (each round starts every variant once, hot then cold, the order rotated
from round to round) and the figures are medians. Hot: the checkpoint in the page cache.
Cold: /proc/sys/vm/drop_caches before each start (root), so the libraries come off the disk
too. Reported per variant: spawn to first forward, and the seconds after CUDA start; and the
criteria: hot (foxhunt - F) <= 0.25 x (transformers - F), cold (foxhunt - F) <= 0.2 x
(transformers - F), each against the F of the same mode. ``--deadline`` stops starting new
runs once the next would end past it (the finished ones are reported), so a run fits a
time-limited machine: 3 variants x 5 rounds, hot and cold, take about 9 minutes with a 16 GB
checkpoint on one H200 on PCIe Gen5 with 16 vCPU.
"""

from __future__ import annotations

import os
import sys
import time

START = time.time()   # in a child: when Python reached this program (its spawn is stamped by the parent)

VARIANTS = ("floor", "transformers", "foxhunt", "foxhunt_no_trace", "foxhunt_no_prefetch", "foxhunt_no_warm_forward",
            "empty_forward")
DEFAULT_VARIANTS = ("floor", "transformers", "foxhunt")
COLD_ONLY = ("foxhunt_no_trace", "foxhunt_no_prefetch")
CRITERIA = {"hot": 0.25, "cold": 0.2}   # (foxhunt - F) <= bar x (transformers - F)
PHASES = ("start", "prefetch", "imports", "cuda", "model", "forward")


# ---------------------------------------------------------------- the child: one start

def start_cuda(device: str) -> None:
    import torch
    if device != "cpu":
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)


def meta_model(directory: str):
    """The model of config.json on the meta device, in bf16 (no storage, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def build_floor(directory: str, device: str, notes: list[str]):
    meta_model(directory)
    return None


def build_transformers(directory: str, device: str, notes: list[str]):
    import torch
    from transformers import AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map=device)
    except ValueError as e:
        if "accelerate" not in str(e):
            raise
        notes.append("accelerate is not installed: from_pretrained without device_map, then .to(device)")
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to(device)


def build_foxhunt(directory: str, device: str, notes: list[str]):
    import foxhunt_stream as fs
    return fs.transformers.from_pretrained(directory, device=device)


def build_foxhunt_no_warm_forward(directory: str, device: str, notes: list[str]):
    import foxhunt_stream as fs
    return fs.transformers.from_pretrained(directory, device=device, warm_forward=False)


def build_empty_forward(directory: str, device: str, notes: list[str]):
    return meta_model(directory).to_empty(device=device).eval()


BUILDERS = {"floor": build_floor, "transformers": build_transformers, "foxhunt": build_foxhunt,
            "foxhunt_no_trace": build_foxhunt, "foxhunt_no_prefetch": build_foxhunt, "foxhunt_no_warm_forward": build_foxhunt_no_warm_forward,
            "empty_forward": build_empty_forward}


def forward(model, device: str) -> None:
    """One token through the model, finished on the device."""
    import torch
    with torch.inference_mode():
        model(torch.tensor([[1]], device=device))
    if device != "cpu":
        torch.cuda.synchronize(device)


def child_args(argv: list[str]) -> tuple[str, str, str, bool, str | None]:
    """``VARIANT DIR [--device D] [--prefetch] [--trace T]``, read without argparse (nothing
    imported yet)."""
    if len(argv) < 2 or argv[0] not in VARIANTS:
        raise SystemExit(f"usage: startup_bench.py child {{{','.join(VARIANTS)}}} DIR [--device D] [--prefetch] "
                         "[--trace T]")
    device = argv[argv.index("--device") + 1] if "--device" in argv else "cuda:0"
    trace = argv[argv.index("--trace") + 1] if "--trace" in argv else None
    return argv[0], argv[1], device, "--prefetch" in argv, trace


def child_main(argv: list[str]) -> None:
    """One start: the prefetch first (when asked; with the import trace when there is one, waiting
    for the code before importing), the imports, CUDA, the model, the forward; then, when a trace
    was named but is missing, it is recorded for the next starts."""
    variant, directory, device, prefetch, trace = child_args(argv)
    stamps = {"start": START}
    traced = trace is not None and os.path.exists(trace)
    if prefetch:
        import foxhunt_stream as fs
        pf = fs.prefetch(directory, imports=trace)   # a missing trace reads nothing, but notes the opens to record
        if traced:
            pf.wait_imports()
        stamps["prefetch"] = time.time()
    import torch  # noqa: F401
    import transformers  # noqa: F401
    stamps["imports"] = time.time()
    start_cuda(device)
    stamps["cuda"] = time.time()
    notes: list[str] = []
    model = BUILDERS[variant](directory, device, notes)
    stamps["model"] = time.time()
    if model is not None:
        forward(model, device)
        stamps["forward"] = time.time()
    if trace is not None and not traced:
        import foxhunt_stream as fs
        notes.append(f"recorded {fs.record_imports(trace)} files into {trace}")
    import json
    print("RESULT " + json.dumps({"stamps": stamps, "notes": notes}), flush=True)


# ---------------------------------------------------------------- the parent: schedule, run, summarize

def schedule(variants: list[str], modes: list[str], rounds: int) -> list[tuple[int, str, str]]:
    """(round, mode, variant) in the order run: each round every variant once per mode, the
    variants' order rotated from round to round; cold-only variants only in cold rounds."""
    out = []
    for r in range(rounds):
        for mode in modes:
            vs = [v for v in variants if mode == "cold" or v not in COLD_ONLY]
            k = r % len(vs) if vs else 0
            out += [(r, mode, v) for v in vs[k:] + vs[:k]]
    return out


def phases(spawn: float, stamps: dict[str, float]) -> dict[str, float]:
    """Seconds of each phase, from the previous stamp (the first from the spawn)."""
    out, prev = {}, spawn
    for key in PHASES:
        if key in stamps:
            out[key] = stamps[key] - prev
            prev = stamps[key]
    return out


def measured(spawn: float, stamps: dict[str, float]) -> dict[str, float]:
    """A start's figures: spawn to its end (the first forward finished; the model, for the floor)
    and the seconds after CUDA start."""
    end = stamps.get("forward", stamps.get("model"))
    return {"total_s": end - spawn, "after_cuda_s": end - stamps["cuda"]}


def should_stop(elapsed: float, estimate: float, deadline: float | None) -> bool:
    """Whether a run expected to take ``estimate`` seconds would end past the deadline."""
    return deadline is not None and elapsed + estimate > deadline


def estimate(runs: list[dict], mode: str, variant: str, default: float = 60.0) -> float:
    """The longest start seen for this variant and mode (else for the mode, else ``default``)."""
    same = [r["wall_s"] for r in runs if r.get("mode") == mode and r.get("variant") == variant and "wall_s" in r]
    mode_runs = [r["wall_s"] for r in runs if r.get("mode") == mode and "wall_s" in r]
    return max(same or mode_runs or [default])


def _median(xs: list[float]) -> float | None:
    import statistics
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """Per mode and variant: medians of the runs that finished, or the last error."""
    out: dict[str, dict[str, dict]] = {}
    for mode in [m for m in ("hot", "cold") if any(r["mode"] == m for r in runs)]:
        out[mode] = {}
        for v in VARIANTS:
            mine = [r for r in runs if r["mode"] == mode and r["variant"] == v]
            ok = [r for r in mine if "total_s" in r]
            if ok:
                keys = {k for r in ok for k in r.get("phases_s", {})}
                out[mode][v] = {"runs": len(ok), "total_s": _median([r["total_s"] for r in ok]),
                                "after_cuda_s": _median([r["after_cuda_s"] for r in ok]),
                                "phases_s": {k: _median([r["phases_s"][k] for r in ok if k in r["phases_s"]])
                                             for k in PHASES if k in keys}}
            elif mine:
                out[mode][v] = {"error": mine[-1].get("error", "")[-300:]}
    return out


def criteria(summary: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """For each mode with F, transformers and foxhunt: (foxhunt - F) against bar x
    (transformers - F), on spawn-to-first-forward (the criterion) and after CUDA start."""
    out = {}
    for mode, rows in summary.items():
        f, t, o = (rows.get(v, {}) for v in ("floor", "transformers", "foxhunt"))
        if mode not in CRITERIA or not all("total_s" in x for x in (f, t, o)):
            continue
        c = {"bar": CRITERIA[mode]}
        for key in ("total_s", "after_cuda_s"):
            ours, theirs = o[key] - f[key], t[key] - f[key]
            c[key] = {"foxhunt_minus_F": ours, "transformers_minus_F": theirs, "limit": CRITERIA[mode] * theirs,
                      "ratio": ours / theirs if theirs > 0 else None, "met": ours <= CRITERIA[mode] * theirs}
        out[mode] = c
    return out


def report_lines(summary: dict, crit: dict, nbytes: int, device: str) -> list[str]:
    from foxhunt_stream.cli.text import table
    lines = [f"checkpoint {nbytes / 1e9:.2f} GB to {device}; seconds, medians; total = spawn to the first forward "
             "finished; F = floor", ""]
    for mode, rows in summary.items():
        f = rows.get("floor", {})
        cells = [(f"{mode}", "runs", "total", "minus F", "after CUDA", "minus F", "phases")]
        for v, r in rows.items():
            if "error" in r:
                cells.append((v, "0", "failed", "", "", "", r["error"].splitlines()[-1][:80] if r["error"] else ""))
                continue
            minus = (lambda k: f"{r[k] - f[k]:+.2f}" if k in f and v != "floor" else "")
            cells.append((v, str(r["runs"]), f"{r['total_s']:.2f}", minus("total_s"), f"{r['after_cuda_s']:.2f}",
                          minus("after_cuda_s"), " ".join(f"{k} {x:.2f}" for k, x in r["phases_s"].items())))
        lines += table(cells, right={1, 2, 3, 4, 5}) + [""]
    for mode, c in crit.items():
        for key, label in (("total_s", "spawn to first forward (the criterion)"), ("after_cuda_s", "after CUDA start")):
            x = c[key]
            if x["ratio"] is None:
                lines.append(f"{mode}, {label}: transformers is not slower than F")
                continue
            lines.append(f"{mode}, {label}: foxhunt - F = {x['foxhunt_minus_F']:+.2f} s, limit {c['bar']} x "
                         f"(transformers - F = {x['transformers_minus_F']:+.2f} s) = {x['limit']:.2f} s: "
                         f"{'met' if x['met'] else 'missed'} (ratio {x['ratio']:.2f})")
    return lines


def child_command(variant: str, mode: str, directory: str, device: str, trace: str | None = None,
                  record: bool = False) -> list[str]:
    """The command of one start. Cold foxhunt starts prefetch, ``foxhunt`` with the import trace
    ``trace``; ``record``: the start that writes the missing trace (it prefetches to note its opens)."""
    cmd = [sys.executable, os.path.abspath(__file__), "child", variant, directory, "--device", device]
    if record or (mode == "cold" and variant in ("foxhunt", "foxhunt_no_trace")):
        cmd.append("--prefetch")
    if trace is not None and (record or (mode == "cold" and variant == "foxhunt")):
        cmd += ["--trace", trace]
    return cmd


def run_start(variant: str, mode: str, directory: str, device: str, timeout: float, trace: str | None = None,
              record: bool = False) -> dict:
    """One start in a fresh process (``child_command``): its figures, or the error it ended with."""
    import json
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(here) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = child_command(variant, mode, directory, device, trace, record)
    spawn = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": timeout}
    wall = time.time() - spawn
    found = [line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not found:
        return {"error": f"exit {p.returncode}: " + (p.stderr.strip() or p.stdout.strip())[-2000:], "wall_s": wall}
    result = json.loads(found[-1])
    return dict(measured(spawn, result["stamps"]), phases_s=phases(spawn, result["stamps"]), wall_s=wall,
                notes=result["notes"])


def run_all(plan, args, files: list[str], say) -> list[dict]:
    from foxhunt_stream.cli import ceilings as ce
    runs: list[dict] = []
    t0 = time.monotonic()
    trace = args.trace or os.path.abspath(args.ckpt).rstrip(os.sep) + ".imports"
    if any(mode == "cold" and variant == "foxhunt" for _, mode, variant in plan) and not os.path.exists(trace):
        ce.warm(files)
        r = run_start("foxhunt", "hot", args.ckpt, args.device, args.timeout, trace, record=True)
        say(f"import trace {trace}: " + (r.get("error") or "; ".join(r["notes"]))[-300:])
    for i, (rnd, mode, variant) in enumerate(plan):
        if should_stop(time.monotonic() - t0, estimate(runs, mode, variant), args.deadline):
            say(f"deadline: {len(plan) - i} of {len(plan)} starts not run")
            break
        if mode == "hot" and ce.resident(files) < 0.99:
            ce.warm(files)
        elif mode == "cold":
            ce.drop_caches(files, whole_cache=True)
        r = run_start(variant, mode, args.ckpt, args.device, args.timeout, trace)
        r.update(round=rnd, mode=mode, variant=variant)
        runs.append(r)
        status = f"{r['total_s']:.2f} s" if "total_s" in r else "FAILED: " + r["error"].splitlines()[-1][:200]
        say(f"[round {rnd + 1} {mode}] {variant}: {status}")
    return runs


def plot(summary: dict, path: str, title: str) -> None:
    """Spawn to first forward per variant and mode: F in grey, what each variant adds above it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [v for v in VARIANTS if any("total_s" in rows.get(v, {}) for rows in summary.values())]
    fig, ax = plt.subplots(figsize=(1.5 * len(shown) * len(summary) + 3, 4.5))
    width = 0.8 / max(1, len(summary))
    for i, (mode, rows) in enumerate(summary.items()):
        floor = rows.get("floor", {}).get("total_s", 0.0)
        for j, v in enumerate(shown):
            if "total_s" not in rows.get(v, {}):
                continue
            x, total = j + (i - (len(summary) - 1) / 2) * width, rows[v]["total_s"]
            ax.bar(x, min(floor, total), width, color="#bbbbbb", edgecolor=f"C{i}", linewidth=1.5)
            ax.bar(x, max(0.0, total - floor), width, bottom=min(floor, total), color=f"C{i}",
                   label=mode if j == len(shown) - 1 else None)
            ax.text(x, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels(shown, fontsize=8)
    ax.set_ylabel("seconds, spawn to first forward (grey: F)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        child_main(argv[1:])
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
    import common
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="hot,cold", help="hot, cold or both (default hot,cold; cold needs root)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"a comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds: start no run that would end later")
    ap.add_argument("--timeout", type=float, default=180, help="seconds per start (default 180)")
    ap.add_argument("--plot", default=None, help="also draw the medians (matplotlib)")
    ap.add_argument("--trace", default=None, help="the import trace of the cold foxhunt starts (default: CKPT.imports, "
                                                  "recorded by one untimed hot start when missing)")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(variants) - set(VARIANTS) or set(modes) - {"hot", "cold"}:
        ap.error(f"variants are {', '.join(VARIANTS)}; modes are hot and cold")
    files = common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    res = common.Results("startup", args.out)
    if "cold" in modes:
        try:
            common.ce.drop_caches(files, whole_cache=True)
        except PermissionError as e:
            res.say(f"cold starts left out: {e}")
            modes.remove("cold")
    runs = run_all(schedule(variants, modes, args.rounds), args, files, res.say)
    summary, nbytes = summarize(runs), sum(t.nbytes for p in files for t in _headers(p))
    crit = criteria(summary)
    res.say("", *report_lines(summary, crit, nbytes, args.device))
    res.data.update(bytes=nbytes, rounds=args.rounds, variants=variants, modes=modes, runs=runs, summary=summary,
                    criteria=crit)
    res.save()
    if args.plot and summary:
        try:
            plot(summary, args.plot, f"spawn to first forward, {nbytes / 1e9:.2f} GB Llama, "
                                     f"{common.hardware(res.data['machine'])}, {res.data['machine']['date'][:10]}")
        except ImportError as e:   # the figures are saved already
            print(f"no plot: {e} (pip install matplotlib)", file=sys.stderr)
    return 0


def _headers(path: str):
    import foxhunt_stream as fs
    return fs.read_header(path).tensors


if __name__ == "__main__":
    sys.exit(main())
