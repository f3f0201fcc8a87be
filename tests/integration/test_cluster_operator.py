"""A cluster set up by an operator who gets it wrong (README "One cache across nodes"):
real daemons on 127.0.0.1 with real TLS, each mistake either refused at the daemon's
start with one line saying what is wrong and what to do, or said by the nodes, never a
cluster that starts as if all were well while its members refuse each other.

- a node certificate of another cluster's CA (tls_cert from another `certs init`
  directory than tls_client_ca);
- a node certificate for another host than the member this node is ([cluster]
  address set, the certificate copied from another node);
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.cluster import make_pki, write_cluster
from tests.support.net import free_ports
from tests.support.node import silofs_cmd

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
        out, _ = proc.communicate(timeout=30)
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
