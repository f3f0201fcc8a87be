"""A bug planted in a silofs process a test starts: a method that raises, N times.

Owns writing a `sitecustomize` module into a directory of the test's: put that directory
first on a process's PYTHONPATH (Node(pythonpath=...), or env={"PYTHONPATH": ...} for one
`silofs mount`) with SILOFS_TEST_FAULTS set, and when the named module is imported in
that process, each named method raises RuntimeError("planted fault") on its first
`times` calls (0: on every call), or, for `times` "sleepS", a coroutine method waits S
seconds before it runs. How a test shows that an exception nobody foresaw (a
bug, not an I/O error) in a request or a background task ends only what it was doing.
Never used by silofs itself; never changes a process without SILOFS_TEST_FAULTS.
"""

from __future__ import annotations

import os
from pathlib import Path

_SITECUSTOMIZE = """
import os
import sys

_SPECS = os.environ.get("SILOFS_TEST_FAULTS", "")


def _plant(module, attr, times):
    cls_name, meth = attr.split(".")
    cls = getattr(module, cls_name)
    real = getattr(cls, meth)
    if times.startswith("sleep"):  # "sleepS": every call waits S seconds first
        _plant_sleep(cls, meth, real, float(times[5:]))
        return
    left = [int(times)]

    def fire():
        if left[0] == 0 and int(times) != 0:
            return False
        left[0] -= 1
        return True

    if hasattr(real, "__code__") and real.__code__.co_flags & 0x80:  # a coroutine function
        async def planted(*args, **kwargs):
            if fire():
                raise RuntimeError("planted fault in " + attr)
            return await real(*args, **kwargs)
    else:
        def planted(*args, **kwargs):
            if fire():
                raise RuntimeError("planted fault in " + attr)
            return real(*args, **kwargs)

    setattr(cls, meth, planted)


def _plant_sleep(cls, meth, real, seconds):
    async def planted(*args, **kwargs):
        import trio

        await trio.sleep(seconds)
        return await real(*args, **kwargs)

    setattr(cls, meth, planted)


if _SPECS:
    import importlib.abc
    import importlib.machinery

    _WANTED = {}
    for spec in _SPECS.split(","):
        name, attr, times = spec.split(":")
        _WANTED.setdefault(name, []).append((attr, times))

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in _WANTED:
                return None
            found = importlib.machinery.PathFinder.find_spec(name, path)
            if found is None or found.loader is None:
                return found
            real_exec = found.loader.exec_module

            def exec_module(module):
                real_exec(module)
                for attr, times in _WANTED[name]:
                    _plant(module, attr, times)

            found.loader.exec_module = exec_module
            return found

    sys.meta_path.insert(0, _Hook())
"""


def fault_env(directory: Path, base: str, *faults: str) -> dict[str, str]:
    """The environment that plants `faults` ("module:Class.method:times" each) in a
    silofs process whose PYTHONPATH would be `base`: `directory`, where the
    sitecustomize is written, goes first."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(directory), base) if p)
    return {"SILOFS_TEST_FAULTS": ",".join(faults), "PYTHONPATH": path}
