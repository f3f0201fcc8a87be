"""The members of this node's cluster and whether each is up: the list in force, each
member's state (up, or down until a time and why), the backoff of a failing member,
which members are due for a probe, and a new list replacing the old one at runtime.

Owns the truth about who is live, which placement (node/placement.py) is computed
over: this node is always live; a member that refused, failed or was too slow is down
for peer_backoff_seconds, doubling with each failure in a row up to MAX_BACKOFF, and
comes back up on its first good probe sent after its last failure; a member down
that calls this node (its ping, a chunk ask) is probed then, not at its backoff's end
(contact_due). Pure state on the
trio loop, with the clock injectable (tests), but for the peer counters, which
connection threads add to as well (under COUNTS): never does I/O (node/cluster.py
probes) and never decides what a failure is (the peer client does).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from silofs.config import ClusterSettings
from silofs.control.tls import parse_tls_url
from silofs.node.placement import Candidate, home

log = logging.getLogger(__name__)

MAX_BACKOFF = 60.0
# An up member is pinged this often: a member that died is found before a read needs
# it, and one that missed an allocation learns it from the ping's version.
PING_SECONDS = 5.0
# Held to add to any PeerCounters: threads serving connections (a chunk answered from
# a member connection's thread) add to the same counters as the loop.
COUNTS = threading.Lock()


@dataclass
class PeerCounters:
    """Peer traffic of one member (or one dataset, or one certificate name asking us):
    what this node asked of it and what it answered, and what it asked of this node."""

    requests_out: int = 0  # chunk requests sent (a 428 round trip counts once)
    bytes_in: int = 0  # chunk values received (header and data), verified
    requests_in: int = 0  # chunk requests served
    bytes_out: int = 0  # chunk values sent (header and data)
    store_fallbacks: int = 0  # chunks read from the store after a failed ask
    wait_seconds: float = 0.0  # time spent waiting on peers' answers
    errors: dict[str, int] = field(default_factory=dict)  # by reason (peer_client.REASONS)

    def error(self, reason: str) -> None:
        with COUNTS:
            self.errors[reason] = self.errors.get(reason, 0) + 1

    def answered(self, nbytes: int) -> None:
        """A chunk request served, `nbytes` of value sent (0: none, a warm's answer)."""
        with COUNTS:
            self.requests_in += 1
            self.bytes_out += nbytes

    def sent(self, nbytes: int) -> None:
        """`nbytes` of value sent for a request answered() counted already."""
        with COUNTS:
            self.bytes_out += nbytes

    def view(self) -> dict[str, object]:
        return {
            "requests_out": self.requests_out,
            "bytes_in": self.bytes_in,
            "requests_in": self.requests_in,
            "bytes_out": self.bytes_out,
            "store_fallbacks": self.store_fallbacks,
            "wait_s": round(self.wait_seconds, 3),
            "errors": dict(self.errors),  # a copy: a thread may add to it meanwhile
        }


@dataclass
class MemberState:
    """One member as this node sees it."""

    candidate: Candidate
    host: str
    port: int
    is_self: bool = False
    up: bool = True
    down_until: float = 0.0  # monotonic; while down, the next probe is due then
    failures: int = 0  # in a row, since it was last up
    last_error: str = ""
    # Monotonic time the last good answer was asked for (a ping's sending: the member
    # was alive after then), and of its last failure.
    last_ok: float = 0.0
    failed_at: float = 0.0
    probing: bool = False  # a probe of it is in flight
    counters: PeerCounters = field(default_factory=PeerCounters)
    # Its member list as its last ping said (members_list), and since when (monotonic)
    # it has differed from this node's: None while they agree or it has not said.
    their_list: tuple[int, int, str] | None = None  # (version, members, digest)
    list_differs_since: float | None = None

    @property
    def address(self) -> str:
        return self.candidate.address

    @property
    def weight(self) -> float:
        return self.candidate.weight


class Membership:
    """The member list in force and each member's state."""

    def __init__(
        self,
        config: ClusterSettings,
        self_address: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.self_address = self_address
        self.members: dict[str, MemberState] = {}
        self.config = config
        self._live: list[Candidate] = []
        self._configured: list[Candidate] = []
        self.down_hosts: frozenset[str] = frozenset()  # set by _relive
        # Members that answered for the first time, or again after being down: the
        # stand-in sweep (node/standins.py) runs when this changed since its last pass.
        self.came_up = 0
        self.replace(config)

    # -- the list ------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def version(self) -> int:
        return self.config.version

    @functools.cached_property
    def digest(self) -> str:
        """members_digest of the list in force (a list put in force is a new Membership
        or replace(), which drops this)."""
        return members_digest(self.config)

    def replace(self, config: ClusterSettings) -> None:
        """Put a new member list in force; members in both keep their state (and
        counters), a member whose weight changed keeps them too."""
        if self_address_missing(config, self.self_address):
            raise ValueError(f"{self.self_address} is not one of the members")
        old = self.members
        self.members = {}
        for spec in config.members:
            host, port = parse_tls_url(spec.address)
            state = old.get(spec.address)
            candidate = Candidate(spec.address, spec.weight)
            if state is None:
                state = MemberState(candidate, host, port, spec.address == self.self_address)
            state.candidate = candidate
            self.members[spec.address] = state
        self.config = config
        self.__dict__.pop("digest", None)  # the cached_property of the old list
        self._configured = [m.candidate for m in self.members.values()]
        self._relive()
        # The hosts of the other members, as names_a_member compares them: asked on
        # every request a member's connection makes, from its thread.
        self._peer_hosts = frozenset(_normal_host(m.host) for m in self.peers())

    def total_weight(self) -> float:
        """The configured members' weights: a part of a share is the member's weight over
        this, whether the others are up or not (a member going down must not make every
        other one evict)."""
        return sum(m.weight for m in self.members.values())

    def self_weight(self) -> float:
        return self.members[self.self_address].weight

    def peers(self) -> list[MemberState]:
        return [m for m in self.members.values() if not m.is_self]

    # -- placement -----------------------------------------------------------------
    def live(self) -> list[Candidate]:
        return self._live

    def home(self, key: bytes) -> MemberState:
        """The live member with the highest score for `key` (this node is always live)."""
        return self.members[home(key, self._live).address]

    def is_home(self, key: bytes) -> bool:
        return home(key, self._live).address == self.self_address

    def placed(self, key: bytes) -> MemberState:
        """The configured member with the highest score for `key`, up or down: the one
        whose part of a share the chunk fills (parts are of the configured weights:
        node/cluster_shares.py). home() is where a read goes now; while a member is
        down its chunks' home is another member, which must not fill its own part with
        them (it holds them for nobody once the member is back)."""
        return self.members[home(key, self._configured).address]

    def placed_by(self) -> Callable[[bytes], str]:
        """placed()'s answer as an address, from the list in force now: a function a
        worker thread may call while the loop puts another list in force."""
        configured = list(self._configured)
        return lambda key: home(key, configured).address

    def _relive(self) -> None:
        self._live = [m.candidate for m in self.members.values() if m.is_self or m.up]
        # The hosts of the members down: empty (and so falsy) while every member is up,
        # which is all a peer request's contacted() asks then.
        self.down_hosts = frozenset(_normal_host(m.host) for m in self.peers() if not m.up)

    # -- up and down ---------------------------------------------------------------
    def mark_down(self, address: str, reason: str, *, probe: bool = False) -> None:
        """A member failed (refused, timed out, answered wrong bytes): down for the
        backoff, doubled for each failed probe in a row since it was last up. Asks that
        were under way when it went down and fail too change nothing: eight reads that
        fail at once are one failure, not a backoff of 2**8."""
        m = self.members.get(address)
        if m is None or m.is_self:
            return
        m.failed_at = self.clock()  # a ping sent before this says nothing of it now
        if not m.up and not probe:
            return
        backoff = min(MAX_BACKOFF, self.config.peer_backoff_seconds * (2**m.failures))
        m.failures += 1
        m.down_until = self.clock() + backoff
        m.last_error = reason
        if m.up:
            log.warning("cluster member %s is down for %.1fs: %s", address, backoff, reason)
            m.up = False
            self._relive()

    def mark_up(self, address: str, asked_at: float | None = None) -> bool:
        """A member answered well a ping sent at `asked_at` (default: now): up again (its
        backoff starts over). Not if it failed since that ping was sent: the answer may
        be from before it died (a ping answered just before a kill -9 and read by the
        loop after a failed ask marked it down brought a dead member back up, and with
        it the stand-in sweep's deletion of the only copies of its chunks). Whether it
        counted."""
        m = self.members.get(address)
        if m is None or m.is_self:
            return False
        if asked_at is None:
            asked_at = self.clock()
        if asked_at < m.failed_at:
            log.debug("cluster member %s: a ping answered from before its last failure", address)
            return False
        if not m.up or m.last_ok == 0.0:
            self.came_up += 1  # its first answer, or back from down (node/standins.py)
        m.last_ok = max(m.last_ok, asked_at)
        m.failures = 0
        if not m.up:
            log.info("cluster member %s is up again", address)
            m.up = True
            m.down_until = 0.0
            self._relive()
        return True

    def answering(self, since: float = 0.0) -> frozenset[str]:
        """The other members up that answered a ping sent at `since` or later (default:
        any since this node started; one not yet pinged is presumed up, but nothing is
        known of it)."""
        return frozenset(
            m.address for m in self.peers() if m.up and m.last_ok > 0.0 and m.last_ok >= since
        )

    def due(self) -> list[MemberState]:
        """Members to probe now: down ones whose backoff ended, up ones not heard from
        for PING_SECONDS; none with a probe in flight (and see contact_due)."""
        now = self.clock()
        return [
            m
            for m in self.peers()
            if not m.probing
            and ((not m.up and now >= m.down_until) or (m.up and now - m.last_ok >= PING_SECONDS))
        ]

    def down_of(self, names: Iterable[str]) -> frozenset[str]:
        """Of a certificate's names, the hosts of members down (normalised); safe from
        any thread: it reads only down_hosts, a frozenset the loop replaces whole."""
        down = self.down_hosts
        if not down:
            return frozenset()
        return down.intersection(_normal_host(n) for n in names)

    def contact_due(self, hosts: frozenset[str]) -> list[MemberState]:
        """On the loop: the members of these hosts to probe now because a member's
        certificate naming them called a peer route (Cluster.contacted): down, with no
        probe in flight. A member refused while it was starting would otherwise stay
        down for the rest of a backoff grown by its refusals (up to MAX_BACKOFF) after
        it starts listening, though its first ping reaches this node at once."""
        return [
            m for m in self.peers() if not m.up and not m.probing and _normal_host(m.host) in hosts
        ]

    # -- who may call the peer routes ----------------------------------------------
    def names_a_member(self, names: Iterable[str]) -> bool:
        """Whether one of a certificate's names (DNS names, IP addresses) is the host of
        a configured member other than this node: only members call peer routes."""
        hosts = self._peer_hosts
        return any(_normal_host(n) in hosts for n in names)


def self_address_missing(config: ClusterSettings, address: str) -> bool:
    return all(m.address != address for m in config.members)


@functools.lru_cache(maxsize=4096)
def _normal_host(name: str) -> str:
    """A host name lower-cased, an IP address in its compressed form (cached: every
    peer request asks it of the caller's certificate names and of the members)."""
    try:
        return ipaddress.ip_address(name.strip().strip("[]")).compressed
    except ValueError:
        return name.strip().lower().rstrip(".")


def members_digest(config: ClusterSettings) -> str:
    """What placement depends on in a member list (its name, each member's address and
    weight; not their order, nor the version or peer settings), hashed: two nodes with
    equal digests place every chunk alike. A ping answers it (members_list), so nodes
    given lists that differ (one pushed to some nodes only) say so."""
    import hashlib
    import json

    members = sorted((m.address, m.weight) for m in config.members)
    text = json.dumps([config.name, members], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
