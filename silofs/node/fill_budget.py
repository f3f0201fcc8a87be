"""The room a dataset has left for chunks fetched ahead of any reader.

Owns the one admission test of the tasks that fill a dataset on their own (warm, and
prefetch by hint): a chunk is fetched only if the dataset would admit it (promise 1,
uniform admission): what it holds, plus what the task has in flight or offered to the
Writer since it last looked, plus the chunk, within its quota. That first answer counts
an offered chunk twice once the Writer has committed it, so a "no" is checked again
exactly: after what is in flight has landed and the Writer has flushed, with the
committed usage alone. Never fetches, never writes LMDB, and never decides a quota
(node/quota.py does).
"""

from __future__ import annotations

from typing import Any

import trio

from silofs.cache.store import Usage


class FillBudget:
    """One filling task's view of one dataset's room. `d` is the Daemon (node/daemon.py
    imports the tasks that use this, so it is not imported here)."""

    def __init__(self, d: Any, dsid: int) -> None:
        self.d = d
        self.dsid = dsid
        self.in_flight = 0  # bytes being fetched
        self.offered = 0  # bytes fetched and offered to the Writer since the last flush
        self._drained = trio.Event()  # set when nothing is in flight

    def quota(self) -> int:
        return int(self.d.quota_policy().quota(self.dsid, self.d.usage))

    def held(self) -> int:
        return int(self.d.usage.get(self.dsid, Usage()).bytes)

    def started(self, length: int) -> None:
        """A fetch of `length` bytes began."""
        self.in_flight += length

    def ended(self, length: int, offered: int) -> None:
        """A fetch of `length` bytes ended, `offered` of them offered to the Writer (0: it
        failed)."""
        self.in_flight -= length
        self.offered += offered
        if self.in_flight == 0:
            self._drained.set()

    async def fits(self, length: int) -> bool:
        """Whether the dataset would admit `length` more bytes."""
        if self.held() + self.offered + self.in_flight + length <= self.quota():
            return True
        # What is in flight or queued may yet be refused or dropped: wait for it and for
        # its admission before deciding the dataset is full.
        if self.in_flight:
            self._drained = trio.Event()
            await self._drained.wait()
        await self.d.writer.flush()
        self.offered = 0
        return self.held() + length <= self.quota()
