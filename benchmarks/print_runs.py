#!/usr/bin/env python
"""One line per startup_bench run of the given JSON files: mode, variant, total, each phase and
the side measurements (background load, kernel warm, forward marks, bytes prefetched).

    python benchmarks/print_runs.py hot.json [cold.json ...]   (missing files are skipped)
"""

from __future__ import annotations

import json
import os
import sys

SIDE = ("bg_load_s", "kernels_warm_s", "fwd_layer_first_s", "fwd_layer_last_s", "fwd_head_s")


def layer_line(landed: list[float], fwd: list[float]) -> str:
    """A streamed forward, layer by layer: when each layer's weights were in and when the forward
    reached it (seconds after the load started), at five layers, and the forward's largest lag."""
    n = min(len(landed), len(fwd))
    picks = sorted({0, n // 4, n // 2, 3 * n // 4, n - 1}) if n else []
    lag = max((fwd[i] - landed[i] for i in range(n)), default=0.0)
    return ("layer landed/forward " + " ".join(f"{i}:{landed[i]:.3f}/{fwd[i]:.3f}" for i in picks)
            + f"; largest lag {lag:.3f}")


def main(paths: list[str]) -> int:
    for path in paths:
        if not os.path.exists(path):
            continue
        for r in json.load(open(path))["runs"]:
            ph = r.get("phases_s", {})
            extra = {k: round(r[k], 3) for k in SIDE if k in r}
            if "prefetch_bytes_at_load" in r:
                extra["prefetched_GB_at_load"] = round(r["prefetch_bytes_at_load"] / 1e9, 2)
            print(r["mode"], r["variant"], round(r.get("total_s", 0), 2),
                  " ".join(f"{k} {v:.3f}" for k, v in ph.items()), extra, r.get("error", "")[-300:])
            if r.get("layers_fwd_s") and r.get("layers_landed_s"):
                print("   ", layer_line(r["layers_landed_s"], r["layers_fwd_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
