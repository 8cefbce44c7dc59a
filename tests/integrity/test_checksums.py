"""Checksums: the format on disk, checking as chunks land, and foxhunt_stream.verify.

Digests are recomputed here straight from xxhash / google_crc32c and the documented definition
(hash of each block, then hash of the little-endian block digests), never with the code under test.
"""

from __future__ import annotations

import json
import os
import struct
import threading

import numpy as np
import pytest
import safetensors
import safetensors.numpy as stn
from hypothesis import given, settings as hsettings, strategies as st

import foxhunt_stream as fs
from foxhunt_stream.integrity import checksums as integrity
from foxhunt_stream.integrity.verifier import Verifier
from foxhunt_stream.io import source
from foxhunt_stream.io.checkpoint import open_checkpoint
from foxhunt_stream.format.dtypes import DTYPES
from foxhunt_stream.format.header import TensorInfo
from foxhunt_stream.format.plan import Selection, plan_load

xxhash = pytest.importorskip("xxhash")
google_crc32c = pytest.importorskip("google_crc32c")

KEY = "foxhunt.checksums"
BLOCK = 4096
SMALL = dict(chunk_bytes=4096, staging_bytes=64 << 10)


def ref_digest(data: bytes, algo: str, block: int) -> str:
    """The documented definition, written independently of foxhunt_stream."""
    if algo == "xxh3-64":
        fn, width = xxhash.xxh3_64_intdigest, 8
    else:
        fn, width = (lambda b: google_crc32c.value(bytes(b))), 4
    blocks = [fn(data[i:i + block]) for i in range(0, len(data), block)]
    return f"{fn(b''.join(d.to_bytes(width, 'little') for d in blocks)):0{2 * width}x}"


def tensors():
    rng = np.random.default_rng(0)
    return {
        "big": rng.standard_normal(10_000).astype(np.float32),          # 40000 B: 10 blocks, last partial
        "exact": rng.integers(0, 2**31, 2048, dtype=np.int64),          # 16384 B: exactly 4 blocks
        "small": np.arange(7, dtype=np.int16),
        "empty": np.zeros((0, 3), np.float64),
        "strided": np.arange(6000, dtype=np.float64).reshape(100, 60)[:, ::2],   # saved row by row
    }


def header_of(path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def stored(path) -> dict:
    return json.loads(header_of(path)[0]["__metadata__"][KEY])


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def data_offset(path, name: str, within: int = 0) -> int:
    h, start = header_of(path)
    return start + h[name]["data_offsets"][0] + within


# ---------------------------------------------------------------- planning (pure)

@hsettings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 5000), dtype=st.sampled_from(["U8", "F16", "F32", "F64", "C64", "BOOL"]),
       granule_log=st.integers(0, 12), extra=st.integers(1, 5), slack=st.integers(0, 4095))
def test_plan_cuts_whole_tensors_on_the_granule(numel, dtype, granule_log, extra, slack):
    dt = DTYPES[dtype]
    granule = 1 << granule_log
    chunk = max(granule * extra + slack % granule, 16)   # real chunks are >= 4096, >= any itemsize
    info = TensorInfo("t", dt, (numel,), 0, numel * dt.itemsize)
    plan = plan_load([Selection(0, 100, info)], chunk, granule=granule)
    pos = 0
    for c in plan.chunks:
        assert c.run.height == 1 and c.run.src == 100 + c.run.dst
        assert c.run.dst == pos                    # in order, no gap, no overlap
        assert c.run.dst % granule == 0            # every cut on the granule
        assert c.run.width <= chunk
        pos += c.run.width
    assert pos == info.nbytes


def test_plan_refuses_a_granule_larger_than_the_chunk():
    info = TensorInfo("t", DTYPES["U8"], (10,), 0, 10)
    with pytest.raises(ValueError, match="granule"):
        plan_load([Selection(0, 0, info)], 4096, granule=8192)


# ---------------------------------------------------------------- the format

@pytest.mark.parametrize("algo", ["xxh3-64", "crc32c"])
def test_saved_digests_match_the_definition_and_stay_plain_safetensors(tmp_path, algo):
    t = tensors()
    p = tmp_path / "m.safetensors"
    fs.save_file(t, p, metadata={"k": "v"}, checksum=algo, checksum_block=BLOCK, **SMALL)
    h, start = header_of(p)
    meta = h["__metadata__"]
    assert set(meta) == {"k", KEY}                 # one namespaced key, user metadata kept
    entry = json.loads(meta[KEY])
    assert entry["algorithm"] == algo and entry["block_bytes"] == BLOCK and entry["v"] == 1
    raw = p.read_bytes()
    assert set(entry["tensors"]) == set(t)
    for name in t:
        a, b = h[name]["data_offsets"]
        assert entry["tensors"][name] == ref_digest(raw[start + a:start + b], algo, BLOCK), name
    # the reference reader loads it, metadata and all
    ref = stn.load_file(str(p))
    for name, x in t.items():
        np.testing.assert_array_equal(ref[name], x)
    with safetensors.safe_open(str(p), "np") as f:
        assert f.metadata()[KEY] == meta[KEY]


def test_file_is_byte_identical_to_the_reference_given_the_same_metadata(tmp_path):
    t = {k: v for k, v in tensors().items() if k != "strided"}
    fs.save_file(t, tmp_path / "a.safetensors", checksum="xxh3-64")
    meta = header_of(tmp_path / "a.safetensors")[0]["__metadata__"]
    stn.save_file(t, str(tmp_path / "b.safetensors"), metadata=meta)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_default_block_is_recorded(tmp_path):
    fs.save_file({"x": np.ones(10, np.float32)}, tmp_path / "m.safetensors", checksum="xxh3-64")
    assert stored(tmp_path / "m.safetensors")["block_bytes"] == 8 << 20


def test_stale_checksum_metadata_from_elsewhere_is_dropped(tmp_path):
    p = tmp_path / "m.safetensors"
    fs.save_file({"x": np.ones(10, np.float32)}, p, metadata={KEY: "stale", "k": "v"})
    assert header_of(p)[0]["__metadata__"] == {"k": "v"}
    fs.save_file({"x": np.ones(10, np.float32)}, p, metadata={KEY: "stale"}, checksum="crc32c")
    assert stored(p)["algorithm"] == "crc32c"


@pytest.mark.parametrize("kw, match", [
    (dict(checksum="md5"), "xxh3-64, crc32c"),
    (dict(checksum="xxh3-64", checksum_block=5000), "power of two"),
    (dict(checksum="xxh3-64", checksum_block=1024), "power of two"),
    (dict(checksum_block=4096), "needs checksum"),
])
def test_bad_checksum_options_are_refused_before_writing(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        fs.save_file({"x": np.ones(4, np.float32)}, tmp_path / "m.safetensors", **kw)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- verify=True

@pytest.fixture(params=["xxh3-64", "crc32c"])
def saved(tmp_path, request):
    p = tmp_path / "m.safetensors"
    fs.save_file(tensors(), p, checksum=request.param, checksum_block=BLOCK, **SMALL)
    return p


@pytest.mark.parametrize("opts", [dict(threads=1, **SMALL), dict(threads=4, **SMALL),
                                  dict(threads=3, chunk_bytes=12288), dict(threads=2, backend="mmap")])
def test_verified_load_returns_the_data(saved, opts):
    out = fs.load_file(saved, verify=True, **opts)
    for name, x in tensors().items():
        np.testing.assert_array_equal(out[name], x)


@pytest.mark.parametrize("name, within", [("big", 0), ("big", 5 * BLOCK + 17), ("big", 39_999),
                                          ("exact", 3 * BLOCK), ("small", 13), ("strided", 100)])
def test_a_flipped_byte_is_caught_naming_file_and_tensor(saved, name, within):
    flip(saved, data_offset(saved, name, within))
    fs.load_file(saved)   # without verify the damage goes unnoticed: the check is what catches it
    with pytest.raises(fs.ChecksumError) as ei:
        fs.load_file(saved, verify=True, threads=3, **SMALL)
    e = ei.value
    assert isinstance(e, fs.FormatError) and e.rule == "checksum"
    assert e.path == os.fspath(saved) and e.tensor == name
    assert os.fspath(saved) in str(e) and repr(name) in str(e)


def test_tampered_digest_is_caught_even_for_an_empty_tensor(tmp_path):
    t = tensors()
    fs.save_file(t, tmp_path / "a.safetensors", checksum="xxh3-64", checksum_block=BLOCK)
    entry = stored(tmp_path / "a.safetensors")
    plain = dict(t, strided=np.ascontiguousarray(t["strided"]))   # the reference needs contiguous arrays
    for victim in ("empty", "small"):
        bad = json.loads(json.dumps(entry))
        d = bad["tensors"][victim]
        bad["tensors"][victim] = ("1" if d[0] != "1" else "2") + d[1:]
        p = tmp_path / f"{victim}.safetensors"
        stn.save_file(plain, str(p), metadata={KEY: json.dumps(bad)})
        with pytest.raises(fs.ChecksumError) as ei:
            fs.load_file(p, verify=True)
        assert ei.value.tensor == victim and ei.value.rule == "checksum"


@pytest.mark.parametrize("value, match", [
    ("not json", "not valid JSON"),
    ('{"v":2,"algorithm":"xxh3-64","block_bytes":4096,"tensors":{}}', '"v": 1'),
    ('{"v":1,"algorithm":"sha1","block_bytes":4096,"tensors":{}}', "unknown algorithm"),
    ('{"v":1,"algorithm":"xxh3-64","block_bytes":1099511627776,"tensors":{}}', "power of two"),
    ('{"v":1,"algorithm":"xxh3-64","block_bytes":4096,"tensors":[]}', "'tensors' must be"),
    ('{"v":1,"algorithm":"xxh3-64","block_bytes":4096,"tensors":{"x":"abc"}}', "16 lowercase hex"),
    ('{"v":1,"algorithm":"crc32c","block_bytes":4096,"tensors":{"ghost":"00000000"}}', "does not hold"),
])
def test_malformed_checksum_metadata_is_a_format_error(tmp_path, value, match):
    p = tmp_path / "m.safetensors"
    stn.save_file({"x": np.ones(3, np.float32)}, str(p), metadata={KEY: value})
    with pytest.raises(fs.FormatError, match=match) as ei:
        fs.load_file(p, verify=True)
    assert ei.value.rule == "checksum-metadata" and ei.value.path == os.fspath(p)
    np.testing.assert_array_equal(fs.load_file(p)["x"], np.ones(3, np.float32))   # ignored without verify


def test_verify_without_checksums_is_an_error_naming_the_file(tmp_path):
    p = tmp_path / "m.safetensors"
    fs.save_file({"x": np.ones(3, np.float32)}, p)
    with pytest.raises(fs.ChecksumError) as ei:
        fs.load_file(p, verify=True)
    assert ei.value.rule == "checksum-missing" and ei.value.path == os.fspath(p)


def test_hashing_happens_once_per_byte_on_the_worker_threads(saved, monkeypatch):
    """No second pass: every byte is read once and hashed once, by the pipeline's own threads."""
    algo = stored(saved)["algorithm"]
    real = integrity.algorithm(algo)
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def spy(data):
        with lock:
            seen.append((threading.current_thread().name, len(data)))
        return real.fn(data)

    class SpyHasher:   # the streaming side: chunks are hashed piece by piece as they are read
        def __init__(self):
            self.h = real.new()

        def update(self, data):
            with lock:
                seen.append((threading.current_thread().name, len(data)))
            self.h.update(data)

    monkeypatch.setitem(integrity._algorithms, algo,
                        integrity.Algorithm(algo, real.width, spy, SpyHasher, lambda s: real.final(s.h)))
    reads: list[int] = []
    monkeypatch.setattr(source, "fault_hook", lambda src, off, n: reads.append(n))
    out = fs.load_file(saved, verify=True, threads=3, **SMALL)
    sizes = [x.nbytes for x in out.values()]
    assert sum(reads) == sum(sizes)                       # read once
    n_blocks = sum(-(-n // BLOCK) for n in sizes)
    # hashed once: every data byte, plus each tensor's final hash over its block digests
    assert sum(n for _, n in seen) == sum(sizes) + real.width * n_blocks
    assert all(t.startswith("foxhunt") for t, n in seen if n)   # on the pipeline's threads


def test_blocks_bigger_than_the_chunk_size_raise_the_chunk(tmp_path):
    p = tmp_path / "m.safetensors"
    t = tensors()
    fs.save_file(t, p, checksum="xxh3-64", checksum_block=16384, chunk_bytes=4096)
    out = fs.load_file(p, verify=True, chunk_bytes=4096, staging_bytes=4096)
    np.testing.assert_array_equal(out["big"], t["big"])


def test_safe_open_verifies_whole_tensors_and_refuses_slices(saved):
    t = tensors()
    with fs.safe_open(saved, verify=True, **SMALL) as f:
        np.testing.assert_array_equal(f.get_tensor("big"), t["big"])
        sl = f.get_slice("big")
        assert sl.get_shape() == [10_000]          # shape and dtype need no bytes
        with pytest.raises(ValueError, match="cannot check a slice of 'big'"):
            sl[10:20]
        assert dict(f.tensors()).keys() == set(t)
    with fs.safe_open(saved) as f:                 # without verify slices work
        np.testing.assert_array_equal(f.get_slice("big")[10:20], t["big"][10:20])


@pytest.mark.parametrize("verify_on", ["read", "landed"])
def test_safe_open_iterator_never_yields_a_corrupt_tensor(saved, verify_on):
    flip(saved, data_offset(saved, "exact", 100))
    got = []
    with fs.safe_open(saved, verify=True, threads=1, verify_on=verify_on, **SMALL) as f:
        with pytest.raises(fs.ChecksumError, match="'exact'"):
            for name, _ in f.tensors():
                got.append(name)
    assert "exact" not in got


def test_load_into_and_background_verify(saved):
    t = tensors()
    store = {k: np.empty_like(v) for k, v in t.items() if k != "strided"}
    store["strided"] = np.empty((100, 30), np.float64)
    fs.load_into(store, saved, verify=True, **SMALL)
    np.testing.assert_array_equal(store["big"], t["big"])
    flip(saved, data_offset(saved, "small", 0))
    with pytest.raises(fs.ChecksumError, match="'small'"):
        fs.load_into(store, saved, verify=True, **SMALL)
    handle = fs.load_file(saved, verify=True, background=True, **SMALL)
    with pytest.raises(fs.ChecksumError, match="'small'"):
        handle.result()


def test_sharded_checkpoint_carries_digests_per_shard(tmp_path):
    t = tensors()
    fs.save_file(t, tmp_path, max_shard_size=20_000, checksum="xxh3-64", checksum_block=BLOCK, **SMALL)
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(shards) > 1
    for s in shards:
        h = header_of(tmp_path / s)[0]
        assert set(stored(tmp_path / s)["tensors"]) == set(h) - {"__metadata__"}
    out = fs.load_file(tmp_path, verify=True, **SMALL)
    for name, x in t.items():
        np.testing.assert_array_equal(out[name], x)
    report = fs.verify(tmp_path, threads=2)
    assert report.checked == len(t) and report.unchecked == [] and len(report.files) == len(shards)


# ---------------------------------------------------------------- fs.verify

def test_verify_reads_every_byte_once_and_reports(saved):
    report = fs.verify(saved, threads=3, **SMALL)
    total = sum(x.nbytes for x in tensors().values())
    assert report.bytes_read == total
    assert report.tensors == report.checked == 5 and report.unchecked == []
    assert report.algorithms == [stored(saved)["algorithm"]]


def test_verify_catches_corruption_without_loading(saved):
    flip(saved, data_offset(saved, "big", 7 * BLOCK))
    with pytest.raises(fs.ChecksumError) as ei:
        fs.verify(saved, threads=2, **SMALL)
    assert ei.value.tensor == "big" and ei.value.path == os.fspath(saved)


def test_verify_structure_only_when_no_checksums(tmp_path):
    p = tmp_path / "m.safetensors"
    fs.save_file({"a": np.ones(3, np.float32), "b": np.ones(2, np.int8)}, p)
    report = fs.verify(p)
    assert report.checked == 0 and report.unchecked == ["a", "b"] and report.bytes_read == 14
    with pytest.raises(fs.ChecksumError, match="checksum-missing"):
        fs.verify(p, require_checksums=True)


def test_verify_catches_structural_damage(saved):
    with open(saved, "ab") as f:
        f.write(b"\0")
    with pytest.raises(fs.FormatError) as ei:
        fs.verify(saved)
    assert ei.value.rule == "incomplete-buffer" and ei.value.path == os.fspath(saved)


# ---------------------------------------------------------------- GPU (skips without one)

def _cuda_ok():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception:
        pytest.skip("no CUDA device")
    return cp


@pytest.mark.gpu
def test_gpu_verified_load_hashes_the_staged_bytes(saved):
    cp = _cuda_ok()
    t = tensors()
    out = fs.load_file(saved, device="cuda:0", framework="cupy", verify=True, threads=3, **SMALL)
    np.testing.assert_array_equal(cp.asnumpy(out["big"]), t["big"])
    flip(saved, data_offset(saved, "big", 3 * BLOCK + 5))
    with pytest.raises(fs.ChecksumError, match="'big'"):
        fs.load_file(saved, device="cuda:0", framework="cupy", verify=True, threads=3, **SMALL)


@pytest.mark.gpu
def test_gpu_save_with_checksums_matches_the_definition(tmp_path):
    cp = _cuda_ok()
    x = np.random.default_rng(1).standard_normal(30_000).astype(np.float32)
    p = tmp_path / "g.safetensors"
    fs.save_file({"x": cp.asarray(x)}, p, checksum="xxh3-64", checksum_block=BLOCK, **SMALL)
    assert stored(p)["tensors"]["x"] == ref_digest(x.tobytes(), "xxh3-64", BLOCK)
    assert fs.verify(p).checked == 1


@pytest.mark.parametrize("algo", ["xxh3-64", "crc32c"])
@pytest.mark.parametrize("size,piece", [(3 * 4096 + 100, 1000), (8192, 8192), (4096 * 5, 3000), (5000, 1)])
def test_chunk_hasher_pieces_give_the_one_shot_digest(algo, size, piece):
    """The loader hashes chunks piece by piece as they are read; the digest must not depend on the cut."""
    if algo == "crc32c":
        pytest.importorskip("google_crc32c")
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    a = integrity.algorithm(algo)
    t = integrity.TensorHasher(a, 4096, size)
    done = []
    for off in range(0, size, 8192):   # chunks of two blocks, each fed in `piece`-byte pieces
        n = min(8192, size - off)
        ch = integrity.ChunkHasher(t, off, n, lambda: done.append(True))
        for p in range(off, off + n, piece):
            ch.update(data[p:min(p + piece, off + n)])
        ch.done()
    assert done == [True]
    assert t.digest() == integrity.tensor_digest(data, algo, 4096)


def test_chunk_hasher_rejects_misuse():
    t = integrity.TensorHasher(integrity.algorithm("xxh3-64"), 4096, 10000)
    with pytest.raises(ValueError, match="not cut"):
        integrity.ChunkHasher(t, 100, 4096, lambda: None)
    ch = integrity.ChunkHasher(t, 0, 4096, lambda: None)
    ch.update(np.zeros(100, np.uint8))
    with pytest.raises(ValueError, match="only"):
        ch.done()
    with pytest.raises(ValueError, match="more bytes"):
        ch.update(np.zeros(5000, np.uint8))


@pytest.mark.parametrize("chunk,block,threads", [(4096, 8 << 20, 16), (8 << 20, 256 << 20, 16), (4096, 16 << 20, 3)])
def test_bigger_blocks_grow_the_chunk_and_keep_staging_bounded(chunk, block, threads):
    """Chunks grow to whole checksum blocks; staging keeps up to 2 slots per worker but never
    balloons (a small chunk_bytes used to multiply into hundreds of GiB of pinned memory)."""
    from foxhunt_stream import settings as fs_settings
    s = fs_settings.merge(chunk_bytes=chunk, threads=threads)   # default staging: 256 MiB
    v = Verifier([("p", "x", integrity.Checksums("xxh3-64", block, {"x": "0" * 16}))], [1 << 40])
    got = v.settings(s)
    assert got.chunk_bytes == block
    assert got.n_slots >= 1 and got.staging_bytes <= max(1 << 30, s.staging_bytes)
    assert got.n_slots >= min(2 * threads, (1 << 30) // block)


# ---------------------------------------------------------------- verify_on="landed"

LANDED = dict(verify_on="landed", **SMALL)


@pytest.mark.parametrize("name, within", [(None, 0), ("big", 5 * BLOCK + 17), ("big", 39_999), ("small", 13),
                                          ("strided", 100)])
def test_landed_verification_returns_the_data_or_names_the_damage(saved, name, within):
    """verify_on="landed" hashes each tensor whole once it is in (xxh3-64; crc32c keeps hashing
    as chunks are read): same data, same errors as the default."""
    if name is not None:
        flip(saved, data_offset(saved, name, within))
        with pytest.raises(fs.ChecksumError) as ei:
            fs.load_file(saved, verify=True, threads=3, **LANDED)
        assert ei.value.tensor == name and ei.value.path == os.fspath(saved)
        return
    out = fs.load_file(saved, verify=True, threads=3, **LANDED)
    for k, x in tensors().items():
        np.testing.assert_array_equal(out[k], x)


def test_landed_verification_hashes_each_tensor_once_after_it_landed(tmp_path, monkeypatch):
    p = tmp_path / "m.safetensors"
    fs.save_file(tensors(), p, checksum="xxh3-64", checksum_block=BLOCK, **SMALL)
    real = integrity.algorithm("xxh3-64")
    data_calls, streamed = [], []

    def fn(data):
        data_calls.append(len(data))
        return real.fn(data)

    def new():
        streamed.append(True)
        return real.new()
    monkeypatch.setitem(integrity._algorithms, "xxh3-64", integrity.Algorithm("xxh3-64", 8, fn, new, real.final))
    out = fs.load_file(p, verify=True, threads=4, **LANDED)
    assert not streamed                                  # nothing hashed piece by piece on the way in
    sizes = {k: v.nbytes for k, v in out.items()}
    blocks = [min(BLOCK, n - o) for n in sizes.values() for o in range(0, n, BLOCK)]
    n_nonempty = sum(1 for n in sizes.values() if n)
    # every block once, plus each tensor's digest over its block digests (8 bytes each; an
    # empty tensor's digest is the hash of no bytes)
    assert sorted(data_calls) == sorted(blocks + [8 * -(-n // BLOCK) for n in sizes.values()])
    assert len(data_calls) == len(blocks) + len(sizes) and n_nonempty < len(sizes)


def test_landed_verification_in_the_background(saved):
    flip(saved, data_offset(saved, "exact", 100))
    with pytest.raises(fs.ChecksumError, match="'exact'"):
        fs.load_file(saved, verify=True, background=True, **LANDED).result()


def test_verify_on_auto_hashes_on_the_gpu_only_what_lands_there(saved, monkeypatch):
    """The default, verify_on="auto": xxh3-64 tensors bound for a GPU are hashed there once they
    have landed (by cupy's kernel: without cupy, as their chunks are read); host destinations
    (and crc32c files) are hashed as their chunks are read."""
    from foxhunt_stream.engine import loader
    from foxhunt_stream.cuda import runtime
    from foxhunt_stream.cuda.devices import CPU, Device
    monkeypatch.setattr(runtime, "has_cupy", lambda: True)
    ck = open_checkpoint(saved)
    names = ck.file_order()
    sels = loader.selections(ck, names)
    s = fs.settings.merge(**SMALL)
    assert s.verify_on == "auto"
    gpu = Device("cuda", 0)
    xxh = integrity.read_checksums(ck.headers[0], ck.paths[0]).algorithm == "xxh3-64"
    for devices, want in ((CPU, [False] * len(names)), (gpu, [xxh] * len(names)),
                          ([gpu if i % 2 else CPU for i in range(len(names))], [xxh and i % 2 == 1 for i in range(len(names))])):
        verifier = loader.prepare(ck, sels, s, devices, verify=True).verifier
        assert [verifier.hashes_landed(d) for d in range(len(names))] == want, devices
    verifier = loader.prepare(ck, sels, fs.settings.merge(verify_on="read", **SMALL), gpu, verify=True).verifier
    assert not any(verifier.hashes_landed(d) for d in range(len(names)))
    monkeypatch.setattr(runtime, "has_cupy", lambda: False)   # torch's CUDA runtime alone: no GPU kernel
    verifier = loader.prepare(ck, sels, s, gpu, verify=True).verifier
    assert not any(verifier.hashes_landed(d) for d in range(len(names)))


def test_verify_on_is_validated():
    with pytest.raises(ValueError, match="verify_on"):
        fs.load_file("nowhere.safetensors", verify=True, verify_on="gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "pt"])
def test_gpu_landed_verification_hashes_on_the_device(tmp_path, framework):
    """verify_on="landed" to a GPU: block digests by the device_digest kernel, short last blocks
    on the host; corruption anywhere is named; an unaligned destination falls back to the host."""
    cp = _cuda_ok()
    if framework == "pt":
        torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    t = {"a": rng.standard_normal(50_000).astype(np.float32), "b": rng.integers(0, 9, 4099, dtype=np.int16),
         "c": np.arange(30, dtype=np.int8), "d": rng.standard_normal((64, 129)).astype(np.float16)}
    p = tmp_path / "g.safetensors"
    fs.save_file(t, p, checksum="xxh3-64", checksum_block=BLOCK)
    out = fs.load_file(p, device="cuda:0", framework=framework, verify=True, verify_on="landed", threads=3, **SMALL)
    for k, x in t.items():
        got = cp.asnumpy(out[k]) if framework == "cupy" else out[k].cpu().numpy()
        np.testing.assert_array_equal(got, x)
    if framework == "cupy":   # a destination at an odd address: hashed from a host copy
        big = cp.zeros(4099 + 1, cp.int16)
        store = {"b": big[1:]}
        fs.load_into(store, p, strict=False, verify=True, verify_on="landed", names=["b"])
        np.testing.assert_array_equal(cp.asnumpy(store["b"]), t["b"])
    # the default (verify_on="auto") hashes on the device too: a plain load hashes every tensor in
    # one launch once all copies are done; tensors() and background handles hash each tensor as
    # it lands (someone may be waiting for it)
    from foxhunt_stream.cuda import digest as device_digest
    batches = []
    real_spans = device_digest.spans_digests

    def spy_spans(spans, *a, **k):
        batches.append(sorted(n for _, n in spans))
        return real_spans(spans, *a, **k)
    device_digest.spans_digests = spy_spans
    try:
        fs.load_file(p, device="cuda:0", framework=framework, verify=True, threads=3, **SMALL)
        assert batches == [sorted(x.nbytes for x in t.values())]
        batches.clear()
        got = fs.load_file(p, device="cuda:0", framework=framework, verify=True, background=True, **SMALL).result()
        assert sorted(batches) == sorted([x.nbytes] for x in t.values()) and set(got) == set(t)
        batches.clear()
        with fs.safe_open(p, framework=framework, device="cuda:0", verify=True, **SMALL) as f:
            names = [n for n, _ in f.tensors()]
        assert sorted(names) == sorted(t) and sorted(batches) == sorted([x.nbytes] for x in t.values())
    finally:
        device_digest.spans_digests = real_spans
    for name, within in (("a", 3 * BLOCK + 5), ("a", 199_999), ("b", 8197), ("c", 3)):
        q = tmp_path / f"bad-{name}-{within}.safetensors"
        q.write_bytes(p.read_bytes())
        flip(q, data_offset(q, name, within))
        with pytest.raises(fs.ChecksumError, match=repr(name)):
            fs.load_file(q, device="cuda:0", framework=framework, verify=True, verify_on="landed", **SMALL)
