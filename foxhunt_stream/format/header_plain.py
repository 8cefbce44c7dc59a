"""A header in the form every writer produces, read in one regex pass: an optional leading
``__metadata__`` object of string to string, then tensor entries holding exactly dtype, shape
and data_offsets, in the order the first entry gives, with any JSON whitespace between tokens.

``re.findall`` captures the entries' fields as text, whose columns become values in C loops (a
dtype or shape once per distinct text). What it cannot vouch for (another form, an invalid
value, a possible lone surrogate, a repeated key) gives None, for ``header_json`` to read
member by member and say what is wrong. A member that does not match ends the pass in a match
of the rest of the text (``_REST``): one pass whatever the text holds. Pure functions, no I/O.
"""

from __future__ import annotations

import functools
import json
import re
from json.decoder import scanstring
from typing import NamedTuple

from .dtypes import DTYPES, DType
from .json_scan import POSSESSIVE as _P, SURROGATE_ESCAPE, WS, lone_surrogate

MAX_DIMS = 64          # numpy's limit (format.header re-exports it)
_U64_MAX = 2**64 - 1
FIELDS = ("dtype", "shape", "data_offsets")
_TAIL = 64             # the most whitespace after the header's object it looks past

# an integer of at most 20 digits (longer ones are left to the member-by-member reader)
_INT = "(?:0|[1-9][0-9]{0,19}" + _P + ")"
# a JSON string's text; without possessive quantifiers one character a step (no endless backtracking)
_CHARS = r'(?:[^"\\\x00-\x1f]' + (_P and "+" + _P) + r'|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*' + _P
_STRING = '"' + _CHARS + '"'
_VALUES = {   # a field's value, its parts captured
    "dtype": r'"([^"\\\x00-\x1f]+' + _P + ')"',
    "shape": r"\[" + WS + "((?:" + _INT + "(?:" + WS + "," + WS + _INT + ")*" + _P + ")?)" + WS + r"\]",
    "data_offsets": r"\[" + WS + "(" + _INT + ")" + WS + "," + WS + "(" + _INT + ")" + WS + r"\]",
}
_PAIR = _STRING + WS + ":" + WS + _STRING
_STRING_MAP = r"(\{" + WS + "(?:" + _PAIR + "(?:" + WS + "," + WS + _PAIR + ")*" + _P + ")?" + WS + r"\})"
_NEXT = WS + "(?:," + WS + '(?=")|\\Z)'   # after a member: a comma and the next name's quote, or the end
_REST = "(?s:.+" + _P + ")"   # no member here: the rest of the text, captured by no group
_METADATA = re.compile('"__metadata__"' + WS + ":" + WS + _STRING_MAP + _NEXT)
_WS_START = re.compile(WS)


@functools.cache
def _entry_pattern(order: tuple[str, ...]) -> re.Pattern:
    """One member (its name, then its fields in ``order``, each a group), then _NEXT; else _REST."""
    fields = ("(?:" + WS + "," + WS + ")").join('"' + f + '"' + WS + ":" + WS + _VALUES[f] for f in order)
    return re.compile('"(' + _CHARS + ')"' + WS + ":" + WS + r"\{" + WS + fields + WS + r"\}" + _NEXT + "|" + _REST)


class PlainHeader(NamedTuple):
    """The header's tensors as columns, in file (text) order; names may repeat (the caller checks)."""
    metadata: dict[str, str] | None
    names: tuple[str, ...]
    dtypes: list[DType]
    shapes: list[tuple[int, ...]]
    starts: list[int]
    ends: list[int]


def _field_order(text: str, start: int) -> tuple[str, ...]:
    """The fields' order in the first entry (at ``start``), guessed from where each name first appears."""
    first = {f: text.find('"' + f + '"', start) for f in FIELDS}
    return tuple(sorted(FIELDS, key=first.__getitem__)) if -1 not in first.values() else FIELDS


def _dims(text: str) -> tuple[int, ...] | None:
    """A shape's numbers (``4, 5``) as a tuple, None beyond the format's limits."""
    if not text:
        return ()
    dims = tuple(map(int, text.split(",")))   # (int() takes the JSON whitespace around a number)
    return dims if len(dims) <= MAX_DIMS and max(dims) <= _U64_MAX else None


def _string_map(text: str) -> dict[str, str] | None:
    """A string map's text (checked JSON of string pairs) as a dict; None if a key repeats."""
    pairs = json.loads(text, object_pairs_hook=list)
    out = dict(pairs)
    return out if len(out) == len(pairs) else None


def _object_span(text: str) -> tuple[int, int] | None:
    """Where the members of the top-level object begin and end, or None if it is not '{' ... '}'."""
    start = _WS_START.match(text).end()
    tail = text[-_TAIL:]
    stop = len(text) - len(tail) + len(tail.rstrip(" \t\r\n")) - 1
    if stop <= start or text[start] != "{" or text[stop] != "}":
        return None
    return _WS_START.match(text, start + 1).end(), stop


def read_plain(text: str) -> PlainHeader | None:
    """The header JSON ``text`` read as the writers' form, every entry checked; None otherwise."""
    span = _object_span(text)
    if span is None:
        return None
    escapes = "\\" in text
    if escapes and SURROGATE_ESCAPE.search(text) and lone_surrogate(text) >= 0:
        return None
    start, stop = span
    metadata = None
    first = _METADATA.match(text, start, stop)
    if first is not None:
        metadata = _string_map(first.group(1))
        if metadata is None:
            return None
        start = first.end()
    order = _field_order(text, start)
    rows = _entry_pattern(order).findall(text, start, stop)
    if not rows:
        return PlainHeader(metadata, (), [], [], [], []) if start == stop else None
    if not any(rows[-1]):   # no group: the rest of the text (_REST), where the form broke
        return None
    columns = list(zip(*rows))
    names = columns[0]
    values, i = {}, 1
    for f in order:   # each field's columns (data_offsets: two)
        n = 2 if f == "data_offsets" else 1
        values[f], i = columns[i:i + n], i + n
    (dtype_texts,), (shape_texts,), (start_texts, end_texts) = (values[f] for f in FIELDS)
    if escapes:
        names = tuple([scanstring(n + '"', 0)[0] if "\\" in n else n for n in names])
    if "__metadata__" in names:
        return None
    dtypes = {t: DTYPES.get(t) for t in set(dtype_texts)}
    shapes = {t: _dims(t) for t in set(shape_texts)}
    starts, ends = list(map(int, start_texts)), list(map(int, end_texts))
    if None in dtypes.values() or None in shapes.values() or (ends and max(max(starts), max(ends)) > _U64_MAX):
        return None
    return PlainHeader(metadata, names, list(map(dtypes.__getitem__, dtype_texts)),
                       list(map(shapes.__getitem__, shape_texts)), starts, ends)
