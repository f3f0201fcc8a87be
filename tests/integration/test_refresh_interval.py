"""A user cannot make the daemon relist a bucket in a loop (docs/SECURITY.md "Limits",
min_refresh_seconds): a real local user made for the test (useradd), a real root
daemon, a local directory bucket.

The user's calls run in a process forked from the test that drops to its uid
(tests/support/asuser.py), so the daemon sees it through SO_PEERCRED as any user: it
runs `silofs-ctl refresh` (the click command, in that process) and the dataset open of
`silofs mount --refresh` (silofs/cli.py _wait_listing, the step before the FUSE mount:
the user cannot exec this host's Python, which lives in root's home, so it cannot run
the mount process itself).
"""

from __future__ import annotations

import contextlib
import io
import logging.handlers  # noqa: F401 - the user's process logs, and cannot import it
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from silofs_ctl.cli import main as ctl_main

from silofs.cli import _wait_listing
from tests.support.asuser import Identity, as_user
from tests.support.fixtures import needs_fuse
from tests.support.node import Node
from tests.support.poll import wait_for
from tests.support.slurm import job_user

pytestmark = [needs_fuse, pytest.mark.fuse]


@pytest.fixture
def user() -> Iterator[Identity]:
    with job_user() as u:
        yield Identity.of(u.pw_name)


@pytest.fixture
def public() -> Iterator[Path]:
    """A 0755 directory under /tmp (pytest's tmp_path is in a 0700 dir of root's): the
    node's socket and the bucket, both reachable by the user."""
    base = Path(tempfile.mkdtemp(prefix="silofs-rr-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


# Everything the user's process runs is imported here, before it forks: it cannot read
# this host's Python library (in root's home) once it has dropped to the user's uid.
def _ctl_refresh(socket: str, dataset: str) -> tuple[int, str]:
    res = CliRunner().invoke(ctl_main, ["refresh", dataset, "--socket", socket])
    return res.exit_code, res.output


def _mount_open(socket: str, uri: str) -> tuple[str, int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        ds = _wait_listing(socket, uri, True, None)
    return ds["state"], ds["generation"], err.getvalue()


def _ready(node: Node, dsid: int) -> dict:
    ds: dict = {}

    def ready() -> bool:
        ds.update(node.request("GET", f"/v1/datasets/{dsid}"))
        return ds["state"] == "ready"

    wait_for(ready, what="the listing")
    return ds


def test_a_user_refresh_too_soon_is_refused_and_a_mount_uses_the_listing(
    public: Path, user: Identity, make_node
) -> None:
    bucket = public / "bucket"
    bucket.mkdir(mode=0o755)
    (bucket / "a.bin").write_bytes(b"a" * 1000)
    (bucket / "a.bin").chmod(0o644)
    config = public / "silofs.toml"
    config.write_text("[limits]\nmin_refresh_seconds = 600\n")
    node: Node = make_node(root=public / "node", args=("--config", str(config)))
    uri = f"file://{bucket}/"
    ds = node.request("POST", "/v1/datasets", {"uri": uri})
    ds = _ready(node, ds["id"])
    # A first listing starts no window: the user's refresh after files were added lists.
    (bucket / "b.bin").write_bytes(b"b" * 1000)
    (bucket / "b.bin").chmod(0o644)
    code, out = as_user(user, _ctl_refresh, node.socket, uri)
    assert code == 0, out
    ds = _ready(node, ds["id"])
    gen = ds["generation"]
    assert ds["objects"] == 2
    (bucket / "c.bin").write_bytes(b"c" * 1000)  # what a refresh would list

    code, out = as_user(user, _ctl_refresh, node.socket, uri)
    assert code != 0, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and "try again in" in lines[0], out
    assert "min_refresh_seconds" in lines[0] and "Traceback" not in out

    state, mounted_gen, said = as_user(user, _mount_open, node.socket, uri)
    assert (state, mounted_gen) == ("ready", gen)
    assert "not refreshed" in said and "try again in" in said, said

    view = _ready(node, ds["id"])
    assert view["generation"] == gen and view["objects"] == 2
    assert view["refreshes_refused"] == 2
    metrics = node.request("GET", "/metrics")
    text = metrics.decode() if isinstance(metrics, bytes) else str(metrics)
    assert f'silofs_dataset_refreshes_refused_total{{dataset="{view["uri"]}"}} 2' in text

    # Root (the daemon's uid here) is exempt: the same command lists at once.
    code, out = _ctl_refresh(node.socket, uri)
    assert code == 0, out
    view = _ready(node, ds["id"])
    assert view["generation"] == gen + 1 and view["objects"] == 3
