"""README "One cache across nodes", run as written: its `silofs-ctl certs` lines and its
silofs.toml block (read from README.md itself, so a change of the doc is tested) start
three node daemons on 127.0.0.1, the bucket on an S3-compatible store named the way the
README's table says (AWS_ENDPOINT_URL), then the section's commands: `allocate-cache`,
`silofs warm` on one node, `silofs-ctl cluster status` over TLS with $SILOFS_CTL_TLS.

Only what cannot be typed on one host is changed: /etc/silofs/pki is a temporary
directory, and each `tls://gpuNN:7470` (and `tcp_listen = "0.0.0.0:7470"`) becomes a
port of 127.0.0.1 (the node certificates name 127.0.0.1 with `--address`).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.fixtures import needs_fuse
from tests.support.net import free_ports
from tests.support.node import REPO, Node
from tests.support.poll import wait_for

SECTION = "### One cache across nodes"
CHUNK = 1 << 20


def _section_blocks(lang: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    start = text.index(SECTION)
    end = text.index("\n### ", start + len(SECTION))
    return re.findall(rf"```{lang}\n(.*?)```", text[start:end], re.S)


def _commands(block: str) -> list[str]:
    return [
        line.split("#", 1)[0].strip()
        for line in block.splitlines()
        if line.split("#", 1)[0].strip()
    ]


def _node_toml(block: str, pki: Path, i: int, ports: list[int]) -> str:
    """The README's block for node gpu0{i+1}: its certificate files and this host's ports."""
    name = f"gpu0{i + 1}"
    text = block.replace('address = "tls://gpu01:7470"', f'address = "tls://{name}:7470"')
    text = text.replace("/etc/silofs/pki/gpu01.", f"{pki}/{name}.")
    text = text.replace("/etc/silofs/pki/", f"{pki}/")
    text = text.replace('"0.0.0.0:7470"', f'"127.0.0.1:{ports[i]}"')
    for j, port in enumerate(ports):
        text = text.replace(f"tls://gpu0{j + 1}:7470", f"tls://127.0.0.1:{port}")
    return text


def _ctl_as_is(*args: str) -> subprocess.CompletedProcess:
    """`silofs-ctl ARGS` of this checkout, outside any node."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'silofs-ctl'}"}
    return subprocess.run(
        [sys.executable, "-m", "silofs_ctl", *args], env=env, capture_output=True, text=True
    )


def _ctl(node: Node, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "silofs_ctl", *args],
        capture_output=True,
        text=True,
        env={**node.env, **(env or {})},
        timeout=60,
    )


@needs_fuse
@pytest.mark.fuse
def test_readme_cluster_section_as_written(
    s3_server, bucket_name, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (certs,) = _section_blocks("sh")
    (block,) = _section_blocks("toml")
    parsed = tomllib.loads(block)
    assert set(parsed) == {"control", "cluster"}, "the README's block changed: update this test"
    assert len(parsed["cluster"]["members"]) == 3

    pki = tmp_path / "pki"
    lines = _commands(certs)
    assert [line.split()[:3] for line in lines] == [["silofs-ctl", "certs", "init"]] + [
        ["silofs-ctl", "certs", "node"]
    ], lines
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'silofs-ctl'}"}
    for line in lines:  # as written, but into the temporary directory
        argv = line.replace("/etc/silofs/pki", str(pki)).split()
        res = subprocess.run(
            [sys.executable, "-m", "silofs_ctl", *argv[1:]], env=env, capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr
    # "... gpu02, gpu03": every node's certificate, for the address it is reached at here
    for name in ("gpu01", "gpu02", "gpu03"):
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "silofs_ctl",
                "certs",
                "node",
                str(pki),
                name,
                "--address",
                "127.0.0.1",
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr

    # The store as the README's table names an S3-compatible one: AWS_ENDPOINT_URL, in the
    # environment of the daemons and of `silofs mount` alike.
    s3_server.apply_env(monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    # 48 small files and a shard of 13 chunks: 'every member holds some' below needs a
    # chunk placed at each, and placement hashes content ids of random bytes and the
    # members' ports (new each run): one of three was placed none of 37 chunks (24
    # files) in 3 * (2/3)**37 = 9e-7 of runs; of 61, 5e-11.
    tree = {f"train/x{i:02d}.jpg": os.urandom(150_000 + i) for i in range(48)}
    tree["train/shard.tar"] = os.urandom(12 * CHUNK + 5)
    s3_server.create(bucket_name, tree)

    ports = free_ports(3)
    nodes: list[Node] = []
    try:
        for i in range(3):
            root = tmp_path / f"node{i}"
            root.mkdir()
            config = root / "silofs.toml"
            config.write_text(_node_toml(block, pki, i, ports))
            node = Node(root, "64M", config=config, chunk_size="1M")
            nodes.append(node)
            node.start()
        ctl_env = {"SILOFS_CTL_TLS": str(pki)}
        for node in nodes:
            assert node.status()["cluster"]["name"] == "train-a"

        uri = f"s3://{bucket_name}/train/"
        mp = nodes[0].mount(uri, tmp_path / "imagenet", "--job", "resnet50")
        total = sum(len(v) for v in tree.values())
        res = _ctl(nodes[0], "allocate-cache", uri, "60M")
        assert res.returncode == 0, res.stderr
        res = nodes[0].run("warm", str(mp))
        assert res.returncode == 0, res.stderr
        assert "could not be placed" not in res.stderr + res.stdout

        # One cache across the nodes: each member holds its part of the dataset, fetched
        # once (a warm on node 0 alone before the endpoint from AWS_ENDPOINT_URL counted
        # as the nodes' default left the other two empty).
        cached = [n.status()["node"]["cached_bytes"] for n in nodes]
        assert all(c > 0 for c in cached), cached
        assert sum(cached) >= total

        # `cluster status` over TLS, as the section says (a node's tls:// address and
        # the controller's certificate in $SILOFS_CTL_TLS), and on the socket. Node 1
        # pinged node 2 while node 2 was still starting (nodes start one after the
        # other): refused, it is down for peer_backoff_seconds (1 s, doubling with each
        # refusal) and up at its next probe, which the warm above does not hasten (node 0
        # asked the homes, not node 1).
        wait_for(
            lambda: all(m["state"] == "up" for m in nodes[1].status()["cluster"]["members"]),
            timeout=60,
            what="node 1 to find its members up",
        )
        res = _ctl(
            nodes[0], "cluster", "status", "--nodes", f"tls://127.0.0.1:{ports[1]}", env=ctl_env
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout.count(" up:") == 2 and " self:" in res.stdout, res.stdout
        res = _ctl(nodes[0], "cluster", "status", "--nodes", nodes[0].socket)
        assert res.returncode == 0 and f"{uri}: share 60.0MiB" in res.stdout, res.stdout

        # Without the certificates, a tls:// node's refusal says what to set, in one line.
        res = _ctl(nodes[0], "cluster", "set", "--members", f"tls://127.0.0.1:{ports[0]}")
        assert res.returncode == 1
        assert res.stderr.count("\n") == 1 and "SILOFS_CTL_TLS" in res.stderr, res.stderr

        # Reads on node 0 get the right bytes, its misses served by the members.
        for key, data in tree.items():
            got = (mp / key.removeprefix("train/")).read_bytes()
            assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest(), key
        peers = wait_for(
            lambda: (
                (m := nodes[0].status()["cluster"]["members"])
                and sum(x["bytes_in"] for x in m) > 0
                and m
            ),
            what="peer traffic on node 0",
        )
        assert all(x["state"] == "up" for x in peers)
    finally:
        for node in nodes:
            node.cleanup()
    problems = [p for node in nodes for p in node.log_problems()]
    assert not problems, "\n".join(problems)
