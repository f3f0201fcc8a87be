"""The real controller against clustered daemons: a dataset is one cache pool per cluster.

Three `silofs daemon`s form one cluster (each 32 MiB of cache, mutual TLS between them)
and a fourth stands alone. One job ("dist") reads a 48 MiB dataset on the three members,
another ("solo") the same dataset on the lone node, a third ("local") an 8 MiB dataset
on one member. `silofs-ctl controller run --once`, reaching the members over their TLS
listener and the lone node over its socket, plans with SiloD's Gavel policy and pushes.

Then: every member reports the same cluster-wide shares (the 48 MiB dataset whole and
the 8 MiB one, which no member's 32 MiB could hold as separate copies), each member's
part is a third of them, the lone node has an allocation of its own within its 32 MiB,
dist's IO is split evenly over its three nodes, and a second round changes nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import ClusterNode, write_cluster
from tests.support.fixtures import needs_fuse
from tests.support.net import free_ports
from tests.support.node import Node
from tests.support.poll import wait_for
from tests.support.trees import patterned_files, write_tree

pytestmark = [needs_fuse, pytest.mark.fuse]

MiB = 1 << 20
CACHE = 32 * MiB
NODES = 3


def make_dataset(root: Path, files: int, size: int) -> str:
    write_tree(root, patterned_files(files, size, "item-{i:03d}.bin"))
    return root.as_uri() + "/"


class Member(Node):
    """A Node started with its cluster's silofs.toml."""

    def __init__(self, spec: ClusterNode) -> None:
        super().__init__(spec.root, CACHE, config=spec.config)
        self.spec = spec


@pytest.fixture
def members(tmp_path: Path) -> Iterator[list[Member]]:
    specs = write_cluster(tmp_path, ["127.0.0.1"] * NODES, free_ports(NODES))
    nodes = [Member(s) for s in specs]
    try:
        for n in nodes:
            n.start()
        yield nodes
    finally:
        for n in nodes:
            n.cleanup()
    problems = [x for n in nodes for x in n.log_problems()]
    assert not problems, "\n".join(problems)


def write_config(tmp_path: Path, members: list[Member], solo: Node, big: str, small: str) -> Path:
    pki = tmp_path / "pki"
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f"""\
[[jobs]]
name = "dist"
dataset = "{big}"
gpus = 3
ideal_io = "60MB/s"

[[jobs]]
name = "solo"
dataset = "{big}"
gpus = 1
ideal_io = "20MB/s"

[[jobs]]
name = "local"
dataset = "{small}"
gpus = 1
ideal_io = "10MB/s"
""")
    nodes = "".join(
        f'[[nodes]]\nname = "{m.spec.name}"\naddress = "{m.spec.address}"\ngpus = 1\n\n'
        for m in members
    )
    config = tmp_path / "controller.toml"
    config.write_text(f"""\
policy = "gavel"
remote_io = "50MB/s"
jobs_file = "{jobs}"

[tls]
cert = "{pki / "controller.pem"}"
key = "{pki / "controller.key"}"
ca = "{pki / "ca.pem"}"

{nodes}[[nodes]]
name = "solo"
socket = "{solo.socket}"
gpus = 1
""")
    return config


def run_once(config: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "silofs_ctl", "controller", "run", "--config", str(config)]
    return subprocess.run([*cmd, "--once"], capture_output=True, text=True, timeout=120)


def dump(obj: object) -> str:
    return json.dumps(obj, indent=1, default=str)


def test_the_controller_gives_a_cluster_one_share_per_dataset(
    tmp_path: Path, members: list[Member], make_node
) -> None:
    big = make_dataset(tmp_path / "imagenet", files=16, size=3 * MiB)  # 48 MiB
    small = make_dataset(tmp_path / "wiki", files=4, size=2 * MiB)  # 8 MiB
    solo = make_node(CACHE, name="solo")
    for i, m in enumerate(members):
        m.mount(big, tmp_path / f"mnt-{i}-big", "--job", "dist")
    members[0].mount(small, tmp_path / "mnt-0-small", "--job", "local")
    solo.mount(big, tmp_path / "mnt-solo", "--job", "solo")
    config = write_config(tmp_path, members, solo, big, small)

    run = run_once(config)
    assert run.returncode == 0, f"controller failed:\n{run.stdout}\n{run.stderr}"
    # the table names the cluster once, with its members and the member pushed to
    assert "cluster test-cluster: one cache over n0, n1, n2" in run.stdout, run.stdout
    assert "pushed to n0" in run.stdout

    # One copy per cluster: the 48 MiB dataset whole and the 8 MiB one, in 96 MiB of
    # pooled cache; every member holds the same table (n0 passed it on) and a third of it.
    want = {big: 48 * MiB, small: 8 * MiB}

    def shares(node: Node) -> dict:
        return {u: s for u, s in node.status()["cluster"]["shares"].items() if u in want}

    for m in members:
        wait_for(lambda m=m: shares(m) == want, what=f"the shares on {m.socket}")
        status = m.status()
        for d in status["datasets"]:
            if d["uri"] in want:
                assert d["cluster_share"] == want[d["uri"]], dump(d)
                assert d["cluster_part"] == want[d["uri"]] // NODES, dump(d)
                assert d["cache_allocation"] is None  # nothing node-local
    # The lone node caches alone: an allocation of its own, within its 32 MiB.
    alone = {d["uri"]: d["cache_allocation"] for d in solo.status()["datasets"]}
    assert alone[big] is not None and 0 < alone[big] <= CACHE, dump(alone)
    assert solo.status()["cluster"] is None

    # dist's IO is split evenly over its three nodes
    rates = [
        next(j for j in m.status()["jobs"] if j["name"] == "dist")["io_allocation"] for m in members
    ]
    assert rates[0] is not None and len(set(rates)) == 1, rates

    # The next round finds nothing to change: no share is set again (each would make a
    # new version of the table).
    versions = [m.status()["cluster"]["allocations_version"] for m in members]
    assert len(set(versions)) == 1 and versions[0] > 0
    again = run_once(config)
    assert again.returncode == 0, again.stderr
    assert [m.status()["cluster"]["allocations_version"] for m in members] == versions
