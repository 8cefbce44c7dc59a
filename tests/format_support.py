"""Shared by the format tests and ``tools/fuzz_header.py``: build safetensors bytes by hand,
ask the reference (safetensors 0.8.0) for its verdict, and mutate valid files.

Nothing here uses foxhunt_stream's parser or serializer, so the tests that use it check
foxhunt_stream against an independent model of the format.
"""

from __future__ import annotations

import json
import random
import re
import struct
from dataclasses import dataclass

import numpy as np

# name -> bits, in the reference's enum order
BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

# Where foxhunt_stream deliberately rejects what safetensors 0.8.0 accepts. Each entry: the
# ``FormatError.rule`` and what the reference does instead. (NaN/Infinity literals and lone
# surrogate escapes are *not* here: serde_json rejects them too, so the verdicts agree.)
STRICTER = {
    "duplicate-key": "a repeated tensor name, __metadata__ key or unknown field: the reference keeps the last one",
    "tensor-entry": "a tensor entry given as a JSON array [dtype, shape, data_offsets]: serde reads it as the struct",
    "unknown-dtype": 'dtype given as {"F32": null}: serde reads a one-key map as the enum variant',
    "shape-limits": "a shape numpy cannot hold: more than 64 dimensions, or an empty tensor with a dimension, or a "
                    "product of its non-zero dimensions in bytes, of 2**63 or more: the reference takes any shape "
                    "whose byte count fits 64 bits",
}

MAX_DIMS = 64   # numpy.MAXDIMS


def beyond_numpy(dtype: str, shape) -> bool:
    """Whether numpy cannot make an array of this safetensors dtype and shape (sub-byte types as
    bytes): more than 64 dimensions, a dimension of 2**63 or more, or non-zero dimensions whose
    product in bytes reaches 2**63."""
    size = max(1, BITS[dtype] // 8)
    for s in shape:
        size *= s or 1
    return len(shape) > MAX_DIMS or any(s >= 2**63 for s in shape) or size >= 2**63


def build(header: str | bytes | dict, data: bytes = b"", *, n: int | None = None, pad: bool = False) -> bytes:
    """``<u64 n><header><data>``; ``n`` defaults to the header's real length."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"), ensure_ascii=False)
    body = header.encode("utf-8", "surrogatepass") if isinstance(header, str) else header
    if pad:
        body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body) if n is None else n) + body + data


def entry(dtype: str, shape, start: int, end: int | None = None) -> dict:
    """A tensor entry; ``end`` defaults to what the shape needs."""
    if end is None:
        end = start + int(np.prod(shape, dtype=object)) * BITS[dtype] // 8
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [start, end]}


def packed(tensors: dict[str, tuple[str, tuple[int, ...]]], *, metadata=None, seed: int = 0,
           extra: dict | None = None) -> tuple[dict, bytes]:
    """A valid header dict and random data for ``{name: (dtype, shape)}``, in the given order."""
    rng = np.random.default_rng(seed)
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    pos = 0
    for name, (dtype, shape) in tensors.items():
        header[name] = entry(dtype, shape, pos)
        if extra:
            header[name].update(extra)
        pos = header[name]["data_offsets"][1]
    data = rng.integers(0, 256, pos, dtype=np.uint8).tobytes()
    return header, data


def expected_bytes(buf: bytes) -> dict[str, bytes]:
    """Each tensor's bytes, located with the plain json module (for files known to be valid)."""
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n])
    base = 8 + n
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if isinstance(e, list):
            e = dict(zip(("dtype", "shape", "data_offsets"), e))
        s, t = e["data_offsets"]
        out[name] = buf[base + s:base + t]
    return out


# ---------------------------------------------------------------- the reference

@dataclass
class RefVerdict:
    ok: bool
    error: str = ""
    tensors: dict | None = None   # name -> (dtype, shape, bytes)


def reference_verdict(buf: bytes) -> RefVerdict:
    """What safetensors 0.8.0 makes of a whole file's bytes (its in-memory deserializer runs the
    same ``read_metadata`` as ``safe_open``)."""
    from safetensors import deserialize
    try:
        out = deserialize(buf)
    except Exception as e:   # the reference raises SafetensorError (and, in some versions, others)
        return RefVerdict(False, f"{type(e).__name__}: {e}")
    return RefVerdict(True, tensors={name: (d["dtype"], tuple(d["shape"]), bytes(d["data"])) for name, d in out})


def documented_stricter(err, buf: bytes) -> bool:
    """True when ``err`` (our FormatError on a file the reference accepted) is one of the
    ``STRICTER`` rules and the file really has that feature."""
    if err.rule not in STRICTER:
        return False
    (n,) = struct.unpack("<Q", buf[:8])
    text = buf[8:8 + n].decode("utf-8")
    if err.rule == "duplicate-key":
        dup = []

        def hook(pairs):
            keys = [k for k, _ in pairs]
            if len(set(keys)) != len(keys):
                dup.append(keys)
            return dict(pairs)
        json.loads(text, object_pairs_hook=hook)
        return bool(dup)
    header = json.loads(text)
    e = header.get(err.tensor)
    if err.rule == "shape-limits":
        return isinstance(e, dict) and e.get("dtype") in BITS and beyond_numpy(e["dtype"], e["shape"])
    if err.rule == "tensor-entry":
        return isinstance(e, list)
    return isinstance(e, dict) and isinstance(e.get("dtype"), dict)   # unknown-dtype


# ---------------------------------------------------------------- seeds and mutations

def seed_files() -> list[bytes]:
    """Small valid files covering the format's features: every dtype, zero-size and scalar
    tensors, unicode names, metadata, unknown fields, offsets listed out of order, whitespace."""
    seeds = []
    every = {f"t_{d}": (d, (2, 4) if BITS[d] < 8 else (3,)) for d in BITS}
    seeds.append(build(*packed(every, metadata={"format": "pt"})))
    h, d = packed({"a": ("F32", (2, 3)), "z": ("F16", (0, 5)), "s": ("I64", ()), "é🦊": ("U8", (5,))})
    seeds.append(build(h, d, pad=True))
    h, d = packed({"w": ("BF16", (4,)), "b": ("F64", (1,))}, metadata={}, extra={"note": [1, {"k": "v"}], "n": -0})
    seeds.append(build(h, d))
    h, d = packed({"x": ("I32", (2,)), "y": ("U16", (3,))})
    items = list(h.items())[::-1]   # listed out of offset order
    seeds.append(build("\n  " + json.dumps(dict(items), indent=1) + " \t\r\n", d))
    seeds.append(build("{}", pad=True))
    seeds.append(build("{}"))
    return seeds


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null|[{}\[\]:,]|\s+|.', re.S)

NUMBERS = ["0", "-0", "1", "-1", "3", "7", "8", "255", "4294967296", "18446744073709551615", "18446744073709551616",
           "9223372036854775808", "1e400", "1.0", "4e0", "-9223372036854775809", "1" + "0" * 310, "0.5", "NaN",
           "Infinity", "1099511627776"]
STRINGS = ['"F32"', '"f32"', '"BF16"', '"F4"', '"F6_E2M3"', '"U8"', '"BOOL"', '"F8_E8M0"', '"C64"', '"F128"', '""',
           '"__metadata__"', '"dtype"', '"shape"', '"data_offsets"', '"\\ud800"', '"\\udc00x"', '"\\ud83d\\ude00"',
           '"\\u0000"', '"é"', '"a\\"b"']
VALUES = ["null", "true", "[]", "{}", "[0]", "[0,0]", "[0,0,0]", '{"F32":null}', '["U8",[1],[0,1]]', "[" * 130 + "]" * 130]


def mutate(buf: bytes, rng: random.Random) -> bytes:
    """One to three random edits: bytes, the length prefix, JSON tokens or the parsed header."""
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        buf = rng.choice(_MUTATORS)(buf, rng)
    return buf


def _split(buf: bytes):
    if len(buf) < 8:
        return None
    (n,) = struct.unpack("<Q", buf[:8])
    if n > len(buf) - 8:
        return None
    try:
        return buf[8:8 + n].decode("utf-8"), buf[8 + n:]
    except UnicodeDecodeError:
        return None


def _rejoin(text: str, data: bytes, old: bytes, rng: random.Random) -> bytes:
    body = text.encode("utf-8", "surrogatepass")
    r = rng.random()
    if r < 0.8:
        return build(body, data)
    if r < 0.9:
        return old[:8] + body + data   # stale length prefix
    return build(body, data, pad=True)


def _flip(buf, rng):
    if not buf:
        return bytes([rng.randrange(256)])
    b = bytearray(buf)
    i = rng.randrange(min(len(b), 8 + 256)) if rng.random() < 0.8 else rng.randrange(len(b))
    b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def _byte(buf, rng):
    if not buf:
        return buf
    b = bytearray(buf)
    b[rng.randrange(len(b))] = rng.choice((0, 0x20, 0x22, 0x2C, 0x5B, 0x5D, 0x7B, 0x7D, 0x30, 0x2D, 0x5C, 0xEF, 0xFF,
                                           0xC0, 0x80, rng.randrange(256)))
    return bytes(b)


def _splice(buf, rng):
    i = rng.randrange(len(buf) + 1)
    j = min(len(buf), i + rng.randrange(16))
    op = rng.randrange(4)
    if op == 0:
        return buf[:i] + buf[j:]                                   # delete
    if op == 1:
        return buf[:i] + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8))) + buf[i:]   # insert
    if op == 2:
        return buf[:i] + buf[i:j] + buf[i:]                         # duplicate
    return buf[:i] + rng.choice((b"\x00" * 8, b" " * 8, b"\xef\xbb\xbf", b"\x00", b"\n")) + buf[i:]


def _length(buf, rng):
    (n,) = struct.unpack("<Q", buf[:8]) if len(buf) >= 8 else (0,)
    choices = [0, 1, 2, n - 1, n + 1, n + 8, n - 8, len(buf) - 8, len(buf), 100_000_000, 100_000_001, 2**63,
               2**64 - 1, rng.randrange(2**64), rng.randrange(max(1, len(buf)))]
    new = rng.choice(choices) % 2**64
    return struct.pack("<Q", new) + buf[8:]


def _tail(buf, rng):
    r = rng.randrange(4)
    if r == 0:
        return buf[:rng.randrange(len(buf) + 1)]
    if r == 1:
        return buf + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    if r == 2:
        return buf[:-1] if buf else buf
    return buf + b"\x00"


def _tokens(buf, rng):
    parts = _split(buf)
    if parts is None:
        return _flip(buf, rng)
    text, data = parts
    toks = _TOKEN.findall(text)
    if not toks:
        return _rejoin(rng.choice(STRINGS + VALUES), data, buf, rng)
    i = rng.randrange(len(toks))
    t = toks[i]
    op = rng.randrange(5)
    if op == 0:                                   # a value of the same kind
        if re.fullmatch(r"-?\d+", t) and rng.random() < 0.3:
            toks[i] = str(int(t) + rng.choice((-1, 1, 8)))
        elif t[0].isdigit() or t[0] == "-":
            toks[i] = rng.choice(NUMBERS)
        elif t.startswith('"'):
            toks[i] = rng.choice(STRINGS)
        else:
            toks[i] = rng.choice(VALUES)
    elif op == 1:
        toks[i] = rng.choice(VALUES + NUMBERS + STRINGS)
    elif op == 2:
        del toks[i]
    elif op == 3:
        toks.insert(i, toks[rng.randrange(len(toks))])
    else:
        j = rng.randrange(len(toks))
        toks[i], toks[j] = toks[j], toks[i]
    return _rejoin("".join(toks), data, buf, rng)


def _structure(buf, rng):
    """Edits of the parsed header that keep it JSON: the ones the validation rules are about."""
    parts = _split(buf)
    if parts is None:
        return _length(buf, rng)
    text, data = parts
    try:
        h = json.loads(text)
    except ValueError:
        return _tokens(buf, rng)
    if not isinstance(h, dict):
        return _tokens(buf, rng)
    names = [k for k, v in h.items() if k != "__metadata__" and isinstance(v, dict)]
    op = rng.randrange(12)
    if names:
        name = rng.choice(names)
        e = h[name]
        if op == 0 and isinstance(e.get("shape"), list):
            sh = e["shape"]
            if sh and rng.random() < 0.7:
                sh[rng.randrange(len(sh))] = rng.choice((0, 1, 2, 3, sh[0] + 1 if isinstance(sh[0], int) else 1,
                                                         2**32, 2**40, 2**63, 2**64 - 1))
            else:
                sh.append(rng.choice((0, 1, 2)))
        elif op == 1 and isinstance(e.get("data_offsets"), list) and e["data_offsets"]:
            offs = e["data_offsets"]
            k = rng.randrange(len(offs))
            if isinstance(offs[k], int):
                offs[k] = max(0, offs[k] + rng.choice((-2, -1, 1, 2, 8)))
        elif op == 2:
            e["dtype"] = rng.choice(list(BITS) + ["f32", "F128", "bf16"])
        elif op == 3:
            other = h[rng.choice(names)]
            offs = other.get("data_offsets", [0, 0])   # identical offsets (an earlier edit may have made them any value)
            e["data_offsets"] = list(offs) if isinstance(offs, list) else offs
        elif op == 4:
            del h[name]
        elif op == 5:
            e.pop(rng.choice(("dtype", "shape", "data_offsets")), None)
        elif op == 6:
            e[rng.choice(("extra", "offsets", "DTYPE", "__metadata__"))] = json.loads(rng.choice(VALUES))
        elif op == 7:
            h[name] = [e.get("dtype"), e.get("shape"), e.get("data_offsets")]
        elif op == 8:
            h[name + rng.choice(("", "x", "\u00e9"))] = {"dtype": "U8", "shape": [len(data) % 3],
                                                          "data_offsets": [len(data), len(data) + len(data) % 3]}
            data += b"\x01" * (len(data) % 3)
    if op == 9:
        h["__metadata__"] = json.loads(rng.choice(('{"a":"b"}', "null", "{}", '{"a":1}', '["a"]', '"x"',
                                                   '{"a":{"b":"c"}}')))
    elif op == 10:
        items = list(h.items())
        rng.shuffle(items)
        h = dict(items)
    elif op == 11:
        text = json.dumps(h, indent=rng.choice((None, 1)), ensure_ascii=rng.random() < 0.5)
        return _rejoin(rng.choice(("", " ", "\n", "\t")) + text + rng.choice(("", " ", "\r\n")), data, buf, rng)
    return _rejoin(json.dumps(h, separators=(",", ":"), ensure_ascii=False), data, buf, rng)


_MUTATORS = (_flip, _byte, _splice, _length, _tail, _tokens, _tokens, _structure, _structure, _structure)


def bounded(n: int):
    """Hypothesis settings for a property test of ``n`` examples, sized for a 2-core CI box."""
    from hypothesis import HealthCheck, settings
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def our_verdict(buf: bytes):
    """Our verdict on a whole file's bytes: the Header, or the FormatError (anything else raises)."""
    from foxhunt_stream.errors import FormatError
    from foxhunt_stream.format.header import parse_header
    try:
        return parse_header(buf, len(buf))
    except FormatError as e:
        assert e.rule and e.path is None
        return e
