"""This node in a cluster: one cache across the members, each chunk fetched from the
store once per cluster.

Owns the cluster as the Daemon sees it: the member list in force (from silofs.toml or
pushed at runtime, the newest by version, persisted in the cache env's meta as
"cluster:members"), this node's address among them, the connections to each member
(node/peer_client.py), the prober that finds members down and back up and pulls cache
shares a member missed, the shares themselves (node/cluster_shares.py) and their push
to every member, the peer counters (per member, per dataset, per certificate asking
this node), and the asking side of a read: a miss whose home (node/placement.py over
node/membership.py) is another member is asked of it, its answer verified block by
block against this node's own ChunkRef before a byte is served, and on any failure
counted by reason and read from the store by this node, charged to its job. The
home's side is node/peer_serve.py. Never serves FUSE, never writes LMDB itself, and
never trusts a member's bytes without the check.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import ipaddress
import json
import logging
import math
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from silofs.cache.format import (
    ChunkFormatError,
    ChunkRef,
    decode_header,
    verify_chunk,
)
from silofs.config import PEER_KEYS, ClusterSettings, NodeSettings, parse_cluster
from silofs.control.tls import DEFAULT_PORT, parse_tcp_address, parse_tls_url, tls_url
from silofs.errors import UsageError
from silofs.flight import SingleFlight
from silofs.node.cluster_shares import ClusterShares, check_shares, now_version
from silofs.node.limiter import TokenBucket
from silofs.node.membership import (
    COUNTS,
    PING_SECONDS,
    Membership,
    MemberState,
    PeerCounters,
)
from silofs.node.peer_ask import MemberSlots, PeerRead, ThreadAsks, ThreadFlight
from silofs.node.peer_client import (
    MAX_SMALL_ANSWER,
    PEER_POOL,
    Bounds,
    PeerError,
    PeerPool,
    PeerReply,
    client_context,
)
from silofs.node.peer_serve import Home
from silofs.node.peer_wire import (
    ALLOCATIONS_PATH,
    CHARGE_HEADER,
    DATASETS_PATH,
    PEER_OPTIONS,
    PING_PATH,
    SOURCE_HEADER,
    UNKNOWN_DATASET_HEADER,
    ChunkAsk,
    answer_source,
    dataset_body,
    most_value_bytes,
)
from silofs.node.standins import homed_live_by, sweep_standins
from silofs.node.state import DatasetState, MountState
from silofs.node.supervise import describe
from silofs.units import count, format_size, is_digits
from silofs.uri import store_endpoint

log = logging.getLogger(__name__)

META_ROW = "cluster:members"
PROBE_TICK = 0.5  # how often the prober looks for members due a ping
# Pings in flight at once. Each runs in a thread and holds a connection (a silent
# member's for peer_timeout_seconds): a pushed list of 1,000 members, most of them
# down, once had the prober run 400 threads at once, and with members that hang the
# handshake it would hold a socket per member, beyond the PEER_POOL per member that
# service.fd_budget keeps for the list in force. The rest wait their turn.
PROBES_AT_ONCE = 16
# Name lookups of the members' hosts (_aliases, at start and for every pushed list): this
# many at once, and all of them within RESOLVE_SECONDS. One after another, 1,000 members
# with DNS down (glibc: 5 s a try, 2 tries) would hold a push, and a daemon's start, for
# hours. A name not resolved in time counts as resolving nowhere, as one that does not
# resolve at all: not this node.
RESOLVE_THREADS = 32
RESOLVE_SECONDS = 10.0
# Failures that are the member's: it is marked down (and skipped) for its backoff.
MEMBER_FAILURES = frozenset({"refused", "timeout", "short", "corrupt", "foreign"})
# A warning per member and reason at most this often; the others at DEBUG.
WARN_EVERY = 10.0
# A member's share table, pulled when its ping says it differs (_pull_shares): at most
# this long (4,096 datasets, each URI and its stamp with room to spare: a table that
# big cannot even be pushed, the peer route taking 1 MiB); after a pull that brings
# nothing new (failed, refused, or older entries), none from that member for
# PULL_BACKOFF seconds (its own pull of this node's table settles the difference
# meanwhile). A ping may say the table differs every time: a compromised member
# answered each pull with 64 MiB of JSON, which json.loads took ~6 s of the loop (every
# mount's miss here waiting) to read before check_shares refused it, every 5 s.
MAX_SHARES_ANSWER = 8 << 20
PULL_BACKOFF = 60.0


class Cluster:
    """The Daemon's cluster room. `d` is the Daemon (node/daemon.py imports this)."""

    def __init__(self, d: Any, settings: NodeSettings) -> None:
        self.d = d
        self.settings = settings
        self.membership: Membership | None = None
        self.pools: dict[str, PeerPool] = {}
        self.slots: dict[str, MemberSlots] = {}
        self.context: ssl.SSLContext | None = None
        # Pushes one at a time: each awaits (a name lookup, the meta write) between its
        # version check and putting its list in force, where another could overtake it.
        self._pushing = trio.Lock()
        self.shares = ClusterShares(d.store, d.writer)
        self.home = Home(d, None)
        self.datasets: dict[str, PeerCounters] = {}  # by dataset URI
        self.incoming: dict[str, PeerCounters] = {}  # by the asking certificate's name
        self.asks: SingleFlight[bytes, PeerRead] = SingleFlight()
        self.thread_asks = ThreadAsks(self)  # a mount connection's thread asks (peer_ask.py)
        self.threads = trio.CapacityLimiter(PEER_POOL)
        self._warned: dict[tuple[str, str], float] = {}
        self._nursery: trio.Nursery | None = None
        # Probes in flight, by member address: a recheck waits for one rather than
        # pinging again (two failed pings of one outage would be two failures).
        self._probes: dict[str, trio.Event] = {}
        self._no_pull_until: dict[str, float] = {}  # a member's failed pull: PULL_BACKOFF
        # (member, its list's digest, ours) warned of by _compare_lists.
        self._lists_warned: set[tuple[str, str, str]] = set()
        # Membership.came_up as of the last stand-in sweep, and whether one runs.
        self._swept = 0
        self._sweeping = False
        self._probing = trio.CapacityLimiter(PROBES_AT_ONCE)
        # By member host: no probe for a call from it (contacted) before this time.
        self._contact_quiet: dict[str, float] = {}
        # Called after each member list is put in force (the node's service refits the
        # control socket's connection limits to the fds the new list's pools may take).
        self.applied: Callable[[], None] = lambda: None
        config = self._newest(settings.cluster, _persisted(d.store))
        if config is not None:
            self.apply(config)

    # -- the member list -----------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.membership is not None

    @property
    def config(self) -> ClusterSettings | None:
        return self.membership.config if self.membership is not None else None

    def _newest(
        self, file: ClusterSettings | None, pushed: ClusterSettings | None
    ) -> ClusterSettings | None:
        if pushed is None or (file is not None and file.version >= pushed.version):
            return file
        log.info(
            "cluster %s: the member list pushed at version %d is newer than silofs.toml's",
            pushed.name,
            pushed.version,
        )
        return pushed

    def apply(self, config: ClusterSettings, address: str | None = None) -> None:
        """Put a member list in force (at start, or pushed: push() persists it first and
        names this node's `address` in it). UsageError (one line) if this node cannot be
        one of its members."""
        if address is None:
            address = self._self_address(config)
        if self.context is None:
            self.context = _member_context(self.settings)
        if self.membership is None:
            self.membership = Membership(config, address)
        else:
            self.membership.replace(config)
        placed = self.membership.placed_by()
        here = self.membership.self_address
        # A chunk placed at another member is admitted here only standing in for it, as
        # a first eviction victim (WritableStore.elsewhere).
        self.d.store.elsewhere = lambda key: placed(key) != here
        # Pools follow the members: removed ones closed, new ones made.
        cluster_name = config.name
        for addr in list(self.pools):
            if addr not in self.membership.members or self.pools[addr].cluster != cluster_name:
                self.pools.pop(addr).close()
                self.slots.pop(addr, None)
        for m in self.membership.peers():
            if m.address not in self.pools:
                self.pools[m.address] = PeerPool(m.address, m.host, m.port, self.context,
                                                 cluster_name)  # fmt: skip
                self.slots[m.address] = MemberSlots(self.thread_asks.token)
        self.threads.total_tokens = max(PEER_POOL, PEER_POOL * len(self.pools))
        self.home.set_serve_rate(config.peer_serve_rate, config.peer_timeout_seconds)
        # Every other member may hold PEER_POOL connections to this node's listener.
        wanted = PEER_POOL * len(self.pools) + 8
        if self.settings.tcp_max_connections < wanted:
            log.warning(
                "tcp_max_connections = %d leaves members too few connections to this node "
                "(they may hold %d): raise it to at least %d",
                self.settings.tcp_max_connections,
                PEER_POOL * len(self.pools),
                wanted,
            )
        log.info(
            "cluster %s (version %d): this node is %s; members %s",
            config.name,
            config.version,
            address,
            ", ".join(f"{m.address} (weight {m.weight:g})" for m in config.members),
        )
        self.applied()

    async def push(self, body: dict, check_only: bool = False) -> ClusterSettings:
        """A member list pushed at runtime (PUT /v1/cluster): parsed, checked newer than
        the one in force, persisted, applied (`check_only`: only judged, nothing
        changed: `silofs-ctl cluster set` asks every node first). UsageError (400) for a
        bad body, ValueError (409) for an older version or a list this node is not in."""
        async with self._pushing:
            return await self._push(body, check_only)

    async def _push(self, body: dict, check_only: bool) -> ClusterSettings:
        if "address" in body:
            raise UsageError("address is this node's own setting ([cluster] in silofs.toml)")
        fields = {k: v for k, v in body.items() if k != "version"}
        # No version given: the clock's, but always newer than the list in force (a
        # wall clock stepped back since that list must not refuse every push for as
        # long as the step, as "not newer").
        current = self.config.version if self.config is not None else -1
        version = body.get("version", max(time.time_ns() // 1000, current + 1))
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise UsageError("version must be a whole number")
        config = parse_cluster(fields, version=version)
        # The peer settings a push leaves out stay as they are in force (silofs.toml's,
        # or an earlier push's): `cluster set` names members only, and reset every
        # node's serve cap, timeout and keep_peer_copies to the defaults.
        kept = self.config or self.settings.cluster
        if kept is not None:
            config = dataclasses.replace(
                config, **{k: getattr(kept, k) for k in PEER_KEYS if k not in fields}
            )
        if self.config is not None and config.version <= self.config.version:
            if config == self.config:
                return config
            raise ValueError(
                f"version {config.version} is not newer than the member list in force "
                f"(version {self.config.version})"
            )
        # Before anything is written; in a thread: it may resolve the members' names.
        address = await trio.to_thread.run_sync(self._self_address, config, ValueError)
        if self.context is None:
            try:
                context = _member_context(self.settings)
            except UsageError as exc:
                raise ValueError(str(exc)) from None
            if not check_only:
                self.context = context
        if check_only:
            return config
        await self.d.writer.call(self.d.store.put_meta, META_ROW, _row(config))
        self.apply(config, address)
        self.d.allocs.notify()  # the weights make the parts: the enforcer looks again
        return config

    def _self_address(self, config: ClusterSettings, conflict: type[Exception] = UsageError) -> str:
        """This node's member address: [cluster] address, or the member whose port is
        tcp_listen's and whose host is one of this node's certificate names (or
        tcp_listen's host)."""
        own = self.settings.cluster.address if self.settings.cluster is not None else None
        members = [m.address for m in config.members]
        if own is not None:
            if own not in members:
                raise conflict(f"this node ({own}) is not one of the members of {config.name}")
        elif self.settings.tcp_listen is None or self.settings.tls_cert is None:
            raise conflict(
                "this node has no [control] tcp_listen and TLS files: members reach each "
                "other over the mutual-TLS listener"
            )
        else:
            host, port = parse_tcp_address(self.settings.tcp_listen)
            names = {host.lower(), *_certificate_names(self.settings.tls_cert)}
            mine = [
                a for a in members if any(a == tls_url(n, port) for n in names if n != "0.0.0.0")
            ]
            if len(mine) != 1:
                # A member written without a port is on DEFAULT_PORT: with tcp_listen on
                # another, "set [cluster] address" sent the operator the wrong way.
                unported = not mine and any(
                    a == tls_url(n, DEFAULT_PORT) for a in members for n in names
                )
                hint = (
                    f" (a member written without a port is on {DEFAULT_PORT}: write "
                    f"tls://HOST:{port})"
                    if unported
                    else ""
                )
                raise conflict(
                    f"cannot tell which member this node is ({len(mine)} of the members match "
                    f"port {port} and its certificate's names): set [cluster] address{hint}"
                )
            own = mine[0]
        if self.settings.tls_cert is not None:
            # The members connect to `own` and check that its host is a name of the
            # certificate this node answers with: one for another host (a copy of
            # another node's files, a --address left out) had every member count this
            # node down while it started as if all were well, and its own asks served
            # under the other host's name.
            host, _ = parse_tls_url(own)
            names = _certificate_names(self.settings.tls_cert)
            if not _names_host(names, host):
                raise conflict(
                    f"this node is member {own}, but its certificate {self.settings.tls_cert} "
                    f"is not for {host} (it names {', '.join(sorted(names)) or 'no host'}): "
                    "the members would refuse it; make this node's certificate with "
                    f"`silofs-ctl certs node DIR NAME --address {host}`"
                )
        if self.settings.tcp_listen is not None:
            twice = _aliases(own, members, parse_tcp_address(self.settings.tcp_listen))
            if twice:
                by_names = "" if self.settings.cluster and self.settings.cluster.address else (
                    f" (this node took itself for {own} by its certificate's names: if that "
                    "is another node's certificate, give this node its own)"
                )  # fmt: skip
                raise conflict(
                    f"{twice[0]} is this node ({own}) again: it reaches this node's own "
                    f"listener, and a node may be one member only{by_names}"
                )
        return own

    # -- the asking side -----------------------------------------------------------
    def shareable(self, ds: DatasetState) -> bool:
        """Whether a dataset is read through the cluster: its store options are ones a
        member takes (peer_wire.PEER_OPTIONS) and its endpoint is this node's default
        (members send their own credentials to their own endpoint only). For s3:// the
        default is what the S3 backend falls back to without [backend] endpoint_url:
        AWS_ENDPOINT_URL in the daemon's environment, which `silofs mount` also sends as
        the mount's endpoint (a MinIO cluster set up by the variable alone was read by
        each node alone, silently)."""
        try:
            default = store_endpoint(ds.uri, self.settings.endpoint_url)
        except UsageError:  # AWS_ENDPOINT_URL with credentials: nothing opens through it
            default = None
        return set(ds.options) <= PEER_OPTIONS and ds.endpoint_url in (None, default)

    def is_home(self, key: bytes) -> bool:
        return self.membership is None or self.membership.is_home(key)

    def keeps_here(self, ds: DatasetState, key: bytes) -> bool:
        """Whether a chunk of `ds` that came from elsewhere than this node's own miss
        (a mount's buffer offered again after a restart) belongs in this cache: not when
        its home is another live member, which holds the cluster's copy (a copy here
        would count the chunk twice, and no sweep deletes it while that member stays up)."""
        return (
            self.membership is None
            or not self.shareable(ds)
            or self.config_keep_copies()
            or self.membership.is_home(key)
        )

    async def read(
        self, ds: DatasetState, limiter: TokenBucket, job: str, ref: ChunkRef, refetch: bool
    ) -> PeerRead | None:
        """A miss of a chunk homed at another member: asked of it (one ask per chunk
        however many readers here wait for it); None if this node is its home (or the
        dataset is not read through the cluster)."""
        if self.membership is None or not self.shareable(ds):
            return None
        while True:
            # Claimed under the thread flights' lock: a connection thread never asks for a
            # chunk the loop asks for, nor the loop for one a thread asks for. A chunk in
            # flight is joined even if its home changed meanwhile (its member went down
            # and this node took its place): one store GET for it, not two.
            member = self.membership.home(ref.key)
            with self.thread_asks.lock:
                failed = self.thread_asks.lead_fallback(ref.key)
                flight = self.thread_asks.flights.get(ref.key)
                if flight is not None:
                    flight.joined += 1  # its value is then bytes of their own (peer_ask.py)
                asked = flight is None and ref.key in self.asks
                lead = flight is None and not asked and not member.is_self
                if lead:
                    self.asks.claim([ref.key])
            if failed is not None:
                return await self._fallback_for(failed, ds, limiter, ref, refetch)
            if flight is not None:
                got = await self.thread_asks.wait(flight)
            elif asked:
                joined = await self.asks.wait(ref.key)
                # The leader's store GET is the leader's to count (Daemon.get_chunk):
                # a reader that joined its ask made none.
                got = dataclasses.replace(joined[0], charged=0) if joined is not None else None
            elif not lead:
                return None  # this node is its home
            else:
                call = functools.partial(self._ask, member, ds, limiter, job, ref, refetch)
                return await self._lead(ref.key, call)
            if got is not None:
                return got

    async def _fallback_for(
        self,
        flight: ThreadFlight,
        ds: DatasetState,
        limiter: TokenBucket,
        ref: ChunkRef,
        refetch: bool,
    ) -> PeerRead:
        """A chunk whose ask from a connection thread failed (counted: ask_failed), read
        from the store by this node for its waiters, as _ask does after its own failure."""
        assert self.membership is not None and flight.failure is not None
        member = self.membership.members.get(flight.address)
        counters: tuple[PeerCounters, ...] = (self.dataset_counters(ds.uri.canonical),)
        if member is not None:
            counters = (member.counters, *counters)
        got = None
        try:
            got = await self._fallback(ds, limiter, ref, refetch, counters)
            return got
        finally:
            self.thread_asks.finish(flight, got)

    async def _lead(self, key: bytes, call: Callable[[], Awaitable[PeerRead]]) -> PeerRead:
        try:
            got = await call()
        except Exception as exc:
            self.asks.settle(key, error=exc)
            raise
        except BaseException:
            self.asks.abandon(key)  # cancelled: a waiter asks anew
            raise
        self.asks.settle(key, got)
        return got

    def ask_failed(
        self, member: MemberState, ds: DatasetState, ref: ChunkRef, exc: PeerError
    ) -> None:
        """On the loop: an exchange a connection thread made (peer_ask.py) failed, counted
        as the loop's own ask counts one and the member marked down if the failure is
        its own, before that thread's request reaches its handler here (run_sync_soon
        keeps the order): the handler then reads the chunk from the store (read())."""
        counters = (member.counters, self.dataset_counters(ds.uri.canonical))
        with COUNTS:
            for c in counters:
                c.requests_out += 1
        self._failed(member, counters, exc, ds, ref)

    def count_remote(self, ds: DatasetState, m: MountState, nbytes: int) -> None:
        """On the loop: a store GET a home made for a chunk a connection thread asked
        for, charged to the mount's job (unlimited: counted, never waited for) and
        counted as the loop's ask counts it (Daemon.get_chunk)."""
        job = self.d.job(m.job)
        self.d.count_fetch(ds, job, m, 1, nbytes, 0)
        # The daemon's nursery, not the prober's: this runs as a callback from a thread
        # (run_sync_soon), where an exception would end the daemon, and the prober's
        # nursery is closed while the supervisor restarts it.
        nursery = self.d.nursery
        if nursery is not None:
            try:
                nursery.start_soon(job.limiter.charge, nbytes)
            except RuntimeError:  # the daemon is stopping: nothing left to limit
                pass

    async def _ask(
        self,
        member: MemberState,
        ds: DatasetState,
        limiter: TokenBucket,
        job: str,
        ref: ChunkRef,
        refetch: bool,
    ) -> PeerRead:
        dsc = self.dataset_counters(ds.uri.canonical)
        counters = (member.counters, dsc)
        with COUNTS:
            for c in counters:
                c.requests_out += 1
        t0 = trio.current_time()
        try:
            reply, charged, data = await self._chunk_exchange(
                member, ds, limiter, job, ref, warm=False
            )
            assert data is not None  # checked in the exchange's thread
        except PeerError as exc:
            self._failed(member, counters, exc, ds, ref)
            return await self._fallback(ds, limiter, ref, refetch, counters)
        finally:
            with COUNTS:
                dsc.wait_seconds += trio.current_time() - t0
        with COUNTS:
            for c in counters:
                c.bytes_in += len(reply.body)  # the value, header and data, as the home sent it
        source = answer_source(reply.headers.get(SOURCE_HEADER))
        if refetch or self.config_keep_copies():
            # This node's own value was bad (replace it), or copies are kept here.
            self.d.offer_value(ds, ref, bytes(data), replace=refetch)
        return PeerRead(data, source, charged if source == "remote" else 0)

    def config_keep_copies(self) -> bool:
        return self.config is not None and self.config.keep_peer_copies

    async def _chunk_exchange(
        self,
        member: MemberState,
        ds: DatasetState,
        limiter: TokenBucket,
        job: str,
        ref: ChunkRef,
        *,
        warm: bool,
    ) -> tuple[PeerReply, int, memoryview | None]:
        """The chunk request and its charge round trip: (the 200 answer, bytes charged to
        the job, the chunk's data checked block by block: None for a warm). A job without
        a rate is charged up front (its charge never waits), so its ask is one round trip;
        a job with one is charged only when the home says a store GET is needed (428 and
        the bytes), then asks again."""
        charged = limiter.rate is None
        paid = 0
        introduced = False
        check = None if warm else functools.partial(self._verified, member, ref=ref)
        most = MAX_SMALL_ANSWER if warm else most_value_bytes(ref)
        assert self.config is not None
        # A read waits for one of the member's exchanges at most the peer bound (a warm
        # takes turns): else reads queue behind slow ones, PEER_POOL at a time, and a
        # member answering right just inside its bounds made the 9th read wait 3 times
        # as long as one exchange (a minute of 102s each: minutes), never counted as a
        # failure. Busy as the home's serve cap is: the store serves the read.
        slot_wait = None if warm else self.config.peer_timeout_seconds
        for _ in range(4):
            ask = ChunkAsk.of(ds.uri.canonical, ref, job, charged=charged, warm=warm)
            reply, data = await self._exchange(
                member, "GET", ask.target(), check=check, most=most, slot_wait=slot_wait
            )
            if reply.status == 428 and not charged:
                n = _charge(reply, ref)
                await limiter.charge(n)  # promise 2: before the home's GET, to this job
                charged, paid = True, n
                continue
            if reply.status == 404 and UNKNOWN_DATASET_HEADER in reply.headers and not introduced:
                await self._introduce(member, ds, slot_wait)
                introduced = True
                continue
            if reply.status != 200:
                # 429: the home's serve cap is full; it is up, the store serves this one.
                reason = "busy" if reply.status == 429 else "http"
                raise PeerError(
                    reason, f"{member.address}: {reply.status} {_error(reply)}", reply.status
                )
            if limiter.rate is None and reply.headers.get(SOURCE_HEADER) == "remote":
                paid = ref.length
                await limiter.charge(paid)  # counted; an unlimited job never waits
            return reply, paid, data
        raise PeerError("http", f"{member.address}: no answer after its charge round trips")

    async def _introduce(
        self, member: MemberState, ds: DatasetState, slot_wait: float | None
    ) -> None:
        body = json.dumps(dataset_body(ds.uri.canonical, ds.options)).encode()
        reply, _ = await self._exchange(
            member, "PUT", DATASETS_PATH, body, most=MAX_SMALL_ANSWER, slot_wait=slot_wait
        )
        if reply.status != 200:
            raise PeerError("http", f"{member.address} refused {ds.uri.canonical}: "
                            f"{reply.status} {_error(reply)}")  # fmt: skip

    async def _exchange(
        self,
        member: MemberState,
        method: str,
        target: str,
        body: bytes = b"",
        check: Callable[[PeerReply], memoryview] | None = None,
        most: int | None = None,
        slot_wait: float | None = None,
    ) -> tuple[PeerReply, memoryview | None]:
        """One exchange with a member, in a worker thread, at most PEER_POOL at once per
        member: (the answer, `check` of a 200 answer, run in the same thread: a chunk's
        blocks are checked off the loop). The time it took is counted as waiting on
        peers. PeerError "busy" (the member left up) if no exchange with it frees within
        `slot_wait` seconds."""
        config = self.config
        assert config is not None
        pool, slots = self.pools.get(member.address), self.slots.get(member.address)
        if pool is None or slots is None:  # a list put in force since left it out
            raise PeerError("refused", f"{member.address} is no longer a member")
        bounds = Bounds(config.peer_timeout_seconds, float(config.peer_floor_rate))
        if slot_wait is None:
            await slots.acquire()
        else:
            with trio.move_on_after(slot_wait) as waited:
                await slots.acquire()
            if waited.cancelled_caught:
                raise PeerError("busy", f"{member.address}: its {PEER_POOL} exchanges "
                                f"all busy for {slot_wait:g}s")  # fmt: skip
        try:
            if not member.up and not member.probing:
                raise PeerError("refused", f"{member.address} is down: {member.last_error}")
            t0 = trio.current_time()
            try:
                return await trio.to_thread.run_sync(
                    functools.partial(
                        pool.request_checked, method, target, bounds, body, check, most=most
                    ),
                    limiter=self.threads,
                    abandon_on_cancel=True,
                )
            finally:
                with COUNTS:
                    member.counters.wait_seconds += trio.current_time() - t0
        finally:
            slots.release(on_loop=True)

    def _verified(self, member: MemberState, reply: PeerReply, ref: ChunkRef) -> memoryview:
        """The chunk's data if the member's value is exactly this node's ChunkRef: the
        header's checksum and identity (content id, chunk size, index, length) and every
        block's xxh3; PeerError naming why not. verify_chunk checks all of it; only a
        value that fails is decoded again, to name why."""
        body = reply.body
        try:
            return verify_chunk(body, ref.obj.content_id, ref.chunk_size, ref.index, ref.length)
        except ChunkFormatError:
            pass
        try:
            h = decode_header(body)
        except ChunkFormatError as exc:
            reason = "short" if len(body) < ref.length else "corrupt"
            raise PeerError(reason, f"{member.address}: {exc}") from None
        if (h.index, h.chunk_size, h.content_id) != (ref.index, ref.chunk_size, ref.obj.content_id):
            raise PeerError("foreign", f"{member.address} answered another chunk")
        if h.length != ref.length:
            reason = "short" if h.length < ref.length else "foreign"
            raise PeerError(reason, f"{member.address} answered {h.length} of {ref.length} bytes")
        try:
            return verify_chunk(body, ref.obj.content_id, ref.chunk_size, ref.index, ref.length)
        except ChunkFormatError as exc:
            raise PeerError("corrupt", f"{member.address}: {exc}") from None

    def _failed(
        self,
        member: MemberState,
        counters: tuple[PeerCounters, ...],
        exc: PeerError,
        ds: DatasetState,
        ref: ChunkRef,
    ) -> None:
        self._count_failure(member, counters, exc)
        self._warn(
            member.address,
            exc.reason,
            f"chunk {ref.index} of {ds.uri.canonical}{ref.obj.key} from {member.address} "
            f"failed ({exc.reason}: {exc}); reading it from the store",
        )

    def _count_failure(
        self, member: MemberState, counters: tuple[PeerCounters, ...], exc: PeerError
    ) -> None:
        """Count a failed exchange by reason; mark the member down if it is its own."""
        for c in counters:
            c.error(exc.reason)
        if exc.reason in MEMBER_FAILURES or _member_refuses(exc):
            assert self.membership is not None
            self.membership.mark_down(member.address, str(exc))

    async def _fallback(
        self,
        ds: DatasetState,
        limiter: TokenBucket,
        ref: ChunkRef,
        refetch: bool,
        counters: tuple[PeerCounters, ...],
    ) -> PeerRead:
        """The chunk from the store by this node, charged to its job; not admitted here
        (it is another member's) unless keep_peer_copies."""
        for c in counters:
            c.store_fallbacks += 1
        data, did = await self.d.fetcher.fetch(
            ds.id, ds.backend, limiter, ref, replace=refetch,
            admit=refetch or self.config_keep_copies(),
        )  # fmt: skip
        return PeerRead(data, "remote", ref.length if did else 0, fallback=True)

    def _warn(self, address: str, reason: str, message: str) -> None:
        now = time.monotonic()
        key = (address, reason)
        if now - self._warned.get(key, -WARN_EVERY) >= WARN_EVERY:
            self._warned[key] = now
            log.warning("%s", message)
        else:
            log.debug("%s", message)

    def dataset_counters(self, uri: str) -> PeerCounters:
        c = self.datasets.get(uri)
        if c is None:
            with COUNTS:  # a connection's thread may make it too
                c = self.datasets.setdefault(uri, PeerCounters())
        return c

    def forget_counters(self, uri: str) -> None:
        """A dataset's peer counters, dropped (one members introduced, forgotten)."""
        with COUNTS:
            self.datasets.pop(uri, None)

    def incoming_counters(self, name: str) -> PeerCounters:
        c = self.incoming.get(name)
        if c is None:
            with COUNTS:
                if len(self.incoming) >= 4096:  # names are certificates of the CA: bounded
                    self.incoming.clear()
                c = self.incoming.setdefault(name, PeerCounters())
        return c

    def homed_here(self, refs: list[ChunkRef], ref: ChunkRef) -> list[ChunkRef]:
        """The run of `refs` around `ref` whose chunks are homed at this node: a
        read-ahead span covers only this node's chunks (the others are their homes')."""
        if self.membership is None:
            return refs
        at = next((i for i, r in enumerate(refs) if r.key == ref.key), None)
        if at is None:
            return [ref]
        lo = at
        while lo > 0 and self.membership.is_home(refs[lo - 1].key):
            lo -= 1
        hi = at + 1
        while hi < len(refs) and self.membership.is_home(refs[hi].key):
            hi += 1
        return refs[lo:hi]

    # -- warm ----------------------------------------------------------------------
    async def warm_ask(
        self, member: MemberState, ds: DatasetState, limiter: TokenBucket, job: str, ref: ChunkRef
    ) -> str:
        """Ask a chunk's home to hold it (a warm): "held", "admitted" (committed there),
        "full", or "failed" (counted, and the member marked down, where the exchange
        failed; or the home's Writer dropped it: asked again later)."""
        counters = (member.counters, self.dataset_counters(ds.uri.canonical))
        try:
            reply, _, _ = await self._chunk_exchange(member, ds, limiter, job, ref, warm=True)
            outcome = _peer_json(reply).get("chunk")
        except PeerError as exc:
            self._count_failure(member, counters, exc)
            return "failed"
        except (ValueError, AttributeError):
            return "failed"
        return outcome if outcome in ("held", "admitted", "full") else "failed"

    # -- probing and shares --------------------------------------------------------
    async def probe_loop(self) -> None:
        """Ping members due a probe (down ones when their backoff ends, up ones every
        PING_SECONDS), close idle connections, pull newer shares. Runs for the daemon's
        life; a member list applied later is picked up on the next tick."""
        try:
            await self._probe_forever()
        finally:
            self._nursery = None  # closed: shares are pushed again by the next prober

    async def _probe_forever(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            token = trio.lowlevel.current_trio_token()
            self.thread_asks.token = token  # connection threads may ask from here on
            for slots in self.slots.values():
                slots.token = token
            while True:
                await trio.sleep(PROBE_TICK)
                if self.membership is None:
                    continue
                for m in self.membership.due():
                    self._start_probe(nursery, m)
                for pool in self.pools.values():
                    pool.sweep()
                if self.membership.came_up != self._swept and not self._sweeping:
                    self._sweeping = True
                    nursery.start_soon(self._sweep_standins, self.membership.came_up)

    async def _sweep_standins(self, came_up: int) -> None:
        """Drop the copies this node holds for members answering now (node/standins.py)."""
        assert self.membership is not None
        if self.config_keep_copies():  # copies of members' chunks are kept by choice
            self._swept, self._sweeping = came_up, False
            return
        try:
            # Whose copies go is decided only after the copies offered so far are
            # committed, by pings sent after that: a member found up earlier may have
            # died since unnoticed here (this node has not asked it since), while the
            # others, knowing it down, had this node fetch and admit its chunks; the
            # sweep a third member's return started deleted those, the only copies.
            await self.d.writer.flush()
            since = self.membership.clock()
            answering = await self._answering_since(since)
            homed_live = homed_live_by(self.membership.placed_by(), answering)
            await sweep_standins(self.d.writer, self.d.store, homed_live)
        except Exception as exc:  # a full map, an I/O error: tried again when the next
            # member comes up (not on every tick: one warning, not one per half second)
            log.warning("cluster: the sweep of stand-in copies failed: %s", describe(exc))
        finally:
            self._swept = came_up
            self._sweeping = False

    async def _answering_since(self, since: float) -> frozenset[str]:
        """The other members that answer a ping sent at `since` or later: each member up
        is pinged now (a probe in flight is waited for; its answer counts only if it was
        sent at `since` or later, else the member is pinged again)."""
        assert self.membership is not None

        async def confirm(m: MemberState) -> None:
            while m.up and m.last_ok < since:
                flying = self._probes.get(m.address)
                if flying is not None:
                    await flying.wait()
                else:
                    async with trio.open_nursery() as nursery:
                        self._start_probe(nursery, m)

        async with trio.open_nursery() as nursery:
            for m in self.membership.peers():
                nursery.start_soon(confirm, m)
        return self.membership.answering(since)

    async def recheck(self, addresses: set[str]) -> None:
        """Ping now those of these members that are down, rather than when their backoff
        ends (a warm about to ask them for their chunks again): each is up, or down
        again, by its answer. A member whose probe is in flight (the prober's, or
        another recheck's) is not pinged again: its answer is waited for, so one failed
        ping is one failure (a second would double the backoff and the error count)."""
        assert self.membership is not None
        down = [m for a in addresses if (m := self.membership.members.get(a)) and not m.up]
        async with trio.open_nursery() as nursery:
            for m in down:
                flying = self._probes.get(m.address)
                if flying is not None:
                    nursery.start_soon(flying.wait)
                else:
                    self._start_probe(nursery, m)

    def contacted(self, names: Iterable[str]) -> None:
        """A member's certificate (`names`) called a peer route, from a connection's
        thread or the loop: the members of its hosts that are down here are probed now
        (Membership.contact_due), on the loop, rather than when their backoff ends. At
        most once per host per PING_SECONDS: a member this node cannot reach but that
        reaches it (a one-way fault) is probed no more often than an up member is
        pinged, however often it calls. Costs an attribute test while every member is
        up (every member request calls it); never waits."""
        membership = self.membership
        if membership is None or not membership.down_hosts:
            return
        token = self.thread_asks.token  # the loop's, once the prober runs
        hosts = membership.down_of(names)
        if token is None or not hosts:
            return
        now = membership.clock()
        if all(self._contact_quiet.get(h, 0.0) > now for h in hosts):
            return
        for h in hosts:  # two threads may both pass: the loop starts one probe a member
            self._contact_quiet[h] = now + PING_SECONDS
        try:
            token.run_sync_soon(self._probe_contacted, hosts)
        except trio.RunFinishedError:
            pass  # the daemon is stopping

    def _probe_contacted(self, hosts: frozenset[str]) -> None:
        """On the loop: contacted()'s probes (the state asked again: a probe may have
        started meanwhile, or another list be in force)."""
        if self.membership is None or self._nursery is None:
            return
        for m in self.membership.contact_due(hosts):
            log.debug("cluster member %s, down here, called this node: probed now", m.address)
            self._start_probe(self._nursery, m)

    def _start_probe(self, nursery: trio.Nursery, member: MemberState) -> None:
        member.probing = True
        self._probes[member.address] = done = trio.Event()

        async def probe() -> None:
            try:
                async with self._probing:
                    await self._probe(member)
            finally:
                if self._probes.get(member.address) is done:
                    del self._probes[member.address]
                done.set()

        nursery.start_soon(probe)

    async def _probe(self, member: MemberState) -> None:
        """Ping a member (`probing` set: a down member's exchange needs it): up, or down
        for its backoff, by its answer; pull its shares if they differ from ours."""
        assert self.membership is not None
        asked = self.membership.clock()
        try:
            reply, _ = await self._exchange(member, "GET", PING_PATH, most=MAX_SMALL_ANSWER)
            if reply.status != 200:
                raise PeerError(
                    "http", f"{member.address}: ping {reply.status} {_error(reply)}", reply.status
                )
            pong = _peer_json(reply)
            if pong.get("name") != self.membership.name:
                raise PeerError("http", f"{member.address} is of cluster {pong.get('name')!r}")
        except (PeerError, ValueError, AttributeError) as exc:
            reason = exc.reason if isinstance(exc, PeerError) else "http"
            member.counters.error(reason)
            self.membership.mark_down(member.address, str(exc), probe=True)
            return
        finally:
            member.probing = False
        if not self.membership.mark_up(member.address, asked_at=asked):
            return  # it failed since this ping was sent: down, for its next probe
        self._compare_lists(member, pong)
        # Tables merge entry by entry: one that differs may hold a change we missed.
        version, digest = pong.get("allocations_version"), pong.get("allocations_digest")
        if (isinstance(version, int) and version > self.shares.version) or (
            isinstance(digest, str) and digest != self.shares.digest
        ):
            await self._pull_shares(member)

    def _compare_lists(self, member: MemberState, pong: dict) -> None:
        """Note a member that places chunks by another list than this node's (a list
        pushed to some nodes only, silofs.toml files edited apart): every miss asked
        of a home the other side does not count one, read from the store twice, the
        shares' parts summing to more or less than the share, and nothing said. Warned
        once per pair of lists, when a second ping PING_SECONDS later still finds them
        apart: a `cluster set` reaches the nodes one after the other, and a ping may
        fall between two of its pushes. A member that does not say (an older one) is
        taken as agreeing."""
        assert self.membership is not None
        digest, version = pong.get("members_digest"), pong.get("members_version")
        n = pong.get("members_count")
        if not (isinstance(digest, str) and _is_int(version) and _is_int(n)):
            return
        member.their_list = (version, n, digest[:64])
        if digest == self.membership.digest:
            member.list_differs_since = None
            return
        now = self.membership.clock()
        if member.list_differs_since is None:
            member.list_differs_since = now
            return
        key = (member.address, digest[:64], self.membership.digest)
        if now - member.list_differs_since < PING_SECONDS or key in self._lists_warned:
            return
        if len(self._lists_warned) >= 4096:  # a member saying a new list every ping
            self._lists_warned.clear()
        self._lists_warned.add(key)
        log.warning(
            "cluster member %s places chunks by another member list (version %d, %s) "
            "than this node (version %d, %s): each asks homes the other does not count, "
            "and reads their chunks from the store; push one list to every node "
            "(`silofs-ctl cluster set --members ...`, without --nodes)",
            member.address,
            version,
            count(n, "member"),
            self.membership.version,
            count(len(self.membership.members), "member"),
        )

    async def _pull_shares(self, member: MemberState) -> None:
        if trio.current_time() < self._no_pull_until.get(member.address, -math.inf):
            return
        # Unless it brings news (a failed, refused or useless pull, or one cancelled).
        self._no_pull_until[member.address] = trio.current_time() + PULL_BACKOFF
        try:
            reply, _ = await self._exchange(member, "GET", ALLOCATIONS_PATH, most=MAX_SHARES_ANSWER)
            if reply.status != 200:
                return
            parsed = check_shares(_peer_json(reply), now=now_version())
        except (PeerError, ValueError) as exc:
            log.debug("pulling cache shares from %s failed: %s", member.address, exc)
            return
        try:
            accepted = await self.shares.accept(*parsed[1:])
        except UsageError as exc:
            log.warning("cache shares of %s refused: %s", member.address, exc)
            return
        if accepted:  # it had news: the next difference is pulled at once
            self._no_pull_until.pop(member.address, None)
            self.d.allocs.notify()

    async def set_share(self, uri: str, size: int | None) -> dict[str, str]:
        """allocate-cache on a clustered node: the dataset's share of the cluster's
        caches, set here and pushed to every member; the members it did not reach, with
        why. UsageError if this node's part, with its other allocations, would exceed
        its cache."""
        assert self.membership is not None
        part = self.part_of(size)
        if part is not None:
            others = sum(v for k, v in self.parts().items() if k != uri and v is not None)
            others += sum(
                v
                for k, v in self.d.allocs.cache.items()
                if k != uri and k not in self.shares.shares
            )
            if others + part > self.d.cache_size:
                # Said in sizes, with the most this share can be: "357913941 bytes"
                # left the operator to work out what the cluster holds.
                room = max(0, self.d.cache_size - others)
                most = int(room * self.membership.total_weight() / self.membership.self_weight())
                raise UsageError(
                    f"a share of {format_size(size or 0)} puts {format_size(part)} of {uri} "
                    f"on this node (its weight's part), which with its other allocations "
                    f"({format_size(others)}) exceeds its cache "
                    f"({format_size(self.d.cache_size)}): the cluster's caches give it at "
                    f"most {format_size(most)} (or free this node's other allocations)"
                )
        await self.shares.set(uri, size)
        self.d.allocs.notify()
        return await self._push_all()

    async def _push_all(self) -> dict[str, str]:
        """Push the share table to every other member at once and wait for the answers
        (each bounded as any exchange: a down member is refused at once), so a warm run
        right after allocate-cache finds every reachable home holding its part. The
        members not reached, with why: they pull the table when a ping finds it differs."""
        if self.membership is None:
            return {}
        body = json.dumps(self.shares.view()).encode()
        missed: dict[str, str] = {}
        async with trio.open_nursery() as nursery:
            for m in self.membership.peers():
                nursery.start_soon(self._push_shares, m, body, missed)
        return missed

    async def _push_shares(self, member: MemberState, body: bytes, missed: dict[str, str]) -> None:
        try:
            reply, _ = await self._exchange(
                member, "PUT", ALLOCATIONS_PATH, body, most=MAX_SMALL_ANSWER
            )
            if reply.status != 200:
                raise PeerError("http", f"{reply.status} {_error(reply)}")
        except PeerError as exc:
            missed[member.address] = str(exc)
            log.info("cache shares not pushed to %s (it pulls them when back): %s",
                     member.address, exc)  # fmt: skip

    async def accept_shares(self, body: dict) -> bool:
        try:
            parsed = check_shares(body, now=now_version())
        except ValueError as exc:
            raise UsageError(f"cache shares refused: {exc}") from None
        accepted = await self.shares.accept(*parsed[1:])
        if accepted:
            self.d.allocs.notify()
        return accepted

    def part_of(self, size: int | None) -> int | None:
        assert self.membership is not None
        if size is None:
            return None
        return int(size * self.membership.self_weight() / self.membership.total_weight())

    def parts(self) -> dict[str, int | None]:
        """This node's part of every dataset share (None: the share was cleared)."""
        if self.membership is None:
            return {}
        return {uri: self.part_of(size) for uri, size in self.shares.shares.items()}

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.home.close()


def _aliases(own: str, members: list[str], listen: tuple[str, int]) -> list[str]:
    """The members other than `own` whose address reaches this node's own listener:
    tcp_listen's port, and a host resolving to an address the listener accepts (any
    address of this host when it listens on all of them). A certificate may name several
    nodes, so its names cannot tell; the addresses can. Names that do not resolve here
    are not this node (a member may be down or not yet in DNS)."""
    host, port = listen
    wildcard = host in ("0.0.0.0", "::")
    accepted = set() if wildcard else _resolve(host)
    candidates = []
    for address in members:
        if address == own:
            continue
        m_host, m_port = parse_tls_url(address)
        if m_port == port:
            candidates.append((address, m_host))
    resolved = _resolve_all(list(dict.fromkeys(h for _, h in candidates)))  # in list order
    out = []
    for address, m_host in candidates:
        ips = resolved[m_host]
        if ips & accepted or (wildcard and any(_is_local(ip) for ip in ips)):
            out.append(address)
    return out


def _resolve_all(hosts: list[str]) -> dict[str, set[str]]:
    """Each host's addresses, looked up RESOLVE_THREADS at once; those not answered
    within RESOLVE_SECONDS (in all) resolve nowhere. Lookups still running then are left
    to end in their threads (getaddrinfo cannot be cancelled); those not begun are
    dropped."""
    if not hosts:
        return {}
    pool = concurrent.futures.ThreadPoolExecutor(
        min(RESOLVE_THREADS, len(hosts)), thread_name_prefix="silofs-resolve"
    )
    try:
        futures = {h: pool.submit(_resolve, h) for h in hosts}
        done, late = concurrent.futures.wait(futures.values(), timeout=RESOLVE_SECONDS)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if late:
        log.warning(
            "%d of %s not resolved within %gs: taken as not this node",
            len(late), count(len(hosts), "member host name"), RESOLVE_SECONDS,
        )  # fmt: skip
    return {h: f.result() if f in done else set() for h, f in futures.items()}


def _resolve(host: str) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {str(info[4][0]) for info in infos}


def _is_local(ip: str) -> bool:
    """Whether `ip` is an address of this host: a loopback address, or one the kernel
    routes to itself (its route's source is the address itself; a bind test would say
    yes to any address where ip_nonlocal_bind is set)."""
    address = ipaddress.ip_address(ip.partition("%")[0])
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))  # a datagram socket's connect sends nothing
            return s.getsockname()[0] == ip
        except OSError:
            return False


def _charge(reply: PeerReply, ref: ChunkRef) -> int:
    text = reply.headers.get(CHARGE_HEADER, "")
    if not is_digits(text) or int(text) > ref.length:
        raise PeerError("http", f"428 with a charge of {text[:40]!r} for a {ref.length}-byte chunk")
    return int(text)


def _peer_json(reply: PeerReply) -> Any:
    """A member's JSON answer; ValueError for anything else. json.loads raises
    RecursionError on deep nesting ("[[[[..."), which the callers' ValueError did not
    catch: a member answering so failed the read it was asked for (EIO), or ended a
    ping's task."""
    try:
        return json.loads(reply.body)
    except RecursionError:
        raise ValueError("a JSON answer nested too deeply") from None


def _error(reply: PeerReply) -> str:
    try:
        return str(_peer_json(reply)["error"])[:300]
    except (ValueError, KeyError, TypeError):
        return bytes(reply.body[:100]).decode("latin-1")


def _member_refuses(exc: PeerError) -> bool:
    """An HTTP answer that says the member will not serve this node (403: it does not
    count this node a member; 5xx but 502, its store's failure): down for its backoff."""
    s = exc.status
    return s is not None and (s == 403 or (500 <= s < 600 and s != 502))


def _row(config: ClusterSettings) -> dict:
    row = {
        "name": config.name,
        "members": [{"address": m.address, "weight": m.weight} for m in config.members],
        "version": config.version,
    }
    for key in PEER_KEYS:
        row[key] = getattr(config, key)
    return row


def _persisted(store: Any) -> ClusterSettings | None:
    row = store.get_meta(META_ROW)
    if not isinstance(row, dict):
        return None
    try:
        fields = {k: v for k, v in row.items() if k != "version" and v is not None}
        return parse_cluster(fields, version=int(row.get("version", 0)))
    except (UsageError, ValueError, TypeError) as exc:
        log.warning("ignoring the persisted cluster member list: %s", exc)
        return None


def _certificate_names(path: str) -> set[str]:
    """The DNS and IP names of this node's certificate."""
    cert = _load_certificate(path)
    from cryptography import x509

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {n.lower() for n in san.get_values_for_type(x509.DNSName)} | {
        str(ip) for ip in san.get_values_for_type(x509.IPAddress)
    }


def _names_host(names: set[str], host: str) -> bool:
    """Whether a certificate with these DNS/IP names is one for `host` as a TLS client
    checks it: the name itself, or a wildcard's one leftmost label."""
    if host in names:
        return True
    try:
        ipaddress.ip_address(host)
        return False  # an address is never a wildcard's
    except ValueError:
        pass
    _, dot, parent = host.partition(".")
    return bool(dot) and f"*.{parent}" in names


def _issued_by_ca(cert_path: str, ca_path: str) -> bool | None:
    """Whether the certificate in `cert_path` (or an intermediate in the same file) is
    issued by a CA of the bundle `ca_path`; None when either cannot be read as PEM
    (loading them says why)."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        with open(cert_path, "rb") as f:
            chain = x509.load_pem_x509_certificates(f.read())
        with open(ca_path, "rb") as f:
            cas = x509.load_pem_x509_certificates(f.read())
    except (OSError, ValueError):
        return None
    for cert in chain:
        for ca in cas:
            if cert.issuer != ca.subject:
                continue
            try:
                cert.verify_directly_issued_by(ca)
                return True
            except (InvalidSignature, ValueError, TypeError):  # TypeError: a key type
                continue
    return False


def _load_certificate(path: str) -> Any:
    from cryptography import x509

    try:
        with open(path, "rb") as f:
            return x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError) as exc:
        raise UsageError(f"tls_cert: cannot read {path}: {exc}") from None


def _member_context(settings: NodeSettings) -> ssl.SSLContext:
    """This node as the other members' client: its certificate must carry the node role
    and the clientAuth purpose (certificates made before clusters have neither)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from silofs.control.tls import NODE_ROLE_URI

    assert settings.tls_cert and settings.tls_key and settings.tls_client_ca
    cert = _load_certificate(settings.tls_cert)
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        client = ExtendedKeyUsageOID.CLIENT_AUTH in usages
    except x509.ExtensionNotFound:
        client = True  # no EKU: every purpose
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        node = NODE_ROLE_URI in san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        node = False
    if not (client and node):
        raise UsageError(
            f"{settings.tls_cert} is not a cluster member's certificate (no node role or "
            "clientAuth): a node needs a new certificate to join a cluster: "
            "`silofs-ctl certs node DIR NAME --address HOST`"
        )
    # The members check each other's certificates against their tls_client_ca: one of
    # another CA (another cluster's directory) started as if all were well, every member
    # refusing it and it them, each side's log saying only that handshakes failed.
    if _issued_by_ca(settings.tls_cert, settings.tls_client_ca) is False:
        raise UsageError(
            f"tls_cert {settings.tls_cert} is not issued by the CA in tls_client_ca "
            f"{settings.tls_client_ca} (another cluster's CA?): the members would refuse "
            "it; make this node's certificate with `silofs-ctl certs node DIR NAME "
            "--address HOST`, DIR the directory of that ca.pem"
        )
    return _client_context(settings.tls_cert, settings.tls_key, settings.tls_client_ca)


def _client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """client_context, or UsageError in the words the listener's start uses (which runs
    after this one with [cluster]): the file and what is wrong with it. OpenSSL's own
    were "[X509: KEY_VALUES_MISMATCH] key values mismatch" or "[Errno 2] No such file
    or directory", naming none of the three files."""
    from silofs.control.tls import (
        NO_PASSPHRASE,
        ca_load_problem,
        chain_load_problem,
        key_file_problem,
    )

    if problem := key_file_problem(key):
        raise UsageError(f"tls_key: {problem}")
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        probe.load_cert_chain(cert, key, password=NO_PASSPHRASE)
    except (OSError, ssl.SSLError) as exc:
        why = chain_load_problem(cert, key, exc)
        if not isinstance(exc, ssl.SSLError):  # which of the two: the cert was read
            why = f"{key}: {why}"
        raise UsageError(f"tls_cert/tls_key: cannot load {cert} / {key}: {why}") from None
    try:
        return client_context(cert, key, ca)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"tls_client_ca: cannot load {ca}: {ca_load_problem(ca, exc)}") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = ["Cluster", "PeerRead"]
