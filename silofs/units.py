"""Parsing and printing of sizes and rates.

Owns the one grammar users type for sizes (500M, 1.5GiB, 2T, 4096) and rates
(200MB/s, 1.5Gbps, unlimited). Never touches settings or I/O.

Binary suffixes (K, M, G, T, KiB, ..., TiB) are powers of 1024, as in `du` and `dd`;
decimal suffixes with a B (KB, MB, GB, TB) are powers of 1000, as storage vendors and
the SiloD paper use them. Rates in bits (bps, Kbps, Mbps, Gbps) are decimal.
"""

from __future__ import annotations

import re

from .errors import UsageError

_BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*$", re.I)
_RATE_RE = re.compile(
    r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kKmMgGtTpP]?)(i?)(B|b|bit)?(ps|/s)?\s*$"
)


def _multiplier(prefix: str, binary_marker: str, unit: str) -> int:
    prefix = prefix.lower()
    if binary_marker or unit == "":
        return _BINARY[prefix]
    return _DECIMAL[prefix]


def parse_size(text: str | int) -> int:
    """Bytes in `text`: 4096, 500M (MiB), 1.5GiB, 2T (TiB), 10GB (10**10)."""
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"size must not be negative: {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise UsageError(f"not a size: {text!r} (try 4096, 500M, 1.5GiB, 2T, 10GB)")
    number, prefix, binary, unit = m.groups()
    if binary and not prefix:
        raise UsageError(f"not a size: {text!r}")
    value = float(number) * _multiplier(prefix, binary, unit.lower())
    return int(round(value))


def parse_rate(text: str | int | None) -> int | None:
    """Bytes per second in `text`; None means unlimited. 0 means no remote IO."""
    if text is None:
        return None
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"rate must not be negative: {text}")
        return text
    raw = str(text).strip()
    if raw.lower() in ("unlimited", "inf", "none"):
        return None
    m = _RATE_RE.match(raw)
    if not m:
        raise UsageError(f"not a rate: {text!r} (try 200MB/s, 1.5Gbps, 0, unlimited)")
    number, prefix, binary, unit, _per_s = m.groups()
    if binary and not prefix:
        raise UsageError(f"not a rate: {text!r}")
    if unit in ("b", "bit"):
        # A lower-case b is a bit, as in Gbps or Mb/s; bit rates are decimal.
        return int(round(float(number) * _DECIMAL[prefix.lower()] / 8))
    mult = _BINARY[prefix.lower()] if binary or not unit else _DECIMAL[prefix.lower()]
    return int(round(float(number) * mult))


def format_size(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5KiB'."""
    value = float(n)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or suffix == "TiB":
            return f"{value:.0f}{suffix}" if suffix == "B" else f"{value:.1f}{suffix}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(n: float | None) -> str:
    """Human-readable decimal rate: 2e8 -> '200.0MB/s'; None -> 'unlimited'."""
    if n is None:
        return "unlimited"
    value = float(n)
    for suffix in ("B/s", "KB/s", "MB/s", "GB/s"):
        if abs(value) < 1000 or suffix == "GB/s":
            return f"{value:.0f}{suffix}" if suffix == "B/s" else f"{value:.1f}{suffix}"
        value /= 1000
    raise AssertionError("unreachable")
