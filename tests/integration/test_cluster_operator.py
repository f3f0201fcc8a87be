"""A cluster set up by an operator who gets it wrong (README "One cache across nodes"):
real daemons on 127.0.0.1 with real TLS, each mistake either refused at the daemon's
start with one line saying what is wrong and what to do, or said by the nodes, never a
cluster that starts as if all were well while its members refuse each other.

- a node certificate of another cluster's CA (tls_cert from another `certs init`
  directory than tls_client_ca);
- a node certificate for another host than the member this node is ([cluster]
  address set, the certificate copied from another node);
- a key of another node's certificate, a key or CA file missing: the same line as a
  node without [cluster] gives, naming the file (OpenSSL's words named none);
- members written without a port while tcp_listen is on another than 7470;
- an IPv6 member written without brackets (its last group read as the port);
- `silofs-ctl cluster set --nodes` naming one node only: the nodes place chunks by two
  lists; `cluster set` says it reached 1 of 3 members, and each node's status and log
  name the members whose list differs until the same list reaches them.
- `allocate-cache` of a share larger than the cluster's caches: one line with the most
  it can be; a share set on one node is shown by `cluster status` on every other.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import make_pki, write_cluster
from tests.support.cluster_run import ClusterDaemon
from tests.support.net import free_ports
from tests.support.node import silofs_cmd
from tests.support.poll import wait_for

START_BOUND = 60.0  # a daemon that refuses its config exits long before this


def _start(root: Path, config: Path) -> tuple[int | None, str]:
    """Start `silofs daemon --config config`: (its exit status, its output) if it exits
    within START_BOUND, else (None, its output so far) after stopping it."""
    argv = silofs_cmd(
        "daemon", "--socket", str(root / "ctl.sock"), "--cache-dir", str(root / "cache"),
        "--cache-size", "64M", "--config", str(config),
    )  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root,
        env={**_env(root)},
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=START_BOUND)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # no daemon outlives the test, stuck or not
            proc.kill()
            out, _ = proc.communicate()
        return None, out


def _env(root: Path) -> dict[str, str]:
    import os

    from tests.support.node import REPO

    return {
        **os.environ,
        "SILOFS_LOG_DIR": str(root / "logs"),
        "PYTHONPATH": f"{REPO}:{REPO / 'silofs-ctl'}",
    }


def _one_error_line(out: str) -> str:
    lines = [line for line in out.splitlines() if "silofs: error:" in line]
    assert len(lines) == 1, out
    assert "Traceback" not in out, out
    return lines[0]


def test_a_node_certificate_of_another_clusters_ca_stops_the_start_in_one_line(
    tmp_path: Path,
) -> None:
    ports = free_ports(3)
    nodes = write_cluster(tmp_path, ["127.0.0.1"] * 3, ports)
    # The operator made gpu02's certificate in another cluster's directory: same name,
    # same address, node role, but another CA than the cluster's tls_client_ca.
    other = make_pki(tmp_path / "other-pki", ["127.0.0.1"] * 3)
    text = nodes[1].config.read_text()
    text = text.replace(str(tmp_path / "pki" / "n1."), str(other / "n1."))
    assert str(other / "n1.pem") in text
    nodes[1].config.write_text(text)
    status, out = _start(nodes[1].root, nodes[1].config)
    assert status == 2, f"the daemon started with another CA's certificate: {out[-2000:]}"
    line = _one_error_line(out)
    assert "not issued by the CA in tls_client_ca" in line and "certs node" in line, line


def test_a_node_certificate_for_another_host_stops_the_start_in_one_line(
    tmp_path: Path,
) -> None:
    ports = free_ports(3)
    # Node n2's certificate names 127.0.0.9 (another node's), its member address is
    # 127.0.0.1: every member checking the host it connects to refuses it.
    nodes = write_cluster(tmp_path, ["127.0.0.1", "127.0.0.1", "127.0.0.9"], ports)
    text = nodes[1].config.read_text()
    text = text.replace(str(tmp_path / "pki" / "n1."), str(tmp_path / "pki" / "n2."))
    nodes[1].config.write_text(text)
    status, out = _start(nodes[1].root, nodes[1].config)
    assert status == 2, f"the daemon started with another host's certificate: {out[-2000:]}"
    line = _one_error_line(out)
    assert "is not for 127.0.0.1" in line and "--address 127.0.0.1" in line, line


@pytest.mark.parametrize("mistake", ["other-key", "no-key", "no-ca"])
def test_a_node_key_or_ca_file_wrong_names_it_in_one_line(tmp_path: Path, mistake: str) -> None:
    nodes = write_cluster(tmp_path, ["127.0.0.1"] * 2, free_ports(2))
    pki = tmp_path / "pki"
    text = nodes[0].config.read_text()
    if mistake == "other-key":  # gpu02's key copied beside gpu01's certificate
        text = text.replace(f'"{pki}/n0.key"', f'"{pki}/n1.key"')
        want = f"{pki}/n1.key is not the key of {pki}/n0.pem"
    elif mistake == "no-key":
        text = text.replace(f'"{pki}/n0.key"', f'"{pki}/gpu01.key"')
        want = f"{pki}/gpu01.key: No such file or directory"
    else:
        text = text.replace(f'"{pki}/ca.pem"', f'"{pki}/cluster-ca.pem"')
        want = f"tls_client_ca: cannot load {pki}/cluster-ca.pem: No such file or directory"
    nodes[0].config.write_text(text)
    status, out = _start(nodes[0].root, nodes[0].config)
    assert status == 2, f"the daemon started: {out[-2000:]}"
    line = _one_error_line(out)
    assert want in line, line


def test_members_without_a_port_say_theirs_is_7470(tmp_path: Path) -> None:
    ports = free_ports(2)
    nodes = write_cluster(tmp_path, ["127.0.0.1", "127.0.0.2"], ports)
    text = nodes[0].config.read_text()
    for host, port in (("127.0.0.1", ports[0]), ("127.0.0.2", ports[1])):
        text = text.replace(f'"tls://{host}:{port}", weight', f'"tls://{host}", weight')
    text = text.replace(f'address = "tls://127.0.0.1:{ports[0]}"\n', "")
    assert f"tls://127.0.0.1:{ports[0]}" not in text.split("[cluster]")[1], text
    nodes[0].config.write_text(text)
    status, out = _start(nodes[0].root, nodes[0].config)
    assert status == 2, f"the daemon started: {out[-2000:]}"
    line = _one_error_line(out)
    assert f"without a port is on 7470: write tls://HOST:{ports[0]}" in line, line


def test_an_ipv6_member_without_brackets_stops_the_start_in_one_line(tmp_path: Path) -> None:
    ports = free_ports(2)
    nodes = write_cluster(tmp_path, ["127.0.0.1"] * 2, ports)
    # fd00::1:2 meant with the default port: it was taken as [fd00::1] port 2, a member
    # no one runs, down for ever and holding its part of every share.
    text = nodes[0].config.read_text()
    member = f'{{ address = "tls://127.0.0.1:{ports[1]}", weight = 1.0 }}'
    text = text.replace(member, '"tls://fd00::1:2"')
    assert "fd00::1:2" in text, text
    nodes[0].config.write_text(text)
    status, out = _start(nodes[0].root, nodes[0].config)
    assert status == 2, f"the daemon started: {out[-2000:]}"
    line = _one_error_line(out)
    assert "in brackets" in line and "tls://[fd00::1]:7470" in line, line


@pytest.fixture
def three(tmp_path: Path) -> Iterator[list[ClusterDaemon]]:
    """Three daemons of one cluster on 127.0.0.1 (no store: member lists only), each
    counting every member up."""
    specs = write_cluster(
        tmp_path, ["127.0.0.1"] * 3, free_ports(3),
        cluster={"peer_timeout_seconds": 1.0, "peer_backoff_seconds": 0.5},
    )  # fmt: skip
    nodes = [ClusterDaemon(spec) for spec in specs]
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            wait_for(
                lambda n=node: all(m["state"] == "up" for m in n.cluster()["members"]),
                timeout=60,
                what="every member up",
            )
        yield nodes
    finally:
        for node in nodes:
            node.cleanup()


def _ctl(node: ClusterDaemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "silofs_ctl", *args],
        capture_output=True, text=True, env=node.env, timeout=60,
    )  # fmt: skip


def _other_lists(node: ClusterDaemon) -> dict[str, dict | None]:
    return {m["address"]: m.get("other_list") for m in node.cluster()["members"] if not m["self"]}


def test_a_member_list_pushed_to_one_node_only_is_said_by_the_push_and_the_nodes(
    three: list[ClusterDaemon],
) -> None:
    a = [n.spec.address for n in three]
    assert all(v is None for n in three for v in _other_lists(n).values())
    # The operator runs `cluster set` on gpu01 against its own socket: the list (gpu03
    # weighted 2, its cache being twice the others') reaches that node only.
    res = _ctl(three[0], "cluster", "set", "--nodes", three[0].socket,
               "--members", ",".join(a), "--weight", f"{a[2]}=2")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "pushed to 1 node of 3 members" in res.stderr, res.stderr
    assert "leave out --nodes" in res.stderr, res.stderr
    # Both sides see it at their next ping of the other (every PING_SECONDS, 5 s).
    wait_for(
        lambda: (
            all(_other_lists(three[0]).values())
            and _other_lists(three[1])[a[0]] is not None
            and _other_lists(three[2])[a[0]] is not None
        ),
        timeout=30,
        what="the nodes to find their member lists differ",
    )
    assert _other_lists(three[1])[a[2]] is None  # those two still agree
    assert _other_lists(three[0])[a[1]]["members"] == 3, _other_lists(three[0])
    res = _ctl(three[0], "cluster", "status", "--nodes", three[0].socket)
    assert res.returncode == 0 and res.stdout.count("another member list") == 2, res.stdout
    # ... and each log says it once, with what to do, when a second ping finds it still.
    log = three[0].logs / "daemon.log"
    wait_for(
        lambda: log.read_text().count("places chunks by another member list") == 2,
        timeout=30,
        what="node 0's warnings",
    )
    assert "without --nodes" in log.read_text()
    # The list pushed to every member: they agree again, and say so.
    res = _ctl(three[0], "cluster", "set", "--nodes", ",".join(n.socket for n in three),
               "--members", ",".join(a), "--weight", f"{a[2]}=2")  # fmt: skip
    assert res.returncode == 0 and "note:" not in res.stderr, res.stderr
    wait_for(
        lambda: all(v is None for n in three for v in _other_lists(n).values()),
        timeout=30,
        what="the nodes to agree again",
    )
    res = _ctl(three[0], "cluster", "status", "--nodes", three[0].socket)
    assert "another member list" not in res.stdout, res.stdout


def test_a_share_beyond_the_clusters_caches_says_the_most_and_shows_on_every_node(
    three: list[ClusterDaemon],
) -> None:
    uri = "s3://bkt/train/"
    # 3 members of 64 MiB, weight 1 each: a share holds 192 MiB at most.
    res = _ctl(three[0], "allocate-cache", "--create", uri, "1G")
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert "at most 192.0MiB" in res.stderr and "341.3MiB" in res.stderr, res.stderr
    assert all(not n.cluster()["datasets"] for n in three)  # nothing set anywhere
    res = _ctl(three[0], "allocate-cache", "--create", uri, "150M")
    assert res.returncode == 0, res.stderr
    # Read on another node, which has not opened the dataset: the share and its part.
    for n in three[1:]:
        wait_for(
            lambda n=n: (
                (r := _ctl(n, "cluster", "status", "--nodes", n.socket)).returncode == 0
                and f"{uri}: share 150.0MiB, part 50.0MiB" in r.stdout
                and r
            ),
            timeout=30,
            what="the share in cluster status",
        )
