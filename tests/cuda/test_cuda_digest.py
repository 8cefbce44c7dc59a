"""The xxh3-64 block digests meant for the GPU (foxhunt_stream.cuda.digest): the kernel's secret
layout through a line-by-line Python mirror of its steps, and (on a GPU) the kernel itself against
python-xxhash."""

from __future__ import annotations

import numpy as np
import pytest

xxhash = pytest.importorskip("xxhash")

from foxhunt_stream.cuda import digest as dd  # noqa: E402

def _kernel_mirror(data: bytes, keys: list[int]) -> int:
    """The kernel's steps, one for one, for the 32 lanes of its warp, with Python ints (the key
    layout, which lane loads which word, the shuffles and the step order)."""
    m = (1 << 64) - 1
    n = len(data)
    word = lambda off: int.from_bytes(data[off:off + 8], "little")  # noqa: E731
    init = [0xC2B2AE3D, 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
            0x85EBCA77C2B2AE63, 0x85EBCA77, 0x27D4EB2F165667C5, 0x9E3779B1]
    T = range(32)
    acc = [init[t & 7] for t in T]
    key = [[keys[(t >> 3) + 4 * k + (t & 7)] for k in range(4)] for t in T]

    def mix32(v, k):
        dk = v ^ k
        return (dk & 0xFFFFFFFF) * (dk >> 32)

    def shfl_xor(vals, mask):
        return [vals[t ^ mask] for t in T]

    def gather(prod, words):
        prod = [(a + b) & m for a, b in zip(prod, shfl_xor(prod, 8))]
        prod = [(a + b) & m for a, b in zip(prod, shfl_xor(prod, 16))]
        words = [(a + b) & m for a, b in zip(words, shfl_xor(words, 8))]
        words = [(a + b) & m for a, b in zip(words, shfl_xor(words, 16))]
        nb = shfl_xor(words, 1)
        for t in T:
            acc[t] = (acc[t] + prod[t] + nb[t]) & m

    n_blocks = (n - 1) // 1024
    for bl in range(n_blocks):
        prod, words = [0] * 32, [0] * 32
        for t in T:
            for k in range(4):
                v = word(8 * (bl * 128 + t + 32 * k))
                prod[t] += mix32(v, key[t][k])
                words[t] += v
        gather(prod, words)
        for t in T:
            a = acc[t] ^ (acc[t] >> 47) ^ keys[16 + (t & 7)]
            acc[t] = (a * 0x9E3779B1) & m
    rest = ((n - 1) - n_blocks * 1024) // 64
    prod, words = [0] * 32, [0] * 32
    for t in T:
        for k in range(4):
            if (t >> 3) + 4 * k < rest:
                v = word(8 * (n_blocks * 128 + t + 32 * k))
                prod[t] += mix32(v, key[t][k])
                words[t] += v
    gather(prod, words)
    prod, words = [0] * 32, [0] * 32
    for t in range(8):
        v = word(n - 64 + 8 * t)
        prod[t], words[t] = mix32(v, keys[24 + t]), v
    gather(prod, words)
    a = acc[:8]   # __shfl_sync(acc, j) for j < 8
    h = (n * 0x9E3779B185EBCA87) & m
    for i in range(4):
        x, y = a[2 * i] ^ keys[32 + 2 * i], a[2 * i + 1] ^ keys[33 + 2 * i]
        p = x * y
        h = (h + ((p & m) ^ (p >> 64))) & m
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & m
    return h ^ (h >> 32)


@pytest.mark.parametrize("length", [241, 1000, 1024, 1025, 3000, 4096, 5121, 8191])
def test_kernel_steps_and_keys_match_xxhash(length):
    keys = [int(k) for k in dd.kernel_keys()]
    assert len(keys) == 40
    data = np.random.default_rng(length + 1).integers(0, 256, length, dtype=np.uint8).tobytes()
    assert _kernel_mirror(data, keys) == xxhash.xxh3_64_intdigest(data)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [4096, 1 << 20])
def test_gpu_kernel_matches_xxhash(block):
    cp = pytest.importorskip("cupy")
    from foxhunt_stream.cuda.devices import cuda_available
    if not cuda_available():
        pytest.skip("needs a CUDA GPU")
    rng = np.random.default_rng(block)
    for total in (block * 3, block * 3 + 1000, block * 2 + 100, 5000 if block > 5000 else block + 5000):
        host = rng.integers(0, 256, total, dtype=np.uint8)
        dev = cp.asarray(host)
        got = dd.block_digests(dev.data.ptr, total, block).get()
        want = []
        for off in range(0, total, block):
            piece = host[off:off + block].tobytes()
            want.append(xxhash.xxh3_64_intdigest(piece) if len(piece) >= dd.MIN_LONG else 0)
        assert [int(g) for g in got] == want, total


def test_block_table_cuts_spans_into_blocks():
    table, first = dd.block_table([(1024, 10_000), (8192, 0), (16, 4096)], 4096)
    n = first[-1]
    assert first == [0, 3, 3, 4] and n == 4
    assert table[:n].tolist() == [1024, 1024 + 4096, 1024 + 8192, 16]
    assert table[n:].tolist() == [4096, 4096, 10_000 - 8192, 4096]
    with pytest.raises(ValueError, match="aligned"):
        dd.block_table([(3, 100)], 4096)
    with pytest.raises(ValueError, match="multiple of 8"):
        dd.block_table([(8, 100)], 4095)


@pytest.mark.gpu
def test_gpu_kernel_hashes_many_spans_in_one_launch():
    cp = pytest.importorskip("cupy")
    from foxhunt_stream.cuda.devices import cuda_available
    if not cuda_available():
        pytest.skip("needs a CUDA GPU")
    rng = np.random.default_rng(7)
    block = 1 << 16
    sizes = [5 * block + 77, 100, 0, block, 3 * block + 4000, 300]
    hosts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    devs = [cp.asarray(h) for h in hosts]
    out, first = dd.spans_digests([(d.data.ptr, n) for d, n in zip(devs, sizes)], block)
    got = [int(x) for x in out.get()]
    for h, a, b in zip(hosts, first, first[1:]):
        want = []
        for off in range(0, len(h), block):
            piece = h[off:off + block].tobytes()
            want.append(xxhash.xxh3_64_intdigest(piece) if len(piece) >= dd.MIN_LONG else 0)
        assert got[a:b] == want
