"""The certificates and the silofs.toml of an N-node cluster on this host.

Owns what a test (or bench/cluster.py) needs to start N node daemons that form one
cluster: a CA with `silofs-ctl certs`' own helpers, a node certificate per member (for
the address it listens on, with the node role), a controller's certificate, a
certificate with the node role that names no member (a stranger), an old-style
serverAuth-only node certificate (made before clusters) or an expired one on request
(odd_node_cert), and per node a silofs.toml with [control] (the mutual-TLS listener)
and [cluster] (every member, this one's address, the peer settings). Never starts a
process.

    nodes = write_cluster(tmp_path, ["127.0.0.1"] * 3, ports=free_ports(3),
                          extra={"backend": {"endpoint_url": proxy.url}})
    nodes[0].config        # Path of node 0's silofs.toml
    nodes[0].address       # "tls://127.0.0.1:PORT", its member address
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from silofs_ctl.certs_cmd import client_cert, init_ca, node_cert


@dataclass
class ClusterNode:
    name: str
    host: str
    port: int
    root: Path  # its directory: silofs.toml, and room for its cache and socket
    config: Path

    @property
    def address(self) -> str:
        return f"tls://{self.host}:{self.port}"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(type(value))


def make_pki(directory: Path, hosts: list[str]) -> Path:
    """A CA in `directory` with a controller, node certificates n0.. for `hosts`, a
    stranger (node role, a name no member has), an old-style node certificate."""
    init_ca(str(directory))
    for i, host in enumerate(hosts):
        node_cert(str(directory), f"n{i}", [host])
    node_cert(str(directory), "stranger", ["10.255.255.1"])
    client_cert(str(directory), "other-client")
    legacy_node_cert(directory, "legacy", hosts[0] if hosts else "127.0.0.1")
    return directory


def write_cluster(
    root: Path,
    hosts: list[str],
    ports: list[int],
    *,
    name: str = "test-cluster",
    weights: list[float] | None = None,
    cluster: dict[str, Any] | None = None,
    extra: dict[str, dict[str, Any]] | None = None,
    pki: Path | None = None,
) -> list[ClusterNode]:
    """The PKI (root/pki, unless given) and one directory with a silofs.toml per node.
    `cluster` adds keys to [cluster] (peer_timeout_seconds, ...); `extra` adds sections
    or keys ({"backend": {"endpoint_url": ...}, "control": {...}})."""
    pki = pki or make_pki(root / "pki", hosts)
    weights = weights or [1.0] * len(hosts)
    members = [
        {"address": f"tls://{h}:{p}", "weight": w}
        for h, p, w in zip(hosts, ports, weights, strict=True)
    ]
    nodes = []
    for i, (host, port) in enumerate(zip(hosts, ports, strict=True)):
        node_root = root / f"n{i}"
        node_root.mkdir(parents=True, exist_ok=True)
        sections: dict[str, dict[str, Any]] = {
            "control": {
                "tcp_listen": f"{host}:{port}",
                "tls_cert": str(pki / f"n{i}.pem"),
                "tls_key": str(pki / f"n{i}.key"),
                "tls_client_ca": str(pki / "ca.pem"),
                "tls_client_names": ["controller"],
            },
            "cluster": {
                "name": name,
                "address": f"tls://{host}:{port}",
                "members": members,
                **(cluster or {}),
            },
        }
        for section, keys in (extra or {}).items():
            sections.setdefault(section, {}).update(keys)
        text = "".join(
            f"[{section}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in keys.items()) + "\n"
            for section, keys in sections.items()
        )
        config = node_root / "silofs.toml"
        config.write_text(text)
        nodes.append(ClusterNode(f"n{i}", host, port, node_root, config))
    return nodes


def legacy_node_cert(directory: Path, name: str, host: str) -> None:
    """A node certificate as `silofs-ctl certs node` made it before clusters: serverAuth
    only, no node role."""
    odd_node_cert(directory, name, host, legacy=True)


def odd_node_cert(
    directory: Path,
    name: str,
    host: str,
    *,
    legacy: bool = False,
    expired: bool = False,
    future: bool = False,
) -> None:
    """A certificate of the CA in `directory` for `host`, as `silofs-ctl certs node`
    never makes one now: `legacy`, serverAuth only and no node role (as it made them
    before clusters); `expired`, a node certificate (both usages, the role) that expired
    yesterday; `future`, one valid only from tomorrow on."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    try:
        names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(host))]
    except ValueError:
        names = [x509.DNSName(host)]
    usage = [ExtendedKeyUsageOID.SERVER_AUTH]
    if not legacy:
        usage.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        names.append(x509.UniformResourceIdentifier("urn:silofs:role:node"))
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=30)
    if expired:
        start, end = now - datetime.timedelta(days=10), now - datetime.timedelta(days=1)
    if future:
        start, end = now + datetime.timedelta(days=1), now + datetime.timedelta(days=10)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(directory / f"{name}.key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
