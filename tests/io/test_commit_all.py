"""sink.commit_all: several temp files published as one (a sharded checkpoint and its index)."""

from __future__ import annotations

import os

import pytest

from foxhunt_stream.io import sink


def _files(directory, contents: dict[str, bytes]) -> list[sink.AtomicFile]:
    out = []
    for name, data in contents.items():
        f = sink.AtomicFile(directory / name, len(data), fsync=False)
        f.write_at(data, 0)
        out.append(f)
    return out


def _listing(directory) -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory))}


def test_commit_all_publishes_in_order_and_leaves_no_temp(tmp_path, monkeypatch):
    (tmp_path / "b").write_bytes(b"old b")
    order = []
    real = os.replace
    monkeypatch.setattr(sink.os, "replace", lambda a, b: (order.append(os.path.basename(b)), real(a, b)))
    sink.commit_all(_files(tmp_path, {"a": b"new a", "b": b"new b", "index": b"{}"}))
    assert order == ["a", "b", "index"]
    assert _listing(tmp_path) == {"a": b"new a", "b": b"new b", "index": b"{}"}


@pytest.mark.parametrize("failing", [1, 2, 3])
def test_commit_all_rolls_back_the_renames_done(tmp_path, monkeypatch, failing):
    (tmp_path / "a").write_bytes(b"old a")
    (tmp_path / "c").write_bytes(b"old c")
    before = _listing(tmp_path)
    files = _files(tmp_path, {"a": b"new a", "b": b"new b", "c": b"new c"})
    real, renames = os.replace, []

    def replace(a, b):
        if sink.TEMP_MARK in os.path.basename(a) and sink.TEMP_MARK not in os.path.basename(b):
            renames.append(b)
            if len(renames) == failing:
                raise OSError(5, "injected")
        return real(a, b)
    monkeypatch.setattr(sink.os, "replace", replace)
    with pytest.raises(OSError, match="injected"):
        sink.commit_all(files)
    assert _listing(tmp_path) == before   # new names gone, replaced files back, no temp or link left


def _try_lock(directory, how) -> bool:
    """Whether the directory's lock can be had at once in mode ``how``."""
    import fcntl
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_commit_all_holds_the_directory_lock_through_renames_and_removals(tmp_path, monkeypatch):
    """Readers of an index take the directory's lock shared: they cannot while the commit runs."""
    import fcntl
    (tmp_path / "old").write_bytes(b"an earlier version's file")
    seen = []
    real_replace, real_rename = os.replace, os.rename

    def replace(a, b):
        seen.append(("replace", os.path.basename(b), _try_lock(tmp_path, fcntl.LOCK_SH)))
        return real_replace(a, b)

    def rename(a, b):
        seen.append(("rename", os.path.basename(a), _try_lock(tmp_path, fcntl.LOCK_SH)))
        return real_rename(a, b)

    def replaces():
        seen.append(("replaces", None, _try_lock(tmp_path, fcntl.LOCK_SH)))
        return [os.fspath(tmp_path / "old"), os.fspath(tmp_path / "a")]   # its own files are never removed
    files = _files(tmp_path, {"a": b"new a", "index": b"{}"})
    monkeypatch.setattr(sink.os, "replace", replace)
    monkeypatch.setattr(sink.os, "rename", rename)
    sink.commit_all(files, replaces=replaces)
    assert [(op, name) for op, name, _ in seen] == [("replaces", None), ("replace", "a"), ("replace", "index"),
                                                   ("rename", "old")]
    assert not any(free for _, _, free in seen)
    assert _try_lock(tmp_path, fcntl.LOCK_EX)   # let go after the commit
    assert _listing(tmp_path) == {"a": b"new a", "index": b"{}"}
