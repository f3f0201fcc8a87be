"""The miss path in the daemon: single-flight per chunk, limiter charge, range GET.

Owns turning "chunk i of object o" into bytes: from LMDB if another mount admitted it
meanwhile, else one remote GET per chunk however many readers wait for it, charged to
the asking job's token bucket before the GET (promise 2), then offered to the Writer.
Never serves FUSE requests and never writes LMDB itself (the Writer does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from .backends.base import Backend, ObjectInfo
from .cache.admission import Writer
from .cache.format import ChunkFormatError, chunk_key, encode_chunk, verify_chunk
from .cache.store import CacheStore, PendingChunk
from .errors import BackendError, ObjectChangedError, UsageError
from .limiter import TokenBucket

log = logging.getLogger(__name__)


@dataclass
class FetchCounters:
    remote_gets: int = 0
    remote_bytes: int = 0
    cache_served: int = 0  # asked of the daemon but found admitted by another mount
    corrupt_chunks: int = 0
    errors: int = 0


@dataclass
class _Flight:
    done: trio.Event = field(default_factory=trio.Event)
    data: bytes | None = None
    error: BackendError | None = None


def chunk_length(obj: ObjectInfo, chunk_size: int, index: int) -> int:
    """Bytes in chunk `index` of `obj`; UsageError if the index is past the end."""
    start = index * chunk_size
    if index < 0 or (start >= obj.size and not (obj.size == 0 and index == 0)):
        raise UsageError(f"chunk {index} is past the end of {obj.key}")
    return min(chunk_size, obj.size - start)


class Fetcher:
    def __init__(self, store: CacheStore, writer: Writer, threads: int) -> None:
        self.store = store
        self.writer = writer
        self.threads = trio.CapacityLimiter(threads)
        self._flights: dict[bytes, _Flight] = {}

    def cached(
        self, obj: ObjectInfo, chunk_size: int, index: int, counters: FetchCounters
    ) -> bytes | None:
        """A verified copy of the chunk from LMDB, or None (a corrupt value is counted)."""
        key = chunk_key(obj.content_id, chunk_size, index)
        expected = chunk_length(obj, chunk_size, index)
        with self.store.read_txn() as txn:
            value = txn.get(key, db=self.store.db(b"chunks"))
            if value is None:
                return None
            try:
                return bytes(verify_chunk(value, obj.content_id, chunk_size, index, expected))
            except ChunkFormatError as exc:
                counters.corrupt_chunks += 1
                log.warning(
                    "cached chunk %d of %s failed verification (%s); refetching",
                    index,
                    obj.key,
                    exc,
                )
                return None

    async def fetch(
        self,
        dsid: int,
        backend: Backend,
        limiter: TokenBucket,
        obj: ObjectInfo,
        chunk_size: int,
        index: int,
        *,
        replace: bool = False,
    ) -> tuple[bytes, bool]:
        """(bytes, whether this call did the GET): the chunk from the store, admitted if
        its dataset has room. Callers asking for a chunk already in flight share its GET."""
        key = chunk_key(obj.content_id, chunk_size, index)
        while (flight := self._flights.get(key)) is not None:
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
            if flight.data is not None:
                return flight.data, False
            # The leader was cancelled (its client went away) or failed otherwise: the
            # next waiter leads a new flight rather than inheriting nothing.
        flight = self._flights[key] = _Flight()
        try:
            flight.data = await self._fetch_once(
                dsid, backend, limiter, obj, chunk_size, index, key, replace
            )
            return flight.data, True
        except BackendError as exc:
            flight.error = exc
            raise
        finally:
            del self._flights[key]
            flight.done.set()

    async def _fetch_once(
        self,
        dsid: int,
        backend: Backend,
        limiter: TokenBucket,
        obj: ObjectInfo,
        chunk_size: int,
        index: int,
        key: bytes,
        replace: bool,
    ) -> bytes:
        length = chunk_length(obj, chunk_size, index)
        await limiter.charge(length)
        start = index * chunk_size

        def get_and_encode() -> tuple[bytes, bytes]:
            data = backend.get_range(obj, start, length) if length else b""
            if len(data) != length:
                raise ObjectChangedError(
                    f"{backend.uri}{obj.key}: expected {length} bytes "
                    f"at {start}, got {len(data)}; it changed since "
                    "listing (run silofs mount --refresh)"
                )
            return data, encode_chunk(dsid, index, chunk_size, obj.key, obj.content_id, data)

        try:
            data, value = await trio.to_thread.run_sync(get_and_encode, limiter=self.threads)
        except ObjectChangedError as exc:
            log.error("%s", exc)
            raise
        self.writer.offer(PendingChunk(dsid, key, value, length, replace=replace))
        return data
