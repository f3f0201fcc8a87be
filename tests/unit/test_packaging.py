"""The built wheel ships exactly one importable copy of each package.

Owns the packaging rule of pyproject.toml: the wheel's top-level names are silofs and
silofs_ctl, nothing else (namespace discovery once shipped the folder silofs-ctl as a
second, unimportable controller), and every sub-package of the source tree is inside.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds a wheel

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_silofs_and_silofs_ctl_once(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"silofs", "silofs_ctl"}
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["silofs", "silofs_ctl"]
    for pkg_dir in [
        *ROOT.joinpath("silofs").rglob("__init__.py"),
        *ROOT.joinpath("silofs-ctl").rglob("__init__.py"),
    ]:
        rel = pkg_dir.relative_to(ROOT).as_posix().removeprefix("silofs-ctl/")
        assert rel in names, f"{rel} is missing from the wheel"
