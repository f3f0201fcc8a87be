"""Another revision of silofs beside this checkout, for before/after figures in one run.

Owns the one way the benchmarks compare against another tree: `--git-rev REV` names a
git revision of this repository (its silofs/ and silofs-ctl/ are unpacked with
`git archive` into a temporary directory, removed on exit; the working tree, the index
and the worktree list are left alone) or a directory holding another checkout (used as
it is). A process then runs that tree's code by having it first on its PYTHONPATH
(`env`), with this checkout after it for what the tree does not hold (tests.support,
bench helpers), and SILOFS_BASELINE set so a bench script re-run for the baseline leaves
its sys.path to PYTHONPATH (bench/common.py). Never builds or installs anything.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CODE = ("silofs", "silofs-ctl")  # what a baseline needs: the packages, not tests or docs


def add_argument(parser: argparse.ArgumentParser, what: str = "silofs") -> None:
    parser.add_argument(
        "--git-rev",
        metavar="REV|DIR",
        help=f"also measure this git revision's {what} (or the checkout in DIR): before/after",
    )


def describe(spec: str) -> str:
    """`spec` as a report names it: a directory as given, a revision with its short hash."""
    if os.path.isdir(spec):
        return spec
    res = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", spec], capture_output=True, text=True
    )
    return f"{spec} ({res.stdout.strip()})" if res.returncode == 0 else spec


@contextmanager
def baseline_tree(spec: str) -> Iterator[Path]:
    """The tree `spec` names (see the module docstring), for the life of the block."""
    if os.path.isdir(spec):
        yield Path(spec).resolve()
        return
    res = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", spec, *CODE], capture_output=True
    )
    if res.returncode != 0:
        raise SystemExit(f"git archive {spec}: {res.stderr.decode(errors='replace').strip()}")
    with tempfile.TemporaryDirectory(prefix="silofs-baseline-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(res.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        yield Path(tmp)


def pythonpath(tree: Path) -> list[str]:
    """The PYTHONPATH entries that make `tree`'s silofs and silofs_ctl the ones imported."""
    return [str(tree), str(tree / "silofs-ctl")]


def env(tree: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with `tree` first on PYTHONPATH and
    this checkout after it."""
    base = dict(os.environ if base is None else base)
    parts = [*pythonpath(tree), str(REPO), str(REPO / "silofs-ctl"), base.get("PYTHONPATH", "")]
    base["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    base["SILOFS_BASELINE"] = str(tree)
    return base


def run(tree: Path, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """`python ARGV` with `tree`'s code (`env`); kwargs go to subprocess.run."""
    return subprocess.run([sys.executable, *argv], env=env(tree), **kwargs)


def run_self_first(spec: str, script: str) -> None:
    """Run `script` with this process's arguments but --git-rev under the tree `spec`
    names, before this tree's run: a bench that measures in one process compares
    revisions by running itself twice, headed so the two reports are told apart."""
    print(f"== {describe(spec)}", flush=True)
    with baseline_tree(spec) as tree:
        argv = [a for a in sys.argv[1:] if a not in (spec, "--git-rev")]
        run(tree, [script, *argv], check=True)
    print("== this tree", flush=True)
