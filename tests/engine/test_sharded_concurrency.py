"""Sharded checkpoints under concurrency: a reader beside a writer re-saving the same directory,
and two writers saving into one directory at once, each for a bounded time (2 s by default,
FOXHUNT_SHARD_STRESS_SECONDS), with a short thread switch interval to make the races likely.

Every version has the same names, shapes and shard layout and fills each tensor with its own
number, so a load mixing two saves raises no format error of its own: only the values show it.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.io.sink import TEMP_MARK

SECONDS = float(os.environ.get("FOXHUNT_SHARD_STRESS_SECONDS", "2"))
N_TENSORS = 8
SHARD = 8000     # two 4000-byte tensors per shard: 4 shards and an index


def model(v: int) -> dict[str, np.ndarray]:
    return {f"w{i}": np.full(1000, v, np.float32) for i in range(N_TENSORS)}


def saves_in(out: dict[str, np.ndarray]) -> set[int]:
    """The versions a load's tensors come from (one, unless the load mixed saves)."""
    assert sorted(out) == sorted(model(0))
    values = set()
    for a in out.values():
        assert (a == a[0]).all()
        values.add(int(a[0]))
    return values


def _run(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"


def test_a_load_beside_a_resaving_writer_returns_one_save(tmp_path, short_switches):
    d = tmp_path / "ckpt"
    fs.save_file(model(0), d, max_shard_size=SHARD, fsync=False)
    deadline = time.monotonic() + SECONDS
    stop = threading.Event()
    errors: list[BaseException] = []
    loads, mixed, refused, saves = [0], [0], [0], [0]

    def writer():
        v = 0
        try:
            while not stop.is_set():
                v += 1
                fs.save_file(model(v), d, max_shard_size=SHARD, fsync=False)
                saves[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def reader():
        try:
            while time.monotonic() < deadline:
                try:
                    got = fs.load_file(d)
                except fs.FormatError as e:   # replaced on every one of the loader's attempts
                    if e.rule != "file-replaced":
                        raise
                    refused[0] += 1
                    continue
                loads[0] += 1
                mixed[0] += len(saves_in(got)) > 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            stop.set()

    _run([threading.Thread(target=writer), threading.Thread(target=reader)])
    print(f"\n{loads[0]} loads beside {saves[0]} saves: {mixed[0]} mixed, {refused[0]} refused as file-replaced")
    if errors:
        raise errors[0]
    assert loads[0] > 0 and saves[0] > 0
    assert mixed[0] == 0, f"{mixed[0]} of {loads[0]} loads returned tensors of two saves"
    assert saves_in(fs.load_file(d)) == {saves[0]}
    assert not [n for n in os.listdir(d) if TEMP_MARK in n]


def test_two_sharded_saves_at_once_leave_one_whole_checkpoint(tmp_path, short_switches):
    d = tmp_path / "ckpt"
    d.mkdir()
    deadline = time.monotonic() + SECONDS
    rounds, mixed = 0, 0
    while time.monotonic() < deadline or rounds < 5:
        rounds += 1
        start = threading.Barrier(2)
        errors: list[BaseException] = []

        def save(v):
            try:
                start.wait()
                fs.save_file(model(v), d, max_shard_size=SHARD, fsync=False)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        _run([threading.Thread(target=save, args=(2 * rounds,)), threading.Thread(target=save, args=(2 * rounds + 1,))])
        if errors:
            raise errors[0]
        try:
            got = saves_in(fs.load_file(d))
        except fs.FormatError as e:   # left mixed, and caught by the save ids
            if e.rule != "mixed-saves":
                raise
            got = {"mixed"}
        mixed += len(got) > 1 or got == {"mixed"}
        assert len(got) > 1 or got <= {2 * rounds, 2 * rounds + 1, "mixed"}
    print(f"\n{rounds} rounds of two concurrent sharded saves: {mixed} left the directory mixed")
    assert mixed == 0, f"{mixed} of {rounds} rounds left the directory mixed"
    assert sorted(os.listdir(d)) == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)] + [
        "model.safetensors.index.json"]


def test_a_reader_holds_the_directory_lock_while_it_reads_the_headers(tmp_path, monkeypatch):
    import fcntl
    from foxhunt_stream.io import checkpoint
    d = tmp_path / "ckpt"
    fs.save_file(model(1), d, max_shard_size=SHARD, fsync=False)
    real, free = checkpoint.read_header_with_identity, []

    def read(path):
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # what a commit takes
            free.append(path)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        return real(path)
    monkeypatch.setattr(checkpoint, "read_header_with_identity", read)
    assert saves_in(fs.load_file(d)) == {1}
    with fs.safe_open(d) as f:
        assert len(f.keys()) == N_TENSORS
    assert free == []


# ---------------------------------------------------------------- the save id

def _mixed_directory(tmp_path):
    """A directory holding the index and three shards of one save and a shard of another (as a
    crash inside the rename sequence, or a writer that does not lock, leaves it)."""
    d, other = tmp_path / "ckpt", tmp_path / "other"
    fs.save_file(model(1), d, max_shard_size=SHARD, fsync=False)
    fs.save_file(model(2), other, max_shard_size=SHARD, fsync=False)
    os.replace(other / "model-00003-of-00004.safetensors", d / "model-00003-of-00004.safetensors")
    return d


def test_a_directory_mixing_two_saves_is_refused_naming_the_shard(tmp_path):
    d = _mixed_directory(tmp_path)
    shard = os.fspath(d / "model-00003-of-00004.safetensors")
    for load in (fs.load_file, fs.safe_open, lambda p: fs.load_into({k: np.zeros_like(v) for k, v in model(1).items()},
                                                                   p)):
        with pytest.raises(fs.FormatError, match="files of two saves") as e:
            load(d)
        assert e.value.rule == "mixed-saves" and e.value.path == shard
    with pytest.raises(fs.FormatError, match="mixed-saves"):
        fs.load_file(d / "model.safetensors.index.json")
    # the files one by one are fine, and so is a list of them (no index: no save to agree on)
    assert {int(a[0]) for a in fs.load_file(shard).values()} == {2}
    assert saves_in(fs.load_file(sorted(str(p) for p in d.glob("*.safetensors")))) == {1, 2}


def test_the_save_id_is_one_per_save_in_every_shard_and_the_index_and_not_in_merged_metadata(tmp_path):
    import json
    from foxhunt_stream.format.shards import SAVE_KEY
    d = tmp_path / "ckpt"
    fs.save_file(model(1), d, max_shard_size=SHARD, metadata={"format": "np", SAVE_KEY: "stale"}, fsync=False)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    save = index["metadata"][SAVE_KEY]
    assert len(save) == 32 and save != "stale"
    assert {fs.read_header(p).metadata[SAVE_KEY] for p in d.glob("*.safetensors")} == {save}
    with fs.safe_open(d) as f:
        assert f.metadata() == {"format": "np", "total_size": str(N_TENSORS * 4000)}
    fs.save_file(model(1), d, max_shard_size=SHARD, fsync=False)
    assert json.loads((d / "model.safetensors.index.json").read_text())["metadata"][SAVE_KEY] != save


def test_one_file_saves_carry_no_save_id(tmp_path):
    import safetensors.numpy as stn
    stn.save_file(model(1), str(tmp_path / "ref.safetensors"), metadata={"format": "np"})
    fs.save_file(model(1), tmp_path / "one.safetensors", metadata={"format": "np"})
    fs.save_file(model(1), tmp_path / "d", max_shard_size="1GB", metadata={"format": "np"})
    ref = (tmp_path / "ref.safetensors").read_bytes()
    assert (tmp_path / "one.safetensors").read_bytes() == ref
    assert (tmp_path / "d" / "model.safetensors").read_bytes() == ref


def test_a_shard_removed_by_a_resave_after_the_headers_were_read_starts_the_load_over(tmp_path, monkeypatch):
    """A re-save with fewer shards removes shards an earlier index named: a load that read the old
    headers just before finds one gone when it opens the files, and starts over on the new save."""
    from foxhunt_stream.engine import loader
    d = tmp_path / "ckpt"
    fs.save_file(model(1), d, max_shard_size=SHARD, fsync=False)
    assert len(list(d.glob("model-*.safetensors"))) == 4
    real, calls = loader.prepare, []

    def resave_first(*a, **k):
        calls.append(1)
        if len(calls) == 1:   # between this load's header reads and its opening of the files
            fs.save_file(model(2), d, max_shard_size=2 * SHARD, fsync=False)   # 2 shards: two removed
        return real(*a, **k)
    monkeypatch.setattr(loader, "prepare", resave_first)
    out = fs.load_file(d)
    assert saves_in(out) == {2} and len(calls) == 2
