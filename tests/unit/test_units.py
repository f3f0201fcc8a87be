"""Sizes and rates: the one grammar users type (silofs/units.py).

Owns the meaning of every suffix (binary for bare K/M/G/T and KiB.., decimal for KB/MB..,
bits for bps and Mb/s), 'unlimited', zero, and the rule that junk is a UsageError with a
one-line message (never a ValueError or OverflowError escaping to the user).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from silofs.errors import UsageError
from silofs.units import count, format_rate, format_size, is_digits, parse_rate, parse_size

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("4096B", 4096),
        ("1K", KiB),
        ("1k", KiB),
        ("500M", 500 * MiB),
        ("2G", 2 * GiB),
        ("2T", 2 * TiB),
        ("1KiB", KiB),
        ("1.5GiB", 3 * GiB // 2),
        ("3MiB", 3 * MiB),
        ("1Ki", KiB),
        ("1TiB", TiB),
        ("1KB", 1000),
        ("10GB", 10 * 10**9),
        ("500MB", 500 * 10**6),
        ("1TB", 10**12),
        ("1.5MB", 1_500_000),
        (".5K", 512),
        ("  4 K ", 4 * KiB),
        ("0G", 0),
        (4096, 4096),
        (0, 0),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("200MB/s", 200 * 10**6),
        ("200MBps", 200 * 10**6),
        ("200MB", 200 * 10**6),
        ("100M", 100 * MiB),
        ("100M/s", 100 * MiB),
        ("100MiB/s", 100 * MiB),
        ("1K/s", KiB),
        ("1.5Gbps", 1_500_000_000 // 8),
        ("8Mb/s", 10**6),
        ("8Mbps", 10**6),
        ("100kbps", 12_500),
        ("800bps", 100),
        ("1GB/s", 10**9),
        ("unlimited", None),
        ("UNLIMITED", None),
        (" unlimited ", None),
        (None, None),
        (0, 0),
        (12345, 12345),
    ],
)
def test_parse_rate(text: str | int | None, expected: int | None) -> None:
    assert parse_rate(text) == expected


def test_binary_bits_are_binary() -> None:
    # The 'i' must not be silently ignored: 8 mebibits per second is 1 MiB/s.
    assert parse_rate("8Mibps") == MiB
    assert parse_rate("8Mib/s") == MiB


def test_a_positive_rate_never_rounds_to_zero() -> None:
    # 0 means "no remote IO at all"; a tiny positive rate must not turn into that.
    assert parse_rate("1bps") == 1
    assert parse_rate("0.1") == 1
    assert parse_rate("0bps") == 0
    assert parse_rate(0.2) == 1
    assert parse_rate(0.0) == 0


@pytest.mark.parametrize("text", ["0.5", "1.5", "0.5B", "4096.5", ".5", "0.0001K", 0.5, 4096.25])
def test_a_size_that_is_not_whole_bytes_is_refused(text: str | float) -> None:
    # "0.5" was rounded to 0 B (`allocate-cache ds 0.5` gave the dataset nothing); a
    # size under a byte with a prefix too.
    with pytest.raises(UsageError, match="not a whole number of bytes") as exc:
        parse_size(text)  # type: ignore[arg-type]
    assert "\n" not in str(exc.value)


def test_a_fraction_with_a_prefix_is_rounded_to_a_byte() -> None:
    # What scenarios and configs write (1.3TiB is 1429365116108.8 B): the nearest byte.
    assert parse_size("1.3TiB") == 1429365116109
    assert parse_size("1.2TiB") == 1319413953331
    assert parse_size("0.3K") == 307
    assert parse_size("4096.0") == parse_size(4096.0) == 4096


def test_exact_integers() -> None:
    # Bare byte counts are exact, however large (no float rounding).
    assert parse_size("9223372036854775807") == 2**63 - 1
    assert parse_size("1234567890123456789B") == 1234567890123456789
    assert parse_rate("11111111111111111") == 11111111111111111
    with pytest.raises(UsageError, match="too large"):
        parse_size("9223372036854775808")
    with pytest.raises(UsageError, match="too large"):
        parse_size(2**64)


JUNK = [
    "",
    " ",
    "-1",
    "-1K",
    "-0",
    "abc",
    "1X",
    "1 K B",
    "iB",
    "K",
    "1e3",
    "1..5",
    "nan",
    "1K\nrm -rf /",
    "9" * 400,
    "9" * 40 + "T",
]


@pytest.mark.parametrize("text", JUNK, ids=lambda t: repr(t[:12]))
def test_junk_size_is_a_one_line_usage_error(text: str) -> None:
    with pytest.raises(UsageError) as exc:
        parse_size(text)
    assert "\n" not in str(exc.value)
    assert str(exc.value)


@pytest.mark.parametrize(
    "text", [*JUNK, "100KBPS", "1.5Gbpss", "fast", "MB/s"], ids=lambda t: repr(t[:12])
)
def test_junk_rate_is_a_one_line_usage_error(text: str) -> None:
    with pytest.raises(UsageError) as exc:
        parse_rate(text)
    assert "\n" not in str(exc.value)
    assert str(exc.value)


@pytest.mark.parametrize("value", [-1, -(2**40), True, False, float("nan"), -1.0, [1], b"1"])
def test_bad_non_strings_are_usage_errors(value: object) -> None:
    with pytest.raises(UsageError):
        parse_size(value)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        parse_rate(value)  # type: ignore[arg-type]


def test_infinity() -> None:
    with pytest.raises(UsageError):
        parse_size(float("inf"))
    assert parse_rate(float("inf")) is None
    assert parse_rate("inf") is None


def test_floats_from_toml() -> None:
    assert parse_size(1e12) == 10**12
    with pytest.raises(UsageError, match="not a whole number of bytes"):
        parse_size(1.5)  # bytes, as "1.5" is (it was 2)
    assert parse_rate(2e8) == 200 * 10**6


@given(st.integers(min_value=0, max_value=2**62))
def test_integer_strings_round_trip(n: int) -> None:
    assert parse_size(str(n)) == n
    assert parse_size(n) == n
    assert parse_rate(str(n)) == n


@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(
        [
            ("K", KiB),
            ("M", MiB),
            ("G", GiB),
            ("T", TiB),
            ("KiB", KiB),
            ("GiB", GiB),
            ("KB", 10**3),
            ("MB", 10**6),
            ("GB", 10**9),
            ("TB", 10**12),
        ]
    ),
)
def test_suffix_multiplies(n: int, suffix: tuple[str, int]) -> None:
    text, mult = suffix
    assert parse_size(f"{n}{text}") == n * mult
    assert parse_size(f"{n}{text.lower()}") == n * mult


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0B"),
        (1023, "1023B"),
        (1024, "1.0KiB"),
        (1536, "1.5KiB"),
        (10 * MiB, "10.0MiB"),
        (3 * GiB // 2, "1.5GiB"),
        (5 * TiB, "5.0TiB"),
        (2048 * TiB, "2048.0TiB"),
        # Rounding must not print a unit's worth of the smaller unit.
        (MiB - 1, "1.0MiB"),
        (GiB - 1, "1.0GiB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (None, "unlimited"),
        (0, "0B/s"),
        (999, "999B/s"),
        (2e8, "200.0MB/s"),
        (1500, "1.5KB/s"),
        (3e9, "3.0GB/s"),
        (999_999, "1.0MB/s"),
        (999.7, "1.0KB/s"),
    ],
)
def test_format_rate(n: float | None, text: str) -> None:
    assert format_rate(n) == text


@settings(max_examples=300)
@given(st.integers(min_value=0, max_value=2**50))
def test_format_size_parses_back_close(n: int) -> None:
    back = parse_size(format_size(n))
    assert abs(back - n) <= max(0.5, n * 0.05 / 1.0)  # one decimal of the chosen unit


@settings(max_examples=300)
@given(st.integers(min_value=0, max_value=10**13))
def test_format_rate_parses_back_close(n: int) -> None:
    back = parse_rate(format_rate(n))
    assert back is not None
    assert abs(back - n) <= max(1, n * 0.05)
    assert parse_rate(format_rate(None)) is None


@pytest.mark.parametrize("text", ["100", "1.5", "  7 "])
def test_a_typed_rate_needs_a_unit(text: str) -> None:
    with pytest.raises(UsageError, match="needs a unit"):
        parse_rate(text, require_unit=True)


@pytest.mark.parametrize(
    "text, expected", [("0", 0), ("100MB/s", 10**8), ("8Mbps", 10**6), ("100B/s", 100)]
)
def test_a_rate_with_a_unit_or_zero_is_accepted(text: str, expected: int) -> None:
    assert parse_rate(text, require_unit=True) == expected


def test_a_count_names_one_in_the_singular_and_every_other_in_the_plural() -> None:
    assert count(1, "node") == "1 node"
    assert [count(n, "node") for n in (0, 2)] == ["0 nodes", "2 nodes"]
    assert count(1, "process", "processes") == "1 process"
    assert count(3, "serving process", "serving processes") == "3 serving processes"
    assert count(1234, "object", grouped=True) == "1,234 objects"


def test_is_digits_is_ascii_digits_only() -> None:
    assert is_digits("0") and is_digits("0123456789")
    # str.isdigit() says yes to each of these; int() refuses the first, reads the second.
    for text in ("", "\u00b2", "\u0663", "1\u00b2", " 1", "1 ", "+1", "-1", "1.0", "0x1"):
        assert not is_digits(text), text
