"""The plain reader (``format.header_plain``) against the member-by-member reader: on valid
headers in the writers' forms and on mutations of them, the verdict with the plain reader first
is the verdict of the member-by-member reader alone (the same Header, or the same error naming
the same rule and tensor); the writers' forms do take the plain reader; and a text it cannot
vouch for costs it one pass."""

from __future__ import annotations

import json
import random
import time
import tracemalloc

import pytest

from foxhunt_stream import FormatError
from foxhunt_stream.format import header
from foxhunt_stream.format.header_plain import read_plain
from format_support import build, mutate, packed, seed_files

E = '{"dtype":"U8","shape":%s,"data_offsets":%s}'


def _verdict(buf: bytes):
    try:
        h = header.parse_header(buf, len(buf))
        return h.metadata, h.tensors, list(h.by_name.items()), h.header_len
    except FormatError as e:
        return e.rule, e.tensor, str(e)


def _both(buf: bytes, monkeypatch) -> tuple:
    first = _verdict(buf)
    with monkeypatch.context() as m:
        m.setattr(header, "read_plain", lambda text: None)
        alone = _verdict(buf)
    return first, alone


CASES = [
    E % ("[2]", "[0,2]"), E % ("[02]", "[0,2]"), E % ("[2.0]", "[0,2]"), E % ("[-0]", "[0,0]"),
    E % ("[2]", "[-0,2]"), E % ("[2]", "[0,2e0]"), E % ("[18446744073709551616]", "[0,2]"),
    E % ("[0,18446744073709551615]", "[0,0]"), E % ("[0,99999999999999999999]", "[0,0]"),
    E % ("[0,999999999999999999999]", "[0,0]"), E % ("[2]", "[0,18446744073709551616]"),
    E % ("[" + ",".join(["1"] * 65) + "]", "[0,1]"), E % ("[" + ",".join(["1"] * 64) + "]", "[0,1]"),
    E % ("[ ]", "[0,1]"), E % ("[]", "[0,1]"), E % ("[2 2]", "[0,4]"), E % ("[2,]", "[0,2]"),
    E % ("[2]", "[0,2,3]"), E % ("[2]", "[2,0]"), E % ("[\u0662]", "[0,2]"),
    '{"dtype":"U\\u0038","shape":[2],"data_offsets":[0,2]}', '{"dtype":"F32 ","shape":[2],"data_offsets":[0,2]}',
    '{"dtype":"U8","shape":[2],"data_offsets":[0,2],"dtype":"U8"}', '{"dtype":"U8","dtype":"U8","data_offsets":[0,2]}',
    '{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":1}', '{"x":"y"}', "{}", "1",
]
NAMES = ['"a"', '"\\ud83d\\ude00"', '"\\ud83d"', '"\U0001F98A"', '"a\\u0000"', '"a\\\\"', '"a\\""', '"a\\x"',
         '"a\x1f"', '"__metadata__"', '"__metadata\\u005f_"', '""']
META = ['{"format":"pt"}', "{}", "null", '{"a":"b","a":"b"}', '{"a":1}', '{"a":"\\ud800"}', '{"a":"\\\\ud800"}',
        '{"a":"x:y","b":"\\u00e9"}']


@pytest.mark.parametrize("data", [b"", b"\x01", b"\x01\x02"])
def test_entries_and_names_get_the_member_by_member_verdict(data, monkeypatch):
    for value in CASES:
        for name in NAMES:
            for text in ("{" + name + ":" + value + "}", '{"b":' + E % ("[0]", "[0,0]") + "," + name + ":" + value + "}"):
                first, alone = _both(build(text, data), monkeypatch)
                assert first == alone, text


def test_metadata_and_the_object_around_the_entries_get_the_member_by_member_verdict(monkeypatch):
    a, b = '"a":' + E % ("[2]", "[0,2]"), '"b":' + E % ("[1]", "[2,3]")
    texts = ["{" + a + "," + b + "}", "{" + a + "," + a + "}", "{" + a + ",}", "{," + a + "}", "{" + a + " " + b + "}",
             "{" + a + ",," + b + "}", "{" + a + "} x", "{" + a + "}\t\r\n ", "{" + a + "}" + " " * 100, "\n {" + a + "}",
             "\ufeff{" + a + "}", "{" + a + "}\x00", "{", "}", "", "[]", "{ }", '{"b":{"x":"y"},' + a + "}"]
    for meta in META:
        texts += ['{"__metadata__":' + meta + "," + a + "}", "{" + a + ',"__metadata__":' + meta + "}",
                  '{"__metadata__":' + meta + ',"__metadata__":' + meta + "," + a + "}",
                  '{"__metadata__":' + meta + "}"]
    for text in texts:
        for data in (b"\x01\x02\x03", b"\x01\x02"):
            first, alone = _both(build(text, data), monkeypatch)
            assert first == alone, text


def test_mutated_files_get_the_member_by_member_verdict(monkeypatch):
    rng = random.Random(11)
    seeds = seed_files()
    seeds.append(build(*packed({f"t{i}": (["U8", "F32", "BF16"][i % 3], (i % 3, 2)) for i in range(40)},
                               metadata={"format": "pt"})))
    for i in range(3000):
        buf = mutate(rng.choice(seeds), rng)
        first, alone = _both(buf, monkeypatch)
        assert first == alone, buf[:300]


def _entries(order, n=5, sep=""):
    out, pos = {}, 0
    for i in range(n):
        fields = {"dtype": "F32", "shape": [i, 2], "data_offsets": [pos, pos + 8 * i]}
        out[f"t{i}"] = {k: fields[k] for k in order}
        pos += 8 * i
    return out, pos


@pytest.mark.parametrize("order", [("dtype", "shape", "data_offsets"), ("data_offsets", "dtype", "shape"),
                                   ("shape", "data_offsets", "dtype")])
@pytest.mark.parametrize("indent", [None, 2])
def test_the_writers_forms_take_the_plain_reader(order, indent):
    entries, size = _entries(order)
    for obj in ({"__metadata__": {"format": "pt"}, **entries}, {"__metadata__": {}, **entries}, entries):
        text = json.dumps(obj, indent=indent, ensure_ascii=False) + "   "
        plain = read_plain(text)
        assert plain is not None and plain.names == tuple(entries) and plain.metadata == obj.get("__metadata__")
        assert plain.shapes == [tuple(e["shape"]) for e in entries.values()]
        assert [header.TensorInfo(*t) for t in zip(*plain[1:])] == list(header.parse_header(
            build(text, bytes(size)), 8 + len(text) + size).tensors)
    # __metadata__ elsewhere than first: read member by member
    assert read_plain(json.dumps({**entries, "__metadata__": {}}, indent=indent)) is None


def test_many_short_members_cost_no_rows():
    """Only entries are matched after the first member, so a text of many short members that are
    not entries (string maps, a repeated __metadata__) ends the pass at the first one."""
    for member in ('"a":{}', '"__metadata__":{}', '"a":{"b":"c"}'):
        text = "{" + ",".join([member] * 300_000) + "}"
        tracemalloc.start()
        try:
            assert read_plain(text) is None
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < len(text), (member, peak)


@pytest.mark.parametrize("text", [
    "{" + " " * 4_000_000 + '"a"}', "{" + "," * 4_000_000 + "}", "{" + '"' * 4_000_000 + "}",
    "{" + '"a":{"dtype":"U8","shape":[' * 150_000 + "}", '{"a":{"dtype":"U8","shape":[' + "0," * 2_000_000 + "}",
    '{"__metadata__":{' + '"a":"b",' * 500_000 + "}", '{"' + "a" * 4_000_000 + "}",
])
def test_a_text_it_cannot_vouch_for_costs_one_pass(text):
    """Each match starts where the last one ended: texts that would take a scanning regex a pass
    per position are one pass here (well under a second for 4 MB)."""
    start = time.perf_counter()
    assert read_plain(text) is None
    assert time.perf_counter() - start < 2.0
