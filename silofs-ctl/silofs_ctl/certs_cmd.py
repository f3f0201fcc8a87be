"""`silofs-ctl certs init` and `certs node`: a small CA for the controller's mutual TLS.

Owns: creating a private CA, the controller's client certificate (clientAuth only) and
each node daemon's certificate (serverAuth, and clientAuth for asking the other members
of its cluster, with its host names and addresses as subjectAltNames and the node role
marker, a URI subjectAltName `urn:silofs:role:node`), as PEM files with private keys
0600. The role is what keeps a node's certificate from acting as the controller on
other nodes: the daemon's TLS listener lets a certificate with the node role call the
peer routes of a cluster its names are members of, and nothing else. Never: installs
files on nodes, or reads a key it did not write.

Keys are ECDSA P-256. Certificates last `--days` (default 825); renew by running
`certs node` again (and `certs init --force` for a new CA, which every node must then
trust). Each CA's name is its own (a creation date and a random tag after "silofs
control CA"), and every certificate names its issuer's key (subject and authority key
identifiers): a rotation trusts the old and the new ca.pem in one bundle, and OpenSSL,
which looks an issuer up by name, finds the CA that signed each certificate. Two CAs of
one name in a bundle made every certificate of the second fail ("certificate signature
failure").
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import re
import secrets

import click

log = logging.getLogger(__name__)

CA = "ca"
CONTROLLER = "controller"


def _write(path: str, data: bytes, mode: int) -> None:
    """Create (or replace) ``path`` with ``mode`` from the start: a key never exists
    with the umask's mode, not even for a moment."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _key_pem(key: object) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_ca(directory: str) -> tuple[object, object]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        with open(os.path.join(directory, f"{CA}.pem"), "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        with open(os.path.join(directory, f"{CA}.key"), "rb") as f:
            key = serialization.load_pem_private_key(f.read(), None)
    except FileNotFoundError as exc:
        raise click.ClickException(
            f"no CA in {directory} ({exc.filename}): run `silofs-ctl certs init {directory}`"
        ) from None
    return cert, key


# The node role marker (silofs/control/tls.py NODE_ROLE_URI, which the daemon reads).
NODE_ROLE_URI = "urn:silofs:role:node"

# A certificate's name is a host name: it names the files NAME.pem and NAME.key in the
# CA's directory, so never a path, and never the CA's own.
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


def _check_name(name: str, what: str) -> str:
    if not _HOST.fullmatch(name) or ".." in name:
        raise click.BadParameter(f"{name!r} is not a host name (letters, digits, '.' and '-')",
                                 param_hint=what)  # fmt: skip
    if name.lower() == CA:
        raise click.BadParameter(f"{name!r} names the CA's own files", param_hint=what)
    return name


def _check_address(address: str) -> str:
    try:
        ipaddress.ip_address(address)
        return address
    except ValueError:
        return _check_name(address, "--address")


def _only_over_a_node(directory: str, name: str) -> None:
    """Refuse to replace NAME.pem unless it is a node's certificate: a controller's (a
    client certificate) replaced by a node's would lose the controller its routes."""
    from cryptography import x509

    path = os.path.join(directory, f"{name}.pem")
    try:
        with open(path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    except FileNotFoundError:
        return
    except (OSError, ValueError, x509.ExtensionNotFound):
        uris = []
    if NODE_ROLE_URI not in uris:
        raise click.ClickException(
            f"{path} exists and is not a node's certificate (the controller's?): "
            "choose another NAME"
        )


def _writing(directory: str, exc: OSError) -> click.ClickException:
    return click.ClickException(
        f"cannot write certificates in {directory}: {exc.strerror or exc}"
        + (f" ({exc.filename})" if exc.filename else "")
    )


def _sign(
    directory: str,
    name: str,
    *,
    server: bool,
    sans: list[str],
    days: int,
) -> tuple[str, str]:
    """A certificate for ``name`` signed by the CA in ``directory``: (cert path, key path)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import Encoding
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert, ca_key = _load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    issuer_key = x509.AuthorityKeyIdentifier.from_issuer_public_key(
        ca_cert.public_key()  # type: ignore[attr-defined]
    )
    now = datetime.datetime.now(datetime.UTC)
    alt: list[x509.GeneralName] = []
    for san in sans:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            alt.append(x509.DNSName(san))
    # A node serves (serverAuth) and asks the other members of its cluster (clientAuth,
    # with the node role); any other certificate is a client's (clientAuth only).
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if server:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        alt.append(x509.UniformResourceIdentifier(NODE_ROLE_URI))
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)  # type: ignore[attr-defined]
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=True)
        .add_extension(issuer_key, critical=False)
    )
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    cert_path = os.path.join(directory, f"{name}.pem")
    key_path = os.path.join(directory, f"{name}.key")
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, cert.public_bytes(Encoding.PEM), 0o644)
    return cert_path, key_path


def init_ca(directory: str, *, controller: str = CONTROLLER, days: int = 825) -> None:
    """A new CA (ca.pem, ca.key) and the controller's client certificate in
    ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import Encoding
    from cryptography.x509.oid import NameOID

    os.makedirs(directory, mode=0o700, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    # A name of its own: a bundle of the old and the new CA (a rotation) then holds two
    # issuers OpenSSL tells apart by name (module docstring).
    label = f"silofs control CA {now:%Y-%m-%d} {secrets.token_hex(4)}"
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write(os.path.join(directory, f"{CA}.key"), _key_pem(key), 0o600)
    _write(os.path.join(directory, f"{CA}.pem"), cert.public_bytes(Encoding.PEM), 0o644)
    _sign(directory, controller, server=False, sans=[], days=days)


def node_cert(directory: str, name: str, addresses: list[str], days: int = 825) -> tuple[str, str]:
    """A node daemon's certificate: CN and subjectAltNames ``name`` and each of
    ``addresses`` (host names or IP addresses the controller's and the other members'
    tls:// URIs use), serverAuth and clientAuth, and the node role."""
    sans = [name, *[a for a in addresses if a != name]]
    return _sign(directory, name, server=True, sans=sans, days=days)


def client_cert(directory: str, name: str, days: int = 825) -> tuple[str, str]:
    """Another client (clientAuth) certificate, e.g. a second controller or a test's."""
    return _sign(directory, name, server=False, sans=[], days=days)


@click.group("certs")
def certs() -> None:
    """A small CA for the controller's mutual TLS to node daemons (docs/SECURITY.md)."""


@certs.command("init")
@click.argument("directory")
@click.option("--controller", default=CONTROLLER, show_default=True, help="The client name.")
@click.option("--days", default=825, show_default=True, type=click.IntRange(1, 3650),
              help="Days the certificates are valid.")  # fmt: skip
@click.option("--force", is_flag=True, help="Replace an existing CA (every node must be redone).")
def init_cmd(directory: str, controller: str, days: int, force: bool) -> None:
    """Create DIRECTORY/ca.pem + ca.key and the controller's client certificate."""
    _check_name(controller, "--controller")
    if os.path.exists(os.path.join(directory, f"{CA}.key")) and not force:
        raise click.ClickException(f"{directory} already holds a CA (ca.key); --force replaces it")
    try:
        init_ca(directory, controller=controller, days=days)
    except OSError as exc:
        raise _writing(directory, exc) from None
    click.echo(
        f"CA and {controller}.pem/.key in {directory}; give each node "
        f"`silofs-ctl certs node {directory} NAME --address ADDR` and ca.pem"
    )


@certs.command("node")
@click.argument("directory")
@click.argument("name")
@click.option(
    "--address",
    "--san",
    "addresses",
    multiple=True,
    help="Another host name or IP address the controller and the other members reach the "
    "node at (repeatable): the host of its tls:// member address must be among them "
    "(default: none; NAME alone).",
)
@click.option("--days", default=825, show_default=True, type=click.IntRange(1, 3650),
              help="Days the certificate is valid.")  # fmt: skip
def node_cmd(directory: str, name: str, addresses: tuple[str, ...], days: int) -> None:
    """Create DIRECTORY/NAME.pem + NAME.key: a node daemon's certificate (its TLS
    listener's, and its own when it asks the other members of its cluster)."""
    _check_name(name, "NAME")
    for address in addresses:
        _check_address(address)
    _only_over_a_node(directory, name)
    try:
        cert, key = node_cert(directory, name, list(addresses), days)
    except OSError as exc:
        raise _writing(directory, exc) from None
    click.echo(
        f"{cert} and {key}: copy them with ca.pem to the node, and set [control] "
        "tls_cert, tls_key and tls_client_ca (= ca.pem) in its silofs.toml"
    )
