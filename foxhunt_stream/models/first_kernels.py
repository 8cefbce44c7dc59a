"""The first forward's kernels, loaded by a thread while the model is built and matched.

A fresh process pays a one-time cost on its first GEMM (cuBLAS's kernels loaded on first use, about
0.1-0.2 s) and smaller ones on each other kernel's first run. The warm forward (``hf.warm_up``)
pays them too, but only once the model is built; a thread started with the load pays them while
transformers' Python builds and matches the model (torch releases the GIL inside each op). Each
weight shape of the checkpoint goes through one ``linear`` on scratch memory, with the norm,
activation and attention ops of a decoder layer.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("foxhunt_stream")

SCRATCH_LIMIT = 512 << 20   # no weight larger than this is made (a vocabulary's, 1 GiB for Llama-3)


def gemm_shapes(shapes: Mapping[str, Sequence[int]], itemsize: int, headroom: int) -> list[tuple[int, int]]:
    """The distinct ``(out, in)`` shapes of the checkpoint's matrices, in first-seen order, that
    fit ``SCRATCH_LIMIT`` and a sixteenth of ``headroom`` (device bytes left beside the load)."""
    limit = min(SCRATCH_LIMIT, headroom // 16)
    out: dict[tuple[int, int], None] = {}
    for shape in shapes.values():
        if len(shape) == 2 and 0 < math.prod(shape) * itemsize <= limit:
            out.setdefault((int(shape[0]), int(shape[1])), None)
    return list(out)


def attention_shape(config: Any) -> tuple[int, int] | None:
    """``(heads, head_dim)`` from a transformers text config, or None where it does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, hidden = getattr(text, "num_attention_heads", None), getattr(text, "hidden_size", None)
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads and hidden else None)
    return (int(heads), int(head_dim)) if heads and head_dim else None


def run_kernels(gemms: Sequence[tuple[int, int]], attention: tuple[int, int] | None, dtype, device) -> None:
    """One token through each GEMM shape and a decoder layer's other ops, on scratch tensors."""
    import torch
    with torch.no_grad():
        for n, k in gemms:
            torch.nn.functional.linear(torch.zeros((1, 1, k), dtype=dtype, device=device),
                                       torch.empty((n, k), dtype=dtype, device=device))
        if gemms:
            x = torch.zeros((1, 1, gemms[0][1]), dtype=dtype, device=device)
            v = x.float()
            (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
            torch.nn.functional.silu(x) * x
        if attention is not None:
            q = torch.zeros((1, attention[0], 1, attention[1]), dtype=dtype, device=device)
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)


class KernelWarmer:
    """``run_kernels`` on a daemon thread; ``join()`` returns its seconds (errors are logged only:
    the warm forward and the user's first forward pay what it did not)."""

    def __init__(self, shapes: Mapping[str, Sequence[int]], config: Any, dtype, device) -> None:
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(dict(shapes), config, dtype, device),
                                        name="foxhunt-first-kernels", daemon=True)
        self._thread.start()

    def _run(self, shapes, config, dtype, device) -> None:
        import torch
        t = time.perf_counter()
        try:
            itemsize = torch.empty((), dtype=dtype).element_size()
            headroom = 1 << 62
            if torch.device(device).type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                headroom = free - sum(math.prod(s) for s in shapes.values()) * itemsize
            run_kernels(gemm_shapes(shapes, itemsize, headroom), attention_shape(config), dtype, device)
        except Exception as e:  # noqa: BLE001 -- an optimisation only
            self.error = e
            log.debug("from_pretrained: loading the first forward's kernels failed: %r", e)
        self.seconds = time.perf_counter() - t

    def join(self) -> float | None:
        self._thread.join()
        return self.seconds
