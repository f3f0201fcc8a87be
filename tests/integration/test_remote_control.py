"""The controller reaching node daemons on other hosts over mutual TLS, with each host a
network namespace of this machine.

Three namespaces made by the test (root needed; skipped with the reason otherwise): the
controller's and two nodes', joined by veth pairs, no route anywhere else. Each node
runs a real `silofs daemon` inside its namespace with [control] tcp_listen on its veth
address and certificates from `silofs-ctl certs`. The controller runs inside its own
namespace, where the nodes' Unix sockets are of no use to it (it is given only
tls:// addresses), learns the jobs from the daemons' registrations, and pushes
allocations. A plaintext client and a foreign certificate get no answer, a node's
certificate used as a client gets 403 everywhere, and the daemons go on serving. The
test reads results through the daemons' Unix sockets (a filesystem path: the same in
every network namespace).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.fixtures import needs_fuse
from tests.support.net import NetnsUnavailable, Star, star
from tests.support.node import Node
from tests.support.trees import random_files, write_tree

pytestmark = [needs_fuse, pytest.mark.fuse]

PORT = 7470
MB = 10**6


@pytest.fixture
def netns() -> Iterator[Star]:
    """Namespaces "ctl", "n1", "n2"; veth ctl<->n1, ctl<->n2; removed after."""
    try:
        with star("ctl", ["n1", "n2"]) as namespaces:
            yield namespaces
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def cluster(
    tmp_path: Path, netns: Star
) -> Iterator[tuple[dict[str, Node], Path, Callable[..., subprocess.CompletedProcess]]]:
    """Two node daemons in their namespaces with TLS listeners, the PKI, and a function
    that runs a command in the controller's namespace."""
    pki = tmp_path / "pki"
    ctl = [sys.executable, "-m", "silofs_ctl"]
    for args in (
        ["certs", "init", str(pki)],
        ["certs", "node", str(pki), "n1", "--address", netns.address("n1")],
        ["certs", "node", str(pki), "n2", "--address", netns.address("n2")],
        ["certs", "init", str(tmp_path / "foreign")],
    ):
        res = subprocess.run([*ctl, *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
    nodes: dict[str, Node] = {}
    try:
        for role in ("n1", "n2"):
            root = tmp_path / role
            root.mkdir()
            conf = root / "silofs.toml"
            conf.write_text(
                textwrap.dedent(f"""\
                    [control]
                    tcp_listen = "{netns.address(role)}:{PORT}"
                    tls_cert = "{pki}/{role}.pem"
                    tls_key = "{pki}/{role}.key"
                    tls_client_ca = "{pki}/ca.pem"
                    tls_client_names = ["controller"]
                    tcp_max_connections = 8
                    tls_handshake_seconds = 5
                """)
            )
            nodes[role] = Node(root, config=conf, prefix=netns.exec_prefix(role))
            nodes[role].start()

        def in_ctl(*cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
            return netns.run("ctl", *cmd, timeout=timeout)

        yield nodes, tmp_path, in_ctl
    finally:
        for node in nodes.values():
            node.cleanup()
    problems = [p for node in nodes.values() for p in node.log_problems()]
    assert not problems, "\n".join(problems)


def _dataset(root: Path, name: str, files: int) -> Path:
    return write_tree(root / name, random_files(random.Random(), files, 256 << 10, "f{i}.bin"))


# Run inside the controller's namespace: what a network peer gets from a node's listener.
PROBE = """
import json, socket, ssl, sys
from silofs.control.client import ControlClient, ControlError, client_tls_context
host, pki, foreign = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
def attempt(key, ctx, method="GET", path="/v1/status", body=None):
    try:
        with ControlClient(f"tls://{host}:7470", timeout=10, tls=ctx) as c:
            ans = c.request(method, path, body)
            out[key] = ["ok", sorted(ans)[:3] if isinstance(ans, dict) else None]
    except ControlError as exc:
        out[key] = [exc.status, str(exc)]
with socket.create_connection((host, 7470), timeout=10) as s:
    s.sendall(b"GET /v1/status HTTP/1.1\\r\\nhost: x\\r\\n\\r\\n")
    got = b""
    try:
        while data := s.recv(65536):
            got += data
    except ConnectionResetError:
        pass
    out["plaintext"] = got.decode("latin-1")[:100]
good = client_tls_context(f"{pki}/controller.pem", f"{pki}/controller.key", f"{pki}/ca.pem")
attempt("foreign", client_tls_context(f"{foreign}/controller.pem", f"{foreign}/controller.key", f"{pki}/ca.pem"))
attempt("node-cert", client_tls_context(f"{pki}/n2.pem", f"{pki}/n2.key", f"{pki}/ca.pem"))
attempt("status", good)
attempt("chunks", good, "GET", "/v1/chunks?mount=x&key=f0.bin&index=0")
attempt("open", good, "POST", "/v1/datasets", {"uri": "/etc"})
attempt("mount", good, "POST", "/v1/mounts", {"dataset": "x", "job": "j"})
print(json.dumps(out))
"""  # noqa: E501


def test_controller_in_its_own_namespace_allocates_over_mutual_tls(cluster, netns: Star) -> None:  # type: ignore[no-untyped-def]
    nodes, tmp, in_ctl = cluster
    addr = {role: netns.address(role) for role in ("n1", "n2")}
    data = tmp / "data"
    data.mkdir()
    imagenet, wiki = _dataset(data, "imagenet", 8), _dataset(data, "wiki", 4)
    # What a Slurm prolog does on each node of a job: mount, then register the job.
    for role, ds, job, gpus, ideal in (
        ("n1", imagenet, "slurm-101", 4, "50MB/s"),
        ("n2", wiki, "slurm-102", 1, "20MB/s"),
    ):
        node = nodes[role]
        mp = node.mount(str(ds), tmp / f"mnt-{role}", "--job", job)
        assert (mp / "f0.bin").read_bytes() == (ds / "f0.bin").read_bytes()
        res = subprocess.run(
            [sys.executable, "-m", "silofs_ctl", "job", "register", job, "--gpus", str(gpus),
             "--ideal-io", ideal, "--dataset", str(ds), "--scheduler", "slurm",
             "--socket", node.socket],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr

    config = tmp / "controller.toml"
    config.write_text(
        textwrap.dedent(f"""\
            policy = "gavel"
            remote_io = "60MB/s"
            timeout = "10s"
            [[nodes]]
            name = "n1"
            address = "tls://{addr["n1"]}:{PORT}"
            [[nodes]]
            name = "n2"
            address = "tls://{addr["n2"]}:{PORT}"
            [tls]
            cert = "pki/controller.pem"
            key = "pki/controller.key"
            ca = "pki/ca.pem"
        """)
    )
    # The nodes' Unix sockets are not in the config: only TLS can reach them.
    res = in_ctl(sys.executable, "-m", "silofs_ctl", "controller", "run", "--config",
                 str(config), "--once")  # fmt: skip
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert "slurm-101" in res.stdout and "slurm-102" in res.stdout, res.stdout
    print(res.stdout)

    # The allocations landed on each node, within the link total (60 MB/s).
    io = {}
    for role, job in (("n1", "slurm-101"), ("n2", "slurm-102")):
        view = nodes[role].request("GET", f"/v1/jobs/{job}")
        assert view["registration"]["scheduler"] == "slurm"
        io[job] = view["io_allocation"]
    assert all(isinstance(v, int) and v > 0 for v in io.values()), io
    assert sum(io.values()) <= 60 * MB + 2, io
    allocs = nodes["n1"].request("GET", "/v1/allocations")
    assert any(k.endswith("imagenet/") or "imagenet" in k for k in allocs["cache"]), allocs

    # Peers that are not the controller get nothing; the controller gets admin routes only.
    res = in_ctl(sys.executable, "-c", PROBE, addr["n1"], str(tmp / "pki"),
                 str(tmp / "foreign"))  # fmt: skip
    assert res.returncode == 0, res.stderr
    probe = json.loads(res.stdout)
    print(json.dumps(probe, indent=1))
    assert "HTTP/1.1 200" not in probe["plaintext"]
    assert probe["foreign"][0] is None, probe["foreign"]  # no HTTP answer at all
    # A node's certificate (the node role) is never an admin: 403 (no cluster here).
    assert probe["node-cert"][0] == 403, probe["node-cert"]
    assert probe["status"][0] == "ok"
    for key in ("chunks", "open", "mount"):
        assert probe[key][0] in (404, 405), probe[key]

    # The daemons went on serving: over their sockets and to the controller again.
    for node in nodes.values():
        assert node.status()["jobs"]
    res = in_ctl(sys.executable, "-m", "silofs_ctl", "controller", "run", "--config",
                 str(config), "--once")  # fmt: skip
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"

    # An operator's one-node commands over TLS, with the certificates in $SILOFS_CTL_TLS.
    n1 = f"tls://{addr['n1']}:{PORT}"
    ctl_cmd = [sys.executable, "-m", "silofs_ctl"]
    res = in_ctl("env", "-u", "SILOFS_CTL_TLS", *ctl_cmd, "status", "--socket", n1)
    assert res.returncode == 1 and "SILOFS_CTL_TLS" in res.stderr, res.stderr
    tls_env = f"SILOFS_CTL_TLS={tmp / 'pki'}"
    res = in_ctl("env", tls_env, *ctl_cmd, "allocate-io", "slurm-101", "5MB/s", "--socket", n1)
    assert res.returncode == 0, res.stderr
    assert nodes["n1"].request("GET", "/v1/jobs/slurm-101/io")["bytes_per_s"] == 5 * MB
    res = in_ctl("env", tls_env, *ctl_cmd, "status", "--socket", n1)
    assert res.returncode == 0 and "slurm-101" in res.stdout, res.stderr

    # A node down (its daemon stopped) is reported, the other still updated.
    nodes["n2"].stop()
    res = in_ctl(sys.executable, "-m", "silofs_ctl", "controller", "run", "--config",
                 str(config), "--once")  # fmt: skip
    assert res.returncode == 1 and "n2" in res.stdout + res.stderr
