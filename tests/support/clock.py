"""A module's own reference to `time`, with some of its functions faked, for unit tests.

monkeypatch.setattr(module.time, "sleep", fake) replaces time.sleep in the time module
itself: every thread of the test process (a fake HTTP server's, a pool's, pytest's own)
then sleeps with the fake. patch_time replaces only `module`'s name for the module.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

import pytest


class _Time:
    """The time module with `fakes` in place of some of its functions."""

    def __init__(self, fakes: dict[str, Any]) -> None:
        self.__dict__.update(fakes)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def patch_time(monkeypatch: pytest.MonkeyPatch, module: ModuleType, **fakes: Any) -> None:
    """`module`'s `time` (an `import time` there) with `fakes` (sleep=..., monotonic=...)
    for the rest of the test, on top of those an earlier call gave it (a fixture's sleep,
    then the test's clock); the time module itself is left alone."""
    before = module.time
    earlier = dict(vars(before)) if isinstance(before, _Time) else {}
    monkeypatch.setattr(module, "time", _Time({**earlier, **fakes}))
