"""Datasets for tests and benchmarks: {key: bytes} maps, and the same written to disk.

Owns making the files a test reads back: seeded random files (the same bytes on every
run for one seed), patterned files (file i is byte i repeated, so a misplaced block is
visible), and writing a map under a directory (a local store's bucket). Never uploads
to a server (servers.py's Store.create does that with these maps).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

Name = str | Callable[[int], str]


def _name(name: Name, i: int) -> str:
    return name(i) if callable(name) else name.format(i=i)


def random_files(
    rnd: random.Random | int, count: int, size: int | Sequence[int], name: Name = "f/{i:04d}.bin"
) -> dict[str, bytes]:
    """`count` files of random bytes from `rnd` (a Random, or a seed for a new one).
    `size` is a fixed size, or sizes to draw from (a range draws like randint/randrange);
    `name` a format of the file's index `i` or a function of it."""
    if isinstance(rnd, int):
        rnd = random.Random(rnd)
    files = {}
    for i in range(count):
        n = size if isinstance(size, int) else rnd.choice(size)
        files[_name(name, i)] = rnd.randbytes(n)
    return files


def patterned_files(count: int, size: int, name: Name = "f{i}.bin") -> dict[str, bytes]:
    """`count` files of `size` bytes, file i all byte i (mod 251)."""
    return {_name(name, i): bytes([i % 251]) * size for i in range(count)}


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    """`files` written under `root` (made, with parents; keys may hold '/'); `root`."""
    root.mkdir(parents=True, exist_ok=True)
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root
