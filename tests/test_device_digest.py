"""The xxh3-64 block digests meant for the GPU (foxhunt_stream.device_digest): the numpy
reference against python-xxhash on the host, the kernel's secret layout through a line-by-line
Python mirror of its steps, and (on a GPU) the kernel itself against python-xxhash."""

from __future__ import annotations

import numpy as np
import pytest

xxhash = pytest.importorskip("xxhash")

from foxhunt_stream import device_digest as dd  # noqa: E402

LENGTHS = [241, 255, 256, 300, 1023, 1024, 1025, 1088, 2047, 2048, 2049, 4096, 5000, 12345, 65536]


@pytest.mark.parametrize("length", LENGTHS)
def test_numpy_reference_matches_xxhash(length):
    rows = np.random.default_rng(length).integers(0, 256, (4, length), dtype=np.uint8)
    got = dd.xxh3_64_long(rows)
    assert [int(g) for g in got] == [xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows]


def test_reference_refuses_short_inputs():
    with pytest.raises(ValueError, match="241"):
        dd.xxh3_64_long(np.zeros((1, 240), np.uint8))


def _kernel_mirror(data: bytes, keys: list[int]) -> int:
    """The kernel's steps, one for one, with Python ints (for the key layout and step order)."""
    m = (1 << 64) - 1
    n = len(data)
    word = lambda off: int.from_bytes(data[off:off + 8], "little")  # noqa: E731
    acc = [0xC2B2AE3D, 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
           0x85EBCA77C2B2AE63, 0x85EBCA77, 0x27D4EB2F165667C5, 0x9E3779B1]

    def stripe(words, k0):
        for j in range(8):
            v = words[j]
            dk = v ^ keys[k0 + j]
            acc[j ^ 1] = (acc[j ^ 1] + v) & m
            acc[j] = (acc[j] + (dk & 0xFFFFFFFF) * (dk >> 32)) & m
    n_blocks = (n - 1) // 1024
    for bl in range(n_blocks):
        for s in range(16):
            stripe([word(bl * 1024 + s * 64 + 8 * j) for j in range(8)], s)
        for j in range(8):
            a = acc[j] ^ (acc[j] >> 47) ^ keys[16 + j]
            acc[j] = (a * 0x9E3779B1) & m
    for s in range(((n - 1) - n_blocks * 1024) // 64):
        stripe([word(n_blocks * 1024 + s * 64 + 8 * j) for j in range(8)], s)
    stripe([word(n - 64 + 8 * j) for j in range(8)], 24)
    h = (n * 0x9E3779B185EBCA87) & m
    for i in range(4):
        a, c = acc[2 * i] ^ keys[32 + 2 * i], acc[2 * i + 1] ^ keys[33 + 2 * i]
        p = a * c
        h = (h + ((p & m) ^ (p >> 64))) & m
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & m
    return h ^ (h >> 32)


@pytest.mark.parametrize("length", [241, 1024, 1025, 3000, 4096])
def test_kernel_steps_and_keys_match_xxhash(length):
    keys = [int(k) for k in dd.kernel_keys()]
    assert len(keys) == 40
    data = np.random.default_rng(length + 1).integers(0, 256, length, dtype=np.uint8).tobytes()
    assert _kernel_mirror(data, keys) == xxhash.xxh3_64_intdigest(data)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [4096, 1 << 20])
def test_gpu_kernel_matches_xxhash(block):
    cp = pytest.importorskip("cupy")
    from foxhunt_stream.device import cuda_available
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
