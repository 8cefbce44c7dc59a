"""Shared by the startup tests: a small checkpoint, the foxhunt threads still alive, and the
sources' fault hook reset after every test."""

from __future__ import annotations

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.io import mapping, source
from thread_support import foxhunt_threads_at_work


@pytest.fixture(autouse=True)
def _no_fault_hook():
    yield
    source.fault_hook = None


@pytest.fixture
def checkpoint(tmp_path) -> str:
    """Six float32 tensors ``t0``..``t5`` of 4096 values each (16 KiB apiece), in one file."""
    rng = np.random.default_rng(0)
    path = str(tmp_path / "s.safetensors")
    fs.save_file({f"t{i}": rng.standard_normal(4096).astype(np.float32) for i in range(6)}, path)
    return path


@pytest.fixture
def foxhunt_threads():
    """A function: the threads of this process that foxhunt started and that are still alive
    (after any used mapping's background unmapping, which outlives a load by design)."""
    def alive():
        mapping.wait_unmapped(30)
        return set(foxhunt_threads_at_work())
    return alive


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """An importable package ``fhfakepkg`` (never imported): its bytecode (and another
    interpreter's), a 20 000-byte library, a 5 000-byte extension and a text file; returns its
    directory and this interpreter's cache tag."""
    import sys
    root = tmp_path / "site"
    pkg = root / "fhfakepkg"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "lib").mkdir()
    (pkg / "__init__.py").write_text("")
    tag = sys.implementation.cache_tag
    (pkg / "__pycache__" / f"__init__.{tag}.pyc").write_bytes(b"p" * 300)
    (pkg / "__pycache__" / "__init__.cpython-00.pyc").write_bytes(b"o" * 50)   # another interpreter's
    (pkg / "lib" / "libbig.so.12").write_bytes(b"b" * 20_000)
    (pkg / "_ext.so").write_bytes(b"e" * 5_000)
    (pkg / "notes.txt").write_text("not code")
    monkeypatch.syspath_prepend(str(root))
    return pkg, tag


@pytest.fixture
def fresh_open_log(monkeypatch):
    """An empty log of the opens ``importtrace.watch_opens`` notes, for this test only (the audit
    hook, once installed by any test, stays for the life of the process)."""
    from foxhunt_stream.startup import importtrace
    monkeypatch.setattr(importtrace, "_opened", [])
    return importtrace._opened
