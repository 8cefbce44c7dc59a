"""JSON values checked as serde_json reads them, without building them: the values of fields
the safetensors format ignores must still be JSON the reference takes (``skip_value``).
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
from json.decoder import scanstring

from ..errors import FormatError

MAX_JSON_DEPTH = 127   # serde_json's recursion limit: the 128th nested '[' or '{' is an error

# Possessive quantifiers (Python 3.11+): no backtracking point saved per repetition (constant memory)
_P = "+" if sys.version_info >= (3, 11) else ""
POSSESSIVE = _P   # for patterns built elsewhere: "+" where re has possessive quantifiers
WS = "[ \t\n\r]*" + _P
STRING = r'"[^"\\\x00-\x1f]*' + _P + r'(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*' + _P + ")*" + _P + '"'
NUMBER = r"-?(?:0|[1-9][0-9]*" + _P + r")(?:\.[0-9]+" + _P + r")?(?:[eE][-+]?[0-9]+" + _P + ")?"
# numbers no double can overflow: at most 200 integer digits and a positive exponent below 100
_SAFE_NUMBER = (r"-?(?:0|[1-9][0-9]{0,199}" + _P + r")(?:\.[0-9]+" + _P + r")?(?:[eE](?:-[0-9]+" + _P
                + r"|\+?[0-9]{1,2}" + _P + r"))?(?![-+.eE0-9])")
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# a high surrogate escape not followed by a low one, or a low one not preceded by a high one
_LONE_SURROGATE = (r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                   r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_SCALAR = "(" + STRING + ")|(" + NUMBER + ")|true|false|null"
_OPENS = r"\[(?:[ \t\n\r]*\[)*"
_CLOSES = r"\](?:[ \t\n\r]*\])*"


@functools.cache
def _compiled(pattern: str) -> re.Pattern:
    """``pattern`` compiled on first use: a fresh process's first load imports this module for its
    constants, and most headers never reach the scanner."""
    return re.compile(pattern)


_FLAT_LEVELS = 6   # containers nested in one _flat_value
_TOO_DEEP_TO_MATCH = "[" * (_FLAT_LEVELS + 1)
_KEY_CHECK_SPAN = 1 << 20   # the most text whose repeated keys one json.loads call checks


def _flat_value(ws: str, members: int) -> str:
    """One JSON value no deeper than _FLAT_LEVELS, its containers of at most 64 values (objects: at
    most ``members``) and safe numbers; every rule checked but depth, lone surrogates and repeated keys."""
    scalar = "(?:" + STRING + "|true|false|null|" + _SAFE_NUMBER + ")"
    value = scalar
    for _ in range(_FLAT_LEVELS):
        member = STRING + ws + ":" + ws + value + ws
        obj = (r"\{" + ws + "(?:" + member + r")?\}" if members == 1 else
               r"\{" + ws + "(?:" + member + "(?:," + ws + r'(?=")|(?=\})))' + "{0,%d}" % members + _P + r"\}")
        value = ("(?:" + r"\[\]|\{\}|\[" + ws + "(?:" + value + ws + "(?:," + ws + r"(?!\])|(?=\])))" + "{0,64}" + _P
                 + r"\]|" + obj + "|" + scalar + ")")
    return value


@functools.cache
def _flat_patterns() -> tuple[tuple[re.Pattern, re.Pattern, bool], ...]:
    """(a value, a run of array elements each followed by a comma, may repeat a key), in the
    order to try them: compact JSON whose objects hold one member (nothing to check: faster), then
    any. Compiled on first use: most headers never need them."""
    out = []
    for members, ws, longest in ((1, "", 4096), (64, WS, 64)):
        value = _flat_value(ws, members)
        run = "(?:" + value + ws + "," + ws + "){0,%d}" % longest + _P
        out.append((re.compile(value), re.compile(run), members > 1))
    return tuple(out)


def json_error(message: str, pos: int, tensor: str | None = None) -> FormatError:
    return FormatError("header-json", f"header is not valid JSON: {message} at char {pos}", tensor=tensor)


def ws_end(text: str, pos: int) -> int:
    return _compiled(WS).match(text, pos).end()


def lone_surrogate(text: str, start: int = 0, end: int | None = None) -> int:
    """Where the first lone surrogate escape in the JSON ``text[start:end]`` is, or -1 (escaped
    backslashes blanked first: "\\\\ud800" is no escape)."""
    m = _compiled(_LONE_SURROGATE).search(text[start:end].replace("\\\\", "  "))
    return -1 if m is None else start + m.start()


def check_string(text: str, start: int, end: int, tensor: str | None) -> None:
    """No lone surrogate escape in ``text[start:end]`` (the raw JSON of strings)."""
    pos = lone_surrogate(text, start, end)
    if pos >= 0:
        raise FormatError("header-json", f"string has a lone surrogate escape {text[pos:pos + 6]!r} at char {pos}",
                          tensor=tensor)


def read_key(text: str, pos: int, tensor: str | None, strings: bool) -> tuple[str, int]:
    """The object key at ``pos`` and where its value starts (past the ':')."""
    if not text.startswith('"', pos):
        raise json_error("expecting a property name in double quotes", pos, tensor)
    try:
        key, end = scanstring(text, pos + 1)
    except json.JSONDecodeError as e:
        raise json_error(e.msg, e.pos, tensor) from None
    if strings:
        check_string(text, pos, end, tensor)
    end = ws_end(text, end)
    if not text.startswith(":", end):
        raise json_error("expecting ':' delimiter", end, tensor)
    return key, ws_end(text, end + 1)


class _RepeatedKey(Exception):
    pass


def _unique_keys(pairs: list) -> None:
    """json's object hook for _no_repeated_key: raises on a repeated key, else builds nothing."""
    if len(pairs) > 1:
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)


def _no_repeated_key(text: str, start: int, end: int, run: bool, tensor: str | None) -> bool:
    """Whether no object in ``text[start:end]`` (a value, or a run of elements each followed by a
    comma) repeats a key (else FormatError); False when the span is too long for one json call."""
    if text.find(":", start, end) < 0:
        return True
    if end - start > _KEY_CHECK_SPAN:
        return False
    try:
        json.loads("[" + text[start:end] + "0]" if run else text[start:end], object_pairs_hook=_unique_keys)
    except _RepeatedKey as e:
        raise FormatError("duplicate-key", f"key {e.args[0]!r} appears twice in one object", tensor=tensor) from None
    except ValueError:   # (the patterns take only JSON: should json disagree, the values are read one by one)
        return False
    return True


def _flat_end(text: str, pos: int, level: int, run: bool, strings: bool, tensor: str | None) -> int:
    """Past the _flat_value at ``pos`` (``run``: the array elements followed by a comma) whose
    container would be at ``level``; ``pos`` itself if there is none."""
    if not _P or level + _FLAT_LEVELS - 1 > MAX_JSON_DEPTH:
        return pos   # (without possessive quantifiers, a long run would hold a backtracking point per value)
    if text.startswith(_TOO_DEEP_TO_MATCH, pos):
        return pos   # sure to fail, after going _FLAT_LEVELS deep: a chain of arrays goes by _OPENS
    for value, elements, repeats in _flat_patterns():
        m = (elements if run else value).match(text, pos)
        if m and m.end() > pos and (not repeats or _no_repeated_key(text, pos, m.end(), run, tensor)):
            if strings:
                check_string(text, pos, m.end(), tensor)
            return m.end()
    return pos


def _run_end(text: str, pos: int, level: int, strings: bool, tensor: str | None) -> int:
    """Past the array elements at ``pos`` (at ``level``) that are _flat_values followed by a comma."""
    while True:
        end = _flat_end(text, pos, level, True, strings, tensor)
        if end == pos:
            return pos
        pos = ws_end(text, end)   # (a compact run stops at the space after its last comma)


def _scalar_end(text: str, pos: int, strings: bool, tensor: str | None) -> int:
    m = _compiled(_SCALAR).match(text, pos)
    if not m:
        raise json_error("expecting a value", pos, tensor)
    if m.group(1) is not None and strings:
        check_string(text, pos, m.end(), tensor)
    elif m.group(2) is not None and not _compiled(_SAFE_NUMBER).fullmatch(m.group(2)) and math.isinf(float(m.group(2))):
        raise FormatError("header-json", f"number {m.group(2)[:20]}... is out of range", tensor=tensor)
    return m.end()


def _nth(text: str, char: str, pos: int, n: int) -> int:
    """Where the ``n``-th ``char`` from ``pos`` is (the caller knows there are that many)."""
    for _ in range(n):
        pos = text.index(char, pos) + 1
    return pos - 1


def _too_deep(pos: int, tensor: str | None) -> FormatError:
    return FormatError("header-json", f"JSON nests deeper than {MAX_JSON_DEPTH} levels at char {pos}", tensor=tensor)


def skip_value(text: str, pos: int, level: int, tensor: str | None, strings: bool) -> int:
    """Where the JSON value at ``pos`` ends, checked as serde_json checks a value it ignores, and by
    our stricter rules, without building it: valid JSON, containers nested at most MAX_JSON_DEPTH
    deep (``level``: the depth the value's own container would have), no key twice in an object,
    numbers that fit a double, and (``strings``: some string of the text may hold one) no lone
    surrogate escape. A problem is a FormatError naming ``tensor``. Iterative, with a stack of the
    open containers; runs of small values take one regex match each (_flat_patterns)."""
    stack: list[set | None] = []
    expect_value = True
    while True:
        if expect_value:
            depth = level + len(stack)
            end = _flat_end(text, pos, depth, False, strings, tensor)
            if end > pos:
                pos = end
            elif text.startswith("[", pos):   # arrays opened in a row are taken at once: a chain of
                opened = _compiled(_OPENS).match(text, pos)  # them costs no more than one
                n = opened.group().count("[")
                if depth + n - 1 > MAX_JSON_DEPTH:
                    raise _too_deep(_nth(text, "[", pos, MAX_JSON_DEPTH - depth + 2), tensor)
                pos = ws_end(text, opened.end())
                stack.extend([None] * n)
                if text.startswith("]", pos):
                    pos += 1
                    stack.pop()
                else:
                    pos = _run_end(text, pos, depth + n, strings, tensor)
                    continue
            elif text.startswith("{", pos):
                if depth > MAX_JSON_DEPTH:
                    raise _too_deep(pos, tensor)
                pos = ws_end(text, pos + 1)
                if text.startswith("}", pos):
                    pos += 1
                else:
                    key, pos = read_key(text, pos, tensor, strings)
                    stack.append({key})
                    continue
            else:
                pos = _scalar_end(text, pos, strings, tensor)
        # a value ends at pos
        if not stack:
            return pos
        pos = ws_end(text, pos)
        keys = stack[-1]
        if text.startswith(",", pos):
            pos = ws_end(text, pos + 1)
            if keys is None:
                pos = _run_end(text, pos, level + len(stack), strings, tensor)
            else:
                key, pos = read_key(text, pos, tensor, strings)
                if key in keys:
                    raise FormatError("duplicate-key", f"key {key!r} appears twice in one object", tensor=tensor)
                keys.add(key)
            expect_value = True
        elif keys is None and text.startswith("]", pos):   # as many closing as arrays are open
            closed = _compiled(_CLOSES).match(text, pos).group().count("]")
            n = 1
            while n < closed and n < len(stack) and stack[-n - 1] is None:
                n += 1
            del stack[-n:]
            pos = _nth(text, "]", pos, n) + 1
            expect_value = False
        elif keys is not None and text.startswith("}", pos):
            stack.pop()
            pos += 1
            expect_value = False
        else:
            raise json_error(f"expecting ',' or {']' if keys is None else '}'!r}", pos, tensor)
