"""json_indent.dumps: json.dumps(obj, indent=2)'s text, every case its fast paths take or leave."""

from __future__ import annotations

import enum
import json
import math

import pytest
from silofs_ctl.json_indent import dumps


class _Int(enum.IntEnum):
    ONE = 1


_CASES = [
    1.5,
    -0.0,
    1e300,
    5e-324,
    math.nan,
    math.inf,
    -math.inf,
    True,
    False,
    None,
    0,
    -3,
    2**70,
    "plain",
    'é\n"\\\u2028 \x00',
    [],
    {},
    (),
    [1.0, -0.0, 0.1 + 0.2],
    [1.0, math.nan],
    [1.0, 2],
    [True, 1],
    [1, 2, 3],
    ["a", "ü"],
    [_Int.ONE, 2],
    {"a": [], "b": {}, "c": [True, 2, 3.0], "d": None},
    [[1.0, 2.0], [], [[]]],
    (1.0, 2),
    # records: the same keys in the same order, each column of one plain type
    [{"t%s": 1.0, "b": "x", "n": 3}, {"t%s": 2.5, "b": "y", "n": -4}],
    [{"a": 1.0}, {"a": True}],
    [{"a": 1.0}, {"a": math.inf}],
    [{"a": 1.0}, {"a": 1}],
    [{"a": 1}, {"b": 1}],
    [{"a": 1, "b": 2}, {"b": 1, "a": 2}],
    [{}, {}],
    [{"a": 1.0}, [1.0]],
    [{"a": [1.0]}, {"a": [2.0]}],
    [{"a": None}, {"a": None}],
    [{1: 1.0}, {1: 2.0}],
    {1: "int key", "x": [1]},
    {"nested": {"deeper": [{"a": 0.5, "b": -0.0}, {"a": 1e-7, "b": 1e22}]}},
]


@pytest.mark.parametrize("obj", _CASES, ids=range(len(_CASES)))
def test_dumps_is_json_dumps_indent_2(obj: object) -> None:
    assert dumps(obj) == json.dumps(obj, indent=2)


def test_a_type_json_cannot_write_fails_as_json_does() -> None:
    with pytest.raises(TypeError):
        dumps({"a": object()})
    with pytest.raises(TypeError):
        dumps([{"a": 1.0}, {"a": {1, 2}}])


def test_a_long_timeline_of_records_is_the_same_text() -> None:
    rows = [
        {"t_s": i * 0.1, "throughput_bytes_per_s": 1e9 / (i + 1), "remote_bytes_per_s": 0.0}
        for i in range(2000)
    ]
    obj = {"scenario": "x", "jobs": [{"name": "j", "epochs": [0.5, 1.0]}], "timeline": rows}
    assert dumps(obj) == json.dumps(obj, indent=2)


def test_a_cycle_fails_as_json_dumps_fails() -> None:
    looped: list = [1.0]
    looped.append(looped)
    with pytest.raises(ValueError, match="Circular"):
        dumps({"a": looped})
