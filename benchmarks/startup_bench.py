#!/usr/bin/env python
"""Startup benchmark: wall time from spawning python to the first forward pass done on the GPU.

    python benchmarks/startup_bench.py /data/llama3-8b-shaped [--cold] [--repeat 3] \\
        [--json startup.json] [--plot startup.png]

Creates the checkpoint once (a Llama-3-8B-shaped model with random bf16 weights, built on the
meta device, materialised on the GPU, randomly initialised there and written by
``save_pretrained`` in 5 GB shards; ``--layers`` makes it smaller), then runs each variant in a
fresh process (``python -c``), so every run pays imports, CUDA start and allocations:

    F   floor: import torch + transformers, start CUDA, build the model on meta (no weights)
    E   F + to_empty on the device + a forward with uninitialised weights (no load at all)
    1   AutoModelForCausalLM.from_pretrained(dir, dtype=bfloat16, device_map=device)
    2   meta model + to_empty + fs.torch.load_model (fs.warmup timed separately)
    2w  2, with fs.warmup(DEV, background=True) right after importing foxhunt_stream
    2wk 2w, and the kernel warm of 2bk started at the same point (after the imports): both
        overlap building the model, not the imports
    2s  meta model, then ``H = fs.torch.load_file(dir, device=DEV, background=True)`` and
        ``fs.torch.load_model(model, H, wait=False)``: the forward starts at once, each module
        waiting for its own tensors, so its one-time costs (kernel loading, cuBLAS, rotary tables)
        overlap the load instead of following it
    2sw 2s, with fs.warmup(DEV, background=True) right after importing foxhunt_stream
    2sc 2s with chunk_bytes=32 MiB (a quarter of the chunks, so of the workers' GIL turns; 8 workers)
    2sq 2s with staging_bytes=64 MiB (default 256): at most a quarter of the copies queued on the
        copy engine, which the forward's lazily loaded kernel modules may wait behind (untested)
    2su 2s with FOXHUNT_CUDART=cupy: the CUDA runtime reached through ``import cupy`` (as before
        ``cudart``), to measure what the lone ``cupy_backends`` import saves
    2si 2s with sys.setswitchinterval(0.2 ms) during the load and forward (default 5 ms): a worker
        waiting for the GIL that the forward holds gets it sooner
    2s8 2s with threads=8: the load leaves the forward CPUs (the default of a background load was
        one per CPU, 16 on the H200, until session 9; three quarters of that since: 12)
    2s12 2s with threads=12
    2s16 2s with threads=16 (the default before session 9)
    2sn 2s with the loader's threads at nice 10: the forward's thread wins every CPU it asks for
    2sk 2s with the kernel warm of 2bk started before the model is built: the first forward's own
        one-time costs (cuBLAS, GEMM shapes, attention) overlap building the model
    2e  2s with the load started before the model is built (right after importing foxhunt_stream):
        building the model on meta overlaps the load, as the handle is meant to be used
    2en 2e with ``names=`` the index's names in natural order (layer 2 before layer 10, as the
        forward needs them; the files hold them alphabetically)
    2b  the restore overlaps the imports: import torch, start CUDA, ``H = fs.torch.load_file(dir,
        device=DEV, background=True)``, then import transformers, build on meta and
        ``fs.torch.load_model(model, H)`` (the meta tensors take the loaded ones). (Session 7's
        first form also ran ``fs.warmup(background=True)`` before import torch: that import took
        ~1 s longer, the CUDA driver and context starting beside it.)
    2bk 2b, and a thread runs the model's GEMM shapes and attention once on dummy tensors while
        the imports run (cuBLAS handle, lazily loaded kernels: the first forward's own costs)
    2p  2, with fs.prefetch(dir, modules=("torch", "nvidia", "transformers")) as the very first
        statement, before torch is imported (the packages' files are read first, then the weights)
    2t  2, with fs.prefetch(dir, imports=TRACE) first: the files an earlier start loaded
        (``fs.record_imports``, which each 2t run calls after its forward) are read first,
        in the order they were needed, then the weights; a cold run with no trace yet gets a
        hot 2t run first that records one (not counted)
    2tw 2t, but the imports start only once the trace's files are read (``PF.wait_imports()``)
    2ts 2tw, then as 2s (the streamed forward)
    2tb 2tw, then as 2b: the restore runs beside import transformers while the prefetch still reads
    2tx 2tw with ``helper_process=True`` spelled out (the default since session 6: the weights
        read by a child process, no GIL shared; with ``helper_process=False`` before)
    2ty 2t with ``helper_process=True``: the imports start at once, beside the code files' reads
    2tn 2t with priority="normal": the weights read by 8 hinted readers, not 2 idle ones
    2tr 2t with max_rate=RATE (``--prefetch-rate``, default 1 GB/s) until the load starts: the disk
        is not kept saturated while the imports still read from it
    2T  2t without the weights (``names=[]``): the trace alone, to tell its effect on the imports
        from the weights' reads competing with them
    3   meta model + safetensors load_file(device=...) per shard + load_state_dict(assign=True)

Each variant ends with a 1-token forward and torch.cuda.synchronize(); the child reports
time.time() then, and phase stamps along the way. Hot runs first read every file once (page
cache warm); ``--cold`` adds runs after ``echo 3 > /proc/sys/vm/drop_caches`` (root), which also
evicts python's and torch's own files, as on a real cold start - so F is measured cold too.
A variant's failure is printed and recorded, and the others still run.

Each run of the full-size model takes roughly 15-40 s. Where one command may only last minutes,
split the work and accumulate: ``--variants F,E,1 --json r.json``, then ``--variants 2,2p,3
--json r.json --append``, and so on (the table and plot cover every run in the file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("F", "E", "1", "2", "2w", "2wk", "2s", "2sw", "2sc", "2si", "2sq", "2su", "2s8", "2s12", "2s16", "2sn", "2sk", "2e", "2en", "2b", "2bk", "2p", "2t", "2tw",
            "2ts", "2tb", "2tx", "2ty", "2tn", "2tr", "2T", "3")
TRACED = ("2t", "2tw", "2ts", "2tb", "2tx", "2ty", "2tn", "2tr", "2T")
# load_model(model, handle, wait=False): the forward streams behind the load
STREAMED = ("2s", "2sw", "2sc", "2si", "2sq", "2su", "2s8", "2s12", "2s16", "2sn", "2sk", "2e", "2en", "2ts")
EARLY = ("2e", "2en")   # streamed, the load started before the model is built
BG_TUNING = {"2sc": ", chunk_bytes=32 << 20", "2sq": ", staging_bytes=64 << 20", "2s8": ", threads=8",
             "2s12": ", threads=12", "2s16": ", threads=16"}   # their load_file options
BACKGROUND = ("2b", "2bk", "2tb")   # the restore starts before import transformers
DEFAULT_RATE = 1e9
PREFETCH_KEYS = ("prefetch_bytes", "prefetch_total", "prefetch_module_bytes", "prefetch_bytes_at_load")
# stamped beside the main thread (other threads, or a mark to count from): not phases
MARKS = ("fwd_layer_first", "fwd_layer_last", "fwd_head")   # 2s: where the streamed forward was when
SIDE_KEYS = PREFETCH_KEYS + ("bg_load_done", "kernels_warm_done", "kernels_from") + MARKS
DEFAULT_TRACE = os.path.join("/tmp", "foxhunt_startup_imports.txt")
LABELS = {
    "F": "floor (imports, CUDA, meta model)",
    "E": "empty model + forward (no weights)",
    "1": "transformers from_pretrained",
    "2": "meta + to_empty + fs.torch.load_model",
    "2w": "2 + fs.warmup(background=True) first",
    "2wk": "2w + kernels warmed beside the model build",
    "2s": "meta + load_model(wait=False), streamed forward",
    "2sw": "2s + fs.warmup(background=True) first",
    "2sc": "2s, 32 MiB chunks (8 workers)",
    "2si": "2s, GIL switch interval 0.2 ms",
    "2sq": "2s, 64 MiB of staging (a shorter copy queue)",
    "2su": "2s, CUDA runtime through import cupy (FOXHUNT_CUDART=cupy)",
    "2s8": "2s, threads=8",
    "2s12": "2s, threads=12",
    "2s16": "2s, threads=16 (the old default)",
    "2sn": "2s, loader threads at nice 10",
    "2sk": "2s + kernels warmed beside the model build",
    "2e": "2s, load started before the model is built",
    "2en": "2e, names in natural (forward) order",
    "2b": "restore beside the imports + load_model",
    "2bk": "2b + kernels warmed meanwhile",
    "2p": "2 + fs.prefetch first",
    "2t": "2 + fs.prefetch(imports=trace) first",
    "2tw": "2t, imports after PF.wait_imports()",
    "2ts": "2tw + the streamed forward (2s)",
    "2tb": "2tw + the restore beside the imports (2b)",
    "2tx": "2tw, weights read by a helper process",
    "2ty": "2t, weights read by a helper process",
    "2tn": "2t, prefetch priority normal",
    "2tr": "2t, prefetch max_rate until the load",
    "2T": "2 + prefetch of the import trace only",
    "3": "safetensors load_file + assign",
}
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 tie_word_embeddings=False)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)


# ---------------------------------------------------------------- (a) the checkpoint

def checkpoint_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))


def create_checkpoint(directory: str, layers: int, device: str, tiny: bool, shard_size: str) -> None:
    """A Llama-3-8B-shaped model with random bf16 weights, made on ``device`` and saved once."""
    import inspect

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = dict(LLAMA3_8B, num_hidden_layers=layers)
    if tiny:
        cfg.update(TINY)
    config = LlamaConfig(**cfg)
    t = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    os.makedirs(directory, exist_ok=True)
    kw = {"max_shard_size": shard_size}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kw["safe_serialization"] = True
    model.save_pretrained(directory, **kw)
    size = sum(os.path.getsize(f) for f in checkpoint_files(directory))
    print(f"created {directory}: {len(checkpoint_files(directory))} shard(s), {size / 2**30:.2f} GiB, "
          f"{time.perf_counter() - t:.1f} s", flush=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- (b) the child programs

HELPERS = '''
def fix_rotary(model, dev):
    """Rotary tables are non-persistent buffers: no checkpoint holds them, and to_empty leaves
    them garbage (assign leaves them on meta). Rebuild each rotary module on the device."""
    import torch
    for name, mod in list(model.named_modules()):
        if "inv_freq" not in getattr(mod, "_buffers", {}):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        with torch.device(dev):
            new = type(mod)(getattr(mod, "config", model.config))
        setattr(parent, name.rsplit(".", 1)[-1], new)
'''


# streamed variants: when each layer's weights were all in (a thread waiting on the load's
# per-tensor readiness, layer after layer as the forward does) and when the forward reached it
LAYER_STAMPS = """LAYERS_LANDED, LAYERS_FWD = [], []
def _landings():
    L = H._landing
    index = {d.name: i for i, d in enumerate(L.plan.destinations)}
    for i, layer in enumerate(model.model.layers):
        for n, _ in layer.named_parameters(prefix=f"model.layers.{i}"):
            L._ready[index[n]].wait()
        LAYERS_LANDED.append(time.time())
threading.Thread(target=_landings, daemon=True).start()
for layer in model.model.layers:
    layer.register_forward_pre_hook(lambda m, a: LAYERS_FWD.append(time.time()) and None)
"""


RENICE = """def _renice(job, nice=10, until=1.0):
    \"\"\"Lower the loader's threads (the workers held back for the allocator start later).\"\"\"
    import os
    done, t_end = set(), time.time() + until
    while time.time() < t_end and not job._done.is_set():
        for t in job._threads:
            if t.native_id and t.native_id not in done:
                try:
                    os.setpriority(os.PRIO_PROCESS, t.native_id, nice)
                except OSError:
                    pass
                done.add(t.native_id)
        time.sleep(0.005)
threading.Thread(target=_renice, args=(H._landing.job,), daemon=True).start()
"""


NATURAL_ORDER = """import os, re
def natural_order(directory):
    \"\"\"The index's tensor names, digits compared as numbers: layer 2 before layer 10.\"\"\"
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        names = list(json.load(open(index))["weight_map"])
    else:   # one file
        names = [t.name for t in fs.read_header(os.path.join(directory, "model.safetensors")).tensors]
    return sorted(names, key=lambda n: [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                             for p in re.split(r"(\\d+)", n)])
"""


PREFETCH_STAMPS = """
T["prefetch_bytes"] = PF.bytes_done
T["prefetch_total"] = PF.nbytes
T["prefetch_module_bytes"] = PF.module_bytes
"""   # after the forward: how much of the checkpoint the prefetch had read


KERNEL_WARM = '''
def _warm_kernels():
    """The first forward's one-time costs, paid on dummy tensors: the cuBLAS handle and workspace
    and the GEMM kernels of the model's weight shapes (1 token), the attention kernel."""
    cfg = json.load(open(os.path.join(DIR, "config.json")))
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = h // heads
    with torch.inference_mode():
        x = torch.zeros(1, 1, h, dtype=torch.bfloat16, device=DEV)
        for n, k in ((heads * d, h), (kv * d, h), (h, heads * d), (i, h), (h, i), (v, h)):
            xi = x if k == h else torch.zeros(1, 1, k, dtype=torch.bfloat16, device=DEV)
            torch.nn.functional.linear(xi, torch.zeros(n, k, dtype=torch.bfloat16, device=DEV))
        q = torch.zeros(1, heads, 1, d, dtype=torch.bfloat16, device=DEV)
        kk = torch.zeros(1, heads, 1, d, dtype=torch.bfloat16, device=DEV)
        torch.nn.functional.scaled_dot_product_attention(q, kk, kk, is_causal=False)
        SYNC
    T["kernels_warm_done"] = time.time()
import os
threading.Thread(target=_warm_kernels, daemon=True).start()
'''


def child_program(variant: str, directory: str, device: str, trace: str = DEFAULT_TRACE,
                  rate: float = DEFAULT_RATE, tune: str = "", step: int | None = None, warm_set: str = "",
                  bg_options: str = "") -> str:
    """The ``python -c`` program of one variant. Stamps are time.time() (comparable with the
    parent's spawn time); the last line printed is ``RESULT {json}``."""
    cuda = device.startswith("cuda")
    sync = "torch.cuda.synchronize()" if cuda else "pass"
    init = "torch.cuda.init(); torch.empty(1, device=DEV); torch.cuda.synchronize()" if cuda else ""
    pre = ""
    if variant == "2p":
        pre = f"""
import foxhunt_stream as fs
PF = fs.prefetch({directory!r}, modules=("torch", "nvidia", "transformers"))
T["prefetch_started"] = time.time()
"""
    elif variant in TRACED:
        prio = {"2tn": ', priority="normal"', "2T": ", names=[]", "2tr": f", max_rate={rate!r}",
                "2tx": ", helper_process=True", "2ty": ", helper_process=True"}.get(variant, "")
        prio += f", {tune}" if tune else ""
        pace = f"import foxhunt_stream.startup.prefetch; foxhunt_stream.startup.prefetch.PACED_BYTES = {int(step)}\n" if step else ""
        pace += "".join(f"import foxhunt_stream.startup.prefetch; foxhunt_stream.warm.{a.strip()}\n"
                        for a in warm_set.split(";") if a.strip())
        pre = f"""
import foxhunt_stream as fs
{pace}PF = fs.prefetch({directory!r}, imports={trace!r}{prio})
T["prefetch_started"] = time.time()
""" + ("""PF.wait_imports()
T["code_warmed"] = time.time()
""" if variant in ("2tw", "2ts", "2tx", "2tb") else "")
    if variant in BACKGROUND:
        pre = pre or """
import foxhunt_stream as fs
"""
        bg = f"""
import torch
T["import_torch"] = time.time()
{init}
T["cuda_init"] = time.time()
import foxhunt_stream.torch
H = fs.torch.load_file({directory!r}, device=DEV, background=True{", " + bg_options if bg_options else ""})
T["load_started"] = time.time()
import threading
threading.Thread(target=lambda: (H._landing.job._done.wait(), T.__setitem__("bg_load_done", time.time())),
                 daemon=True).start()
""" + (KERNEL_WARM.replace("SYNC", sync) if variant == "2bk" else "")
    sample = os.environ.get("STALL_SAMPLE_DIR")   # --stall-sample: where the main thread waits
    sampler = (f"import benchmarks.stall_sampler as _ss; "
               f"_ss.start({os.path.join(sample, '')!r} + {variant!r} + '_%d.json' % time.time_ns())\n"
               if sample else "")
    head = f"""
import time
T = {{"start": time.time()}}
{sampler}NOTES = []
DIR, DEV = {directory!r}, {device!r}
{pre}
import json, sys
""" + (bg if variant in BACKGROUND else """import torch
T["import_torch"] = time.time()
""") + """import transformers
from transformers import AutoConfig, AutoModelForCausalLM
T["import_transformers"] = time.time()
""" + ("" if variant in BACKGROUND else f"""{init}
T["cuda_init"] = time.time()
""") + f"""{HELPERS}
def meta_model():
    config = AutoConfig.from_pretrained(DIR)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(torch.float32)

def forward(model):
    model.eval()
    with torch.inference_mode():
        out = model(torch.tensor([[1]], device=DEV)).logits
        {sync}
    return float(out.float().abs().sum())
"""
    if variant == "F":
        body = """
model = meta_model()
T["meta_model"] = time.time()
"""
    elif variant == "E":
        body = """
model = meta_model()
T["meta_model"] = time.time()
model.to_empty(device=DEV)
fix_rotary(model, DEV)
T["to_empty"] = time.time()
forward(model)
T["forward"] = time.time()
"""
    elif variant == "1":
        body = """
try:
    model = AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.bfloat16, device_map=DEV)
except ValueError as e:
    if "accelerate" not in str(e):
        raise
    NOTES.append("no accelerate installed: from_pretrained without device_map, then .to(device)")
    model = AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.bfloat16).to(DEV)
T["load"] = time.time()
forward(model)
T["forward"] = time.time()
"""
    elif variant in BACKGROUND:
        body = """
model = meta_model()
T["meta_model"] = time.time()
missing, unexpected = fs.torch.load_model(model, H)
assert not missing and not unexpected, (missing, unexpected)
T["load_wait"] = time.time()
fix_rotary(model, DEV)
forward(model)
T["forward"] = time.time()
"""
        if variant in TRACED:
            body += PREFETCH_STAMPS
    elif variant in STREAMED:
        names = ""
        if variant == "2en":
            names = ", names=natural_order(DIR)"
        start_load = f"""H = fs.torch.load_file(DIR, device=DEV, background=True{names}{BG_TUNING.get(variant, '')})
""" + ("""T["load_started"] = time.time()
""" if variant in EARLY else "") + """import threading
threading.Thread(target=lambda: (H._landing.job._done.wait(), T.__setitem__("bg_load_done", time.time())),
                 daemon=True).start()
""" + (RENICE if variant == "2sn" else "")
        body = ("""import os; os.environ["FOXHUNT_CUDART"] = "cupy"   # the runtime as before ba0f419: import cupy
""" if variant == "2su" else "") + """
import foxhunt_stream as fs
import foxhunt_stream.torch
T["import_foxhunt"] = time.time()
""" + ("""WARMING = fs.warmup(DEV, background=True)   # overlaps building the model; the load waits for its pool
""" if variant == "2sw" else "") + ("""import threading
T["kernels_from"] = time.time()   # where kernels_warm_s counts from
""" + KERNEL_WARM.replace("SYNC", sync) if variant == "2sk" else "") + (NATURAL_ORDER if variant == "2en" else "") + (
            start_load if variant in EARLY else "") + """model = meta_model()
T["meta_model"] = time.time()
""" + ("""T["prefetch_bytes_at_load"] = PF.bytes_done
""" if variant in TRACED else "") + ("""sys.setswitchinterval(0.0002)   # the loader's workers wait less for the GIL
""" if variant == "2si" else "") + ("" if variant in EARLY else start_load) + """SL = fs.torch.load_model(model, H, wait=False)
assert not SL.missing and not SL.unexpected, (SL.missing, SL.unexpected)
T[""" + repr("streamed" if variant in EARLY else "load_started") + """] = time.time()
""" + LAYER_STAMPS + """for key, mod in (("fwd_layer_first", model.model.layers[0]), ("fwd_layer_last", model.model.layers[-1]),
                 ("fwd_head", model.lm_head)):   # after load_model's hooks: stamped once the weights are in
    mod.register_forward_pre_hook(lambda m, a, key=key: T.setdefault(key, time.time()) and None)   # None: args kept
fix_rotary(model, DEV)
forward(model)
assert SL.done()
T["forward"] = time.time()
""" + ("""sys.setswitchinterval(0.005)
""" if variant == "2si" else "")
        if variant in TRACED:
            body += PREFETCH_STAMPS
    elif variant in ("2", "2w", "2wk", "2p") + TRACED:
        body = """
import foxhunt_stream as fs
import foxhunt_stream.torch
T["import_foxhunt"] = time.time()
""" + ("""WARMING = fs.warmup(DEV, background=True)   # overlaps building the model
""" if variant in ("2w", "2wk") else "") + ("""import threading
T["kernels_from"] = time.time()   # where kernels_warm_s counts from
""" + KERNEL_WARM.replace("SYNC", sync) if variant == "2wk" else "") + """model = meta_model()
T["meta_model"] = time.time()
model.to_empty(device=DEV)
T["to_empty"] = time.time()
""" + ("WARMUP = WARMING.result()" if variant in ("2w", "2wk") else "WARMUP = fs.warmup(DEV)") + """
T["fs_warmup"] = time.time()
""" + ("""T["prefetch_bytes_at_load"] = PF.bytes_done
""" if variant in ("2p",) + TRACED else "") + """missing, unexpected = fs.torch.load_model(model, DIR)
assert not missing and not unexpected, (missing, unexpected)
T["load"] = time.time()
fix_rotary(model, DEV)
forward(model)
T["forward"] = time.time()
"""
        if variant in ("2p",) + TRACED:
            body += PREFETCH_STAMPS
    elif variant == "3":
        body = """
import os
from safetensors.torch import load_file
T["import_safetensors"] = time.time()
model = meta_model()
T["meta_model"] = time.time()
sd = {}
for f in sorted(os.listdir(DIR)):
    if f.endswith(".safetensors"):
        sd.update(load_file(os.path.join(DIR, f), device=DEV))
""" + ("torch.cuda.synchronize()\n" if cuda else "") + """
T["load_file"] = time.time()
model.load_state_dict(sd, strict=True, assign=True)
T["load"] = time.time()
fix_rotary(model, DEV)
forward(model)
T["forward"] = time.time()
"""
    else:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    tail = """
T["done"] = time.time()
extra = {"warmup": WARMUP} if "WARMUP" in globals() else {}
if "LAYERS_FWD" in globals():
    extra.update(layers_fwd=LAYERS_FWD, layers_landed=LAYERS_LANDED)
""" + (f"""extra["trace_files"] = fs.record_imports({trace!r})   # for the next start: after the timing
""" if variant in TRACED else "") + """
print("RESULT " + json.dumps({"stamps": T, "notes": NOTES, **extra}), flush=True)
"""
    return textwrap.dedent(head) + textwrap.dedent(body) + textwrap.dedent(tail)


# ---------------------------------------------------------------- running

def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def warm_cache(files: list[str]) -> None:
    buf = bytearray(64 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def run_variant(variant: str, directory: str, device: str, timeout: float, trace: str = DEFAULT_TRACE,
                rate: float = DEFAULT_RATE, tune: str = "", step: int | None = None, warm_set: str = "",
                bg_options: str = "") -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = child_program(variant, directory, device, trace, rate, tune, step, warm_set, bg_options)
    spawn = time.time()
    try:
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    result = None
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
    if r.returncode != 0 or result is None:
        return {"error": f"exit {r.returncode}: " + (r.stderr.strip()[-2000:] or r.stdout.strip()[-2000:])}
    stamps = result["stamps"]
    out = {"total_s": stamps["done"] - spawn,
           "phases_s": _phases(spawn, stamps)}
    if "warmup" in result:
        out["fs_warmup_detail_s"] = result["warmup"]
    if "trace_files" in result:
        out["trace_files"] = result["trace_files"]
    if result.get("notes"):
        out["notes"] = result["notes"]
    for k in PREFETCH_KEYS:
        if k in stamps:
            out[k] = stamps[k]
    if "bg_load_done" in stamps:   # 2b, 2s: the restore's own wall time, beside the imports or the forward
        out["bg_load_s"] = stamps["bg_load_done"] - stamps["load_started"]
    for k in MARKS:
        if k in stamps:
            out[k + "_s"] = stamps[k] - stamps["load_started"]
    if "kernels_warm_done" in stamps:
        out["kernels_warm_s"] = stamps["kernels_warm_done"] - stamps.get("kernels_from", stamps.get("load_started"))
    for k in ("layers_fwd", "layers_landed"):   # streamed: per layer, seconds after the load started
        if k in result:
            out[k + "_s"] = [round(t - stamps["load_started"], 4) for t in result[k]]
    return out


def _phases(spawn: float, stamps: dict) -> dict:
    """Durations between consecutive stamps, the first measured from the spawn."""
    out, prev = {}, spawn
    for k, v in stamps.items():
        if k in SIDE_KEYS:
            continue
        out["python_start" if k == "start" else k] = v - prev
        prev = v
    out.pop("done", None)
    return out


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict], nbytes: int) -> dict:
    summary: dict = {}
    for mode in sorted({r["mode"] for r in runs}):
        totals = {v: [r["total_s"] for r in runs if r["mode"] == mode and r["variant"] == v and "total_s" in r]
                  for v in VARIANTS}
        floor = median(totals["F"])
        summary[mode] = {}
        for v, xs in totals.items():
            if not xs:
                errs = [r["error"] for r in runs if r["mode"] == mode and r["variant"] == v and "error" in r]
                if errs:
                    summary[mode][v] = {"error": errs[-1][:300]}
                continue
            loads = [r["phases_s"].get("load") for r in runs
                     if r["mode"] == mode and r["variant"] == v and r.get("phases_s", {}).get("load")]
            med = median(xs)
            row = {"total_s": med, "min_s": min(xs), "runs": len(xs),
                   "minus_floor_s": med - floor if floor is not None else None}
            ok = [r for r in runs if r["mode"] == mode and r["variant"] == v and "phases_s" in r]
            row["phases_s"] = {k: median([r["phases_s"][k] for r in ok if k in r["phases_s"]])
                               for k in ok[-1]["phases_s"]} if ok else {}
            if loads:
                row["load_phase_s"] = median(loads)
                row["load_GBps"] = nbytes / median(loads) / 1e9
            summary[mode][v] = row
    return summary


def print_table(summary: dict, nbytes: int) -> None:
    print(f"\ncheckpoint: {nbytes / 2**30:.2f} GiB; seconds from spawning python to the first forward done "
          "(median of runs); 'minus F' subtracts the floor\n")
    modes = list(summary)
    head = f"{'variant':<42}" + "".join(f"{m + ' total':>12}{m + ' minus F':>14}{m + ' load GB/s':>15}" for m in modes)
    print(head)
    print("-" * len(head))
    for v in VARIANTS:
        cells = []
        present = False
        for m in modes:
            row = summary[m].get(v)
            if row is None:
                cells.append(f"{'':>12}{'':>14}{'':>15}")
            elif "error" in row:
                present = True
                cells.append(f"{'error':>12}{'':>14}{'':>15}")
            else:
                present = True
                mf = row.get("minus_floor_s")
                gbps = row.get("load_GBps")
                cells.append(f"{row['total_s']:>12.2f}{(f'{mf:+.2f}' if mf is not None else '-'):>14}"
                             f"{(f'{gbps:.1f}' if gbps else '-'):>15}")
        if present:
            print(f"{v + '  ' + LABELS[v]:<42}" + "".join(cells))
    print("\nphases (median seconds, each from the previous stamp; python_start from the spawn):")
    for m in modes:
        for v in VARIANTS:
            phases = summary[m].get(v, {}).get("phases_s")
            if phases:
                print(f"  [{m}] {v:<3} " + "  ".join(f"{k} {x:.2f}" for k, x in phases.items()))
    for m in modes:
        for v, row in summary[m].items():
            if "error" in row:
                print(f"\n[{m}] variant {v} failed: {row['error']}")


def plot(summary: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(summary)
    shown = [v for v in VARIANTS if any(v in summary[m] and "total_s" in summary[m][v] for m in modes)]
    fig, ax = plt.subplots(figsize=(1.6 * len(shown) + 3, 4.8))
    width = 0.8 / max(1, len(modes))
    colors = {"hot": "#d95f02", "cold": "#1b9e77"}
    for i, m in enumerate(modes):
        floor = summary[m].get("F", {}).get("total_s") or 0.0
        for j, v in enumerate(shown):
            row = summary[m].get(v, {})
            if "total_s" not in row:
                continue
            x = j + (i - (len(modes) - 1) / 2) * width
            color = colors.get(m, f"C{i}")
            base = min(floor, row["total_s"])
            ax.bar(x, base, width, color="#bbbbbb", edgecolor=color, linewidth=1.5,
                   label=f"{m}: floor F" if v == "F" else None)
            if v != "F":
                ax.bar(x, row["total_s"] - base, width, bottom=base, color=color,
                       label=f"{m}: above F" if j == shown.index(v) and v == next(w for w in shown if w != "F") else None)
            ax.text(x, row["total_s"], f"{row['total_s']:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels([f"{v}\n{LABELS[v]}" for v in shown], fontsize=7)
    ax.set_ylabel("seconds, spawn to first forward (grey: floor F)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    print(f"wrote {path}")


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _gpu_name(device: str) -> str | None:
    if not device.startswith("cuda"):
        return None
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", help="checkpoint directory (created on first use)")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3-8B)")
    ap.add_argument("--tiny", action="store_true", help="tiny widths too (a smoke test, e.g. with --device cpu)")
    ap.add_argument("--shard-size", default="5GB", help="max_shard_size for save_pretrained (default 5GB)")
    ap.add_argument("--recreate", action="store_true", help="write the checkpoint again even if present")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {','.join(VARIANTS)}")
    ap.add_argument("--repeat", type=int, default=3, help="runs per variant and mode (median reported)")
    ap.add_argument("--cold", action="store_true", help="also run cold (drop caches before each run; root)")
    ap.add_argument("--no-hot", action="store_true", help="skip the hot runs")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per child run")
    ap.add_argument("--json", help="write every run and the summary here")
    ap.add_argument("--append", action="store_true",
                    help="add to the runs already in --json (split a long benchmark over several commands)")
    ap.add_argument("--plot", help="write a PNG bar chart here (needs matplotlib)")
    ap.add_argument("--imports-trace", default=DEFAULT_TRACE,
                    help=f"variant 2t's import trace (written by each 2t run; default {DEFAULT_TRACE})")
    ap.add_argument("--prefetch-rate", type=float, default=DEFAULT_RATE, help="variant 2tr's max_rate, bytes/s")
    ap.add_argument("--bg-options", default="",
                    help="more keyword arguments for the 2b variants' background load_file, e.g. 'threads=4'")
    ap.add_argument("--prefetch-options", default="",
                    help="more keyword arguments for the 2t variants' fs.prefetch, e.g. 'threads=4'")
    ap.add_argument("--prefetch-step", type=int, default=None,
                    help="bytes per call of the idle / paced prefetch readers (warm.PACED_BYTES, default 4 MiB)")
    ap.add_argument("--prefetch-set", default="",
                    help="';'-separated foxhunt_stream.startup.prefetch settings for the 2t variants, "
                         "e.g. \"IDLE_READ='pread'; PACED_BYTES=1<<20\"")
    ap.add_argument("--stall-sample", metavar="DIR",
                    help="each child samples its main thread's waits (benchmarks/stall_sampler.py) into DIR")
    args = ap.parse_args(argv)
    if args.stall_sample:
        os.makedirs(args.stall_sample, exist_ok=True)
        os.environ["STALL_SAMPLE_DIR"] = os.path.abspath(args.stall_sample)

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    directory = os.path.abspath(args.directory)
    if args.recreate or not (os.path.isfile(os.path.join(directory, "config.json"))
                             and checkpoint_files(directory)):
        create_checkpoint(directory, args.layers, args.device, args.tiny, args.shard_size)
    files = checkpoint_files(directory)
    nbytes = sum(os.path.getsize(f) for f in files)
    modes = ([] if args.no_hot else ["hot"]) + (["cold"] if args.cold else [])
    if "cold" in modes:
        try:
            drop_caches()
        except OSError as e:
            print(f"--cold needs root and a writable /proc/sys/vm/drop_caches ({e}); skipping the cold runs",
                  file=sys.stderr)
            modes.remove("cold")

    runs: list[dict] = []
    if args.append and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            old = json.load(f)
        if old.get("checkpoint_bytes") != nbytes:
            ap.error(f"--append: {args.json} measured another checkpoint ({old.get('checkpoint_bytes')} bytes)")
        runs = old["runs"]
        print(f"appending to the {len(runs)} run(s) already in {args.json}")
    if "cold" in modes and set(TRACED) & set(variants) and not os.path.exists(args.imports_trace):
        warm_cache(files)
        r = run_variant("2t", directory, args.device, args.timeout, args.imports_trace)
        print(f"recorded the import trace {args.imports_trace} in an uncounted hot 2t run: "
              f"{r.get('trace_files', r.get('error'))}", flush=True)
    for mode in modes:
        for rep in range(args.repeat):
            for v in variants:
                if mode == "hot":
                    warm_cache(files)
                else:
                    drop_caches()
                r = run_variant(v, directory, args.device, args.timeout, args.imports_trace, args.prefetch_rate,
                                args.prefetch_options, args.prefetch_step, args.prefetch_set, args.bg_options)
                r.update(variant=v, mode=mode, repeat=rep)
                runs.append(r)
                status = f"{r['total_s']:.2f} s" if "total_s" in r else "FAILED: " + r["error"].splitlines()[-1][:200]
                print(f"[{mode} {rep + 1}/{args.repeat}] {v:<3} {status}", flush=True)
                for note in r.get("notes", []):
                    print(f"      note: {note}", flush=True)

    summary = summarize(runs, nbytes)
    print_table(summary, nbytes)
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": _git_commit(), "host": platform.node(), "gpu": _gpu_name(args.device),
        "python": sys.version.split()[0], "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "directory": directory, "files": len(files), "checkpoint_bytes": nbytes, "device": args.device,
        "summary": summary, "runs": runs,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            plot(summary, args.plot, f"{nbytes / 2**30:.2f} GiB checkpoint in {len(files)} file(s), "
                                     f"{report['gpu'] or args.device}, {report['date']}")
        except Exception as e:  # noqa: BLE001 - a missing matplotlib must not lose the numbers
            print(f"plot failed: {e}", file=sys.stderr)
    return 0 if all("total_s" in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
