"""The miss path in the daemon: single-flight per chunk, limiter charge, range GET.

Owns turning "chunk i of object o" into bytes: from LMDB if another mount admitted it
meanwhile, else one remote GET per chunk however many readers wait for it, charged to
the asking job's token bucket before the GET (promise 2), then offered to the Writer.
Never serves FUSE requests and never writes LMDB itself (the Writer does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import lmdb
import trio

from silofs.cache.format import ChunkRef, checked_chunk, encode_chunk
from silofs.cache.store import CacheStore, PendingChunk
from silofs.flight import SingleFlight
from silofs.node.backends.base import Backend
from silofs.node.limiter import TokenBucket
from silofs.node.writer import Writer

log = logging.getLogger(__name__)


@dataclass
class FetchCounters:
    remote_gets: int = 0
    remote_bytes: int = 0
    cache_served: int = 0  # asked of the daemon but found admitted by another mount
    corrupt_chunks: int = 0
    errors: int = 0
    version_mismatches: int = 0  # asked for a version other than the one now listed


class Fetcher:
    def __init__(self, store: CacheStore, writer: Writer, threads: int) -> None:
        self.store = store
        self.writer = writer
        self.threads = trio.CapacityLimiter(threads)
        self._flights: SingleFlight[bytes, bytes] = SingleFlight()

    def cached(self, ref: ChunkRef, counters: FetchCounters) -> tuple[bytes | None, bool]:
        """(a verified copy of the chunk from LMDB or None, whether a value is there that
        failed verification: corrupt (counted) or of an older format; the caller fetches
        with replace=True so the bad value does not stay in the way of every read)."""
        with self.store.read_txn() as txn:
            try:
                value = txn.get(ref.key, db=self.store.db(b"chunks"))
            except lmdb.Error as exc:  # a damaged LMDB page (LMDB checks none)
                counters.corrupt_chunks += 1
                log.warning(
                    "cache lookup of chunk %d of %s failed: %s", ref.index, ref.obj.key, exc
                )
                return None, False
            if value is None:
                return None, False
            data = checked_chunk(value, ref, counters)
            return (None, True) if data is None else (bytes(data), False)

    async def fetch(
        self,
        dsid: int,
        backend: Backend,
        limiter: TokenBucket,
        ref: ChunkRef,
        *,
        replace: bool = False,
    ) -> tuple[bytes, bool]:
        """(bytes, whether this call did the GET): the chunk from the store, admitted if
        its dataset has room. Callers asking for a chunk already in flight share its GET;
        one fetched and still waiting for admission (a reader right behind a prefetch,
        or a second request of one reader) is answered from the Writer's queue, no GET."""
        if not replace and (value := self.writer.pending(ref.key)) is not None:
            data = checked_chunk(value, ref, FetchCounters())  # we encoded it: never bad
            if data is not None:
                return bytes(data), False
        return await self._flights.run(
            ref.key, lambda: self._fetch_once(dsid, backend, limiter, ref, replace)
        )

    async def _fetch_once(
        self, dsid: int, backend: Backend, limiter: TokenBucket, ref: ChunkRef, replace: bool
    ) -> bytes:
        await limiter.charge(ref.length)
        obj = ref.obj

        def get_and_encode() -> tuple[bytes, bytes]:
            # The backend returns exactly ref.length bytes or raises (its contract).
            data = backend.get_range(obj, ref.start, ref.length) if ref.length else b""
            return data, encode_chunk(
                dsid, ref.index, ref.chunk_size, obj.key, obj.content_id, data
            )

        data, value = await trio.to_thread.run_sync(get_and_encode, limiter=self.threads)
        self.writer.offer(PendingChunk(dsid, ref.key, value, ref.length, replace=replace))
        return data
