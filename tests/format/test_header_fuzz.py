"""Parser fuzzing, bounded to a few seconds.

(a) Arbitrary bytes, arbitrary JSON and mutated valid files (bit flips, splices, length-prefix
    edits, JSON token and structure edits) fed to ``parse_header`` and ``fs.load_file``: every
    input ends in a FormatError or in a correct load, never in another exception, and memory
    stays linear in the input, whatever sizes the header claims.
(b) Differential: mutated files against safetensors 0.8.0. Verdicts must be equal, or ours a
    rejection the reference does not make that ``format_support.STRICTER`` documents. We are
    never laxer than the reference. When both accept, names, dtypes, shapes, bytes and metadata
    agree.

``tools/fuzz_header.py`` runs the same checks for millions of inputs (see benchmarks/FUZZ.md).
"""

from __future__ import annotations

import json
import random
import tempfile
import tracemalloc
from pathlib import Path

import safetensors
from hypothesis import given
from hypothesis import strategies as st

import foxhunt_stream as fs
from foxhunt_stream import FormatError
from foxhunt_stream.format.dtypes import DTYPES
from foxhunt_stream.format.header import TensorInfo, check_size, tensor_info, tile_data_region
from format_support import (BITS, bounded, our_verdict, MAX_DIMS, build, documented_stricter, expected_bytes, mutate, reference_verdict,
                            seed_files)

SEEDS = seed_files()


def _check_accepted(header, buf: bytes) -> None:
    """An accepted header describes the file: tensors tile the data region up to EOF."""
    pos = 0
    for t in header.tensors:
        assert t.start == pos and t.end >= t.start
        assert t.numel * t.dtype.bits == 8 * t.nbytes
        pos = t.end
    assert header.data_start + pos == len(buf)


def _mutated(draw_seed: int, rnd: random.Random, rounds: int) -> bytes:
    buf = SEEDS[draw_seed % len(SEEDS)]
    for _ in range(rounds):
        buf = mutate(buf, rnd)
    return buf


mutated_files = st.builds(_mutated, st.integers(0, len(SEEDS) - 1), st.randoms(use_true_random=False),
                          st.integers(1, 4))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12)
entries = st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "U8", "F4", "BF16", "x"]),
                                 "shape": st.lists(st.integers(0, 4), max_size=3),
                                 "data_offsets": st.lists(st.integers(0, 40), min_size=2, max_size=2)})
headers = st.dictionaries(st.text(max_size=4), entries | json_values, max_size=4)


# ---------------------------------------------------------------- (a) robustness

@bounded(400)
@given(st.binary(max_size=200))
def test_arbitrary_bytes(buf):
    result = our_verdict(buf)
    if not isinstance(result, FormatError):
        _check_accepted(result, buf)


@bounded(150)
@given(headers | json_values, st.binary(max_size=48))
def test_arbitrary_json_headers(obj, data):
    buf = build(json.dumps(obj), data)
    result = our_verdict(buf)
    if not isinstance(result, FormatError):
        _check_accepted(result, buf)
    _same_verdict_as_reference(buf, result)


@bounded(300)
@given(mutated_files)
def test_mutated_files_parse_or_raise_format_error(buf):
    result = our_verdict(buf)
    if not isinstance(result, FormatError):
        _check_accepted(result, buf)


@bounded(120)
@given(mutated_files)
def test_mutated_files_load_or_raise_format_error(buf):
    """Through the public loader too: a FormatError naming the file, or arrays holding the file's bytes."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "m.safetensors")
        path.write_bytes(buf)
        try:
            out = fs.load_file(path)
        except FormatError as e:
            assert e.path == str(path) and str(path) in str(e)
            return
    raw = expected_bytes(buf)
    assert sorted(out) == sorted(raw)
    for k, arr in out.items():
        assert arr.tobytes() == raw[k]


@bounded(40)
@given(mutated_files)
def test_memory_stays_linear_in_the_input(buf):
    """No allocation follows a size the header claims: peak memory is bounded by the input's size."""
    our_verdict(buf)  # untraced first: a one-time import or pattern compile is not the input's cost
    tracemalloc.start()
    try:
        our_verdict(buf)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 64 * len(buf) + (256 << 10)


# ---------------------------------------------------------------- (b) differential

@bounded(1000)
@given(mutated_files)
def test_differential_against_the_reference(buf):
    _same_verdict_as_reference(buf, our_verdict(buf))


def _same_verdict_as_reference(buf: bytes, ours) -> None:
    ref = reference_verdict(buf)
    if isinstance(ours, FormatError):
        assert not ref.ok or documented_stricter(ours, buf), f"we reject what the reference accepts: {ours}"
        return
    assert ref.ok, f"we accept what the reference rejects ({ref.error})"
    base = ours.data_start
    assert {t.name: (t.dtype.name, t.shape, buf[base + t.start:base + t.end]) for t in ours.tensors} == ref.tensors


@bounded(60)
@given(mutated_files)
def test_differential_metadata_when_both_accept(buf):
    ours = our_verdict(buf)
    if isinstance(ours, FormatError) or not reference_verdict(buf).ok:
        return
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "m.safetensors")
        path.write_bytes(buf)
        with safetensors.safe_open(str(path), "numpy") as f:
            assert ours.metadata == f.metadata()
            assert [t.name for t in ours.tensors if t.nbytes] == [k for k in f.offset_keys()
                                                                 if ours.by_name[k].nbytes]


def test_mutators_reach_every_verdict():
    """The mutations are worth something: a fixed sample reaches acceptance, the documented
    stricter rules and most rejection rules."""
    rnd = random.Random(1234)
    rules, accepted = set(), 0
    for i in range(3000):
        buf = _mutated(i, rnd, 1 + i % 3)
        result = our_verdict(buf)
        if isinstance(result, FormatError):
            rules.add(result.rule)
        else:
            accepted += 1
    assert accepted > 50
    assert rules >= {"header-too-small", "header-too-large", "header-length", "header-utf8", "header-json",
                     "header-not-object", "metadata-type", "tensor-entry", "unknown-dtype", "offsets-tiling",
                     "size-mismatch", "incomplete-buffer", "duplicate-key"}, rules


# ---------------------------------------------------------------- the fast checks agree with the rules

_EDGES = st.sampled_from([-1, 2**64, 2**64 - 1, 0, True, 1.0, None, "1"])
_VALUES = st.one_of(st.integers(-3, 2**64 + 2), st.booleans(), st.floats(allow_nan=False, width=32), st.none(),
                    st.text(max_size=3))


@st.composite
def _entries(draw):
    """A well-formed tensor entry, then maybe an edit: a field's value, one dim or one offset
    replaced, a field dropped, an unknown field added, the shape grown past 64 dimensions."""
    entry = {"dtype": draw(st.sampled_from(sorted(DTYPES))), "shape": draw(st.lists(st.integers(0, 9), max_size=3)),
             "data_offsets": sorted(draw(st.lists(st.integers(0, 99), min_size=2, max_size=2)))}
    edit = draw(st.sampled_from(["none", "value", "dim", "offset", "drop", "add", "dims"]))
    key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
    if edit == "value":
        entry[key] = draw(st.one_of(_VALUES, st.sampled_from(["f32", "X"]), st.lists(_VALUES, max_size=3)))
    elif edit == "dim" and entry["shape"]:
        entry["shape"][draw(st.integers(0, len(entry["shape"]) - 1))] = draw(_EDGES)
    elif edit == "offset":
        entry["data_offsets"][draw(st.integers(0, 1))] = draw(_EDGES)
    elif edit == "drop":
        del entry[key]
    elif edit == "add":
        entry["extra"] = draw(_VALUES)
    elif edit == "dims":
        entry["shape"] = entry["shape"] * draw(st.integers(20, 70)) + draw(st.lists(_EDGES, max_size=1))
    return entry


def _verdict(fn, *args):
    try:
        return fn(*args)
    except FormatError as e:
        return (e.rule, e.tensor)


def _rules_say(name, entry):
    """The entry rules written out plainly, checked in their documented order: the TensorInfo,
    or the first rule broken."""
    if not isinstance(entry, dict) or not all(k in entry for k in ("dtype", "shape", "data_offsets")):
        return ("tensor-entry", name)
    dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in BITS:
        return ("unknown-dtype", name)
    uint64 = lambda v: type(v) is int and 0 <= v < 2**64   # noqa: E731 (bool is not a JSON integer)
    if not isinstance(shape, list) or not all(uint64(s) for s in shape):
        return ("shape", name)
    if len(shape) > MAX_DIMS:
        return ("shape-limits", name)
    if not isinstance(offs, list) or len(offs) != 2 or not all(uint64(o) for o in offs):
        return ("data-offsets", name)
    return TensorInfo(name, DTYPES[dtype], tuple(shape), offs[0], offs[1])


@bounded(600)
@given(entry=st.one_of(_entries(), st.lists(_VALUES, max_size=3), _VALUES))
def test_entry_checks_follow_the_rules(entry):
    """``tensor_info`` checks an entry in one pass: for any entry it gives what the rules say, the
    same TensorInfo or the first rule broken."""
    assert _verdict(tensor_info, "t", entry) == _rules_say("t", entry)


@bounded(400)
@given(dtype=st.sampled_from(sorted(DTYPES)),
       shape=st.lists(st.one_of(st.integers(0, 5), st.sampled_from([2**20, 2**32, 2**40, 2**63])), max_size=4),
       delta=st.sampled_from([0, 0, 1, -1, 2**64]))
def test_size_fast_check_agrees_with_the_rules(dtype, shape, delta):
    """``tile_data_region`` checks each size in one pass and leaves the rest to ``check_size``: a tensor
    passes it exactly when it passes ``check_size`` (zero dims after huge ones included)."""
    numel = 1
    for s in shape:
        numel *= s
    end = max(0, numel * DTYPES[dtype].bits // 8 + delta)
    info = TensorInfo("t", DTYPES[dtype], tuple(shape), 0, end)
    by_rules = _verdict(check_size, info)
    assert _verdict(tile_data_region, [info]) == (end if by_rules is None else by_rules)


def test_the_mutator_edits_offsets_an_earlier_edit_made_any_value():
    """Mutations chain: an entry whose data_offsets an earlier edit turned into a number is copied
    as it is ("identical offsets"), not taken for a list."""
    import format_support

    class CopyOffsets(random.Random):
        def randrange(self, start, stop=None, step=1):
            return 3 if (start, stop) == (12, None) else super().randrange(start, stop, step)
    text = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": 0},
                       "b": {"dtype": "F32", "shape": [1], "data_offsets": 0}}).encode()
    out = format_support._structure(len(text).to_bytes(8, "little") + text + b"\0" * 8, CopyOffsets(1))
    h = json.loads(out[8:8 + int.from_bytes(out[:8], "little")])
    assert h["a"]["data_offsets"] == 0 == h["b"]["data_offsets"]
