"""``fs.verify``: check a checkpoint without a GPU, every header rule and every byte once, with a
load's pieces but bytes dropped once hashed: host memory stays at a few chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import settings as _settings
from ..engine.loader import open_sources, prepare, selections
from ..engine.pipeline import Job
from ..engine.staging import host_pool, slot_bytes
from ..engine.targets import read_inspected
from ..io.checkpoint import open_checkpoint
from .verifier import Verifier


@dataclass
class VerifyReport:
    """What ``verify`` checked: every header rule of every file, every byte read once, and the
    digest of every tensor that has one (``unchecked`` lists those without)."""
    files: list[str]
    tensors: int
    bytes_read: int
    checked: int
    unchecked: list[str]
    algorithms: list[str]


def verify(source, *, require_checksums: bool = False, **options) -> VerifyReport:
    """Validate a checkpoint without a GPU: headers (every format rule, shards against their index), then
    every tensor byte read once against its stored digest. Raises the first problem (FormatError /
    ChecksumError / OSError naming the file); returns a VerifyReport. With ``require_checksums``, a
    tensor without a digest is an error."""
    s = _settings.merge(**options)
    ck = open_checkpoint(source)
    names = ck.file_order()
    sels = selections(ck, names)
    verifier = Verifier.for_selections(ck, sels, [sel.info.nbytes for sel in sels], require=require_checksums)
    plan, s, policies, _ = prepare(ck, sels, s, verifier=verifier)
    sources = open_sources(ck, policies)   # the loader's: how each file is read, same-file check
    try:
        pool = host_pool(slot_bytes(s.chunk_bytes), max(s.threads, 1))

        def work(worker: int, chunk) -> None:
            slot = pool.acquire()
            try:   # a chunk of several tensors: none has a digest (the plan packs none that has)
                read_inspected(sources[chunk.file], chunk.run.src, chunk.run.span, slot.array,
                               verifier.inspector(chunk.dest, chunk.run) if type(chunk.dest) is int else None)
            finally:
                pool.release(slot)

        Job(plan.chunks, work, s.threads, name="foxhunt-verify").start().wait()
        for src in sources:
            src.check_unchanged()
        read = sum(src.bytes_read for src in sources)
    finally:
        for src in sources:
            src.close()
    checked = verifier.checked
    algos = verifier.algorithms
    return VerifyReport(list(ck.paths), len(names), read, sum(checked),
                        [n for n, c in zip(names, checked) if not c], algos)
