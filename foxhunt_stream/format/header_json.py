"""A safetensors header's JSON read as serde_json reads it, member by member: each tensor entry's
known fields built, those the format ignores checked without being built (json_scan), every rule
in text order. For headers ``header_plain`` leaves: another form, or a broken rule.
"""

from __future__ import annotations

import json
import math
import re
from json.decoder import scanstring
from typing import Callable, NamedTuple

from ..errors import FormatError
from .json_scan import (NUMBER, POSSESSIVE, STRING, SURROGATE_ESCAPE, WS, check_string, json_error, lone_surrogate,
                        read_key, skip_value, ws_end)

KNOWN_FIELDS = frozenset(("dtype", "shape", "data_offsets"))


def _reject_constant(token: str):
    raise FormatError("header-json", f"non-standard JSON constant {token}")


# what _parse_int treats specially: "-0", and a run of 300 digits (found in C by bytes.translate)
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGITS = b"0" * 300


def _parse_int(token: str):
    """Integers as serde_json reads them: ``-0`` is the float -0.0; beyond a double, an error."""
    if token == "-0":
        return -0.0
    value = int(token)
    if len(token) > 300 and math.isinf(_to_float(value)):
        raise FormatError("header-json", f"number {token[:20]}... is out of range")
    return value


def _to_float(value: int) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _parse_float(token: str) -> float:
    value = float(token)
    if math.isinf(value):
        raise FormatError("header-json", f"number {token[:40]} is out of range")
    return value


_DECODERS = {hook: json.JSONDecoder(parse_int=hook, parse_float=_parse_float, parse_constant=_reject_constant)
             for hook in (None, _parse_int)}


class _Reading(NamedTuple):
    """How one header's JSON must be read, from a look at its text."""
    decoder: json.JSONDecoder   # with the per-integer hook only where "-0" or a 300-digit run occurs
    strings: bool               # some \u escape may be a lone surrogate: check every string


# the values of a known field that are built: a string, a number, a literal, an array of numbers
_FLAT_FIELD = re.compile("(?:" + STRING + "|" + NUMBER + r"|true|false|null|\[" + WS + "(?:" + NUMBER + "(?:"
                         + WS + "," + WS + NUMBER + ")*" + POSSESSIVE + ")?" + WS + r"\])")


class _Shown:
    """A value too large to build that only an error message will show (it breaks a rule)."""
    __slots__ = ("kind",)

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return {"list": "[...]", "dict": "{...}", "str": '"..."'}.get(self.kind, "...")


_KINDS = {"[": "list", "{": "dict", '"': "str", "t": "bool", "f": "bool", "n": "NoneType"}


def kind_name(value) -> str:
    return value.kind if isinstance(value, _Shown) else type(value).__name__


def _shown(text: str, start: int, end: int):
    """The value ``text[start:end]`` (already checked) for a message: itself if small."""
    if end - start <= 256:
        return json.loads(text[start:end])
    return _Shown(_KINDS.get(text[start], "number"))


_IGNORED = None   # the value kept for an unknown field: its key, for the duplicate check, and nothing else


def _read_object(text: str, pos: int, read_value: Callable, repeated: Callable, tensor: str | None,
                 strings: bool) -> tuple[dict, int]:
    """The members of the object at ``pos``: ``read_value(key, pos)`` gives each value and its end;
    ``repeated(key)`` is the error for a key given twice."""
    out: dict = {}
    pos = ws_end(text, pos + 1)
    if text.startswith("}", pos):
        return out, pos + 1
    while True:
        key, pos = read_key(text, pos, tensor, strings)
        if key in out:
            raise repeated(key)
        out[key], pos = read_value(key, pos)
        pos = ws_end(text, pos)
        if text.startswith(",", pos):
            pos = ws_end(text, pos + 1)
        elif text.startswith("}", pos):
            return out, pos + 1
        else:
            raise json_error("expecting ',' or '}'", pos, tensor)


def _read_field(text: str, pos: int, name: str, key: str, reading: _Reading):
    """A tensor entry's field: dtype, shape and data_offsets built, any other checked and dropped."""
    if key not in KNOWN_FIELDS:
        return _IGNORED, skip_value(text, pos, 3, name, reading.strings)
    if not _FLAT_FIELD.match(text, pos):
        end = skip_value(text, pos, 3, name, reading.strings)
        return _shown(text, pos, end), end
    try:
        value, end = reading.decoder.scan_once(text, pos)
    except json.JSONDecodeError as e:
        raise json_error(e.msg, e.pos, name) from None
    except FormatError as e:   # a number out of range
        raise FormatError(e.rule, e.detail, tensor=name) from None
    if reading.strings and type(value) is str:
        check_string(text, pos, end, name)
    return value, end


def _read_metadata_value(text: str, pos: int, reading: _Reading):
    if text.startswith('"', pos):
        try:
            value, end = scanstring(text, pos + 1)
        except json.JSONDecodeError as e:
            raise json_error(e.msg, e.pos) from None
        if reading.strings:
            check_string(text, pos, end, None)
        return value, end
    end = skip_value(text, pos, 3, None, reading.strings)
    return _shown(text, pos, end), end


def _read_member(text: str, pos: int, key: str, reading: _Reading):
    """A top-level value: ``__metadata__`` or a tensor entry."""
    strings = reading.strings
    if not text.startswith("{", pos):
        end = skip_value(text, pos, 2, None if key == "__metadata__" else key, strings)
        return _shown(text, pos, end), end
    if key == "__metadata__":
        return _read_object(text, pos, lambda k, p: _read_metadata_value(text, p, reading),
                            lambda k: FormatError("duplicate-key", f"__metadata__ key {k!r} appears twice"), None,
                            strings)
    return _read_object(text, pos, lambda k, p: _read_field(text, p, key, k, reading),
                        lambda k: FormatError("duplicate-key", f"field {k!r} appears twice", tensor=key), key, strings)


def _repeated_member(key: str) -> FormatError:
    if key == "__metadata__":
        return FormatError("duplicate-key", "__metadata__ appears twice in the header")
    return FormatError("duplicate-key", "tensor name appears twice in the header", tensor=key)


def _read_header_object(text: str, reading: _Reading) -> dict:
    """The top-level object read member by member: tensor entries as dicts of their known fields
    (unknown ones hold None), ``__metadata__`` as built, every rule checked in text order."""
    pos = ws_end(text, 0)
    if text.startswith("{", pos):
        obj, end = _read_object(text, pos, lambda k, p: _read_member(text, p, k, reading), _repeated_member, None,
                                reading.strings)
    else:
        end = skip_value(text, pos, 1, None, reading.strings)
    if ws_end(text, end) != len(text):
        raise json_error("extra data", ws_end(text, end))
    if not text.startswith("{", pos):
        raise FormatError("header-not-object", f"header JSON is a {_KINDS.get(text[pos], 'number')}, not an object")
    return obj


def read_header_object(text: str, data: bytes, start: int, stop: int) -> dict:
    """The header's top-level object from its JSON ``text`` (``data[start:stop]`` decoded), as
    ``_read_header_object`` gives it; values too big to build that break a rule come as
    placeholders whose kind_name says what they are."""
    # serde's integer rules (``-0``, numbers beyond a double) need a Python hook per integer;
    # a header without such tokens (every real one) parses with the C scanner's own ints
    ints = data.find(b"-0", start, stop) >= 0 or data.translate(_DIGITS_AS_ZERO).find(_LONG_DIGITS, start, stop) >= 0
    # surrogate code points only come from \u escapes (the bytes are checked UTF-8)
    strings = bool(SURROGATE_ESCAPE.search(text)) and lone_surrogate(text) >= 0
    return _read_header_object(text, _Reading(_DECODERS[_parse_int if ints else None], strings))
