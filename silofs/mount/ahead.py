"""Cached values a sequential reader reads next, read ahead into buffers of the mount's own.

Owns ValuesAhead: a bounded pool of page-aligned buffers (anonymous maps, allocated as
needed and reused), the values read into them by O_DIRECT (pages.DirectFile), by chunk
key in the order they were read, and the reads in flight, one per key. A value here
was read by the disk's DMA: no page-cache fill, no mapping of its pages, no copy on the
CPU; the serving thread verifies the blocks a request serves on the buffer itself (the
mount's own memory: nothing can change it after the check) and replies from it.

Never verifies a value (the reader does, on every read), never touches the env (the
reader's worker finds and reads the value), and never hands a buffer to another read
while a reply may still read it: every change here happens on the trio thread; a view
a hit returns is written to /dev/fuse before its task yields (pyfuse3 replies before
the handler's task awaits again), and a view kept across an await is copied by the
reader first. A buffer goes back to the pool only when its value is dropped: served to
its end, or the oldest value when a read needs a buffer and the pool is at its bound.
"""

from __future__ import annotations

import logging
import mmap
from collections import OrderedDict

import trio

log = logging.getLogger(__name__)

# Anonymous memory in huge pages where the kernel gives them (transparent huge pages):
# the disk's DMA into a buffer and the reply's copy out of it pin its pages, one 2 MiB
# page at a time instead of 512 small ones (a 512 MiB pass: 0.26 against 0.29-0.30
# CPU-s of the mount, bench/README.md).
HUGE_PAGE = 2 << 20


class ValuesAhead:
    """Values read ahead, by chunk key; at most `max_buffers` buffers of `buffer_bytes`."""

    def __init__(self, buffer_bytes: int, max_buffers: int) -> None:
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max_buffers
        self.allocated = 0  # buffers mapped (free, holding a value, or being read into)
        self.read = 0  # values read into a buffer
        self.served = 0  # requests served from here
        self.waited = 0  # requests that waited for their value's read
        self._free: list[mmap.mmap] = []
        # Values read and reads in flight, by key. Public only for the hit path of a
        # mount that reads nothing ahead (small files): it looks at them only when one
        # is not empty, two calls fewer per READ (mount/reader.py hit()).
        self.values: OrderedDict[bytes, tuple[mmap.mmap, memoryview]] = OrderedDict()
        self.flights: dict[bytes, trio.Event] = {}

    def get(self, key: bytes) -> memoryview | None:
        """The value of `key` read ahead (the whole LMDB value: header and data), or None.
        Valid until the caller's task yields."""
        item = self.values.get(key)
        return None if item is None else item[1]

    def reading(self, key: bytes) -> bool:
        """Whether a read of `key`'s value is in flight."""
        return key in self.flights

    def wanted(self, key: bytes) -> bool:
        return key not in self.values and key not in self.flights

    async def wait(self, key: bytes) -> memoryview | None:
        """get(), after the read of `key` in flight (if any) is done."""
        flight = self.flights.get(key)
        if flight is not None:
            self.waited += 1
            await flight.wait()
        return self.get(key)

    def begin(self, key: bytes) -> bool:
        """Note a read of `key`'s value in flight (a request for it waits for it from
        now on); False if `max_buffers` reads are in flight already."""
        if len(self.flights) >= self.max_buffers:
            return False
        self.flights[key] = trio.Event()
        return True

    def buffer(self) -> mmap.mmap | None:
        """A buffer for a read begun: a free one, a new one while fewer than
        `max_buffers` are mapped, else the oldest value's (it is behind its reader);
        None if every buffer is being read into."""
        if self._free:
            return self._free.pop()
        if self.allocated < self.max_buffers:
            self.allocated += 1
            return _new_buffer(self.buffer_bytes)
        if self.values:
            return self.values.popitem(last=False)[1][0]
        return None

    def end(self, key: bytes, buf: mmap.mmap | None, value: memoryview | None) -> None:
        """The read begun for `key` is over: `value` (a view in `buf`) is kept, or, if
        None (not cached, in the page cache already, or not readable), the buffer is
        free again. Wakes the requests waiting for it."""
        if buf is not None and value is not None:
            self.values[key] = (buf, value)
            self.read += 1
        elif buf is not None:
            self._free.append(buf)
        flight = self.flights.pop(key, None)
        if flight is not None:
            flight.set()

    def drop(self, key: bytes) -> None:
        """Forget `key`'s value (served to its end, or damaged); its buffer is free."""
        item = self.values.pop(key, None)
        if item is not None:
            self._free.append(item[0])

    def close(self) -> None:
        """Forget every value and buffer; the maps are unmapped once nothing views them."""
        self.values.clear()
        self._free.clear()
        self.allocated = 0


def _new_buffer(size: int) -> mmap.mmap:
    """A private anonymous map of at least `size` bytes whose whole 2 MiB blocks are
    asked to be huge pages: the map is a whole number of them long (so the kernel aligns
    it to one), and the block holding its tail is kept in small pages, so a buffer
    resides in about `size` bytes, not the next 2 MiB up."""
    huge = size // HUGE_PAGE * HUGE_PAGE
    length = -(-size // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)
    try:
        if huge:
            buf.madvise(mmap.MADV_HUGEPAGE, 0, huge)
        if length > huge:
            buf.madvise(mmap.MADV_NOHUGEPAGE, huge, length - huge)
    except (AttributeError, OSError):  # no transparent huge pages here: small pages
        pass
    return buf
