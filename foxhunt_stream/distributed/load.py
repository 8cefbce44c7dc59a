"""Load once, share over torch.distributed: each rank reads only its part (docs/tensor-parallel.md).

Four phases: agree on the selection (``ownership.plan_exchange``); start each rank's reads of what
it owns and of its TP slices, and allocate what it receives; the owners broadcast in windows of at
most ``exchange_bytes`` as their tensors land (a rank that fails keeps taking part); agree on the
outcome (``DistributedLoadError`` on every rank). A hung rank is bounded by the group's timeout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..cuda.devices import Device, check_device, parse_device
from ..engine.frameworks import get_framework
from ..engine.loader import load_file as load_local
from ..format.dtypes import DTYPES, host_shape
from ..format.tp import TPSlice, shard_index
from ..io.checkpoint import Names, open_checkpoint, select
from .ownership import CheckpointMismatch, ExchangePlan, Window, describe, plan_exchange

DEFAULT_EXCHANGE_BYTES = 64 << 20

log = logging.getLogger("foxhunt_stream")


class DistributedLoadError(RuntimeError):
    """A distributed load failed on one or more ranks; raised on every rank of the group.
    ``failures``: rank -> "ExceptionType: message" (a rank's own exception is the ``__cause__``)."""

    def __init__(self, failures: dict[int, str], rank: int) -> None:
        self.failures, self.rank = failures, rank
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
        super().__init__(f"distributed load failed on {len(failures)} rank(s) (this is rank {rank}): {lines}")


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class _Group:
    """The few collectives we need, on one process group."""

    def __init__(self, pg) -> None:
        import torch.distributed as dist
        self.dist, self.pg = dist, pg
        self.rank = dist.get_rank(pg)
        self.world = dist.get_world_size(pg)

    def gather(self, obj) -> list:
        out = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.pg)
        return out

    def agree(self, error: BaseException | None) -> None:
        """All ranks learn whether any failed; every rank raises if one did."""
        statuses = self.gather(None if error is None else _failure(error))
        failures = {r: m for r, m in enumerate(statuses) if m is not None}
        if failures:
            raise DistributedLoadError(failures, self.rank) from error

    def broadcast(self, buf, owner: int) -> None:
        src = self.dist.get_global_rank(self.pg, owner) if self.pg is not None else owner
        self.dist.broadcast(buf, src=src, group=self.pg)


def _bytes(t):
    """A flat uint8 view of a contiguous tensor (any dtype, any number of dims)."""
    import torch
    return t.reshape(-1).view(torch.uint8)


# -- 1. agree on the selection -------------------------------------------------------------------

@dataclass
class _Agreed:
    """This rank's side of the selection the group agreed on."""
    device: Device
    fw: Any                       # the torch framework on ``device``
    chosen: list[str]             # what this rank asked for, in its order
    indices: dict[str, Any]       # name -> this rank's slice index (None: whole); empty without shard=
    shard: TPSlice | None
    plan: ExchangePlan


def _select_here(source, device, names: Names, shard: TPSlice | None):
    """This rank's device, framework, names, their descriptions and slice indices (may raise)."""
    import torch
    dev = parse_device(device)
    check_device(dev)
    fw = get_framework("pt", dev)
    if dev.is_cuda:
        torch.cuda.set_device(dev.index)   # NCCL's object collectives use the current device
    ck = open_checkpoint(source)
    chosen = select(ck, names)
    descs = {n: describe(ck, n) for n in chosen}
    indices = {n: shard_index(descs[n].shape, shard, n) for n in chosen} if shard is not None else {}
    for n, idx in indices.items():
        if idx is not None and DTYPES[descs[n].dtype].sub_byte:
            raise NotImplementedError(f"tensor {n!r}: sharding a sub-byte dtype ({descs[n].dtype}) "
                                      "over process_group is not supported")
    return dev, fw, chosen, descs, indices


def _agree_on_selection(group: _Group, source, device, names: Names, shard: TPSlice | None,
                        window: int) -> _Agreed:
    """Every rank's selection (or its error) gathered; one plan computed alike on every rank."""
    error: BaseException | None = None
    try:
        dev, fw, chosen, descs, indices = _select_here(source, device, names, shard)
    except Exception as e:
        error = e
    sliced = [] if error is not None else sorted(n for n, idx in indices.items() if idx is not None)
    gathered = group.gather(_failure(error) if error is not None else (descs, window, sliced))
    failures = {r: g for r, g in enumerate(gathered) if isinstance(g, str)}
    if failures:
        raise DistributedLoadError(failures, group.rank) from error
    window = min(g[1] for g in gathered)   # every rank must cut the same windows: the smallest bound
    try:
        plan = plan_exchange([g[0] for g in gathered], window, group.rank, sliced=[g[2] for g in gathered])
    except CheckpointMismatch as e:
        raise DistributedLoadError(e.failures, group.rank) from None
    return _Agreed(dev, fw, chosen, indices, shard, plan)


# -- 2.-4. start the reads, exchange, finish -----------------------------------------------------

class _Exchange:
    """This rank's part of the exchange: its reads in flight, the whole tensors it holds, and its
    result. From the first broadcast on, a rank that failed (``failed``) still takes part in every
    broadcast, sending or dropping junk, and says so at the end: no rank is left waiting."""

    def __init__(self, group: _Group, agreed: _Agreed) -> None:
        self.group, self.agreed, self.plan = group, agreed, agreed.plan
        self.mine = set(agreed.chosen)
        self.whole = {n for n in agreed.chosen if agreed.indices.get(n) is None}   # wanted whole here
        self.local = set(agreed.plan.local)                                          # sliced and read here
        self.full: dict[str, Any] = {}
        self.result: dict[str, Any] = {}
        self.handle = None
        self.scratch = None
        self.failed: BaseException | None = None

    def _empty(self, n: str):
        d = self.plan.union[n]
        return self.agreed.fw.empty(DTYPES[d.dtype], d.shape, self.agreed.device, n)

    def _slicing(self) -> TPSlice | None:
        """How this rank's own reads are sliced: its slice of each ``local`` tensor, owned ones whole."""
        if not self.plan.local:
            return None
        shard, owned = self.agreed.shard, set(self.plan.owned)
        return TPSlice(shard.rank, shard.world_size, lambda n: None if n in owned else shard.dim_for(n))

    def start(self, source, verify: bool, progress: bool | None, options: dict) -> None:
        """Phase 2: start reading what this rank owns, then its own slices; allocate what it
        receives and the scratch window; the group agrees on any failure before any broadcast."""
        import torch
        error: BaseException | None = None
        try:
            reads = self.plan.owned + self.plan.local   # owned first: the broadcasts wait on those
            if reads:
                self.handle = load_local(source, device=self.agreed.device, framework="pt", names=reads,
                                         shard=self._slicing(), verify=verify, progress=progress, background=True,
                                         **options)
            for n in self.agreed.chosen:
                if n in self.whole and self.plan.owners[n] != self.group.rank:
                    self.full[n] = self._empty(n)
            if self.plan.windows:
                self.scratch = torch.empty(max(w.nbytes for w in self.plan.windows), dtype=torch.uint8,
                                           device=str(self.agreed.device))
        except Exception as e:
            error = e
        try:
            self.group.agree(error)
        except BaseException:
            if self.handle is not None:
                self.handle.cancel()
            self.full.clear()
            raise

    def fail(self, e: BaseException) -> None:
        if self.failed is None:
            self.failed = e
            if self.handle is not None:
                self.handle.cancel()
        self.full.clear()
        self.result.clear()

    def source_of(self, n: str):
        """Owner side: the landed tensor (waiting for its reads), or None after a failure."""
        if self.failed is None and n not in self.full:
            try:
                t = self.handle.wait(n)
                d = self.plan.union[n]
                dt = DTYPES[d.dtype]
                if t.dtype != self.agreed.fw.torch_dtype(dt) or tuple(t.shape) != host_shape(dt, d.shape):
                    raise ValueError(f"tensor {n!r}: this rank read {t.dtype} {list(t.shape)}, "
                                     f"the group agreed on {d.dtype} {list(d.shape)}")
                self.full[n] = t
            except Exception as e:
                self.fail(e)
        return self.full.get(n)

    def dest_of(self, n: str):
        """Receiver side: where a tensor wanted whole here lands, or None (its bytes dropped)."""
        if self.failed is None and n in self.whole and n not in self.full:
            try:
                self.full[n] = self._empty(n)
            except Exception as e:
                self.fail(e)
        return self.full.get(n)

    def finish(self, n: str) -> None:
        """Tensor ``n`` is complete here: into the result (or only this rank's slice of it)."""
        import torch
        if self.failed is None and n in self.mine and n in self.full:
            t = self.full[n]
            idx = self.agreed.indices.get(n)
            self.result[n] = t if idx is None else t[idx].clone(memory_format=torch.contiguous_format)
        self.full.pop(n, None)   # sliced, or not wanted here: the whole one goes as soon as it is sent

    def take_local(self, n: str) -> None:
        """This rank's own slice of ``n``, as its reads land it."""
        try:
            self.result[n] = self.handle.wait(n)
        except Exception as e:
            self.fail(e)

    def broadcast(self, w: Window) -> None:
        """One window: a single segment goes straight from/into its tensor, several through scratch."""
        sender = w.owner == self.group.rank
        if len(w.segments) == 1:
            n, start, length = w.segments[0]
            t = self.source_of(n) if sender else self.dest_of(n)
            self.group.broadcast(self.scratch[:length] if t is None else _bytes(t)[start:start + length], w.owner)
            return
        buf = self.scratch[:w.nbytes]
        pos = 0
        for n, start, length in w.segments:
            t = self.source_of(n) if sender else None
            if t is not None:
                buf[pos:pos + length].copy_(_bytes(t)[start:start + length])
            pos += length
        self.group.broadcast(buf, w.owner)
        pos = 0
        for n, start, length in w.segments:
            t = None if sender else self.dest_of(n)
            if t is not None:
                _bytes(t)[start:start + length].copy_(buf[pos:pos + length])
            pos += length

    def run(self) -> None:
        """Phase 3: every window in the agreed order, then what no window carries (own slices...)."""
        remaining = {n: self.plan.union[n].nbytes for n in self.plan.order}
        for w in self.plan.windows:
            self.broadcast(w)
            for n, _, length in w.segments:
                remaining[n] -= length
                if remaining[n] == 0:
                    self.finish(n)
        for n in self.plan.order:
            if n not in self.mine or n in self.result or self.failed is not None:
                continue
            if n in self.local:
                self.take_local(n)
                continue
            if self.plan.owners[n] == self.group.rank:
                self.source_of(n)
            else:
                self.dest_of(n)
            self.finish(n)

    def close(self) -> None:
        """Phase 4: the reads end (closing the files), the device settles, the group agrees."""
        import torch
        try:
            if self.handle is not None and self.failed is None:
                self.handle.result()   # closes the files; a file changed under the reads raises here
            if self.agreed.device.is_cuda:
                torch.cuda.current_stream(self.agreed.device.index).synchronize()
        except Exception as e:
            self.fail(e)
        try:
            self.group.agree(self.failed)
        except BaseException:
            self.fail(RuntimeError("failed elsewhere"))
            raise


def _window_bytes(framework: str | None, background: bool, exchange_bytes: int | None) -> int:
    """The arguments only a distributed load has, checked; returns this rank's window bound."""
    if framework not in (None, "pt", "torch"):
        raise ValueError(f"load_file(process_group=...) shares torch tensors: framework must be 'pt', "
                         f"got {framework!r}")
    if background:
        raise ValueError("load_file(process_group=...) cannot run in the background")
    window = DEFAULT_EXCHANGE_BYTES if exchange_bytes is None else int(exchange_bytes)
    if window < 1:
        raise ValueError(f"exchange_bytes must be positive, got {exchange_bytes}")
    return window


def load_file_distributed(source, device="cpu", framework: str | None = None, names: Names = None, *,
                          process_group, shard: TPSlice | None = None, exchange_bytes: int | None = None,
                          verify: bool = False, progress: bool | None = None, background: bool = False,
                          **options) -> dict[str, Any]:
    """``load_file`` over a torch.distributed group: every rank of ``process_group`` calls it (with its
    own ``device``, ``names`` and ``shard``); the checkpoint is read once across the group and shared
    with broadcasts (with ``shard``, only the replicated tensors). Returns this rank's ``{name:
    torch.Tensor}``. ``framework``: "pt" (or None). ``exchange_bytes`` bounds the exchange's device
    memory (64 MiB). An error on any rank raises ``DistributedLoadError`` on all of them.
    """
    window = _window_bytes(framework, background, exchange_bytes)
    group = _Group(process_group)
    t0 = time.perf_counter()
    agreed = _agree_on_selection(group, source, device, names, shard, window)
    exchange = _Exchange(group, agreed)
    exchange.start(source, verify, progress, options)
    t_load = time.perf_counter()
    exchange.run()
    exchange.close()
    plan = agreed.plan
    log.debug("distributed load, rank %d of %d: owns %d of %d tensors (%d bytes), reads %d slices itself; "
              "plan+load %.3f s, exchange %.3f s in %d broadcasts (window %d)", group.rank, group.world,
              len(plan.owned), len(plan.order), plan.nbytes(plan.owned), len(plan.local), t_load - t0,
              time.perf_counter() - t_load, len(plan.windows), plan.window_bytes)
    return {n: exchange.result[n] for n in agreed.chosen}
