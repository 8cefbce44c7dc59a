"""Malformed, hostile and edge-case files, each checked against safetensors 0.8.0.

Every case is a file on disk. For each one we ask the reference (``safetensors.safe_open(path,
"numpy")``) for its verdict and assert ours matches: both reject (ours with a
``foxhunt_stream.FormatError`` whose ``rule`` is pinned per case and whose message names the
file, and the tensor where one is involved), or both accept with the same names, metadata and
bytes. Bytes are checked against the file itself (located with the plain ``json`` module) and
against the reference's own arrays wherever it can express the dtype.

Where we are deliberately stricter than the reference, ``STRICTER_CASES`` asserts the
reference's verdict (accept) and ours (reject) separately; ``format_support.STRICTER`` lists
those rules. NaN/Infinity literals and lone surrogate escapes look like stricter-than-reference
cases, but safetensors 0.8.0's serde_json rejects them too, so they are ordinary same-verdict
cases below.
"""

from __future__ import annotations

import struct
import tracemalloc
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
import safetensors

import foxhunt_stream as fs
from foxhunt_stream import FormatError
from foxhunt_stream.format.dtypes import DTYPES
from foxhunt_stream.format.header import parse_header
from format_support import BITS, STRICTER, build, entry, expected_bytes, packed

F32x2 = entry("F32", [2], 0)          # 8 bytes of data
D8 = bytes(range(1, 9))
HDR = '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]'   # an open entry, for text-level cases


@dataclass(frozen=True)
class Case:
    id: str
    buf: bytes
    rule: str
    tensor: str | None = None


def _t(**fields) -> dict:
    """Entry ``a`` = F32[2] at [0, 8] with ``fields`` replaced (value None removes the field)."""
    e = dict(F32x2, **fields)
    return {"a": {k: v for k, v in e.items() if v is not None}}


def _text(inner: str, data: bytes = D8) -> bytes:
    return build("{" + inner + "}", data)


REJECT = [
    # 8-byte little-endian length, within the limit and the file
    Case("empty-file", b"", "header-too-small"),
    Case("seven-bytes", b"\x02\x00\x00\x00\x00\x00\x00", "header-too-small"),
    Case("length-over-limit", build("{}", n=100_000_001), "header-too-large"),
    Case("huge-length-u64-max", build("{}", n=2**64 - 1), "header-too-large"),
    Case("huge-length-2^63", build("{}", n=2**63), "header-too-large"),
    Case("big-endian-length", struct.pack(">Q", 2) + b"{}", "header-too-large"),
    Case("length-past-eof", build("{}", n=100), "header-length"),
    Case("length-at-limit-past-eof", build("{}", n=100_000_000), "header-length"),
    Case("length-one-past-eof", build(_t(), D8, n=len(build(_t(), D8)) - 7), "header-length"),
    # UTF-8
    Case("invalid-byte-ff", build(b'{"\xff":1}'), "header-utf8"),
    Case("overlong-encoding", build(b'{"\xc0\xaf":1}'), "header-utf8"),
    Case("utf8-encoded-surrogate", build(b'{"\xed\xa0\x80":1}'), "header-utf8"),
    Case("truncated-multibyte", build(b'{"\xe2\x82":1}'), "header-utf8"),
    # JSON (an error inside a tensor's entry names the tensor)
    Case("utf8-bom", build(b"\xef\xbb\xbf{}"), "header-json"),
    Case("empty-json", build(b""), "header-json"),
    Case("nul-padding", build(b"{}\x00\x00\x00\x00\x00\x00"), "header-json"),
    Case("trailing-garbage", build(b"{}x"), "header-json"),
    Case("truncated-json", build('{"a":{"dtype"'), "header-json", "a"),
    Case("single-quotes", build("{'a': 1}"), "header-json"),
    Case("trailing-comma", _text(HDR + "},"), "header-json"),
    Case("control-char-in-string", _text(HDR + ',"x":"\x01"}'), "header-json", "a"),
    Case("nan-literal", _text(HDR + ',"x":NaN}'), "header-json", "a"),
    Case("infinity-in-shape", _text('"a":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,8]}'), "header-json", "a"),
    Case("lone-surrogate-name", _text('"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'), "header-json"),   # the name itself is invalid: quoted in the message, not a tensor
    Case("lone-surrogate-unknown-field", _text(HDR + ',"x":"\\ud800"}'), "header-json", "a"),
    Case("lone-trailing-surrogate-metadata", _text('"__metadata__":{"k":"\\udc00"},' + HDR + "}"), "header-json"),
    Case("number-out-of-range", _text(HDR + ',"x":1e400}'), "header-json", "a"),
    Case("integer-out-of-range", _text(HDR + ',"x":-1' + "0" * 400 + "}"), "header-json", "a"),
    Case("nesting-too-deep", _text(HDR + ',"x":' + "[" * 126 + "]" * 126 + "}"), "header-json", "a"),
    Case("json-array", build("[]"), "header-not-object"),
    Case("json-string", build('"x"'), "header-not-object"),
    Case("json-null", build("null"), "header-not-object"),
    # __metadata__: a str -> str map or null
    Case("metadata-list", build({"__metadata__": ["k", "v"]}), "metadata-type"),
    Case("metadata-string", build({"__metadata__": "k=v"}), "metadata-type"),
    Case("metadata-int-value", build({"__metadata__": {"k": 1}}), "metadata-type"),
    Case("metadata-null-value", build({"__metadata__": {"k": None}}), "metadata-type"),
    Case("metadata-nested", build({"__metadata__": {"k": {"a": "b"}}}), "metadata-type"),
    # duplicate fields (rejected by the reference too)
    Case("duplicate-metadata", _text('"__metadata__":{},"__metadata__":{},' + HDR + "}"), "duplicate-key"),
    Case("duplicate-dtype-field", _text(HDR + ',"dtype":"F32"}'), "duplicate-key", "a"),
    Case("duplicate-offsets-field", _text(HDR + ',"data_offsets":[0,8]}'), "duplicate-key", "a"),
    # three fields in writer form, one of them twice (so one missing)
    Case("duplicate-field-of-three", _text('"a":{"dtype":"F32","shape":[2],"dtype":"F32"}'), "duplicate-key", "a"),
    Case("triple-field", _text('"a":{"shape":[2],"shape":[2],"shape":[2]}'), "duplicate-key", "a"),
    # entries: an object with dtype, shape, data_offsets
    Case("entry-null", build({"a": None}), "tensor-entry", "a"),
    Case("entry-string", build({"a": "F32"}), "tensor-entry", "a"),
    Case("entry-array-of-4", build({"a": ["F32", [2], [0, 8], 1]}, D8), "tensor-entry", "a"),
    Case("missing-dtype", build(_t(dtype=None), D8), "tensor-entry", "a"),
    Case("missing-shape", build(_t(shape=None), D8), "tensor-entry", "a"),
    Case("missing-data-offsets", build(_t(data_offsets=None), D8), "tensor-entry", "a"),
    Case("unknown-dtype", build(_t(dtype="F128"), D8), "unknown-dtype", "a"),
    Case("lowercase-dtype", build(_t(dtype="f32"), D8), "unknown-dtype", "a"),
    Case("dtype-with-space", build(_t(dtype="F32 "), D8), "unknown-dtype", "a"),
    Case("dtype-int", build(_t(dtype=32), D8), "unknown-dtype", "a"),
    Case("dtype-list", build(_t(dtype=["F32"]), D8), "unknown-dtype", "a"),
    Case("negative-dim", build(_t(shape=[-2]), D8), "shape", "a"),
    Case("float-dim", build(_t(shape=[2.0]), D8), "shape", "a"),
    Case("exponent-dim", _text('"a":{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}'), "shape", "a"),
    Case("minus-zero-dim", _text('"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}', b""), "shape", "a"),
    Case("bool-dim", build(_t(shape=[True, 2]), D8), "shape", "a"),
    Case("dim-over-u64", build(_t(shape=[2**64]), D8), "shape", "a"),
    Case("shape-not-list", build(_t(shape=2), D8), "shape", "a"),
    Case("shape-null", build({"a": {"dtype": "F32", "shape": None, "data_offsets": [0, 8]}}, D8), "shape", "a"),
    Case("three-offsets", build(_t(data_offsets=[0, 4, 8]), D8), "data-offsets", "a"),
    Case("one-offset", build(_t(data_offsets=[8]), D8), "data-offsets", "a"),
    Case("negative-offset", build(_t(data_offsets=[-8, 0]), D8), "data-offsets", "a"),
    Case("minus-zero-offset", _text('"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}'), "data-offsets", "a"),
    Case("offset-over-u64", build(_t(data_offsets=[0, 2**64]), D8), "data-offsets", "a"),
    Case("float-offsets", build(_t(data_offsets=[0.0, 8.0]), D8), "data-offsets", "a"),
    Case("offsets-object", build(_t(data_offsets={"start": 0, "end": 8}), D8), "data-offsets", "a"),
    # offsets sorted by (start, end) tile the data region from 0, no gap, no overlap
    Case("gap-at-start", build(_t(data_offsets=[4, 12]), bytes(12)), "offsets-tiling", "a"),
    Case("gap-between", build({"a": entry("U8", [4], 0), "b": entry("U8", [4], 5)}, bytes(9)), "offsets-tiling", "b"),
    Case("overlap", build({"a": entry("U8", [4], 0), "b": entry("U8", [4], 2)}, bytes(6)), "offsets-tiling", "b"),
    Case("identical-offsets", build({"a": entry("U8", [4], 0), "b": entry("U8", [4], 0)}, bytes(4)),
         "offsets-tiling", "b"),
    Case("end-before-start", build({"a": entry("U8", [4], 0), "b": entry("U8", [0], 4, 0)}, bytes(4)),
         "offsets-tiling", "b"),
    # element count x bits: no overflow, whole bytes, equal to end - start
    Case("shape-overflow", build({"a": entry("U8", [2**32] * 3, 0, 8)}, D8), "size-overflow", "a"),
    Case("partial-product-overflow", build({"a": entry("U8", [2**40, 2**40, 0], 0, 0)}), "size-overflow", "a"),
    Case("bits-overflow", build({"a": entry("F64", [2**61], 0, 8)}, D8), "size-overflow", "a"),
    Case("f4-odd-count", build({"a": entry("F4", [3], 0, 1)}, b"\x00"), "misaligned-slice", "a"),
    Case("f6-two-elements", build({"a": entry("F6_E2M3", [2], 0, 1)}, b"\x00"), "misaligned-slice", "a"),
    Case("lying-size-long-span", build(_t(data_offsets=[0, 12]), bytes(12)), "size-mismatch", "a"),
    Case("lying-size-short-span", build(_t(shape=[4]), D8), "size-mismatch", "a"),
    Case("zero-size-with-bytes", build(_t(shape=[0, 2]), D8), "size-mismatch", "a"),
    # the data region ends exactly at EOF
    Case("trailing-bytes", build(_t(), D8 + b"\x00"), "incomplete-buffer"),
    Case("truncated-data", build(_t(), D8[:-1]), "incomplete-buffer"),
    Case("empty-header-trailing-byte", build("{}", b"\x00"), "incomplete-buffer"),
    Case("one-tib-tensor-in-100-bytes", build({"a": entry("U8", [2**40], 0)}, bytes(30)), "incomplete-buffer"),
]

# Ours reject, the reference accepts: deliberate (see format_support.STRICTER).
STRICTER_CASES = [
    Case("duplicate-tensor-name", _text(HDR + "}," + HDR + "}"), "duplicate-key", "a"),
    Case("duplicate-metadata-key", _text('"__metadata__":{"k":"1","k":"2"},' + HDR + "}"), "duplicate-key"),
    Case("duplicate-unknown-field", _text(HDR + ',"x":1,"x":2}'), "duplicate-key", "a"),
    Case("entry-as-array", build({"a": ["F32", [2], [0, 8]]}, D8), "tensor-entry", "a"),
    Case("dtype-as-enum-map", build(_t(dtype={"F32": None}), D8), "unknown-dtype", "a"),
    # numpy's limits (at most 64 dims; dims and the bytes of the non-zero ones below 2**63)
    Case("65-dims", build({"a": entry("U8", [1] * 65, 0)}, b"\x01"), "shape-limits", "a"),
    Case("200-empty-dims", build({"a": entry("F32", [0] * 200, 0)}), "shape-limits", "a"),
    Case("empty-with-dim-2^63", build({"a": entry("U8", [0, 2**63], 0)}), "shape-limits", "a"),
    Case("empty-with-dim-u64-max", build({"a": entry("BOOL", [2**64 - 1, 0], 0)}), "shape-limits", "a"),
    Case("empty-dims-over-2^63-bytes", build({"a": entry("F32", [0, 2**62, 2], 0)}), "shape-limits", "a"),
    Case("empty-f64-dims-over-2^63-bytes", build({"a": entry("F64", [2**60, 0], 0)}), "shape-limits", "a"),
]


def _every_dtype():
    return packed({f"t_{d}": (d, (2, 4) if BITS[d] < 8 else (3,)) for d in BITS}, seed=1)


def _unicode_names():
    names = ["日本語", "🦊.weight", "e\u0301", "a\x00b", "", "__metadata", "__METADATA__", " sp ace ", "é"]
    return packed({n: ("U8", (i + 1,)) for i, n in enumerate(names)}, seed=2)


ACCEPT = {
    "empty-header": build("{}"),
    "empty-header-padded": build("{}", pad=True),
    "empty-header-with-metadata": build({"__metadata__": {"format": "pt"}}),
    "metadata-null": build({"__metadata__": None, "a": F32x2}, D8),
    "metadata-empty": build(*packed({"a": ("F32", (2,))}, metadata={})),
    "metadata-unicode": build(*packed({"a": ("U8", (3,))}, metadata={"ключ": "значение 🦊", "": ""})),
    "zero-size-tensors": build(*packed({"z0": ("F32", (0,)), "a": ("I16", (3,)), "z1": ("F64", (3, 0, 2)),
                                        "z2": ("U8", (0,)), "b": ("U8", (1,)), "z3": ("BF16", (0, 0))})),
    "identical-zero-size-offsets": build({"a": entry("U8", [0], 0), "b": entry("F32", [0], 0)}),
    "scalars": build(*packed({"f": ("F32", ()), "i": ("I64", ()), "b": ("BOOL", ()), "h": ("BF16", ())})),
    "unicode-names": build(*_unicode_names()),
    "escaped-unicode-names": _text('"\\u00e9\\ud83e\\udd8a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'),
    "every-dtype": build(*_every_dtype()),
    "whitespace-around-json": build(" \n\t\r" + '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
                                    + "\r\n\t  ", D8),
    "unknown-fields-ignored": _text(HDR + ',"x":{"y":[1,-0,1e308,"s",null,true]},"offsets":[9,9],"dtype2":"?"}'),
    "nesting-at-the-limit": _text(HDR + ',"x":' + "[" * 125 + "]" * 125 + "}"),
    "offsets-listed-out-of-order": build({"b": entry("U8", [4], 8), "a": entry("F32", [2], 0)}, bytes(range(12))),
    "escaped-field-names": _text('"__metad\\u0061ta__":{"k":"v"},"a":{"dt\\u0079pe":"F32","shape":[2],'
                                 '"data_offsets":[0,8]}'),
    "unpadded-header-length": build({"a": entry("U8", [3], 0)}, b"xyz"),
    "f4-and-f6-packed": build({"p": entry("F4", [2, 2], 0), "q": entry("F6_E3M2", [4], 2), "r": entry("F4", [2], 5)},
                              bytes(range(6))),
    "64-dims": build({"a": entry("U8", [1] * 64, 0), "z": entry("U8", [0] * 64, 1)}, b"\x07"),
    "empty-at-numpy-limits": build({"a": entry("U8", [0, 2**63 - 1], 0), "b": entry("F32", [2**61 - 1, 0], 0),
                                    "c": entry("I16", [2**31, 0, 2**30 - 1], 0)}),
}

# What our numpy arrays hold for each dtype (independent of foxhunt_stream.format.dtypes).
NUMPY = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16, "F16": np.float16,
         "BF16": ml_dtypes.bfloat16, "I32": np.int32, "U32": np.uint32, "F32": np.float32, "F64": np.float64,
         "I64": np.int64, "U64": np.uint64, "C64": np.complex64, "F8_E4M3": ml_dtypes.float8_e4m3fn,
         "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
         "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz, "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
         "F4": np.uint8, "F6_E2M3": np.uint8, "F6_E3M2": np.uint8}
# dtypes the reference's numpy framework returns; for the others we ask its torch framework.
REF_NUMPY = {"BOOL", "U8", "I8", "I16", "U16", "F16", "I32", "U32", "F32", "F64", "I64", "U64", "C64"}
REF_TORCH = {"BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4"}


def _write(tmp_path, buf: bytes):
    path = tmp_path / "case.safetensors"
    path.write_bytes(buf)
    return path


def _reference_rejects(path) -> bool:
    try:
        with safetensors.safe_open(str(path), "numpy") as f:
            f.keys()
    except Exception:   # SafetensorError, or an OSError for files too short to map
        return True
    return False


def _check_error(err: FormatError, case: Case, path) -> None:
    assert err.rule == case.rule, str(err)
    assert err.path == str(path) and str(path) in str(err)
    assert err.tensor == case.tensor
    if case.tensor is not None:
        assert repr(case.tensor) in str(err)
    assert f"[{case.rule}]" in str(err)


@pytest.mark.parametrize("case", REJECT, ids=[c.id for c in REJECT])
def test_rejected_like_the_reference(case, tmp_path):
    path = _write(tmp_path, case.buf)
    assert _reference_rejects(path), "safetensors 0.8.0 accepts this file"
    with pytest.raises(FormatError) as e:
        fs.load_file(path)
    _check_error(e.value, case, path)
    with pytest.raises(FormatError) as e:
        fs.safe_open(path, "numpy")
    _check_error(e.value, case, path)


@pytest.mark.parametrize("case", STRICTER_CASES, ids=[c.id for c in STRICTER_CASES])
def test_documented_stricter_than_the_reference(case, tmp_path):
    path = _write(tmp_path, case.buf)
    assert not _reference_rejects(path), "safetensors 0.8.0 now rejects this too: move the case to REJECT"
    with pytest.raises(FormatError) as e:
        fs.load_file(path)
    _check_error(e.value, case, path)
    assert case.rule in STRICTER


def test_case_count():
    """At least 40 malformed files: one per rule, and the known attacks."""
    assert len(REJECT) + len(STRICTER_CASES) >= 40
    rules = {c.rule for c in REJECT}
    assert rules >= {"header-too-small", "header-too-large", "header-length", "header-utf8", "header-json",
                     "header-not-object", "metadata-type", "duplicate-key", "tensor-entry", "unknown-dtype",
                     "shape", "data-offsets", "offsets-tiling", "size-overflow", "misaligned-slice",
                     "size-mismatch", "incomplete-buffer"}


@pytest.mark.parametrize("name", sorted(ACCEPT))
def test_accepted_like_the_reference(name, tmp_path):
    buf = ACCEPT[name]
    path = _write(tmp_path, buf)
    raw = expected_bytes(buf)
    with safetensors.safe_open(str(path), "numpy") as ref:
        ref_keys, ref_meta = ref.keys(), ref.metadata()
        ref_info = {k: (ref.get_slice(k).get_dtype(), ref.get_slice(k).get_shape()) for k in ref_keys}
        ref_np = {k: ref.get_tensor(k) for k in ref_keys if ref_info[k][0] in REF_NUMPY}

    out = fs.load_file(path)
    with fs.safe_open(path, "numpy") as f:
        assert f.keys() == ref_keys
        assert f.metadata() == ref_meta
        assert {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()} == ref_info
    assert sorted(out) == ref_keys == sorted(raw)
    for k, arr in out.items():
        dtype, shape = ref_info[k]
        assert arr.dtype == np.dtype(NUMPY[dtype]), k
        assert arr.tobytes() == raw[k], k
        if BITS[dtype] % 8 == 0:
            assert list(arr.shape) == shape, k
        else:
            assert arr.nbytes * 8 == int(np.prod(shape, dtype=object)) * BITS[dtype]
        if k in ref_np:
            assert ref_np[k].shape == arr.shape and ref_np[k].dtype == arr.dtype
            assert ref_np[k].tobytes() == arr.tobytes()


@pytest.mark.parametrize("name", sorted(ACCEPT))
def test_accepted_like_the_reference_reads_them_through_torch(name, tmp_path, torch):
    """The dtypes the reference reads only through torch (bf16, fp8, F4): the same bytes."""
    buf = ACCEPT[name]
    path = _write(tmp_path, buf)
    with safetensors.safe_open(str(path), "pt") as ref:
        ref_pt = {k: ref.get_tensor(k).view(-1).view(torch.uint8).numpy().tobytes() if ref.get_slice(k).get_shape()
                  else ref.get_tensor(k).reshape(1).view(torch.uint8).numpy().tobytes()
                  for k in ref.keys() if ref.get_slice(k).get_dtype() in REF_TORCH}
    out = fs.load_file(path)
    assert all(ref_pt[k] == out[k].tobytes() for k in ref_pt)


def test_every_dtype_case_covers_all_22():
    assert len(BITS) == 22
    header, _ = _every_dtype()
    assert {e["dtype"] for e in header.values()} == set(BITS) == set(NUMPY) == set(DTYPES)


def _peak_while(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    except FormatError:
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


@pytest.mark.parametrize("claim", [
    {"a": entry("U8", [2**40], 0)},                                 # 1 TiB tensor, file of ~100 bytes
    {"a": entry("F64", [2**20, 2**20, 2**10], 0)},                  # 8 PiB
    {"a": entry("U8", [2**40], 0), "b": entry("U8", [2**40], 2**40)},
])
def test_huge_claims_rejected_before_any_large_allocation(claim, tmp_path):
    buf = build(claim, bytes(20))
    assert len(buf) < 200
    path = _write(tmp_path, buf)
    with pytest.raises(FormatError) as e:
        fs.load_file(path)
    assert e.value.rule == "incomplete-buffer"
    for fn in (lambda: fs.load_file(path), lambda: fs.safe_open(path, "numpy"), lambda: parse_header(buf, len(buf))):
        assert _peak_while(fn) < 256 * 1024


@pytest.mark.parametrize("n", [99_999_999, 100_000_000, 2**64 - 1])
def test_huge_header_length_never_read(n, tmp_path):
    path = _write(tmp_path, build("{}", n=n))
    with pytest.raises(FormatError) as e:
        fs.load_file(path)
    assert e.value.rule in ("header-length", "header-too-large")
    assert _peak_while(lambda: fs.load_file(path)) < 256 * 1024


def test_parse_header_is_pure_and_errors_gain_the_path():
    buf = REJECT[[c.id for c in REJECT].index("gap-between")].buf
    with pytest.raises(FormatError) as e:
        parse_header(buf, len(buf))
    assert e.value.path is None and e.value.tensor == "b"
    named = e.value.with_path("/x/y.safetensors")
    assert named.rule == e.value.rule and named.tensor == "b" and str(named).startswith("/x/y.safetensors: tensor 'b'")
    assert isinstance(named, ValueError)
