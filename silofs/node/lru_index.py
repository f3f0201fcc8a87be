"""Recency order of cached chunks for datasets in irregular-access (LRU) mode.

Owns two LMDB databases: lru (dataset id + sequence number -> chunk key) and lrupos
(dataset id + chunk key -> sequence number), and evicting a dataset's least recently
used chunks to make room. Uniform datasets never touch these ("SiloD: A Co-design of
Caching and Scheduling for Deep Learning Clusters", EuroSys '23, §6, "Handling irregular
data access": curriculum-style jobs whose items are reused within an epoch).
Rows can go stale when a chunk is evicted by other means; eviction skips those. Called
only from the Writer thread; never decides quotas.
"""

from __future__ import annotations

import heapq
import logging
import struct

from silofs.cache import rows
from silofs.cache.store import Usage
from silofs.node.store_write import WritableStore

log = logging.getLogger(__name__)

_ID = struct.Struct(">Q")
_SEQ = struct.Struct(">Q")


def _seq_of(key: bytes) -> int:
    """An lru row's sequence number; 0 (oldest: the row goes first, and with it a chunk
    it may name) for a key that is not 16 bytes (a damaged leaf, rows.py)."""
    if len(key) != _ID.size + _SEQ.size:
        rows.damaged("lru row key", key, "taken as the oldest")
        return 0
    return int(_SEQ.unpack_from(key, _ID.size)[0])


class LruIndex:
    def __init__(self, store: WritableStore) -> None:
        self.store = store
        self.order = store.env.open_db(b"lru")
        self.pos = store.env.open_db(b"lrupos")
        self._seq = self._last_seq()

    def _last_seq(self) -> int:
        with self.store.env.begin() as txn:
            cur = txn.cursor(db=self.order)
            best = 0
            for key, _ in cur:  # one row per dataset would do, but this runs once at start
                best = max(best, _seq_of(key))
            return best

    def touch(self, dsid: int, keys: list[bytes]) -> None:
        """Mark chunks as just used (newest last)."""
        prefix = _ID.pack(dsid)
        with self.store.env.begin(write=True) as txn:
            for key in keys:
                old = txn.get(prefix + key, db=self.pos)
                if old is not None:
                    txn.delete(prefix + old, db=self.order)
                self._seq += 1
                seq = _SEQ.pack(self._seq)
                txn.put(prefix + seq, key, db=self.order)
                txn.put(prefix + key, seq, db=self.pos)

    def evict_oldest(self, dsid: int, target_bytes: int, usage: dict[int, Usage]) -> int:
        """Evict least recently used chunks of `dsid` until it holds <= target_bytes."""
        prefix = _ID.pack(dsid)
        freed = 0
        with self.store.env.begin(write=True) as txn:
            # Chunks of versions no listing names go first (their recency rows are
            # skipped later, as any row of a chunk evicted by other means).
            freed += self.store.evict_stale(txn, dsid, target_bytes, usage)
            cur = txn.cursor(db=self.order)
            while usage.get(dsid, Usage()).bytes > target_bytes:
                if not cur.set_range(prefix) or not cur.key().startswith(prefix):
                    break
                key = bytes(cur.value())
                cur.delete()
                txn.delete(prefix + key, db=self.pos)
                if self.store.owns(txn, dsid, key):
                    freed += self.store.remove_owned(txn, dsid, key, usage)
        return freed

    def evict_oldest_among(self, dsids: set[int], free_bytes: int, usage: dict[int, Usage]) -> int:
        """Evict the least recently used chunks of all of `dsids` together (one LRU over
        them: sequence numbers are node-wide) until `free_bytes` are freed or none is
        left. What the unallocated LRU datasets share is one LRU, as Alluxio's cache."""
        freed = 0
        with self.store.env.begin(write=True) as txn:
            cursors = {d: txn.cursor(db=self.order) for d in dsids}
            heads: list[tuple[int, int]] = []  # (seq, dsid) of each dataset's oldest row
            for d, cur in cursors.items():
                prefix = _ID.pack(d)
                if cur.set_range(prefix) and cur.key().startswith(prefix):
                    heads.append((_seq_of(cur.key()), d))
            heapq.heapify(heads)
            while heads and freed < free_bytes:
                _, d = heapq.heappop(heads)
                cur = cursors[d]
                prefix = _ID.pack(d)
                key = bytes(cur.value())
                cur.delete()  # the cursor now sits on the next row
                txn.delete(prefix + key, db=self.pos)
                if self.store.owns(txn, d, key):
                    freed += self.store.remove_owned(txn, d, key, usage)
                if cur.key() and cur.key().startswith(prefix):
                    heapq.heappush(heads, (_seq_of(cur.key()), d))
        return freed

    def forget(self, dsid: int) -> None:
        """Drop a dataset's recency rows (it went back to uniform admission)."""
        prefix = _ID.pack(dsid)
        with self.store.env.begin(write=True) as txn:
            for db in (self.order, self.pos):
                cur = txn.cursor(db=db)
                while cur.set_range(prefix) and cur.key().startswith(prefix):
                    cur.delete()
