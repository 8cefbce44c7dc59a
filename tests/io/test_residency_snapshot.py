"""``pagecache.residency_snapshot``: a load's setup samples each of its files once."""

from __future__ import annotations

import numpy as np
import safetensors.numpy as stn

import foxhunt_stream as fs
from foxhunt_stream.io import pagecache


def _counting(monkeypatch) -> list:
    calls = []
    real = pagecache._sample_residency

    def counting(path, samples):
        calls.append((str(path), samples))
        return real(path, samples)
    monkeypatch.setattr(pagecache, "_sample_residency", counting)
    return calls


def test_inside_a_snapshot_each_file_is_sampled_once(tmp_path, monkeypatch):
    p = tmp_path / "f.bin"
    p.write_bytes(b"x" * 3 * 4096)
    calls = _counting(monkeypatch)
    with pagecache.residency_snapshot():
        assert pagecache.resident_fraction(p) == pagecache.resident_fraction(p) == 1.0
        pagecache.resident_fraction(p, samples=1 << 62)   # another question: sampled apart
    pagecache.resident_fraction(p)                          # outside: sampled afresh
    assert calls == [(str(p), 64), (str(p), 1 << 62), (str(p), 64)]


def test_a_column_load_samples_each_file_once(tmp_path, monkeypatch):
    x = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"m{i}.safetensors"))
        stn.save_file({f"w{i}": x + i}, paths[-1])
    calls = _counting(monkeypatch)
    out = fs.load_file(paths, shard=fs.TPSlice(1, 4, 1))   # asks: read through the cache? gather? cold?
    np.testing.assert_array_equal(out["w2"], (x + 2)[:, 64:128])
    assert sorted(calls) == sorted((p, 64) for p in paths)
