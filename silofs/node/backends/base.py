"""The Backend protocol every object store implements, and what they share.

Owns the contract between the node daemon and a store: list a dataset prefix, read a
byte range of one object as of the version the listing saw, and say which errors are
worth retrying. Backend methods block (SDK calls); callers run them in threads behind a
CapacityLimiter. A backend never caches, never rate-limits and never touches LMDB.
"""

from __future__ import annotations

import base64
import datetime
import email.utils
import functools
import hashlib
import logging
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from silofs.errors import (
    AccessDeniedError,
    BackendError,
    ChecksumMismatchError,
    NotFoundError,
    TransientError,
)
from silofs.records import ObjectInfo, PrefixListed

log = logging.getLogger(__name__)
_COUNTERS_LOCK = threading.Lock()

T = TypeVar("T")
# After a denial, a store's credentials are looked at again (S3: the credential chain
# resolved; GCS, Azure: the key or SAS token file read) at most this often per dataset
# (RetryingBackend._renew): a bucket refusing some objects costs one look a while.
RENEW_SECONDS = 10.0
# A denial this soon after a look found them changed is tried again (once) without a
# look: requests refused together (a listing's workers, the fetch threads) were signed
# with the old credentials too, and only the first to ask used to retry: the others failed.
RENEWED_SECONDS = 10.0
# RetryingBackend._credentials_held: what the client signs with cannot go stale under
# it (none to renew: anonymous, or credentials the SDK refreshes itself).
FIXED: Any = object()
# One page of one prefix's listing: the objects directly under the prefix, the
# sub-prefixes the page named (full store prefixes, ending in '/'), and whether it was the
# prefix's last page.
DirPage = tuple[list[ObjectInfo], list[str], bool]


@dataclass(frozen=True)
class BackendOptions:
    """Settings common to all stores; store-specific ones go in `extra`."""

    endpoint_url: str | None = None
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    max_attempts: int = 5  # total tries for a retryable error, with backoff
    # No retry of a read (a ranged GET, or opening one) begins this long after its
    # first try did: a store that accepts requests and never answers failed a miss only
    # after max_attempts x read_timeout (~150 s). 60 s: about what mountpoint-s3's 10
    # attempts take and NFS's defaults give (60 s, 3 tries) before an error.
    read_deadline: float = 60.0
    backoff_base: float = 0.2  # seconds; doubled each retry, with full jitter
    backoff_max: float = 10.0
    page_size: int = 1000
    # Prefixes listed at once when a store lists by delimiter (S3 ListObjectsV2 with
    # Delimiter='/'): a listing of many directories takes ~1/list_workers of the serial
    # round trips. 1 lists serially, one page after another. 32: at 50 ms per request,
    # 16 left a 100-prefix tree at ~9x the serial rate (7 rounds of requests), 32 ~10.5x
    # (bench/listing.py); the queue to the writer holds at most 2 x list_workers pages.
    list_workers: int = 32
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class StoreCounters:
    """What a dataset's store did wrong, for status and /metrics. Incremented from the
    fetch threads; a lost increment under a race is acceptable for a counter this coarse."""

    retries: int = 0  # retryable errors that were retried (each retry once)
    checksum_errors: int = 0  # bodies that did not match the store's checksum (retried)
    short_reads: int = 0  # bodies shorter than the range asked for (retried)
    # Requests a store's lean path (S3: s3lean.py) handed to its SDK, which redid them:
    # error answers, transport errors, pages it could not parse.
    lean_fallbacks: int = 0


# Store requests made by the calling thread, for `remote_requests` in status: one read
# can take several (a retry; Azure's GETs of at most 4 MiB). The fetcher reads the
# difference around one fetch, which runs in one thread (node/fetch.py).
_thread_requests = threading.local()


def note_requests(n: int = 1) -> None:
    """Count `n` store requests made by this thread."""
    _thread_requests.n = getattr(_thread_requests, "n", 0) + n


def requests_made() -> int:
    """Store requests this thread has counted so far (compare two readings)."""
    return getattr(_thread_requests, "n", 0)


class Backend(Protocol):
    """A read-only view of one dataset prefix in one store."""

    uri: str  # canonical dataset URI, e.g. s3://bucket/prefix/

    def check(self) -> None:
        """Raise NotFoundError / AccessDeniedError / UnreachableError if unusable."""

    def list(self) -> Iterator[ObjectInfo]:
        """Every object under the prefix, paginated, in any order.

        Keys ending in '/' (directory markers) and empty-named keys are skipped.
        """

    def list_events(self) -> Iterator[ObjectInfo | PrefixListed]:
        """list(), with a PrefixListed after what it announces: the daemon writes a
        directory's "complete" row from it, so a mount serving a listing still being
        written (--list-in-background) answers for that directory before the end."""

    def get_range(self, info: ObjectInfo, start: int, length: int) -> bytes:
        """Bytes [start, start+length) of the object as of `info.version`.

        Raises ObjectChangedError if the object no longer has that version; returns
        fewer bytes only at the end of the object.
        """

    def identifies(self, info: ObjectInfo) -> bool:
        """Whether `info.content_id` is the content id this store gives every object of
        `info.version` and `info.size`, so bytes read as of that version may be cached
        under it. False where the content id cannot be told from those (a digest of the
        bytes): only a listing can vouch for it then."""

    def close(self) -> None:
        """Release clients and connection pools."""


# Connections kept per client: a listing's workers (list_workers, 32 by default) and the
# fetcher's threads (16) share it at once under --list-in-background; fewer than both
# and every request over the size opens a connection and drops it ("pool is full").
DEFAULT_POOL = 64
_ERRNO_TEXT = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")


def pool_size(opts: BackendOptions) -> int:
    """Connections one SDK client keeps: extra max_pool_connections, or DEFAULT_POOL."""
    return int(opts.extra.get("max_pool_connections", DEFAULT_POOL))


def pooled_session(session: Any, opts: BackendOptions) -> Any:
    """`session` (a requests.Session: Azure's and GCS's transport) with pool_size(opts)
    connections per host and no retries of its own (retry_call owns retries)."""
    import requests.adapters  # with the SDK that needs it: S3 and local never load it

    adapter = requests.adapters.HTTPAdapter(pool_maxsize=pool_size(opts), max_retries=0)
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return session


def truthy(value: str | None) -> bool:
    """An `extra` option's yes: 1, true or yes, in any case."""
    return (value or "").lower() in ("1", "true", "yes")


def connection_reason(exc: BaseException) -> str:
    """The OS-level reason inside a wrapped connection error ('Connection refused'), short."""
    found = _ERRNO_TEXT.search(str(exc))
    return found.group(1).strip() if found else str(exc)[:160]


@dataclass(frozen=True)
class KeyFile:
    """The file a store client's credentials came from (None: not from a file) and a
    digest of what it held when the client was made (one object per client: compared
    by identity in RetryingBackend._renew)."""

    path: str | None
    digest: bytes | None

    @classmethod
    def read(cls, path: str) -> tuple[bytes, KeyFile]:
        """What `path` holds (its first MiB) and its KeyFile; OSError if unreadable."""
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
        return raw, cls(path, hashlib.sha256(raw).digest())

    @classmethod
    def of(cls, path: str | None) -> KeyFile:
        """The KeyFile of `path` now (a None digest: no path, or unreadable)."""
        return cls(path, cls.digest_of(path))

    @classmethod
    def digest_of(cls, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return cls.read(path)[1].digest
        except OSError:
            return None

    def changed(self) -> bool:
        """Whether the file holds other bytes now than when the client was made."""
        now = self.digest_of(self.path)
        return now is not None and now != self.digest


@dataclass
class _RenewGate:
    """When RetryingBackend._renew may look at a store's credentials again (monotonic)."""

    look_after: float = 0.0  # no look before
    renewed_at: float = float("-inf")  # when a look last found them changed


class RetryingBackend:
    """What every object-store backend shares: one retry policy around each listing page
    and each ranged GET, reads clamped to the size the listing saw, and the life of the
    store's SDK client (built on first use under `_lock`, never at construction, since
    building one may do I/O; released by close()).

    Subclasses set `uri`, `opts`, `where` (e.g. "bucket b", for messages), `_lock` and
    `_client` (None until built), and provide one-try operations: _any_object() (one
    request or two proving the prefix readable and not empty), _list_page(token) ->
    (items, next token or None), _info(item) -> ObjectInfo or None, and
    _get_once(info, start, end) -> bytes.

    _get_once checks whatever checksum the store sends for the bytes it returned and
    raises ChecksumMismatchError (retried, counted in `counters`) on a mismatch; a short
    body is retried here. What each store can and cannot check is in docs/SEMANTICS.md.
    """

    uri: str
    opts: BackendOptions
    where: str
    item_noun = "objects"  # what the store calls what it lists, for messages
    _lock: threading.Lock
    _client: Any
    # The credentials file the client's credentials came from, set when it is made
    # (GCS's key file, Azure's SAS token file); None: none to look at (_credentials_held).
    _key: KeyFile | None = None

    @property
    def counters(self) -> StoreCounters:
        """Retries of this backend (one per dataset), created on first use."""
        return self._once("_counters", StoreCounters)

    @property
    def retry_log(self) -> RetryLog:
        """How this backend's retries are logged (one per dataset), created on first use."""
        return self._once("_retry_log", RetryLog)

    def _once(self, name: str, make: Callable[[], T]) -> T:
        """The backend's `name` attribute, made by make() on first use (one per backend,
        whichever fetch thread asks first)."""
        value = self.__dict__.get(name)
        if value is None:
            with _COUNTERS_LOCK:
                value = self.__dict__.setdefault(name, make())
        return value

    def _retry(self, fn: Callable[[], T], what: str, deadline: float | None = None) -> T:
        """retry_call with this backend's options, counters, RetryLog and renewal."""
        return retry_call(fn, self.opts, what, self.counters, self.retry_log, self._renew, deadline)

    def _read_deadline(self) -> float:
        """The monotonic time past which a read starting now is not retried."""
        return time.monotonic() + self.opts.read_deadline

    def _renew(self) -> bool:
        """After a denial: whether to try again because the store's credentials were
        found changed since its client was made (a credentials file rewritten, the old
        key revoked): the client is then dropped (in-flight requests finish on it) and
        the next request builds one that signs with the new ones. One look per
        RENEW_SECONDS per dataset; a denial within RENEWED_SECONDS of a look that found
        them changed is tried again without one. A client is made once per dataset and
        reads its credentials then: a rotated key was refused until the daemon restarted.

        The store says what its client holds (_credentials_held, under `_lock`) and
        whether that changed (_credentials_changed, outside it: it may do file I/O)."""
        gate = self._once("_renew_gate", _RenewGate)
        now = time.monotonic()
        with self._lock:
            if now - gate.renewed_at < RENEWED_SECONDS:
                return True  # renewed a moment ago: this request was signed with the old
            if self._client is None or now < gate.look_after:
                return False
            held = self._credentials_held()
            if held is FIXED:
                return False
            gate.look_after = now + RENEW_SECONDS
        news = self._credentials_changed(held)
        if news is None:
            return False
        with self._lock:
            gate.renewed_at = now
            if self._credentials_held() is not held:
                return True  # another thread renewed them meanwhile
            self._drop_client()
        log.info("%s", news)
        return True

    def _credentials_held(self) -> Any:
        """Under `_lock`, with a client made: what it signs with, one object per client
        (compared by identity), or FIXED if that cannot go stale. Here: the client's
        credentials file (`_key`), FIXED without one; S3 overrides."""
        return FIXED if self._key is None or self._key.path is None else self._key

    # What a store's key file holds, for the log ("Azure ... the SAS token"): a store
    # whose client takes credentials from `_key` sets it; S3 overrides both looks.
    _key_holds = "the credentials"

    def _credentials_changed(self, held: Any) -> str | None:
        """Whether the credentials found now differ from `held`: a line for the log
        saying so, or None (unchanged, or none found). Here: the key file `held` holds
        other bytes now."""
        if not held.changed():
            return None
        return (
            f"{self.uri}: the store refused {self._key_holds} the daemon had and "
            f"{held.path} changed since: using it again"
        )

    def _drop_client(self) -> None:
        """Under `_lock`: forget the client (not closed: in-flight requests finish on
        it); the next request makes one."""
        self._client = None

    def check(self) -> None:
        self._retry(self._check_once, f"check {self.uri}")

    def _check_once(self) -> None:
        if not self._any_object():
            raise NotFoundError(
                f"no {self.item_noun} under {self.uri}: check the prefix ({self.where} exists)"
            )

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def list(self) -> Iterator[ObjectInfo]:
        for item in self.list_events():
            if isinstance(item, ObjectInfo):
                yield item

    def list_events(self) -> Iterator[ObjectInfo | PrefixListed]:
        """list(), with PrefixListed records that tell the daemon a directory is complete
        before the whole listing is (--list-in-background): when the listing fans out by
        prefix, after each page that named sub-prefixes and after each prefix's last
        page; when it is one serial stream of keys in the store's order, after the last
        key under each directory (prefixes_in_order)."""
        if self.opts.list_workers > 1 and self._lists_by_prefix():
            yield from fan_out(getattr(self, "prefix", ""), self.opts.list_workers, self._dir_pages)
            return
        if self._lists_in_order():
            yield from prefixes_in_order(self._list_flat(), self.uri)
        else:
            yield from self._list_flat()

    def _list_flat(self) -> Iterator[ObjectInfo]:
        """Every object, one page after another (no delimiter)."""
        token: str | None = None
        while True:
            fetch = functools.partial(self._list_page, token)
            items, token = self._retry(fetch, f"list {self.uri}")
            for item in items:
                info = self._info(item)
                if info is not None:
                    yield info
            if not token:
                return

    def _lists_in_order(self) -> bool:
        """Whether _list_page returns keys in ascending order (UTF-8 byte order, which is
        code point order): S3 general purpose buckets, Azure and GCS promise it. S3
        Express One Zone directory buckets ("--x-s3" names) do not, so a serial listing
        of one sends no PrefixListed (its lookups wait for the whole listing)."""
        return not str(getattr(self, "bucket", "")).endswith("--x-s3")

    def identifies(self, info: ObjectInfo) -> bool:
        return False  # a store that can tell says so (Backend.identifies)

    def get_range(self, info: ObjectInfo, start: int, length: int) -> bytes:
        # Clamp to the listed size: past-the-end reads are short (or empty) without a
        # request, and the server never sees an unsatisfiable range.
        end = min(start + length, info.size)
        if length <= 0 or start >= end:
            return b""
        fetch = functools.partial(self._get_exact, info, start, end)
        return self._retry(fetch, f"read {self.uri}{info.key}", self._read_deadline())

    def open_range(
        self, info: ObjectInfo, start: int, length: int, whole: bool = False
    ) -> RangeStream | None:
        """An open ranged GET of [start, start+length) (clamped to the listed size), to
        read in order in pieces, or None where the store streams no ranges or the range
        is the whole object (get_range then checks the store's whole-object checksum),
        unless `whole`: the caller reads the object in chunks, each verified as a range
        would be. Opening is retried as get_range is; a piece that comes short raises
        TransientError, and the caller reads the rest with get_range."""
        end = min(start + length, info.size)
        everything = start == 0 and end == info.size and not whole
        if start >= end or everything or not self._streams_ranges():
            return None

        def opener() -> Any:
            note_requests()  # each attempt is a request
            return self._open_once(info, start, end)

        body = self._retry(opener, f"read {self.uri}{info.key}", self._read_deadline())
        return RangeStream(body, start, end, f"{self.uri}{info.key}", self.counters)

    def _streams_ranges(self) -> bool:
        """Whether _open_once is implemented."""
        return False

    def _open_once(self, info: ObjectInfo, start: int, end: int) -> Any:
        """The response body (read(n), close()) of one ranged GET of [start, end)."""
        raise NotImplementedError

    # Whether _get_once counts its own requests (note_requests): one that makes several
    # for one range does. Otherwise each attempt here is counted as one.
    _counts_own_requests = False

    def _get_exact(self, info: ObjectInfo, start: int, end: int) -> bytes:
        if not self._counts_own_requests:
            note_requests()
        try:
            data = self._get_once(info, start, end)
        except ChecksumMismatchError:
            self.counters.checksum_errors += 1
            raise
        if len(data) != end - start:  # a dropped connection, not a changed object: retry
            self.counters.short_reads += 1
            raise TransientError(
                f"short read from {self.uri}{info.key}: got {len(data)} of {end - start} bytes"
            )
        return data

    # -- fan-out by delimiter ------------------------------------------------------
    def _lists_by_prefix(self) -> bool:
        """Whether _list_dir_page is implemented (stores with delimiter listings)."""
        return False

    def _list_dir_page(
        self, prefix: str, token: str | None
    ) -> tuple[Iterable[Any], list[str], str | None]:
        """One page of a delimiter listing of `prefix`: (objects directly under it, the
        sub-prefixes on this page, next token or None)."""
        raise NotImplementedError

    def _dir_pages(self, prefix: str) -> Iterator[DirPage]:
        """The pages of one prefix's delimiter listing, each retried on its own."""
        token: str | None = None
        while True:
            fetch = functools.partial(self._list_dir_page, prefix, token)
            items, subs, token = self._retry(fetch, f"list {self.uri}")
            yield [i for i in map(self._info, items) if i is not None], subs, not token
            if not token:
                return

    def _any_object(self) -> bool:
        raise NotImplementedError

    def _list_page(self, token: str | None) -> tuple[Iterable[Any], str | None]:
        raise NotImplementedError

    def _info(self, item: Any) -> ObjectInfo | None:
        raise NotImplementedError

    def _get_once(self, info: ObjectInfo, start: int, end: int) -> bytes:
        raise NotImplementedError


class DelimitedListing(RetryingBackend):
    """A RetryingBackend whose store lists one page by (prefix, token, page size,
    delimiter) in one call (Azure List Blobs, GCS objects.list): the flat listing and
    the fan-out's '/'-delimited pages both come from its _list_raw."""

    prefix: str

    def _list_raw(
        self, prefix: str, token: str | None, page_size: int | None, delimiter: str | None
    ) -> tuple[list[Any], list[str], str | None]:
        """(objects, sub-prefixes, next token or None) of one page."""
        raise NotImplementedError

    def _list_page(
        self, token: str | None, page_size: int | None = None
    ) -> tuple[list[Any], str | None]:
        items, _, token = self._list_raw(self.prefix, token, page_size, None)
        return items, token

    def _any_object(self) -> bool:
        # A listing, not bucket metadata: GCS's objectViewer may list but not read
        # bucket metadata.
        return bool(self._list_page(None, page_size=1)[0])

    def _lists_by_prefix(self) -> bool:
        return True

    def _list_dir_page(
        self, prefix: str, token: str | None
    ) -> tuple[list[Any], list[str], str | None]:
        return self._list_raw(prefix, token, None, "/")


class RangeStream:
    """An open ranged GET read in order, by one thread at a time (the daemon keeps one
    open between the spans of a sequential reader: node/fetch.py)."""

    def __init__(self, body: Any, start: int, end: int, what: str, counters: StoreCounters):
        self._body = body
        self.pos = start  # the object offset of the next byte read
        self.end = end
        self._what = what
        self._counters = counters

    def read(self, n: int) -> bytes:
        """The next min(n, what is left) bytes; TransientError if the body ends early."""
        want = min(n, self.end - self.pos)
        parts: list[bytes] = []
        got = 0
        while got < want:
            piece = self._body.read(want - got)
            if not piece:
                self._counters.short_reads += 1
                raise TransientError(
                    f"short read from {self._what}: the stream ended at {self.pos + got} "
                    f"of {self.end}"
                )
            parts.append(piece)
            got += len(piece)
        self.pos += want
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, buf: memoryview) -> None:
        """Fill `buf` with the next len(buf) bytes; TransientError if the body ends
        first. A body with a readinto of its own (a socket's recv_into underneath) fills
        it directly; another is read and copied."""
        want = len(buf)
        if want > self.end - self.pos:
            raise ValueError(f"{want} bytes asked of a stream with {self.end - self.pos} left")
        fill = getattr(self._body, "readinto", None)
        got = 0
        while got < want:
            if fill is not None:
                n = fill(buf[got:])
            else:
                piece = self._body.read(want - got)
                n = len(piece)
                buf[got : got + n] = piece
            if not n:
                self._counters.short_reads += 1
                raise TransientError(
                    f"short read from {self._what}: the stream ended at {self.pos + got} "
                    f"of {self.end}"
                )
            got += n
        self.pos += want

    def close(self) -> None:
        try:
            self._body.close()
        except Exception as exc:  # closing a broken connection: nothing left to save
            log.debug("closing a range stream of %s: %s", self._what, exc)


# Prefixes named and not yet walked, per list worker, before a worker walks the next one
# it finds itself (fan_out): ~0.5 KB each queued, so 64 x 32 workers hold ~1 MB.
FAN_OUT_BACKLOG = 64
FAN_OUT_DEPTH = 32


def fan_out(
    root: str, workers: int, pages: Callable[[str], Iterator[DirPage]]
) -> Iterator[ObjectInfo | PrefixListed]:
    """Every object under store prefix `root`, listing each '/'-delimited prefix as its
    own task on `workers` threads (`pages(prefix)` lists one prefix; one worker lists
    prefix after prefix), with a PrefixListed after each page that named sub-prefixes
    and after each prefix's last page. Backend-neutral: the object stores' delimiter
    listings and the local directory walk both come through here.

    Pages go through a queue of 2 x workers pages, so a consumer that writes slower than
    the store lists holds the workers back instead of buffering the listing: memory
    stays flat. So does the backlog of prefixes named and not yet walked: past
    FAN_OUT_BACKLOG per worker, the worker that found a sub-prefix walks it itself,
    depth first, before its own next page (a million sample directories under one
    prefix would otherwise queue a million walks, ~0.5 GB). Any worker's error ends the
    listing with that error; a consumer that stops early stops the workers."""
    Item = list[ObjectInfo | PrefixListed] | BaseException | None
    out: queue.Queue[Item] = queue.Queue(2 * workers)
    stop = threading.Event()
    lock = threading.Lock()
    pending = [1]  # prefixes submitted and not finished

    def rel(prefix: str) -> str | None:
        return prefix[len(root) :] if prefix.startswith(root) else None

    def put(item: Item) -> None:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def walk(prefix: str, depth: int = 0) -> None:
        # Each sub-prefix announced and walked once: a store may name one on several
        # pages of its parent (fake-gcs-server repeats a page's prefixes on the next),
        # which would list its objects again, or announce a directory whose walk already
        # ended. Held for this prefix's pages only (the executor's queue holds its
        # pending walks anyway), so nothing grows with the whole listing.
        seen: set[str] = set()
        try:
            here = rel(prefix)
            for objects, named, last in pages(prefix):
                if stop.is_set():
                    return
                subs = [s for s in named if s not in seen]
                seen.update(subs)
                page: list[ObjectInfo | PrefixListed] = list(objects)
                if here is not None and (subs or last):
                    # After the page's objects: a consumer that writes in order has
                    # written them when it reads this.
                    names = tuple(s for s in map(rel, subs) if s is not None)
                    page.append(PrefixListed(here, names, done=last))
                if page:
                    put(page)
                # Only now: what a sub-prefix's walk puts comes after the page that
                # named it (its objects after a file of the same name on this page).
                for sub in subs:
                    with lock:
                        pending[0] += 1
                        # Not deeper than FAN_OUT_DEPTH walks in one thread's stack: a
                        # chain of nested prefixes is narrow, and queued it is small.
                        inline = pending[0] > backlog and depth < FAN_OUT_DEPTH
                    if inline:
                        walk(sub, depth + 1)  # in pending, and ended, as a queued one
                    else:
                        pool.submit(walk, sub)
                if last:
                    break
        except BaseException as exc:  # handed to the consumer, which raises it
            put(exc)
            return
        with lock:
            pending[0] -= 1
            done = pending[0] == 0
        if done:
            put(None)

    backlog = FAN_OUT_BACKLOG * workers
    pool = ThreadPoolExecutor(workers, thread_name_prefix="silofs-list")
    try:
        pool.submit(walk, root)
        while True:
            item = out.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield from item
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)


def prefixes_in_order(
    objects: Iterable[ObjectInfo], what: str
) -> Iterator[ObjectInfo | PrefixListed]:
    """`objects` (a serial listing in ascending key order), with PrefixListed(done=True)
    for each directory as soon as a key outside it arrives: in that order every key
    under "a/b/" comes before the first key past it, so the directory is complete then.
    This is what makes a serial listing (list_workers = 1) usable before it ends. A key
    out of order (a store that broke its promise) ends the records, with an error line:
    the directories it already called complete may lack names until the listing ends."""
    open_dirs: list[str] = []  # the directories of the last key, outermost first
    last: str | None = None
    ordered = True
    for obj in objects:
        key = obj.key
        if ordered and last is not None and key <= last:
            ordered = False
            log.error(
                "listing %s: key %r came after %r: not in order, so directories are "
                "complete only with the whole listing",
                what,
                key,
                last,
            )
        if ordered:
            here = open_dirs[-1] if open_dirs else ""
            if key.startswith(here) and key.find("/", len(here)) < 0:
                last = key  # the common case: the next file of the same directory
                yield obj
                continue
            dirs = _dirs_of(key)
            same = 0
            while same < min(len(dirs), len(open_dirs)) and dirs[same] == open_dirs[same]:
                same += 1
            for d in reversed(open_dirs[same:]):  # deepest first
                yield PrefixListed(d, (), done=True)
            open_dirs, last = dirs, key
        yield obj


def _dirs_of(key: str) -> list[str]:
    """ "a/b/c" -> ["a/", "a/b/"]."""
    out, i = [], key.find("/")
    while i >= 0:
        out.append(key[: i + 1])
        i = key.find("/", i + 1)
    return out


def md5_b64(data: bytes) -> str:
    """Base64 MD5, as Azure's Content-MD5 and GCS's x-goog-hash carry it."""
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


# A store that throttles or fails for minutes is retried by every fetch and listing
# thread at once: one WARNING per retry was a line every few milliseconds. The first
# retry of a quiet store is a WARNING; the others within RETRY_LOG_SECONDS are DEBUG,
# and the next WARNING (a retry past that window) says how many there were.
RETRY_LOG_SECONDS = 60.0


class RetryLog:
    """How one store's retries reach the log: one WARNING per RETRY_LOG_SECONDS at most,
    naming the retries it left to DEBUG since the last one (all are counted in the
    dataset's `store_retries` whatever the log says). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._quiet_until = float("-inf")  # monotonic; before it, retries are DEBUG
        self._unsaid = 0  # retries logged at DEBUG since the last WARNING

    def retry(self, what: str, exc: BackendError, attempt: int, most: int, delay: float) -> None:
        now = time.monotonic()
        with self._lock:
            loud = now >= self._quiet_until
            unsaid = self._unsaid
            if loud:
                self._quiet_until, self._unsaid = now + RETRY_LOG_SECONDS, 0
            else:
                self._unsaid += 1
        line = "%s: %s; retry %d/%d in %.2fs"
        if not loud:
            log.debug(line, what, exc, attempt, most, delay)
            return
        more = f" ({unsaid} more retries of this store since the last such line)" if unsaid else ""
        log.warning(
            line + "%s; its other retries in the next %.0fs are logged at DEBUG",
            what, exc, attempt, most, delay, more, RETRY_LOG_SECONDS,
        )  # fmt: skip


def retry_call(
    fn: Callable[[], T],
    opts: BackendOptions,
    what: str,
    counters: StoreCounters | None = None,
    notes: RetryLog | None = None,
    renew: Callable[[], bool] | None = None,
    deadline: float | None = None,
) -> T:
    """Call `fn`, retrying retryable BackendErrors with capped exponential backoff; each
    retry is counted in `counters` (the dataset's, shown in status and /metrics) and told
    to `notes` (the store's RetryLog; without one, the call's first retry is a WARNING).
    An AccessDeniedError is tried once more, at once, if `renew()` says the credentials
    changed (a key rotated in a credentials file the daemon read at its first request).
    No retry begins at or past `deadline` (time.monotonic()): the last error is raised
    then, with max_attempts not reached. A try under way is not cut short (an SDK call
    cannot be): a read ends by `deadline` plus at most one read_timeout."""
    notes = notes if notes is not None else RetryLog()
    attempt = 1
    renewed = False
    while True:
        try:
            return fn()
        except BackendError as exc:
            if isinstance(exc, AccessDeniedError) and renew is not None and not renewed:
                renewed = True
                if renew():
                    continue
            if not exc.retryable or attempt >= opts.max_attempts:
                raise
            delay = random.uniform(0, min(opts.backoff_max, opts.backoff_base * 2**attempt))
            asked = exc.retry_after if isinstance(exc, TransientError) else None
            if asked is not None:  # the store said when: no sooner, and at most backoff_max
                delay = max(delay, min(asked, opts.backoff_max))
            if deadline is not None and time.monotonic() + delay >= deadline:
                log.debug("%s: %s; not retried: its deadline passes first", what, exc)
                raise
            notes.retry(what, exc, attempt, opts.max_attempts - 1, delay)
            if counters is not None:
                counters.retries += 1
            time.sleep(delay)
            attempt += 1


def retry_after(value: str | None) -> float | None:
    """A Retry-After header's wait in seconds (delta-seconds or an HTTP date), or None
    for none or one that does not parse."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # "-0000": UTC, as HTTP dates are
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - time.time())


def busy(message: str, header: str | None) -> TransientError:
    """A TransientError for a throttling or failing answer, carrying its Retry-After."""
    exc = TransientError(message)
    exc.retry_after = retry_after(header)
    return exc


def join_prefix(prefix: str, key: str) -> str:
    """Store key for a dataset-relative key (prefix is '' or ends with '/')."""
    return prefix + key


def relative_key(prefix: str, store_key: str) -> str | None:
    """Dataset-relative key, or None for keys that are not files (markers, empty)."""
    if not store_key.startswith(prefix):
        return None
    rel = store_key[len(prefix) :]
    if not rel or rel[-1] == "/" or rel[0] == "/" or "//" in rel:
        return None
    # A '.' or '..' part starts with '.' after a '/' or at the start: most keys have
    # none, and skip the split (a listing calls this for every object).
    if ("/." in rel or rel[0] == ".") and any(part in (".", "..") for part in rel.split("/")):
        return None
    return rel
