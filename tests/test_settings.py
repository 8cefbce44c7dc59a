"""Settings: defaults in code, FOXHUNT_* environment overrides validated loudly, per-call
options checked at every front end, and ``settings.override`` blocks that restore."""

from __future__ import annotations

import contextvars
import logging

import numpy as np
import pytest
import safetensors.numpy as stn

import foxhunt_stream as fs
from foxhunt_stream import settings
from foxhunt_stream.errors import OptionError

VALID = ", ".join(sorted(settings.Settings._fields))   # every option, as the message lists them


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "m.safetensors"
    stn.save_file({"x": np.arange(1000, dtype=np.float32)}, str(path))
    return path


def fresh(fn, *a, **k):
    """Run ``fn`` in an empty context, so settings are read from the environment again."""
    return contextvars.Context().run(fn, *a, **k)


# ---------------------------------------------------------------- per-call options

def test_unknown_option_is_type_error_listing_valid_ones_everywhere(ckpt, tmp_path):
    calls = {
        "load_file": lambda: fs.load_file(ckpt, thread=2),
        "safe_open": lambda: fs.safe_open(ckpt, framework="numpy", thread=2),
        "load_into": lambda: fs.load_into({"x": np.zeros(1000, np.float32)}, ckpt, thread=2),
        "save_file": lambda: fs.save_file({"x": np.ones(2, np.float32)}, tmp_path / "o.safetensors", thread=2),
        "override": lambda: settings.override(thread=2).__enter__(),
        "merge": lambda: settings.merge(thread=2),
    }
    for where, call in calls.items():
        with pytest.raises(TypeError) as ei:
            call()
        assert "thread" in str(ei.value) and VALID in str(ei.value), where
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("options, match", [
    (dict(threads=-1), "threads"),
    (dict(threads=True), "threads"),
    (dict(threads=2.5), "threads"),
    (dict(threads="many"), "threads"),
    (dict(chunk_bytes="lots"), "not a size"),
    (dict(chunk_bytes=100), "chunk_bytes"),
    (dict(chunk_bytes=-5), "non-negative"),
    (dict(chunk_bytes="1MiB", staging_bytes="512KiB"), "staging_bytes"),
    (dict(read_bytes=100), "read_bytes"),
    (dict(read_bytes="a few"), "not a size"),
    (dict(backend="aio"), "pread, mmap, direct"),
    (dict(direct_io="maybe"), "direct_io"),
    (dict(write_backend="aio"), "write_backend"),
])
def test_bad_option_values_are_value_errors(ckpt, options, match):
    with pytest.raises(ValueError, match=match):
        settings.merge(**options)
    with pytest.raises(ValueError, match=match):
        fs.load_file(ckpt, **options)


def test_option_coercion():
    s = settings.merge(threads="3", chunk_bytes="1MiB", staging_bytes="8MB", direct_io=False)
    assert (s.threads, s.chunk_bytes, s.staging_bytes, s.direct_io) == (3, 1 << 20, 8_000_000, "off")
    assert settings.merge(direct_io=True).direct_io == "on"
    assert settings.merge(threads=None).threads == settings.merge().threads   # None = keep the default
    assert settings.merge().threads >= 1                                       # 0 resolves to the CPU count


def test_options_take_effect(ckpt, caplog):
    """The backend option reaches the sources (the loader logs which ones it used)."""
    with caplog.at_level(logging.DEBUG, logger="foxhunt_stream"):
        fs.load_file(ckpt, backend="mmap", direct_io="off", threads=1, chunk_bytes=4096)
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("load:")]
    assert any("['mmap']" in m and "1 threads" in m and "chunk 4096" in m for m in msgs), msgs


def test_a_background_load_leaves_the_caller_cpus(monkeypatch, tmp_path):
    """threads=0 means one per CPU less one in eight (for the caller's thread and the driver's), at
    most 16, and three quarters of the CPUs for a load the caller works beside; an explicit count
    (option or environment) is taken as it is."""
    monkeypatch.setattr(settings, "available_cpus", lambda: 16)
    assert fresh(settings.merge).threads == 14
    assert fresh(settings.merge, background=True).threads == 12
    assert fresh(settings.merge, background=True, threads=16).threads == 16
    assert fresh(settings.merge, threads=16).threads == 16
    monkeypatch.setattr(settings, "available_cpus", lambda: 32)
    assert fresh(settings.merge).threads == 16
    monkeypatch.setattr(settings, "available_cpus", lambda: 8)
    assert fresh(settings.merge).threads == 7
    monkeypatch.setattr(settings, "available_cpus", lambda: 2)
    assert fresh(settings.merge).threads == 2
    assert fresh(settings.merge, background=True).threads == 1
    monkeypatch.setattr(settings, "available_cpus", lambda: 16)
    path = tmp_path / "many.safetensors"
    stn.save_file({f"t{i}": np.full(1024, i, np.float32) for i in range(40)}, str(path))
    handle = fs.load_file(path, background=True, chunk_bytes=4096)
    assert handle.workers == 12
    assert all(np.array_equal(a, np.full(1024, int(n[1:]), np.float32)) for n, a in handle.result().items())
    with settings.override(threads=16):
        handle = fs.load_file(path, background=True, chunk_bytes=4096)
    assert handle.workers == 16 and len(handle.result()) == 40
    monkeypatch.setenv("FOXHUNT_THREADS", "16")
    assert fresh(settings.merge, background=True).threads == 16


# ---------------------------------------------------------------- environment

def test_env_overrides_defaults(monkeypatch):
    monkeypatch.setenv("FOXHUNT_THREADS", "3")
    monkeypatch.setenv("FOXHUNT_CHUNK_BYTES", "1MiB")
    monkeypatch.setenv("FOXHUNT_BACKEND", "mmap")
    monkeypatch.setenv("FOXHUNT_DIRECT_IO", "off")
    monkeypatch.setenv("FOXHUNT_READ_BYTES", "512KiB")
    s = fresh(settings.merge)
    assert (s.threads, s.chunk_bytes, s.backend, s.direct_io) == (3, 1 << 20, "mmap", "off")
    assert s.read_bytes == s.read_cut == 512 << 10
    # a per-call option beats the environment
    assert fresh(settings.merge, threads=5, backend="pread").threads == 5


@pytest.mark.parametrize("var, value", [
    ("FOXHUNT_THREADS", "lots"),
    ("FOXHUNT_THREADS", "-2"),
    ("FOXHUNT_CHUNK_BYTES", "16 furlongs"),
    ("FOXHUNT_CHUNK_BYTES", "12"),
    ("FOXHUNT_CHUNK_BYTES", "9" * 400),
    ("FOXHUNT_READ_BYTES", "1KiB"),
    ("FOXHUNT_STAGING_BYTES", "1MiB"),
    ("FOXHUNT_STAGING_BYTES", "1" + "0" * 19),
    ("FOXHUNT_BACKEND", "io_uring"),
    ("FOXHUNT_DIRECT_IO", "yes"),
    ("FOXHUNT_WRITE_BACKEND", "splice"),
    ("FOXHUNT_VERIFY_ON", "gpu"),
])
def test_bad_env_is_loud(ckpt, monkeypatch, var, value):
    """A bad FOXHUNT_* value fails the first call that reads settings with an OptionError naming
    the variable and the value it holds, instead of being ignored."""
    monkeypatch.setenv(var, value)
    with pytest.raises(OptionError) as ei:
        fresh(fs.load_file, ckpt)
    message = str(ei.value)
    assert message.startswith(f"environment variable {var}="), message
    assert (value if len(value) < 40 else value[:30]) in message
    assert len(message) < 300   # a 400-digit value is named, not printed whole


def test_env_values_that_disagree_name_the_variables_set(ckpt, monkeypatch):
    """staging_bytes must hold a chunk: the message names whichever of the two the environment set."""
    monkeypatch.setenv("FOXHUNT_CHUNK_BYTES", "512MiB")
    with pytest.raises(OptionError, match=r"^environment variable FOXHUNT_CHUNK_BYTES='512MiB': staging_bytes"):
        fresh(fs.load_file, ckpt)
    monkeypatch.setenv("FOXHUNT_STAGING_BYTES", "16MiB")
    with pytest.raises(OptionError, match="FOXHUNT_STAGING_BYTES='16MiB' and FOXHUNT_CHUNK_BYTES='512MiB'"):
        fresh(fs.load_file, ckpt)


@pytest.mark.parametrize("value", ["1" * 400, "9" * 30 + "TiB", "1" * 400 + ".5GB", 10**400, 2**63, "8589934592GiB"],
                         ids=["400-digits", "30-digits-TiB", "400-digits-fraction", "int-10**400", "int-2**63",
                              "2**63-bytes-in-GiB"])
def test_a_size_too_large_to_be_a_size_is_an_option_error(ckpt, value):
    with pytest.raises(OptionError, match="too large"):
        settings.parse_size(value)
    for call in (lambda: settings.merge(chunk_bytes=value), lambda: fs.load_file(ckpt, staging_bytes=value)):
        with pytest.raises(OptionError, match="too large"):
            call()


@pytest.mark.parametrize("text, size", [("8589934591GiB", 8589934591 << 30), (str(2**63 - 1), 2**63 - 1),
                                        ("0" * 400 + "12", 12), ("1.5GB", 1_500_000_000), ("0.5KiB", 512),
                                        ("9007199254740993", 2**53 + 1), ("4503599627.370497MB", 2**52 + 1),
                                        ("3.3333MiB", 3495218)])
def test_sizes_are_exact(text, size):
    """Whole bytes by integer arithmetic (a float would round 2**53 + 1)."""
    assert settings.parse_size(text) == size


def test_env_is_read_once_per_context(monkeypatch):
    """Defaults are read once (like KvikIO); a later change of the environment needs a new context."""
    def both():
        first = settings.merge().chunk_bytes
        monkeypatch.setenv("FOXHUNT_CHUNK_BYTES", "2MiB")
        return first, settings.merge().chunk_bytes
    monkeypatch.setenv("FOXHUNT_CHUNK_BYTES", "1MiB")
    assert fresh(both) == (1 << 20, 1 << 20)
    assert fresh(settings.merge).chunk_bytes == 2 << 20


# ---------------------------------------------------------------- override

def test_override_applies_and_restores():
    base = settings.current()
    with settings.override(threads=2, chunk_bytes="64KiB") as s:
        assert (s.threads, s.chunk_bytes) == (2, 64 << 10)
        assert settings.merge().chunk_bytes == 64 << 10
        assert settings.merge(chunk_bytes=8192).chunk_bytes == 8192   # per call beats the block
        with settings.override(threads=1):
            assert settings.current().threads == 1
            assert settings.current().chunk_bytes == 64 << 10          # nested blocks stack
        assert settings.current().threads == 2
    assert settings.current() == base


def test_override_restores_after_exception():
    base = settings.current()
    with pytest.raises(RuntimeError):
        with settings.override(backend="mmap"):
            assert settings.current().backend == "mmap"
            raise RuntimeError("inside")
    assert settings.current() == base


def test_override_bad_value_changes_nothing():
    base = settings.current()
    with pytest.raises(ValueError):
        with settings.override(backend="nope"):
            pass
    assert settings.current() == base


def test_override_beats_env(monkeypatch):
    monkeypatch.setenv("FOXHUNT_THREADS", "3")

    def inner():
        with settings.override(threads=4):
            return settings.merge().threads
    assert fresh(inner) == 4


def test_reads_are_cut_smaller_than_a_slot_and_never_bigger():
    """Defaults: 8 MiB slots, contiguous reads in 4 MiB pieces; a read never exceeds a slot."""
    s = settings.Settings()
    assert (s.chunk_bytes, s.read_bytes, s.read_cut) == (8 << 20, 4 << 20, 4 << 20)
    assert settings.merge(chunk_bytes="1MiB", staging_bytes="2MiB").read_cut == 1 << 20
