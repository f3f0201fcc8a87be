"""README "Using it" and "Allocating cache and remote IO", run line by line as written
against a real daemon and an S3-compatible store (moto, named by AWS_ENDPOINT_URL as
the README's table says). The lines are read from README.md itself, so a changed line is
a tested line; each must exit 0.

Only what cannot be typed on a shared test host is changed: the bucket (`datasets` is a
fresh bucket's name), /mnt/... (a temporary directory), the control socket (the node's
own, through SILOFS_SOCKET as the README's commands take it), sizes that do not fit this
host's disk (500G, 200G), and `python train.py` (a read of every file).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fixtures import needs_fuse
from tests.support.node import REPO, Node


def _block(heading: str) -> list[str]:
    """The first ```sh block under `heading`, one command a line, comments dropped."""
    text = (REPO / "README.md").read_text()
    start = text.index(heading)
    block = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert block is not None, heading
    lines = (line.split(" #", 1)[0].strip() for line in block.group(1).splitlines())
    return [line for line in lines if line and not line.startswith("#")]


@needs_fuse
@pytest.mark.fuse
def test_readme_using_it_and_allocations_as_written(
    make_node, s3_server, bucket_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_server.apply_env(monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    tree = {f"imagenet/train/n01/x{i}.jpg": os.urandom(20_000 + i) for i in range(12)}
    tree["curriculum/a.bin"] = os.urandom(70_000)
    s3_server.create(bucket_name, tree)
    node: Node = make_node()
    mnt = tmp_path / "mnt"
    (mnt / "imagenet").mkdir(parents=True)
    bindir = str(Path(sys.executable).parent)  # silofs and silofs-ctl, as after `. .venv/...`
    env = {**node.env, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}

    def as_here(line: str) -> str:
        line = line.replace("s3://datasets/", f"s3://{bucket_name}/")
        line = line.replace("/mnt/", f"{mnt}/")
        line = line.replace("/run/silofs/control.sock", node.socket)
        return line.replace("500G", node.cache_size).replace(" 200G", " 1M")

    def run(line: str) -> subprocess.CompletedProcess:
        argv = shlex.split(as_here(line))
        if argv[0] == "curl" and shutil.which("curl") is None:
            pytest.skip("curl is not installed")
        res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, f"{line!r} -> {res.returncode}: {res.stderr}"
        return res

    using = _block("## Using it")
    assert using[0].startswith(". .venv/bin/activate") and using[-1].startswith("silofs unmount")
    ran = []
    try:
        for line in using[1:-1]:
            if line.startswith("python train.py"):
                for key, data in tree.items():
                    if key.startswith("imagenet/train/"):
                        path = mnt / "imagenet" / key.removeprefix("imagenet/train/")
                        assert path.read_bytes() == data, key
                continue
            ran.append(run(line))
        assert "resnet50" in ran[-1].stdout  # silofs-ctl status: the mount's job

        # The allocation block names a second dataset (curriculum/): open it as a mount.
        node.mount(f"s3://{bucket_name}/curriculum/", tmp_path / "curriculum")
        allocations = _block("### Allocating cache and remote IO")
        assert any(line.startswith("silofs-ctl allocate-io") for line in allocations)
        for line in allocations:
            res = run(line)
            if "/metrics" in line:
                assert "silofs_" in res.stdout
        status = node.status()
        jobs = {j["name"]: j for j in status["jobs"]}
        assert jobs["resnet50"]["io_allocation"] is None  # --clear, the block's last word on it
        admission = {d["uri"]: d["admission"] for d in status["datasets"]}
        assert admission[f"s3://{bucket_name}/curriculum/"] == "lru"
    finally:
        run(using[-1])  # silofs unmount
