"""Mutual TLS for the control API's optional TCP listener (remote controllers).

Owns: the server's SSLContext (TLS 1.2 at least, a client certificate required and
checked against the configured CA, for client authentication), the name a verified
client certificate proves (its subject CN), the checks of a process's own
certificate (its dates) and key (no other user may read it), and the TCP address grammar
("HOST:PORT", "[V6]:PORT", ":PORT"). Never: accepts a connection, maps a certificate
to a local uid (a remote peer only ever has the admin role: control/peer.py), or
creates keys and certificates (`silofs-ctl certs` does).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import re
import ssl
import stat
from typing import Any

from silofs.errors import UsageError
from silofs.units import is_digits

log = logging.getLogger(__name__)

DEFAULT_PORT = 7470


def parse_tcp_address(text: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT", "[V6]:PORT" or ":PORT" (all interfaces: "0.0.0.0");
    UsageError naming the value otherwise."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not is_digits(port_text) or not 0 < int(port_text) < 65536:
        raise UsageError(f"tcp_listen must be HOST:PORT, like 0.0.0.0:7470, not {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise UsageError(f"tcp_listen: write an IPv6 address in brackets, like [::]:7470: {text!r}")
    return host or "0.0.0.0", int(port_text)


TLS_PREFIX = "tls://"


def parse_tls_url(address: str) -> tuple[str, int]:
    """(host, port) of "tls://HOST:PORT" or "tls://[V6]:PORT" (port default 7470; the
    scheme may be left out); ValueError with one line otherwise. The host is lower-cased
    (DNS names are not case-sensitive; a certificate's names are compared to it)."""
    rest = address[len(TLS_PREFIX) :] if address.startswith(TLS_PREFIX) else address
    host, port = rest, str(DEFAULT_PORT)
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        if tail:
            if not tail.startswith(":"):
                raise ValueError(f"bad node address {address!r}: want tls://HOST:PORT")
            port = tail[1:]
    elif rest.count(":") > 1:
        # An IPv6 address without brackets: its last group reads as a port, or not
        # (tls://fd00::1:2 was [fd00::1] port 2 to us, fd00::1:2 port 7470 to whoever
        # wrote it). tcp_listen refuses it so too.
        raise ValueError(
            f"bad node address {address!r}: write an IPv6 address in brackets, like "
            "tls://[fd00::1]:7470"
        )
    elif ":" in rest:
        host, _, port = rest.rpartition(":")
    if not _is_host(host, bracketed=rest.startswith("[")):
        raise ValueError(
            f"bad node address {address!r}: want tls://HOST:PORT, HOST a host name "
            "(letters, digits, '.' and '-') or an IP address"
        )
    if not is_digits(port) or not 0 < int(port) < 65536:
        raise ValueError(f"bad node address {address!r}: want tls://HOST:PORT")
    try:  # one spelling per address: [0:0::1] is [::1] (a member listed twice, else)
        return ipaddress.ip_address(host).compressed, int(port)
    except ValueError:
        return host.lower(), int(port)


# A host name as certificates name nodes (silofs-ctl certs): letters, digits, '.' and '-'.
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


def _is_host(host: str, bracketed: bool) -> bool:
    """A name a connection and a certificate can both mean: an IP address ([IPv6] in
    brackets), or a host name; never one with spaces, control characters, '@' or '/'."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        # A name whose last label is all digits is no host name (RFC 1123) but an IPv4
        # address the resolver reads its own way: 010.0.0.1 is 8.0.0.1 (octal), 127.1
        # is 127.0.0.1. Written so, a member was another host than the one meant.
        last = host.rsplit(".", 1)[-1]
        return (
            not bracketed
            and bool(_HOST_NAME.fullmatch(host))
            and ".." not in host
            and not is_digits(last)
        )
    return not bracketed or addr.version == 6


def tls_url(host: str, port: int) -> str:
    """The canonical "tls://HOST:PORT" (brackets around an IPv6 address)."""
    return f"{TLS_PREFIX}[{host}]:{port}" if ":" in host else f"{TLS_PREFIX}{host}:{port}"


# sun_path holds 108 bytes, its terminating NUL included (unix(7)).
UNIX_PATH_MAX = 107


def socket_path_too_long(socket_path: str) -> str | None:
    """The one-line complaint about a control address that is a Unix socket's path no
    Unix socket can have (Python says only "AF_UNIX path too long", with no errno), else
    None."""
    size = len(os.fsencode(socket_path))
    if size <= UNIX_PATH_MAX or socket_path.startswith(TLS_PREFIX):
        return None
    return (
        f"control socket path {socket_path} is {size} bytes: a Unix socket's path holds "
        f"at most {UNIX_PATH_MAX}; choose a shorter --socket"
    )


def server_context(cert: str, key: str, client_ca: str) -> ssl.SSLContext:
    """The listener's context: our certificate and key, and every client must present a
    certificate issued by ``client_ca`` for client authentication (OpenSSL checks the
    chain, the validity dates and the clientAuth purpose: a node's serverAuth-only
    certificate from the same CA is refused as a client). UsageError naming the file
    when one cannot be loaded."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    # No session tickets: a resumed session would skip the certificate check we log
    # and count; a controller connects a few times a minute, a full handshake is cheap.
    # (TLS 1.3 sends its tickets after the handshake: num_tickets = 0 sends none, so an
    # idle keep-alive connection is never readable on the client's side either.)
    ctx.options |= ssl.OP_NO_TICKET
    ctx.num_tickets = 0
    if problem := key_file_problem(key):
        raise UsageError(f"tls_key: {problem}")
    try:
        ctx.load_cert_chain(cert, key, password=NO_PASSPHRASE)
    except (OSError, ssl.SSLError) as exc:
        why = chain_load_problem(cert, key, exc)
        raise UsageError(f"tls_cert/tls_key: cannot load {cert} / {key}: {why}") from None
    try:
        ctx.load_verify_locations(cafile=client_ca)
    except (OSError, ssl.SSLError) as exc:
        why = ca_load_problem(client_ca, exc)
        raise UsageError(f"tls_client_ca: cannot load {client_ca}: {why}") from None
    if dates := certificate_dates_problem(cert):
        # Not a refusal to start: the mounts and the local socket do not need it, and a
        # certificate that expires while the daemon runs is served the same way. Said
        # here because nothing else would: the clients refuse it, the daemon only sees
        # connections closed.
        log.error(
            "tls_cert %s %s: controllers and cluster members refuse this node until it "
            "has a new one (`silofs-ctl certs node`, then a restart); the mounts are "
            "served as ever",
            cert,
            dates,
        )
    return ctx


def certificate_dates_problem(path: str, now: datetime.datetime | None = None) -> str | None:
    """What is wrong with the validity dates of the certificate in `path`, this
    process's own: "expired on ..." or "is not valid before ..." (UTC); None when they
    hold, or when the file cannot be read as PEM (loading it says why)."""
    from cryptography import x509

    try:
        with open(path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError):
        return None
    now = now or datetime.datetime.now(datetime.UTC)
    if now > cert.not_valid_after_utc:
        return f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    if now < cert.not_valid_before_utc:
        return (
            f"is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC "
            "(is this host's clock right?)"
        )
    return None


# Bits of a private key's mode that let other users read or change it (the group may
# read it: a deployment's ssl-cert group, say).
_KEY_OPEN_BITS = 0o027


def key_file_problem(path: str) -> str | None:
    """One line when the private key in `path` may be read or written by other users
    (as ssh and PostgreSQL refuse such keys: a local user who reads a node's key is a
    cluster member to every other node, one who reads the controller's an admin of
    every node); None otherwise, or when it cannot be stat'ed (loading it says why)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None
    if not mode & _KEY_OPEN_BITS:
        return None
    return f"{path} may be read or written by other users (mode {mode:04o}): chmod 600 {path}"


# The role marker of a node daemon's certificate (a URI subjectAltName that `silofs-ctl
# certs node` writes): such a certificate may call the peer routes of the cluster its
# names are members of, and nothing else. A controller's certificate has none.
NODE_ROLE_URI = "urn:silofs:role:node"


def certificate_identity(tls: Any) -> tuple[str | None, frozenset[str], bool]:
    """(subject CN, its DNS and IP subjectAltNames, whether it carries the node role) of
    the verified peer certificate of an SSLSocket, SSLObject or trio SSLStream."""
    cert = tls.getpeercert()
    if not cert:
        return None, frozenset(), False
    names = frozenset(
        str(v) for k, v in cert.get("subjectAltName", ()) if k in ("DNS", "IP Address")
    )
    node = any(k == "URI" and v == NODE_ROLE_URI for k, v in cert.get("subjectAltName", ()))
    return certificate_name(tls), names, node


def certificate_name(tls: Any) -> str | None:
    """The subject CN of the verified peer certificate of an SSLObject or trio SSLStream
    (None without one)."""
    cert = tls.getpeercert()
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


# load_cert_chain's password for every key silofs loads (daemon, members, controller):
# an empty passphrase, never a prompt. Without a password OpenSSL asks for an encrypted
# key's passphrase on the terminal, and a daemon's start waited for it; such a key then
# fails to load, and chain_load_problem says it is encrypted.
NO_PASSPHRASE = b""


def chain_load_problem(cert: str, key: str, exc: BaseException) -> str:
    """Why SSLContext.load_cert_chain(cert, key) failed, in words an operator acts on:
    OpenSSL says only "PEM lib" for a certificate or a key that is not PEM, and for an
    encrypted key."""
    if not isinstance(exc, ssl.SSLError):
        return _reason(exc)
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        with open(cert, "rb") as f:
            x509.load_pem_x509_certificate(f.read())
    except OSError as err:
        return f"{cert}: {_reason(err)}"
    except ValueError:
        return f"{cert} is not a PEM certificate"
    try:
        with open(key, "rb") as f:
            serialization.load_pem_private_key(f.read(), None)
    except OSError as err:
        return f"{key}: {_reason(err)}"
    except TypeError:
        return f"{key} is encrypted: silofs needs a key without a passphrase"
    except (ValueError, UnsupportedAlgorithm):
        return f"{key} is not a PEM private key"
    if getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
        return f"{key} is not the key of {cert} (a pair from two runs of `silofs-ctl certs`?)"
    return _reason(exc)


def ca_load_problem(ca: str, exc: BaseException) -> str:
    """Why SSLContext.load_verify_locations(ca) failed, in words an operator acts on."""
    if getattr(exc, "reason", None) == "NO_CERTIFICATE_OR_CRL_FOUND":
        return f"no PEM certificate in {ca} (a DER file, a key, an empty file?)"
    return _reason(exc)


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
