"""Ports on 127.0.0.1, and hosts made of network namespaces of this machine.

Owns free_port and two shapes of private network, every namespace (and so every veth
end) deleted on exit even when the body raised, nothing routed anywhere else:
`star`, a hub namespace joined to each leaf namespace by its own veth pair with
link-local addresses (the leaves reach the hub only), and `bridge`, a hub namespace
with a bridge that every leaf's veth joins, all on one subnet (the leaves reach each
other and the hub), each leaf's link shaped with `tc` (Link: a rate, and a delay where
the kernel has netem). A test or a benchmark runs a process "on another host" by
prefixing its command with `exec_prefix(role)`; `netns_socket` makes a socket of this
process inside a namespace (an in-process server listening "on another host"). Never
touches the host's own interfaces or routes. Namespaces need root and iproute2: both
raise NetnsUnavailable saying which is missing, for the caller to skip.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that nothing listens on right now: bound all at
    once while they are picked, since free_port() called twice may give one port twice
    (a run of the cluster tests listed a member twice, and its daemons would not start).
    Picked below the kernel's ephemeral range where it leaves room: a port bound to 0 is
    one of those, which any connection this host opens meanwhile (a client of the store,
    of a daemon) may take before the test's server listens on it (a cluster daemon
    failed to start, "Address already in use", in 1 of 5 loaded runs of test_cluster)."""
    low = _ephemeral_low()
    with ExitStack() as stack:
        ports: list[int] = []
        tries = 10 * n + 100
        while len(ports) < n:
            tries -= 1
            if tries < 0:
                raise RuntimeError(f"no {n} free ports found below {low}")
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            port = _PICK.randrange(PICK_FROM, low) if low > PICK_FROM + 1000 else 0
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # listened on, in use by a connection, or picked already
                continue
            ports.append(s.getsockname()[1])
        return ports


PICK_FROM = 10_000  # free_ports' range starts here (below: well-known and registered)
_PICK = random.SystemRandom()  # two test processes picking at once rarely meet


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no permission)."""


class ShapingUnavailable(RuntimeError):
    """The kernel lacks the qdisc a Link needs (netem for a delay, tbf for a rate)."""


def _require_netns() -> None:
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2 is not installed (apt-get install iproute2)")


_serial = itertools.count()


def _tag() -> str:
    """A suffix unique to this process and call: two sets of namespaces never clash."""
    return f"{os.getpid() % 100000}{next(_serial)}"


def _add_namespaces(names: Sequence[str], made: list[str]) -> None:
    for name in names:
        res = ip("netns", "add", name)
        if res.returncode != 0:
            raise NetnsUnavailable(f"cannot create a network namespace: {res.stderr.strip()}")
        made.append(name)
        _check(ip("-n", name, "link", "set", "lo", "up"))


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
    _require_netns()
    if len(leaves) > 63:
        raise ValueError("at most 63 leaves on one /24")
    tag = _tag()
    names = {role: f"silofs-{role}-{tag}" for role in (hub, *leaves)}
    links = {leaf: (f"169.254.12.{4 * i + 1}", f"169.254.12.{4 * i + 2}") for i, leaf in enumerate(leaves)}  # fmt: skip  # noqa: E501
    made: list[str] = []
    try:
        _add_namespaces(list(names.values()), made)
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


# ---------------------------------------------------------------------------------------
# One subnet: a bridge in the hub, a veth from each leaf to it, links shaped with tc


@dataclass(frozen=True)
class Link:
    """How a leaf's link to the bridge is shaped, each direction alike: `rate` bytes/s
    (tbf; None: the veth's own speed) and `delay` seconds one way (netem, which not
    every kernel has: ShapingUnavailable then)."""

    rate: float | None = None
    delay: float = 0.0


@dataclass(frozen=True)
class Bridge:
    """Namespaces made by `bridge`: role -> namespace name, role -> address on the one
    subnet (the hub's is on its bridge), and per leaf its veth pair's (hub end, leaf
    end) interface names."""

    names: dict[str, str]
    addresses: dict[str, str]
    devices: dict[str, tuple[str, str]]

    def address(self, role: str) -> str:
        return self.addresses[role]

    def exec_prefix(self, role: str) -> list[str]:
        """The argv prefix that runs a command inside `role`'s namespace."""
        return ["ip", "netns", "exec", self.names[role]]

    def run(self, role: str, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.exec_prefix(role), *cmd], capture_output=True, text=True, timeout=timeout
        )

    def shape(self, leaf: str, link: Link) -> None:
        """Shape both directions of `leaf`'s link (replacing what was there); Link() with
        neither a rate nor a delay takes the shaping off."""
        hub = next(iter(self.names))
        ends = ((self.names[hub], self.devices[leaf][0]), (self.names[leaf], self.devices[leaf][1]))
        for ns, dev in ends:
            _tc(ns, "del", dev)
            if link.rate is None and not link.delay:
                continue
            res = _tc(ns, "replace", dev, *_qdisc(link))
            if res.returncode != 0:
                kind = "netem" if link.delay else "tbf"
                raise ShapingUnavailable(
                    f"tc {kind} on {dev}: {res.stderr.strip()} (the kernel may lack "
                    f"CONFIG_NET_SCH_{kind.upper()})"
                )

    def set_link(self, leaf: str, up: bool) -> None:
        """Take `leaf`'s link off the bridge (its packets dropped, no reset: a host cut
        off the network) or put it back."""
        hub = next(iter(self.names))
        _check(ip("-n", self.names[hub], "link", "set", self.devices[leaf][0], "up" if up else "down"))  # fmt: skip  # noqa: E501


def _tc(ns: str, verb: str, dev: str, *qdisc: str) -> subprocess.CompletedProcess:
    argv = ["tc", "-n", ns, "qdisc", verb, "dev", dev, "root", *qdisc]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def _qdisc(link: Link) -> list[str]:
    """tc's words for a Link: netem (delay, and its own rate) or tbf (a rate alone)."""
    if link.delay:
        words = ["netem", "delay", f"{link.delay * 1e6:.0f}us", "limit", "10000"]
        return words + (["rate", f"{int(link.rate * 8)}bit"] if link.rate else [])
    assert link.rate is not None
    # A burst of 10 ms at the rate (at least 64 KiB: a GSO packet of the veth), and a
    # queue of 100 ms before tbf drops.
    burst = max(64 << 10, int(link.rate / 100))
    return ["tbf", "rate", f"{int(link.rate * 8)}bit", "burst", str(burst), "latency", "100ms"]


@contextmanager
def bridge(
    hub: str, leaves: Sequence[str], subnet: str = "10.213.0", links: dict[str, Link] | None = None
) -> Iterator[Bridge]:
    """Namespaces `hub` and each of `leaves` on one /24 (`subnet`.0/24): the hub's
    bridge is .1, leaf i is .(i + 2); each leaf's link shaped by `links` (none: not
    shaped). Up to 200 leaves. Deleted on exit (deleting a namespace deletes its veth
    ends and the bridge with it)."""
    _require_netns()
    if len(leaves) > 200:
        raise ValueError("at most 200 leaves on one /24")
    tag = _tag()
    names = {role: f"silofs-{role}-{tag}" for role in (hub, *leaves)}
    addresses = {hub: f"{subnet}.1", **{leaf: f"{subnet}.{i + 2}" for i, leaf in enumerate(leaves)}}  # fmt: skip  # noqa: E501
    devices = {leaf: (f"bh{i}x{tag}"[:15], f"bl{i}x{tag}"[:15]) for i, leaf in enumerate(leaves)}
    made: list[str] = []
    try:
        _add_namespaces(list(names.values()), made)
        hub_ns = names[hub]
        _check(ip("-n", hub_ns, "link", "add", "br0", "type", "bridge"))
        _check(ip("-n", hub_ns, "addr", "add", f"{addresses[hub]}/24", "dev", "br0"))
        _check(ip("-n", hub_ns, "link", "set", "br0", "up"))
        for leaf, (a, b) in devices.items():
            _check(ip("link", "add", a, "netns", hub_ns, "type", "veth", "peer", "name", b, "netns", names[leaf]))  # fmt: skip  # noqa: E501
            _check(ip("-n", hub_ns, "link", "set", a, "master", "br0"))
            _check(ip("-n", names[leaf], "addr", "add", f"{addresses[leaf]}/24", "dev", b))
            _check(ip("-n", hub_ns, "link", "set", a, "up"))
            _check(ip("-n", names[leaf], "link", "set", b, "up"))
        made_bridge = Bridge(names, addresses, devices)
        for leaf, link in (links or {}).items():
            made_bridge.shape(leaf, link)
        yield made_bridge
    finally:
        for name in made:
            ip("netns", "del", name)


# ---------------------------------------------------------------------------------------
# Sockets of this process inside a namespace

_CLONE_NEWNET = 0x40000000


def netns_socket(
    netns: str | None, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM
) -> socket.socket:
    """A socket of this process that lives in network namespace `netns` (as `ip netns`
    names it; None: this process's own). A socket keeps the namespace it was made in,
    so a helper thread enters the namespace, makes it and ends: no other thread of this
    process ever changes namespace."""
    if netns is None:
        return socket.socket(family, kind)
    out: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            out.append(socket.socket(family, kind))
        except BaseException as exc:  # handed to the caller's thread
            out.append(exc)

    thread = threading.Thread(target=make, name=f"netns-{netns}")
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]
