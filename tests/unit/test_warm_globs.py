"""A warm's --paths globs (silofs/node/warm.py matches, glob_error): a literal '[' in a
key is matched by `[[]`, a '[' whose set no ']' closes is refused by name (fnmatch would
take it as a literal '[' silently), and what fnmatch's sets mean otherwise is kept."""

from __future__ import annotations

import fnmatch

import pytest

from silofs.node.warm import glob_error, matches


@pytest.mark.parametrize(
    ("key", "glob", "hit"),
    [
        ("data[1].bin", "data[[]1].bin", True),
        ("data[1].bin", "data[1].bin", False),  # a set: matches "data1.bin"
        ("data1.bin", "data[1].bin", True),
        ("x/[a]/y", "x/[[]a]/*", True),
        ("a]b", "a]b", True),  # a ']' alone is a literal
        ("a!b", "a[!]]b", True),  # '!' negates, a first ']' is a member
        ("a]b", "a[!]]b", False),
        ("train/img-7.jpg", "train/*", True),
    ],
)
def test_sets_and_a_literal_bracket(key: str, glob: str, hit: bool) -> None:
    assert glob_error(glob) is None
    assert matches(key, [glob]) is hit


@pytest.mark.parametrize(
    ("glob", "at"),
    [("img[1.bin", 3), ("[", 0), ("a[!", 1), ("a[]", 1), ("a[!]", 1), ("ok[x]/b[", 7)],
)
def test_a_bracket_no_bracket_closes_is_named(glob: str, at: int) -> None:
    why = glob_error(glob)
    assert why is not None and f"the '[' at {at} starts a set" in why and "'[[]'" in why
    # fnmatch itself would have taken it as a literal (what the refusal replaces)
    assert fnmatch.fnmatchcase(glob.replace("[x]", "x"), glob)


@pytest.mark.parametrize("glob", ["*", "a/*.bin", "[[]", "[]]", "[!]]", "a[b]c[d]", "]a[b]"])
def test_balanced_globs_pass(glob: str) -> None:
    assert glob_error(glob) is None
