"""Line-aware checking of TOML files: typed values with units, errors that name the line.

Owns: finding the line of a key (tomllib gives none, so the text is scanned for table
headers and `key =` lines), and turning sizes, rates, durations and numbers into typed
values with one-line errors "FILE:LINE: message". Shared by scenarios, the controller's
config and its jobs file. Never: knows what any key means.
"""

from __future__ import annotations

import logging
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from silofs.errors import UsageError
from silofs.units import parse_rate, parse_size

log = logging.getLogger(__name__)

_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|min|h|d)?\s*$")
_DURATION_UNITS = {None: 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_DURATION_UNITS["d"] = 86400.0


class ConfigError(Exception):
    """A file that cannot be used; the message names the file and, if known, the line."""


def read_text(path: str | Path, error: type[ConfigError] = ConfigError) -> str:
    """The file's text; one line for a file that cannot be read or is not UTF-8 (a
    binary or Latin-1 file raised UnicodeDecodeError: a traceback)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(
            f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); TOML files are UTF-8"
        ) from None


def load_toml(text: str, path: str, error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path}: not valid TOML: {exc}") from None


def parse_duration(value: Any) -> float:
    """Seconds in 90, "90s", "5m", "1.5h", "2d"."""
    if isinstance(value, bool):
        raise UsageError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise UsageError(f"duration must be a finite number: {value}")
        if value < 0:
            raise UsageError(f"duration must not be negative: {value}")
        return float(value)
    text = str(value)
    if text.strip().startswith("-"):
        raise UsageError(f"duration must not be negative: {text!r}")
    m = _DURATION_RE.match(text)
    if not m:
        raise UsageError(f"not a duration: {text!r} (try 90s, 5m, 1.5h, 2d)")
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not math.isfinite(seconds):  # 400 digits are float infinity
        raise UsageError(f"duration too large: {text[:40]!r}")
    return seconds


class Lines:
    """Where each table and key sits in the text: ("jobs", 3, "gpus") -> line number."""

    _HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
    _PART = r"(?:[A-Za-z0-9_-]+|\"[^\"]*\")"
    _KEY = re.compile(rf"^\s*({_PART}(?:\s*\.\s*{_PART})*)\s*=")

    def __init__(self, text: str) -> None:
        self.where: dict[tuple, int] = {}
        counts: dict[tuple, int] = {}
        table: tuple = ()
        for number, line in enumerate(text.splitlines(), start=1):
            header = self._HEADER.match(line)
            if header:
                table = self._table(header, counts)
                self.where.setdefault(table, number)
                continue
            key = self._KEY.match(line)
            if key:
                path = table + tuple(p.strip().strip('"') for p in key.group(1).split("."))
                self.where.setdefault(path, number)

    @staticmethod
    def _table(header: re.Match, counts: dict[tuple, int]) -> tuple:
        name = tuple(p.strip().strip('"') for p in header.group(2).split("."))
        if header.group(1) == "[[":
            index = counts.get(name, 0)
            counts[name] = index + 1
            return name + (index,)
        return name

    def line(self, *path: Any) -> int | None:
        """The line of `path`, else of the closest enclosing table that has one."""
        for end in range(len(path), 0, -1):
            if path[:end] in self.where:
                return self.where[path[:end]]
        return None


class Checker:
    """Checks values of one parsed file; errors are `error` instances naming the line."""

    def __init__(self, path: str, text: str, error: type[ConfigError] = ConfigError) -> None:
        self.path = path
        self.lines = Lines(text)
        self.error = error

    def fail(self, where: tuple, message: str) -> ConfigError:
        line = self.lines.line(*where)
        prefix = f"{self.path}:{line}" if line else self.path
        return self.error(f"{prefix}: {message}")

    def check_keys(self, table: Any, allowed: set[str], where: tuple) -> None:
        """Refuses a key not in `allowed`, and a value that is no table at all (`jobs =
        [1]`, `nodes = ["a"]`: iterating an int raised TypeError, a traceback)."""
        if not isinstance(table, Mapping):
            what = ".".join(str(p) for p in where if isinstance(p, str)) or "the file"
            raise self.fail(where, f"{what} must be a table, not {table!r}"[:200])
        for key in table:
            if key not in allowed:
                hint = ", ".join(sorted(allowed))
                raise self.fail(where + (key,), f"unknown key {key!r} (known: {hint})")

    def name(self, value: Any, where: tuple, what: str) -> str:
        """A non-empty string of printable characters: names reach tables printed to a
        terminal and log lines, where an ESC sequence in a trace's job name recoloured
        or retitled the terminal and a newline broke the table's rows."""
        if not isinstance(value, str) or not value:
            raise self.fail(where, f"{what} must be a non-empty string")
        if not value.isprintable():
            raise self.fail(
                where, f"{what} {value!r} holds a control character (a newline, ESC, ...)"
            )
        return value

    def need(self, table: Mapping[str, Any], key: str, where: tuple) -> Any:
        if key not in table:
            raise self.fail(where, f"missing key {key!r}")
        return table[key]

    def size(self, value: Any, where: tuple, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise self.fail(where, f"{what}: not a size: {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            # TOML's nan and inf: int() of them raised ValueError/OverflowError, a traceback.
            raise self.fail(where, f"{what} must be a finite number, not {value!r}")
        if isinstance(value, int | float) and value < 0 or str(value).strip().startswith("-"):
            raise self.fail(where, f"{what} must not be negative: {value!r}")
        try:
            return parse_size(value if isinstance(value, str) else int(value))
        except UsageError as exc:
            raise self.fail(where, f"{what}: {exc}") from None

    def rate(self, value: Any, where: tuple, what: str, *, require_unit: bool = False) -> float:
        """Bytes per second (inf: unlimited). require_unit: a bare number other than 0,
        "100" or 100, is an error, as on the command line (units.parse_rate): in a file
        an operator writes, 100 B/s for a link or a job is a typo for a unit, not a plan."""
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise self.fail(where, f"{what}: not a rate: {value!r}")
        if isinstance(value, float) and math.isnan(value):
            raise self.fail(where, f"{what} must be a number, not {value!r}")
        if value == math.inf:
            return math.inf  # TOML's inf: unlimited, as "unlimited" (int() of it raised)
        if isinstance(value, int | float) and value < 0 or str(value).strip().startswith("-"):
            raise self.fail(where, f"{what} must not be negative: {value!r}")
        try:
            if require_unit and not isinstance(value, str) and value != 0:
                parse_rate(str(value), require_unit=True)  # the one message for it
            parsed = parse_rate(
                value if isinstance(value, str) else int(value), require_unit=require_unit
            )
        except UsageError as exc:
            raise self.fail(where, f"{what}: {exc}") from None
        return math.inf if parsed is None else float(parsed)

    def number(self, value: Any, where: tuple, what: str, *, integer: bool) -> float:
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            kind = "a whole number" if integer else "a number"
            raise self.fail(where, f"{what} must be {kind}, not {value!r}")
        if value <= 0 or not math.isfinite(value):
            raise self.fail(where, f"{what} must be positive: {value!r}")
        return value

    def duration(self, value: Any, where: tuple, what: str) -> float:
        try:
            return parse_duration(value)
        except UsageError as exc:
            raise self.fail(where, f"{what}: {exc}") from None
