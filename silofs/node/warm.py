"""Warming a dataset: fill its cache share with a uniform random sample of its chunks.

Owns one warm task per dataset: the chunks of the listed objects that match the globs,
in random order, skipping those the dataset already holds (so a warm resumes where a
stopped one ended), fetched through the Fetcher (single-flight with mounts' misses,
charged to the job's token bucket first: promise 2) until the dataset's quota is full.
Random order is what keeps promise 1's hit ratio (cache/dataset whatever the access
order) when the quota is smaller than the dataset: the warm stops at the first chunk
that does not fit rather than looking for smaller ones, which would bias the sample.
An untrusted peer's warm fetches only the local files it could read itself
(docs/SECURITY.md). In a cluster the walk spans the members: a chunk placed here (among
the configured members, as the parts of a share are) is fetched as alone, one placed at
another member is sent to it (node/cluster.py warm_ask), a down member's chunks wait
for it, until every member says its part of the share is full. Progress lives in
WarmState, shown in the dataset view. Never writes LMDB (the Writer admits what the
Fetcher offers) and never decides a quota.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from silofs.cache.format import ChunkRef
from silofs.errors import BackendError, UsageError
from silofs.node.fetch import BACKGROUND
from silofs.node.fill_budget import FillBudget
from silofs.node.state import DatasetState
from silofs.records import ObjectInfo
from silofs.units import count, format_size

log = logging.getLogger(__name__)

WARM_CONCURRENCY = 8  # chunks in flight per warm; the Fetcher's thread limit still applies
# The shuffled list of chunks costs ~250 B per chunk the dataset does not hold: 8 M chunks
# (32 TiB at 4 MiB chunks) is ~2 GB of daemon memory. Beyond it, warm parts (--paths).
WARM_MAX_CHUNKS = 8_000_000
# Rounds of asking again the chunks whose home's warm ask failed, and the pause before
# each (long enough for a busy home to be probed again).
WARM_RETRIES = 2
WARM_RETRY_PAUSE = 1.0


@dataclass
class WarmState:
    job: str
    paths: list[str]
    chunk_size: int
    uid: int  # who started it: they (or root) may cancel it
    # An untrusted peer's (uid, gids): of a local dataset, only the objects it could
    # read itself are fetched (docs/SECURITY.md). None: root, admins, the daemon's user.
    reader: tuple[int, frozenset[int]] | None = None
    state: str = "running"  # running | done | cancelled | error
    matched_bytes: int = 0  # bytes of the objects the globs match
    matched_objects: int = 0  # objects the globs match (0: --paths named nothing)
    target_bytes: int = 0  # min(quota when it started, matched_bytes)
    skipped_bytes: int = 0  # matching bytes the dataset already held when it started
    fetched_bytes: int = 0
    chunks_total: int = 0  # chunks it did not hold when it started
    chunks_done: int = 0  # of those, fetched
    denied_objects: int = 0  # matching objects skipped: the reader may not read them
    # Chunks a peer's warm ask failed for, after the retries (the walk goes on without
    # them): the share is that much short of full, and the CLI says so.
    failed_chunks: int = 0
    # monotonic (elapsed_s is a duration: a wall clock stepped back made it negative)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    error: str = ""
    scope: trio.CancelScope = field(default_factory=trio.CancelScope, repr=False)

    def view(self) -> dict[str, Any]:
        done = min(self.skipped_bytes + self.fetched_bytes, self.target_bytes)
        elapsed = (self.finished or time.monotonic()) - self.started
        return {
            "state": self.state,
            "job": self.job,
            "paths": self.paths,
            "chunk_size": self.chunk_size,
            "matched_bytes": self.matched_bytes,
            "matched_objects": self.matched_objects,
            "target_bytes": self.target_bytes,
            "done_bytes": done,
            "skipped_bytes": self.skipped_bytes,
            "fetched_bytes": self.fetched_bytes,
            "chunks_total": self.chunks_total,
            "chunks_done": self.chunks_done,
            "denied_objects": self.denied_objects,
            "failed_chunks": self.failed_chunks,
            "elapsed_s": round(elapsed, 2),
            "bytes_per_s": round(self.fetched_bytes / elapsed) if elapsed > 0 else 0,
            "error": self.error or None,
        }


def matches(key: str, globs: list[str]) -> bool:
    """fnmatch on the object key (its path in the mount); `*` also matches '/'. `[...]`
    is a set: a literal '[' is `[[]` (checked by glob_error first)."""
    return not globs or any(fnmatch.fnmatchcase(key, g) for g in globs)


def glob_error(glob: str) -> str | None:
    """Why `glob` is refused, or None. A '[' whose set no ']' closes: fnmatch would take
    it as a literal '[' and every later '[' too, silently unlike what was meant (a set
    missing its end is a typo far more often than a key with '['), so it is named, with
    the way to a literal '['. Scans as fnmatch.translate does: after '[' an optional '!'
    and a first ']' are members, and the set ends at the next ']'."""
    i, n = 0, len(glob)
    while i < n:
        if glob[i] != "[":
            i += 1
            continue
        j = i + 1
        if j < n and glob[j] == "!":
            j += 1
        if j < n and glob[j] == "]":
            j += 1
        while j < n and glob[j] != "]":
            j += 1
        if j >= n:
            return (
                f"glob {glob!r}: the '[' at {i} starts a set no ']' closes "
                "(a literal '[' is written '[[]')"
            )
        i = j + 1
    return None


def readable(
    ds: DatasetState, objects: list[ObjectInfo], uid: int, gids: frozenset[int]
) -> tuple[list[ObjectInfo], list[str]]:
    """(the objects uid/gids could read themselves, the keys of those they may not): of
    a local dataset, the check GET /v1/chunks makes (node/backends/local.py
    check_peer_read); of a cloud dataset, all ([access] grants a whole prefix). Runs in
    a worker thread: one walk per directory (check_peer_read_many), then an openat per
    file through the directory's fd. One path walk per object made a million-file warm
    plan for ~2 minutes before its first fetch."""
    one = getattr(ds.backend, "check_peer_read", None)
    many = getattr(ds.backend, "check_peer_read_many", None)
    if ds.uri.scheme != "file" or (one is None and many is None):
        return objects, []
    # Each error: denied, changed since listing, or gone.
    bad: dict[str, BackendError | OSError] = {}
    if many is not None:
        bad = many(objects, uid, gids)
    else:  # a backend with the one-object check only: fail closed, object by object
        for o in objects:
            try:
                one(o, uid, gids)
            except (BackendError, OSError) as exc:
                bad[o.key] = exc
    ok = [o for o in objects if o.key not in bad]
    denied = [o.key for o in objects if o.key in bad]
    if denied:
        log.warning(
            "warm of %s by uid %d skips %s it may not read (e.g. %s)",
            ds.uri.canonical,
            uid,
            count(len(denied), "object"),
            denied[0],
        )
    return ok, denied


async def run_warm(d: Any, ds: DatasetState, w: WarmState) -> None:
    """The warm task; ends done, cancelled or in error, never raising. `d` is the
    Daemon (node/daemon.py imports this module, so it is not imported back)."""
    BACKGROUND.set(True)  # this task's and its children's GETs leave misses a share
    with w.scope:
        try:
            await _warm(d, ds, w)
            w.state = "done"
        except (BackendError, UsageError) as exc:
            w.state, w.error = "error", str(exc)
            log.error("warm of %s stopped: %s", ds.uri.canonical, exc)
    if w.scope.cancelled_caught:
        w.state = "cancelled"
    w.finished = time.monotonic()
    log.info(
        "warm of %s for job %s %s: %s skipped (cached), %s fetched",
        ds.uri.canonical,
        w.job,
        w.state,
        format_size(w.skipped_bytes),
        format_size(w.fetched_bytes),
    )


async def _warm(d: Any, ds: DatasetState, w: WarmState) -> None:
    clustered = d.cluster.active and d.cluster.shareable(ds)
    # In a cluster, a chunk held here counts as held only if it is this node's to hold:
    # one homed at another member (admitted here while that member was down) is still
    # asked of it, or its part stays short by it.
    placed = d.cluster.membership.placed_by() if clustered else None
    here = d.cluster.membership.self_address if clustered else None

    def plan() -> tuple[int, list[ChunkRef], int]:
        """(matched bytes, chunks to walk, bytes held), in one read txn; the owners rows
        answer without faulting in chunk values."""
        objects = [o for o in d.store.iter_listing(ds.id) if matches(o.key, w.paths)]
        w.matched_objects = len(objects)
        if w.reader is not None:
            objects, denied = readable(ds, objects, *w.reader)
            w.denied_objects = len(denied)
        chunks = sum(max(1, -(-o.size // w.chunk_size)) for o in objects)
        if chunks > WARM_MAX_CHUNKS:
            raise UsageError(
                f"{chunks} chunks match: more than one warm takes ({WARM_MAX_CHUNKS}); "
                "warm the dataset in parts with --paths"
            )
        matched, missing, held_bytes = sum(o.size for o in objects), [], 0
        with d.store.read_txn() as txn:
            for o in objects:
                # A zero-byte object is one empty chunk, as the mount reads it.
                for i in range(max(1, -(-o.size // w.chunk_size))):
                    ref = ChunkRef.of(o, w.chunk_size, i)
                    mine = placed is None or placed(ref.key) == here
                    if mine and d.store.owns(txn, ds.id, ref.key):
                        held_bytes += ref.length
                    else:
                        missing.append(ref)
        return matched, missing, held_bytes

    w.matched_bytes, refs, w.skipped_bytes = await trio.to_thread.run_sync(plan)
    random.shuffle(refs)
    w.chunks_total = len(refs)

    budget = FillBudget(d, ds.id)
    w.target_bytes = min(budget.quota(), w.matched_bytes)
    limiter = d.job(w.job).limiter
    slots = trio.Semaphore(WARM_CONCURRENCY)
    failure: list[BackendError] = []
    if clustered:
        share = d.cluster.shares.share(ds.uri.canonical)
        w.target_bytes = w.matched_bytes if share is None else min(share, w.matched_bytes)
        await _walk_cluster(d, ds, w, refs, budget, limiter, slots, failure)
        await d.writer.flush()
        if failure:
            raise failure[0]
        return

    fetch = functools.partial(_fetch_here, d, ds, w, limiter, budget, slots, failure)

    async with trio.open_nursery() as nursery:
        for ref in refs:
            if failure or not await budget.fits(ref.length):
                break
            await slots.acquire()
            budget.started(ref.length)
            nursery.start_soon(fetch, ref)
    await d.writer.flush()  # admitted before the warm says done
    if failure:
        raise failure[0]


async def _fetch_here(
    d: Any,
    ds: DatasetState,
    w: WarmState,
    limiter: Any,
    budget: FillBudget,
    slots: trio.Semaphore,
    failure: list[BackendError],
    ref: ChunkRef,
) -> None:
    """One chunk of the walk fetched by this node (admitted if its dataset has room);
    its slot and budget released whatever happens, a failure kept for the walk."""
    data = b""
    try:
        data, fetched = await d.fetcher.fetch(ds.id, ds.backend, limiter, ref)
    except BackendError as exc:
        failure.append(exc)
        return
    finally:
        budget.ended(ref.length, len(data))
        slots.release()
    w.chunks_done += 1
    w.fetched_bytes += len(data)
    if fetched:
        for c in (ds.fetch, d.job(w.job).fetch):
            c.remote_gets += 1
            c.remote_bytes += len(data)
            c.remote_requests += 1


async def _walk_cluster(
    d: Any,
    ds: DatasetState,
    w: WarmState,
    refs: list[ChunkRef],
    budget: FillBudget,
    limiter: Any,
    slots: trio.Semaphore,
    failure: list[BackendError],
) -> None:
    """The random walk of a clustered dataset: each chunk goes to the member it is
    placed at among the configured members (whose part of the share it fills): one
    placed here is fetched as alone (while this node's part has room); one placed at
    another member is sent to it (a warm ask: it fetches it, charged to this job, if
    its part has room). A home that says "full" gets no more; the walk ends when every
    member is full or the chunks are done, so each holds a uniform sample of its own
    chunks (promise 1).

    A chunk whose member is down (found down by a failed ask, or not yet found up
    since it started: its backoff) waits, as does one whose ask failed: the walk never
    hands a member's chunks to the one standing in for it, which would fill that one's
    part with chunks it holds for nobody once the member is back, and leave the
    member's part short (a warm started while a member was still in its startup
    backoff filled the other two and ended with the third a third full). After the
    walk, the members of the waiting chunks are pinged at once and their chunks asked
    again; in the last round, a member still down has its chunks asked of the member
    standing in for it (where reads of them go meanwhile)."""
    full: set[str] = set()
    membership = d.cluster.membership

    local = functools.partial(_fetch_here, d, ds, w, limiter, budget, slots, failure)

    waiting: list[ChunkRef] = []  # chunks whose member was down, or whose ask failed

    async def remote(member: Any, ref: ChunkRef) -> None:
        try:
            outcome = await d.cluster.warm_ask(member, ds, limiter, w.job, ref)
        finally:
            slots.release()
        if outcome == "full":
            full.add(member.address)
        elif outcome == "held":
            w.skipped_bytes += ref.length
        elif outcome == "admitted":
            w.chunks_done += 1
            w.fetched_bytes += ref.length
        else:
            waiting.append(ref)

    async def walk(todo: list[ChunkRef], last: bool) -> None:
        async with trio.open_nursery() as nursery:
            for ref in todo:
                if failure or full.issuperset(membership.members):
                    break
                member = membership.placed(ref.key)
                if not member.up:  # never this node: it is always up
                    if not last:
                        waiting.append(ref)
                        continue
                    member = membership.home(ref.key)
                    if member.is_self and d.store.holds(ds.id, ref.key):  # held here: no GET again
                        w.skipped_bytes += ref.length
                        continue
                if member.address in full:
                    continue
                if member.is_self:
                    if not await budget.fits(ref.length):
                        full.add(member.address)
                        continue
                    await slots.acquire()
                    budget.started(ref.length)
                    nursery.start_soon(local, ref)
                else:
                    await slots.acquire()
                    nursery.start_soon(remote, member, ref)

    await walk(refs, last=WARM_RETRIES == 0)
    # A member down or slow for a moment (marked down for a backoff) is pinged and
    # asked again, so a busy moment does not leave its part short; what still fails is
    # reported, not hidden behind "done".
    for n in range(WARM_RETRIES):
        if not waiting or failure:
            break
        todo, waiting[:] = waiting[:], []
        await trio.sleep(WARM_RETRY_PAUSE)
        await d.cluster.recheck({membership.placed(ref.key).address for ref in todo})
        await walk(todo, last=n == WARM_RETRIES - 1)
    w.failed_chunks = len(waiting)
    if waiting:
        log.warning(
            "warm of %s: %s could not be placed at their homes",
            ds.uri.canonical,
            count(len(waiting), "chunk"),
        )
