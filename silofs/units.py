"""Parsing and printing of sizes and rates, printing of counts, and the one test of a
whole number written in ASCII digits (is_digits: a header, a query, a port).

Owns the one grammar users type for sizes (500M, 1.5GiB, 2T, 4096) and rates
(200MB/s, 1.5Gbps, unlimited). Never touches settings or I/O.

Binary suffixes (K, M, G, T, KiB, ..., TiB) are powers of 1024, as in `du` and `dd`;
decimal suffixes with a B (KB, MB, GB, TB) are powers of 1000, as storage vendors and
the SiloD paper use them. Rates in bits (bps, Kbps, Mbps, Gbps) are decimal.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from silofs.errors import UsageError

MAX_VALUE = 2**63 - 1  # sizes and rates end up in u64 fields and LMDB rows

_BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*$", re.I)
_RATE_RE = re.compile(
    r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kKmMgGtTpP]?)(i?)(B|b|bit)?(ps|/s)?\s*$"
)


def is_digits(text: str) -> bool:
    """Whether `text` is one or more ASCII digits 0-9. str.isdigit() also says yes to
    "²" (which int() refuses: a ValueError where a one-line 400 was meant) and to "٣"
    (which int() reads as 3): text a client, a member or a config file sends is tested
    with this one before int()."""
    return text.isascii() and text.isdigit()


def _multiplier(prefix: str, binary_marker: str, unit: str) -> int:
    prefix = prefix.lower()
    if binary_marker or unit == "":
        return _BINARY[prefix]
    return _DECIMAL[prefix]


def _number(value: int | float, what: str) -> Fraction:
    """A non-string input (TOML int or float) as an exact, checked number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(f"not a {what}: {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"not a {what}: {value!r}")
    if value < 0:
        raise UsageError(f"{what} must not be negative: {value}")
    return Fraction(value)


def _checked(value: Fraction, text: object, what: str) -> int:
    n = round(value)
    if n > MAX_VALUE:
        raise UsageError(f"{what} too large: {_short(text)}")
    return n


def _short(text: object) -> str:
    r = repr(text)
    return r if len(r) <= 40 else r[:37] + "..."


def parse_size(text: str | int) -> int:
    """Bytes in `text`: 4096, 500M (MiB), 1.5GiB, 2T (TiB), 10GB (10**10).

    A number without a prefix counts bytes and must be whole: "0.5" is refused, as GNU
    truncate and head refuse it (it was rounded to 0 B: `allocate-cache ds 0.5` gave the
    dataset nothing, silently). With a prefix the fraction of a byte is rounded to the
    nearest (1.3TiB is 1429365116108.8 B), but never a positive size to 0 B."""
    if not isinstance(text, str):
        value = _number(text, "size")
        _whole_bytes(value, text)
        return _checked(value, text, "size")
    m = _SIZE_RE.match(text)
    if not m:
        raise UsageError(f"not a size: {_short(text)} (try 4096, 500M, 1.5GiB, 2T, 10GB)")
    number, prefix, binary, unit = m.groups()
    if binary and not prefix:
        raise UsageError(f"not a size: {_short(text)}")
    # Fraction, not float: "11111111111111111111" is that many bytes, and a huge number
    # is a "too large" UsageError rather than an OverflowError from float infinity.
    value = Fraction(number) * _multiplier(prefix, binary, unit.lower())
    if not prefix or 0 < value < 1:
        _whole_bytes(value, text)
    return _checked(value, text, "size")


def _whole_bytes(value: Fraction, text: object) -> None:
    if value.denominator != 1:
        raise UsageError(
            f"not a whole number of bytes: {_short(text)} (a size without K, M, G or T "
            "counts bytes: try 4096, 500M, 1.5GiB)"
        )


RATE_FORMS = "200MB/s, 100MiB/s, 1.5Gbps, 800Mbps, 0 (no remote IO) or unlimited"


def parse_rate(text: str | int | None, *, require_unit: bool = False) -> int | None:
    """Bytes per second in `text`; None means unlimited. 0 means no remote IO.

    With require_unit (what people type: flags, config files), a bare number other than
    0 is an error: JuiceFS users mean Mbps by `100`, rclone users KiB/s, so silently
    taking it as 100 B/s helps nobody. API bodies may send plain integers (bytes/s)."""
    if text is None:
        return None
    if isinstance(text, float) and text == math.inf:
        return None
    if not isinstance(text, str):
        number = _number(text, "rate")
        if require_unit and number != 0:  # a TOML integer or float: as unit-less as "100"
            raise UsageError(f"the rate {_short(text)} needs a unit: write one of {RATE_FORMS}")
        return _rate(number, text)
    raw = text.strip()
    if raw.lower() in ("unlimited", "inf", "none"):
        return None
    m = _RATE_RE.match(raw)
    if not m:
        raise UsageError(f"not a rate: {_short(text)} (write one of {RATE_FORMS})")
    number, prefix, binary, unit, per_s = m.groups()
    if binary and not prefix:
        raise UsageError(f"not a rate: {_short(text)}")
    if require_unit and not (prefix or unit or per_s) and Fraction(number) != 0:
        raise UsageError(f"the rate {_short(text)} needs a unit: write one of {RATE_FORMS}")
    if unit in ("b", "bit"):
        # A lower-case b is a bit, as in Gbps or Mb/s; bit rates are decimal unless
        # marked binary (Mibps).
        mult = Fraction(_BINARY[prefix.lower()] if binary else _DECIMAL[prefix.lower()], 8)
    else:
        mult = Fraction(_BINARY[prefix.lower()] if binary or not unit else _DECIMAL[prefix.lower()])
    return _rate(Fraction(number) * mult, text)


def _rate(value: Fraction, text: object) -> int:
    # 0 means "no remote IO at all": a positive rate must never round down to it.
    return max(1, _checked(value, text, "rate")) if value > 0 else 0


def count(n: int, noun: str, many: str | None = None, *, grouped: bool = False) -> str:
    """`n` and its noun, singular for one: count(1, "node") is "1 node", count(0, "node")
    "0 nodes"; `many` is the plural where an "s" is not it (count(2, "process",
    "processes")); `grouped`: with thousands separators ("1,024 files")."""
    number = f"{n:,}" if grouped else str(n)
    return f"{number} {noun if n == 1 else many or noun + 's'}"


def format_size(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5KiB'."""
    value = float(n)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        # Decide on the printed (rounded) value: 1048575 is '1.0MiB', not '1024.0KiB'.
        number = f"{value:.0f}" if suffix == "B" else f"{value:.1f}"
        if abs(float(number)) < 1024 or suffix == "TiB":
            return number + suffix
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(n: float | None) -> str:
    """Human-readable decimal rate: 2e8 -> '200.0MB/s'; None -> 'unlimited'."""
    if n is None:
        return "unlimited"
    value = float(n)
    for suffix in ("B/s", "KB/s", "MB/s", "GB/s"):
        number = f"{value:.0f}" if suffix == "B/s" else f"{value:.1f}"
        if abs(float(number)) < 1000 or suffix == "GB/s":
            return number + suffix
        value /= 1000
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """Human-readable duration, two significant units at most: 0.5 -> '0.5s', 90 ->
    '1m30s', 4_194_304 -> '48d13h'; inf -> 'forever'."""
    if seconds == float("inf"):
        return "forever"
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    total = int(seconds)
    for unit, size, sub, subsize in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if total >= size:
            return f"{total // size}{unit}{(total % size) // subsize}{sub}"
    return f"{total // 60}m{total % 60}s"
