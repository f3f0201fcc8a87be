"""json.dumps(obj, indent=2), the same text, made faster for long lists of records.

Owns: dumps(), which `silofs-ctl simulate --json` prints with. Never: a format of its
own: every output is json.dumps(obj, indent=2)'s to the character (a unit test compares
them), and anything it does not handle plainly is given to json.dumps whole.

Why: json.dumps with an indent runs the pure-Python encoder (the C one has no indent),
one generator step per token. A 4-week Gavel run's result has a timeline of ~650,000
records of three floats (98 MB of JSON): 2.9 s of CPU, ~4% of the run. Here a list of
records with the same keys, each key's values of one plain type, is written by one
format string per record over columns of values turned to text by map() in C: the text
of a float is float.__repr__ as json's encoders use it (Infinity and NaN, which it
writes otherwise, take the general path).
"""

from __future__ import annotations

import json
import math
from json.encoder import encode_basestring_ascii as _string  # json's ensure_ascii=True
from typing import Any

_float_repr = float.__repr__
_int_repr = int.__repr__
_isfinite = math.isfinite
_INDENT = "  "


class _Unsupported(Exception):
    """Something json.dumps writes by a rule not copied here (a key not a str, a
    subclass of int or float, a type it cannot write): it writes the whole object."""


def dumps(obj: Any) -> str:
    """json.dumps(obj, indent=2)."""
    try:
        return _encode(obj, 0)
    except (_Unsupported, RecursionError):  # (json.dumps says a cycle is one)
        return json.dumps(obj, indent=2)


def _float(x: float) -> str:
    if x != x:
        return "NaN"
    if x == math.inf:
        return "Infinity"
    if x == -math.inf:
        return "-Infinity"
    return _float_repr(x)


def _encode(obj: Any, depth: int) -> str:
    """`obj` as json.dumps(indent=2) writes it `depth` levels in."""
    kind = type(obj)
    if kind is float:
        return _float_repr(obj) if _isfinite(obj) else _float(obj)
    if kind is str:
        return _string(obj)
    if kind is int:
        return _int_repr(obj)
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    inner = "\n" + _INDENT * (depth + 1)
    outer = "\n" + _INDENT * depth
    if kind is dict:
        if not obj:
            return "{}"
        parts = []
        for key, value in obj.items():
            if type(key) is not str:
                raise _Unsupported
            parts.append(inner + _string(key) + ": " + _encode(value, depth + 1))
        return "{" + ",".join(parts) + outer + "}"
    if kind is list or kind is tuple:
        if not obj:
            return "[]"
        items = _records(obj, depth + 1) if type(obj[0]) is dict else None
        if items is None:
            items = _column(obj)
        if items is None:
            items = [_encode(item, depth + 1) for item in obj]
        return "[" + inner + ("," + inner).join(items) + outer + "]"
    raise _Unsupported


def _column(values: list | tuple) -> list[str] | None:
    """Each of `values` as JSON if they are all finite floats, all str or all int (not
    a subclass: json writes those by other rules), else None."""
    kinds = set(map(type, values))
    if kinds == {float}:
        return list(map(_float_repr, values)) if all(map(_isfinite, values)) else None
    if kinds == {str}:
        return list(map(_string, values))
    if kinds == {int}:
        return list(map(_int_repr, values))
    return None


def _records(rows: list | tuple, depth: int) -> list[str] | None:
    """Each of `rows` as JSON `depth` levels in, when they are dicts with the same str
    keys in the same order and each key's values make a _column; else None."""
    if set(map(type, rows)) != {dict}:
        return None
    keys = set(map(tuple, rows))
    if len(keys) != 1:
        return None
    (names,) = keys
    if not names or any(type(name) is not str for name in names):
        return None
    columns = []
    for name in names:
        column = _column([row[name] for row in rows])
        if column is None:
            return None
        columns.append(column)
    inner = "\n" + _INDENT * (depth + 1)
    template = "{" + ",".join(inner + _string(name).replace("%", "%%") + ": %s" for name in names)
    template += "\n" + _INDENT * depth + "}"
    return list(map(template.__mod__, zip(*columns, strict=True)))
