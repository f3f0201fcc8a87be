"""The controller against two real node daemons: it pushes, and each daemon's status shows it.

Two `silofs daemon`s, each with a real `silofs mount` of one local dataset for the same
distributed job ("dist"), and a second dataset and job on the first node. The real
`silofs-ctl controller run --once` plans with SiloD's Gavel policy and pushes; then
each daemon's GET /v1/status must show exactly the allocations planned for it, with
the distributed job's remote IO split evenly across its two nodes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from silofs_ctl.controller import Controller
from silofs_ctl.controller_config import load_controller_config

from tests.support.trees import patterned_files, write_tree


def make_dataset(root: Path, files: int, size: int) -> str:
    write_tree(root, patterned_files(files, size, "item-{i:03d}.bin"))
    return root.as_uri() + "/"


def dump(obj: object) -> str:
    return json.dumps(obj, indent=1, default=str)


def write_config(tmp_path: Path, sockets: dict[str, str], data: str, text: str) -> str:
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f"""\
[[jobs]]
name = "dist"
dataset = "{data}"
gpus = 2
ideal_io = "80MB/s"

[[jobs]]
name = "local"
dataset = "{text}"
gpus = 1
ideal_io = "20MB/s"
""")
    config = tmp_path / "controller.toml"
    config.write_text(f"""\
policy = "gavel"
remote_io = "50MB/s"
jobs_file = "{jobs}"

[[nodes]]
name = "a"
socket = "{sockets["a"]}"
gpus = 4
cache = "40M"

[[nodes]]
name = "b"
socket = "{sockets["b"]}"
gpus = 4
cache = "40M"
""")
    return str(config)


def allocations(status: dict) -> tuple[dict, dict]:
    cache = {d["uri"]: d["cache_allocation"] for d in status["datasets"]}
    io = {j["name"]: j["io_allocation"] for j in status["jobs"]}
    return cache, io


def test_controller_pushes_to_two_real_daemons(tmp_path: Path, make_node) -> None:
    data = make_dataset(tmp_path / "imagenet", files=16, size=4 << 20)  # 64 MiB
    text = make_dataset(tmp_path / "wiki", files=4, size=1 << 20)  # 4 MiB
    a, b = make_node(name="a"), make_node(name="b")
    a.mount(data, tmp_path / "mnt-a-data", "--job", "dist")
    b.mount(data, tmp_path / "mnt-b-data", "--job", "dist")
    a.mount(text, tmp_path / "mnt-a-text", "--job", "local")
    config_path = write_config(tmp_path, {"a": a.socket, "b": b.socket}, data, text)

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "silofs_ctl",
            "controller",
            "run",
            "--config",
            config_path,
            "--once",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"controller failed:\n{run.stdout}\n{run.stderr}"

    # What the controller would push now, planned from the same statuses: nothing left to
    # change, and each daemon shows exactly that plan.
    ctl = Controller(load_controller_config(config_path))
    try:
        plan = ctl.round(dry_run=True, force=True)
    finally:
        ctl.close()
    assert plan is not None and not ctl.down
    for node, name in ((a, "a"), (b, "b")):
        status = node.status()
        cache, io = allocations(status)
        for uri, nbytes in plan.cache[name].items():
            assert cache[uri] == nbytes, dump(status)
        for job, rate in plan.io[name].items():
            assert io[job] == rate, dump(status)
        assert sum(plan.cache[name].values()) <= 40 << 20
    dist_a, dist_b = a.status(), b.status()
    rate_a = allocations(dist_a)[1]["dist"]
    rate_b = allocations(dist_b)[1]["dist"]
    assert rate_a is not None and rate_a == rate_b  # split evenly across its nodes
    local = allocations(dist_a)[1]["local"]
    assert local is not None
    assert rate_a + rate_b + local <= 50_000_000
    assert allocations(dist_a)[0][text] == 4 << 20  # the small dataset fits whole
