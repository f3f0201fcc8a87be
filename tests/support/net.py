"""Ports on 127.0.0.1, and hosts made of network namespaces of this machine.

Owns free_port, and `star`: a hub namespace joined to each leaf namespace by a veth pair
with link-local addresses, nothing routed anywhere else, every namespace (and so every
veth end) deleted on exit even when the body raised. A test or a benchmark runs a
process "on another host" by prefixing its command with `Star.exec_prefix(role)`.
Never touches the host's own interfaces or routes. Namespaces need root and iproute2:
`star` raises NetnsUnavailable saying which is missing, for the caller to skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no permission)."""


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _check(res: subprocess.CompletedProcess) -> None:
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(res.args[1:])}: {res.stderr.strip()}")


@dataclass(frozen=True)
class Star:
    """Namespaces made by `star`: role -> namespace name, and per leaf the /30 link's
    (hub address, leaf address)."""

    names: dict[str, str]
    links: dict[str, tuple[str, str]]

    def address(self, leaf: str) -> str:
        """The leaf's address, as the hub reaches it."""
        return self.links[leaf][1]

    def exec_prefix(self, role: str) -> list[str]:
        """The argv prefix that runs a command inside `role`'s namespace."""
        return ["ip", "netns", "exec", self.names[role]]

    def run(self, role: str, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.exec_prefix(role), *cmd], capture_output=True, text=True, timeout=timeout
        )


@contextmanager
def star(hub: str, leaves: Sequence[str]) -> Iterator[Star]:
    """Namespaces `hub` and each of `leaves`, the hub linked to every leaf by a veth pair
    on 169.254.12.0/24 (leaf i: hub 169.254.12.(4i+1), leaf 169.254.12.(4i+2)); up to 63
    leaves. Deleted on exit (deleting a namespace deletes its veth ends)."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2 is not installed (apt-get install iproute2)")
    if len(leaves) > 63:
        raise ValueError("at most 63 leaves on one /24")
    tag = f"{os.getpid() % 100000}"
    names = {role: f"silofs-{role}-{tag}" for role in (hub, *leaves)}
    links = {leaf: (f"169.254.12.{4 * i + 1}", f"169.254.12.{4 * i + 2}") for i, leaf in enumerate(leaves)}  # fmt: skip  # noqa: E501
    made: list[str] = []
    try:
        for name in names.values():
            res = ip("netns", "add", name)
            if res.returncode != 0:
                raise NetnsUnavailable(f"cannot create a network namespace: {res.stderr.strip()}")
            made.append(name)
            _check(ip("-n", name, "link", "set", "lo", "up"))
        for i, (leaf, (hub_addr, leaf_addr)) in enumerate(links.items()):
            a, b = f"sh{i}x{tag}"[:15], f"sl{i}x{tag}"[:15]  # interface names: 15 bytes
            _check(ip("link", "add", a, "netns", names[hub], "type", "veth", "peer", "name", b, "netns", names[leaf]))  # fmt: skip  # noqa: E501
            _check(ip("-n", names[hub], "addr", "add", f"{hub_addr}/30", "dev", a))
            _check(ip("-n", names[leaf], "addr", "add", f"{leaf_addr}/30", "dev", b))
            _check(ip("-n", names[hub], "link", "set", a, "up"))
            _check(ip("-n", names[leaf], "link", "set", b, "up"))
        yield Star(names, links)
    finally:
        for name in made:
            ip("netns", "del", name)
