"""`silofs-ctl cluster` (silofs_ctl/cluster_cmd.py): the members Slurm reports, the body
pushed to every node, and one line for what is typed wrong."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from silofs_ctl.cluster_cmd import members_body, slurm_nodes
from silofs_ctl.slurm import SlurmError


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_members_from_scontrols_json(tmp_path: Path) -> None:
    doc = {"nodes": [{"name": "gpu02"}, {"name": "gpu01"}, {"name": "gpu01"}, {"x": 1}]}
    scontrol = script(tmp_path, "scontrol", f"echo '{json.dumps(doc)}'")
    assert slurm_nodes(scontrol, "/nonexistent") == ["gpu01", "gpu02"]


def test_members_from_sinfo_when_scontrol_has_no_json(tmp_path: Path) -> None:
    scontrol = script(tmp_path, "scontrol", "echo 'invalid option --json' >&2; exit 1")
    sinfo = script(tmp_path, "sinfo", "echo 'gpu[01-03]'; echo gpu02; echo cpu7")
    assert slurm_nodes(scontrol, sinfo) == ["cpu7", "gpu01", "gpu02", "gpu03"]
    empty = script(tmp_path, "sinfo2", "true")
    with pytest.raises(SlurmError, match="no nodes"):
        slurm_nodes(scontrol, empty)


def test_members_of_a_partition_only(tmp_path: Path) -> None:
    # A Slurm cluster's GPU nodes run silofs, its CPU and login nodes do not: every
    # node made a member left those down for ever, each holding its part of a share.
    doc = {
        "nodes": [
            {"name": "gpu01", "partitions": ["gpu", "all"]},
            {"name": "gpu02", "partitions": ["gpu"]},
            {"name": "cpu7", "partitions": ["cpu", "all"]},
            {"name": "login1", "partitions": None},
        ]
    }
    scontrol = script(tmp_path, "scontrol", f"echo '{json.dumps(doc)}'")
    assert slurm_nodes(scontrol, "/nonexistent", ["gpu"]) == ["gpu01", "gpu02"]
    assert slurm_nodes(scontrol, "/nonexistent", ["gpu", "cpu"]) == ["cpu7", "gpu01", "gpu02"]
    assert len(slurm_nodes(scontrol, "/nonexistent")) == 4
    with pytest.raises(SlurmError, match="no node in partition gpus"):
        slurm_nodes(scontrol, "/nonexistent", ["gpus"])  # a typo: one line, no empty list
    # sinfo (no --json) is asked for the partition's nodes.
    old = script(tmp_path, "scontrol-old", "exit 1")
    sinfo = script(
        tmp_path, "sinfo", 'if [ "$5" = -p ] && [ "$6" = gpu ]; then echo "gpu[01-02]"; fi'
    )
    assert slurm_nodes(old, sinfo, ["gpu"]) == ["gpu01", "gpu02"]
    with pytest.raises(SlurmError, match="no nodes in partition cpu"):
        slurm_nodes(old, sinfo, ["cpu"])


def test_the_pushed_body_names_every_member_with_one_version() -> None:
    body = members_body("c", ["tls://a:1", "tls://b:1"], {"tls://b:1": 2.0}, 42)
    assert body == {
        "name": "c",
        "version": 42,
        "members": ["tls://a:1", {"address": "tls://b:1", "weight": 2.0}],
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cluster", "set", "--name", "c"], "--members or --from-slurm"),
        (["cluster", "set", "--members", "tls://a:1", "--from-slurm"], "one of them"),
        (["cluster", "set", "--members", "tls://a:1", "--partition", "gpu"], "--from-slurm"),
        (["cluster", "set", "--members", "tls://a:1", "--weight", "x"], "ADDRESS=WEIGHT"),
        # Judged here as every node would, before any is sent.
        (
            ["cluster", "set", "--members", "tls://a:1", "--weight", "tls://b:1=2"],
            "not one of the members",
        ),  # fmt: skip
        (["cluster", "set", "--name", "c", "--members", "tls://a:1,tls://A:1"], "listed twice"),
        (["cluster", "set", "--members", "tls://a:99999"], "bad node address"),
        (["cluster", "set", "--members", "a:1"], "tls://HOST:PORT"),
        (["cluster", "set", "--members", "tls://a:1", "--name", "a b"], "name must be"),
        (["cluster", "status"], "--nodes"),
    ],
)
def test_mistakes_are_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    import subprocess

    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", *args, "--nodes", str(tmp_path / "no.sock")]
        if args[1] == "set"
        else [sys.executable, "-m", "silofs_ctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_an_unreachable_node_is_named_and_fails_the_command(tmp_path: Path) -> None:
    import subprocess

    sock = str(tmp_path / "no.sock")
    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "cluster", "set", "--name", "c",
         "--members", "tls://a:1", "--nodes", sock],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 1
    assert f"{sock}: cannot reach" in res.stderr
    assert "1 of 1 node did not take the list" in res.stderr


@pytest.mark.parametrize(("down", "said"), [(1, "1 node did"), (2, "2 nodes did")])
def test_status_counts_the_nodes_that_did_not_answer_in_words(
    tmp_path: Path, down: int, said: str
) -> None:
    import subprocess

    nodes = ",".join(str(tmp_path / f"no{i}.sock") for i in range(down))
    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "cluster", "status", "--nodes", nodes],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 1
    assert res.stderr.splitlines()[-1] == f"silofs-ctl: error: {said} not answer", res.stderr
