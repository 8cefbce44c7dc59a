#!/usr/bin/env python
"""Long-running fuzz driver for the safetensors header parser.

Every input is a whole file's bytes, given to ``foxhunt_stream.format.header.parse_header`` and checked:

* it ends in a ``FormatError`` or in a ``Header`` that describes the input (tensors tile the data
  region up to the last byte) - any other exception is a finding;
* differential, on every ``--diff-every``-th input: safetensors 0.8.0 (``safetensors.deserialize``,
  the same ``read_metadata`` as ``safe_open``) gives the same verdict, or ours is a rejection that
  ``tests/format_support.STRICTER`` documents; when both accept, the same tensors and bytes;
* bounded: the slowest input's time is recorded; every ``--mem-every``-th input is parsed again
  under tracemalloc and its peak compared with its size; and the address space is capped
  (``--as-limit-gb``), so an allocation following a claimed size would fail loudly.

Engines: ``atheris`` (coverage-guided libFuzzer; a custom mutator mixes the structure-aware
mutations of ``tests/format_support.py`` with libFuzzer's own) when it is installed, else
``random`` (the structure-aware mutations alone, plus raw random bytes).

    python tools/fuzz_header.py --runs 1000000 --engine atheris --seed 1

Prints progress every ``--progress`` inputs and a summary at the end (also written as JSON to
``--summary``); exit status 1 if anything was found. Findings are saved under ``--artifacts``.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import resource
import sys
import tempfile
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


class Fuzzer:
    def __init__(self, args, parse_header, FormatError, Header) -> None:
        from format_support import documented_stricter, reference_verdict
        self.args = args
        self.parse_header, self.FormatError, self.Header = parse_header, FormatError, Header
        self.reference_verdict, self.documented_stricter = reference_verdict, documented_stricter
        self.inputs = 0
        self.accepted = 0
        self.rules: collections.Counter = collections.Counter()
        self.stricter: collections.Counter = collections.Counter()
        self.diffed = 0
        self.findings: collections.Counter = collections.Counter()
        self.examples: dict[str, str] = {}
        self.slowest = (0.0, 0)           # (seconds, input length), single observation
        self.slowest_retimed = (0.0, 0)   # best of 3 for the inputs that looked slow
        self.mem_samples = 0
        self.max_peak = (0, 0)          # (peak bytes, input length)
        self.max_ratio = (0.0, 0, 0)    # (peak / length, peak, length)
        self.longest = 0
        self.started = time.perf_counter()
        self.done = False

    # -- one input
    def __call__(self, data: bytes) -> None:
        self.inputs += 1
        self.longest = max(self.longest, len(data))
        t0 = time.perf_counter()
        try:
            verdict = self.parse_header(data, len(data))
        except self.FormatError as e:
            verdict = e
        except BaseException as e:   # noqa: BLE001 - any other exception is what we hunt
            self.found("exception", data, f"{type(e).__name__}: {e}")
            verdict = None
        dt = time.perf_counter() - t0
        if dt > self.slowest[0]:
            self.slowest = (dt, len(data))
        if dt > 0.01:   # on a shared machine most of these are scheduling noise: time it again
            dt = self.retime(data)
            if dt > self.slowest_retimed[0]:
                self.slowest_retimed = (dt, len(data))
                with open(os.path.join(self.args.artifacts, "slowest-input.bin"), "wb") as f:
                    f.write(data)
            if dt > self.args.slow:
                self.found("slow", data, f"{dt:.3f} s")
        if isinstance(verdict, self.Header):
            self.accepted += 1
            self.check_accepted(verdict, data)
        elif verdict is not None:
            self.rules[verdict.rule] += 1
        if verdict is not None and self.inputs % self.args.diff_every == 0:
            self.differential(verdict, data)
        if self.inputs % self.args.mem_every == 0:
            self.memory(data)
        if self.inputs % self.args.progress == 0:
            self.progress()
        if self.inputs == self.args.runs:
            self.finish()

    def retime(self, data: bytes) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            try:
                self.parse_header(data, len(data))
            except BaseException:   # noqa: BLE001 - already recorded
                pass
            best = min(best, time.perf_counter() - t0)
        return best

    def found(self, kind: str, data: bytes, detail: str) -> None:
        self.findings[kind] += 1
        digest = hashlib.sha1(data).hexdigest()[:16]
        path = os.path.join(self.args.artifacts, f"{kind}-{digest}.bin")
        if self.findings[kind] <= 50:
            with open(path, "wb") as f:
                f.write(data)
        self.examples.setdefault(kind, f"{path}: {detail}"[:400])

    def check_accepted(self, h, data: bytes) -> None:
        pos = 0
        for t in h.tensors:
            if t.start != pos or t.numel * t.dtype.bits != 8 * (t.end - t.start):
                self.found("bad-accept", data, f"tensor {t.name!r} does not tile")
                return
            pos = t.end
        if h.data_start + pos != len(data):
            self.found("bad-accept", data, "data region does not end at EOF")

    def differential(self, verdict, data: bytes) -> None:
        self.diffed += 1
        ref = self.reference_verdict(data)
        if isinstance(verdict, self.FormatError):
            if ref.ok:
                if self.documented_stricter(verdict, data):
                    self.stricter[verdict.rule] += 1
                else:
                    self.found("stricter-undocumented", data, str(verdict))
            return
        if not ref.ok:
            self.found("laxer-than-reference", data, ref.error)
            return
        base = verdict.data_start
        ours = {t.name: (t.dtype.name, t.shape, data[base + t.start:base + t.end]) for t in verdict.tensors}
        if ours != ref.tensors:
            self.found("accepted-differently", data, "tensors differ from the reference's")

    def memory(self, data: bytes) -> None:
        self.mem_samples += 1
        tracemalloc.start()
        try:
            try:
                self.parse_header(data, len(data))
            except self.FormatError:
                pass
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        if peak > self.max_peak[0]:
            self.max_peak = (peak, len(data))
        ratio = peak / max(1, len(data))
        if len(data) >= 512 and ratio > self.max_ratio[0]:   # (tiny inputs: the fixed overhead dominates)
            self.max_ratio = (ratio, peak, len(data))
        if peak > self.args.mem_factor * len(data) + (1 << 20):
            self.found("memory", data, f"peak {peak} bytes for a {len(data)}-byte input")

    # -- reporting
    def summary(self) -> dict:
        elapsed = time.perf_counter() - self.started
        return {
            "engine": self.args.engine, "seed": self.args.seed, "command": " ".join(sys.argv),
            "inputs": self.inputs, "seconds": round(elapsed, 1), "inputs_per_second": round(self.inputs / elapsed),
            "accepted": self.accepted, "rejected_by_rule": dict(self.rules.most_common()),
            "differential_inputs": self.diffed, "documented_stricter": dict(self.stricter),
            "findings": dict(self.findings), "finding_examples": self.examples,
            "slowest_input_seconds": round(self.slowest[0], 4), "slowest_input_bytes": self.slowest[1],
            "slowest_retimed_seconds": round(self.slowest_retimed[0], 5),
            "slowest_retimed_bytes": self.slowest_retimed[1],
            "longest_input_bytes": self.longest, "memory_samples": self.mem_samples,
            "max_peak_bytes": self.max_peak[0], "max_peak_input_bytes": self.max_peak[1],
            "max_peak_per_input_byte_inputs_over_512b": round(self.max_ratio[0], 1),
            "max_ratio_peak_bytes": self.max_ratio[1], "max_ratio_input_bytes": self.max_ratio[2],
        }

    def progress(self) -> None:
        s = self.summary()
        print(f"[fuzz] {s['inputs']} inputs, {s['seconds']} s, {s['inputs_per_second']}/s, accepted {s['accepted']}, "
              f"findings {s['findings'] or 0}, slowest {s['slowest_input_seconds']} s "
              f"(re-timed {s['slowest_retimed_seconds']} s)", flush=True)

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        s = self.summary()
        text = json.dumps(s, indent=2, ensure_ascii=False)
        print(text, flush=True)
        if self.args.summary:
            with open(self.args.summary, "w") as f:
                f.write(text + "\n")
        if self.args.engine == "atheris":   # libFuzzer would exit 0 whatever we found
            sys.stdout.flush()
            os._exit(1 if self.findings else 0)


def seeds() -> list[bytes]:
    from format_support import seed_files
    out = list(seed_files())
    import importlib.util
    path = os.path.join(ROOT, "tests", "format", "test_header_reference.py")   # its cases seed the fuzzer too
    spec = importlib.util.spec_from_file_location("header_reference_cases", path)
    cases = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = cases   # its dataclasses look their module up
    spec.loader.exec_module(cases)
    out += [c.buf for c in cases.REJECT + cases.STRICTER_CASES] + list(cases.ACCEPT.values())
    return out


DICTIONARY = ['"dtype"', '"shape"', '"data_offsets"', '"__metadata__"', '"F32"', '"BF16"', '"F4"', '"F6_E2M3"',
              '"U8"', '"BOOL"', '"F8_E8M0"', '"C64"', "\\\\ud800", "\\\\udc00", "-0", "1e400", "NaN", "[0,0]", "{}",
              "[]", "null", "18446744073709551615", "18446744073709551616", "\\xef\\xbb\\xbf", "\\x00\\x00\\x00\\x00"]


def run_atheris(args, fuzzer, corpus: list[bytes]) -> None:
    import atheris
    from format_support import mutate
    work = tempfile.mkdtemp(prefix="foxhunt-fuzz-corpus-")
    for i, buf in enumerate(corpus):
        if len(buf) <= args.max_len:
            with open(os.path.join(work, f"seed{i:03d}"), "wb") as f:
                f.write(buf)
    dict_path = os.path.join(work, "..", os.path.basename(work) + ".dict")
    with open(dict_path, "w") as f:
        f.writelines(f'kw{i}="{tok.replace(chr(34), chr(92) + chr(34))}"\n' for i, tok in enumerate(DICTIONARY))

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        r = rng.random()
        if r < 0.45:
            out = mutate(data if data else rng.choice(corpus), rng)
        elif r < 0.5:
            out = mutate(rng.choice(corpus), rng)
        else:
            out = atheris.Mutate(data, max_size)
        return out[:max_size]

    argv = [sys.argv[0], f"-runs={args.runs}", f"-seed={args.seed}", f"-max_len={args.max_len}",
            f"-timeout={args.timeout}", f"-rss_limit_mb={args.rss_limit_mb}", f"-dict={dict_path}",
            "-print_final_stats=1", work]
    atheris.Setup(argv, fuzzer, custom_mutator=custom_mutator)
    atheris.Fuzz()


def run_random(args, fuzzer, corpus: list[bytes]) -> None:
    from format_support import mutate
    rng = random.Random(args.seed)
    while fuzzer.inputs < args.runs:
        if rng.random() < 0.05:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        else:
            data = rng.choice(corpus)
            for _ in range(rng.randrange(1, 5)):
                data = mutate(data, rng)
        fuzzer(data[:args.max_len])
    fuzzer.finish()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1_000_000)
    p.add_argument("--engine", choices=("auto", "atheris", "random"), default="auto")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--diff-every", type=int, default=1, help="compare with the reference on every n-th input")
    p.add_argument("--mem-every", type=int, default=500, help="trace memory on every n-th input")
    p.add_argument("--mem-factor", type=int, default=64, help="finding if peak > factor * input + 1 MiB")
    p.add_argument("--timeout", type=int, default=10, help="seconds per input (libFuzzer -timeout)")
    p.add_argument("--slow", type=float, default=0.5, help="finding if an input takes longer (best of 3)")
    p.add_argument("--rss-limit-mb", type=int, default=2048)
    p.add_argument("--as-limit-gb", type=float, default=8.0, help="address-space cap for this process (0: none)")
    p.add_argument("--progress", type=int, default=100_000)
    p.add_argument("--summary", default="", help="also write the summary JSON here")
    p.add_argument("--artifacts", default="", help="directory for findings (default: a new temp dir)")
    args = p.parse_args()
    if args.engine == "auto":
        try:
            import atheris  # noqa: F401
            args.engine = "atheris"
        except ImportError:
            args.engine = "random"
    args.artifacts = args.artifacts or tempfile.mkdtemp(prefix="foxhunt-fuzz-findings-")
    os.makedirs(args.artifacts, exist_ok=True)
    print(f"[fuzz] engine {args.engine}, {args.runs} runs, seed {args.seed}, findings in {args.artifacts}", flush=True)

    if args.engine == "atheris":
        import atheris
        with atheris.instrument_imports(include=["foxhunt_stream"]):
            from foxhunt_stream.errors import FormatError
            from foxhunt_stream.format.header import Header, parse_header
    else:
        from foxhunt_stream.errors import FormatError
        from foxhunt_stream.format.header import Header, parse_header
    corpus = seeds()
    fuzzer = Fuzzer(args, parse_header, FormatError, Header)
    if args.as_limit_gb:
        limit = int(args.as_limit_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    if args.engine == "atheris":
        run_atheris(args, fuzzer, corpus)
    else:
        run_random(args, fuzzer, corpus)
    return 1 if fuzzer.findings else 0


if __name__ == "__main__":
    sys.exit(main())
