"""The page-cache policy: a default load leaves a checkpoint that fits in the page cache (so the
next start is hot), reads one that would not fit with O_DIRECT, and ``prefetch`` follows the same
rule. Residency is read with ``mincore`` (``pagecache.resident_fraction``, every page)."""

from __future__ import annotations


import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.io import pagecache, read_policy
from page_cache_support import evict

EVERY_PAGE = 1 << 62


def _evict(path) -> float:
    """Drop ``path`` from the page cache; its residency after."""
    evict(path)
    return pagecache.resident_fraction(path, samples=EVERY_PAGE)


@pytest.fixture
def evicted(tmp_path):
    """A 16 MiB checkpoint in two files, written, then evicted from the page cache. Where the
    filesystem keeps its pages whatever the advice (tmpfs), there is nothing to test: skip, saying so."""
    rng = np.random.default_rng(0)
    tensors = {f"w{i}": rng.integers(0, 255, 8 << 20, dtype=np.uint8) for i in range(2)}
    fs.save_file(tensors, str(tmp_path), max_shard_size="9MB")
    paths = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    assert len(paths) == 2
    left = [_evict(p) for p in paths]
    if max(left) > 0.05:
        pytest.skip(f"POSIX_FADV_DONTNEED does not evict on this filesystem ({left} still resident)")
    return str(tmp_path), paths, tensors


def _resident(paths) -> list[float]:
    return [pagecache.resident_fraction(p, samples=EVERY_PAGE) for p in paths]


def test_a_default_load_leaves_an_evicted_checkpoint_in_the_page_cache(evicted):
    """The restart case: the first start reads from disk, and what it read stays in memory."""
    src, paths, tensors = evicted
    out = fs.load_file(src)
    assert all(np.array_equal(out[k], v) for k, v in tensors.items())
    assert min(_resident(paths)) > 0.99


def test_a_checkpoint_that_would_not_fit_is_read_around_the_page_cache(evicted, monkeypatch):
    monkeypatch.setattr(read_policy, "available_memory", lambda: 8 << 20)   # half of it: 4 MiB < one file
    src, paths, tensors = evicted
    out = fs.load_file(src)
    assert all(np.array_equal(out[k], v) for k, v in tensors.items())
    assert max(_resident(paths)) < 0.05


def test_only_the_files_beyond_the_budget_are_read_around_the_cache(evicted, monkeypatch):
    monkeypatch.setattr(read_policy, "available_memory", lambda: 20 << 20)  # half: 10 MiB, one file
    src, paths, _ = evicted
    fs.load_file(src)
    first, second = _resident(paths)
    assert first > 0.99 and second < 0.05


def test_direct_io_on_always_reads_around_the_cache(evicted):
    src, paths, _ = evicted
    fs.load_file(src, direct_io="on")
    assert max(_resident(paths)) < 0.05


def test_a_subset_counts_only_the_bytes_it_reads(evicted, monkeypatch):
    """A quarter of each file: whole, the two files (2 x 8 MiB) would not fit a 10 MiB budget, the
    two quarters (2 x 2 MiB) do, and both stay in the cache."""
    monkeypatch.setattr(read_policy, "available_memory", lambda: 20 << 20)
    src, paths, _ = evicted
    out = fs.load_file(src, shard=fs.Shard(0, 4, 0))
    assert {k: v.size for k, v in out.items()} == {"w0": 2 << 20, "w1": 2 << 20}
    assert min(_resident(paths)) > 0.24


def test_prefetch_follows_the_same_rule(evicted, monkeypatch):
    src, paths, _ = evicted
    monkeypatch.setattr(read_policy, "available_memory", lambda: 20 << 20)
    h = fs.prefetch(src, helper_process=False)
    h.wait()
    assert h.skipped == [paths[1]]
    first, second = _resident(paths)
    assert first > 0.99 and second < 0.05
    monkeypatch.setattr(read_policy, "available_memory", lambda: 1 << 40)
    h = fs.prefetch(src, helper_process=False)
    h.wait()
    assert h.skipped == [] and min(_resident(paths)) > 0.99


# ---------------------------------------------------------------- the rule itself (pure)

@pytest.mark.parametrize("needs, resident, available, want", [
    ([4, 4, 4, 4], [0, 0, 0, 0], 20, [True, True, False, False]),     # budget 10: two files
    ([4, 4, 4, 4], [0, 0, 1, 0], 20, [True, False, True, False]),     # the resident file counts first
    ([8, 4, 8, 1], [0, 0, 0, 0], 20, [True, False, False, True]),     # a later, smaller file may fit
    ([30, 4], [0.6, 0], 20, [True, False]),                           # mostly resident: through the cache anyway
    ([4, 4], [0, 0], None, [True, True]),                             # memory unknown: as before any budget
    ([], [], 20, []),
])
def test_keep_in_cache(needs, resident, available, want):
    assert read_policy.keep_in_cache(needs, resident, available) == want


def test_half_of_the_memory_available_is_the_budget():
    assert read_policy.KEEP_FRACTION == 0.5
    assert read_policy.keep_in_cache([50], [0], 100) == [True]
    assert read_policy.keep_in_cache([51], [0], 100) == [False]


@pytest.mark.parametrize("limit, usage, stat, want", [
    ("max\n", "123\n", "file 5\n", None),                                        # v2, no limit
    ("1000\n", "900\n", "anon 800\nfile 100\nkernel 0\n", 200),                   # v2: the cache is reclaimable
    ("9223372036854771712\n", "5\n", "cache 1\n", None),                         # v1, no limit
    ("1000\n", "1200\n", "cache 0\nrss 1200\n", 0),                               # over the limit
    ("4096\n", "1024\n", "cache 512\nrss 512\n", 3584),                           # v1
])
def test_cgroup_headroom(limit, usage, stat, want):
    assert read_policy.cgroup_headroom(limit, usage, stat) == want


def test_available_memory_is_memavailable_here_at_most():
    avail = read_policy.available_memory()
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    assert avail is not None and 0 < avail <= meminfo["MemAvailable"] * 1.05


def _sendfile_spy(monkeypatch) -> list[tuple[int, int, int]]:
    """Every (fd, offset, length) that a source passes through the cache again (``FileSource.promote``)."""
    from foxhunt_stream.io import source
    seen: list[tuple[int, int, int]] = []
    real = source.sendfile_to_null

    def spy(fd, offset, length, *args, **kwargs):
        seen.append((fd, offset, length))
        return real(fd, offset, length, *args, **kwargs)
    monkeypatch.setattr(source, "sendfile_to_null", spy)
    return seen


def _covered(ranges: list[tuple[int, int, int]]) -> int:
    return sum(n for _, _, n in set(ranges))


def test_a_cold_load_uses_each_page_twice_so_the_restart_reads_hot(evicted, monkeypatch):
    """The pages a cold load brings in are passed through the cache once more right after each
    read (no copy), so the kernel counts them in use twice now, not at the next start's load."""
    src, paths, tensors = evicted
    seen = _sendfile_spy(monkeypatch)
    out = fs.load_file(src, chunk_bytes=1 << 20)
    assert all(np.array_equal(out[k], v) for k, v in tensors.items())
    assert _covered(seen) >= sum(v.nbytes for v in tensors.values())   # every tensor byte, once more


def test_a_hot_load_does_not_touch_its_pages_again(evicted, monkeypatch):
    src, paths, tensors = evicted
    fs.load_file(src)                     # now resident
    seen = _sendfile_spy(monkeypatch)
    out = fs.load_file(src, chunk_bytes=1 << 20)
    assert all(np.array_equal(out[k], v) for k, v in tensors.items())
    assert seen == []
