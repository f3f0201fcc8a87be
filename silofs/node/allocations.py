"""The node's allocations: what a controller (or an admin) decided, persisted.

Owns four tables, kept for datasets and jobs that are not mounted yet (promise 4): each
dataset's cache allocation and admission mode (by canonical URI), each job's remote IO
allocation and registration (by job name); loading them from the env's meta db at start
(skipping job names the grammar refuses), persisting every change through the Writer,
the rule that cache allocations never add up to more than the cache (checked and
written as one step), and the quota policy they make. Never applies a change beyond
its tables (a job's limiter, a dataset's LRU rows: the Daemon does) and never evicts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import trio

from silofs.errors import UsageError
from silofs.node.quota import QuotaPolicy
from silofs.node.state import DatasetState
from silofs.node.store_write import WritableStore
from silofs.node.writer import Writer
from silofs.records import job_name_error
from silofs.units import format_rate, format_size

log = logging.getLogger(__name__)

ADMISSION_MODES = ("uniform", "lru")


class Allocations:
    """The four tables, changed only through the methods below (each persists first)."""

    def __init__(self, store: WritableStore, writer: Writer, cache_size: int) -> None:
        self.store = store
        self.writer = writer
        self.cache_size = cache_size
        self.cache: dict[str, int] = {k: int(v) for k, v in _rows(store, "cache:")}
        total = sum(self.cache.values())
        if total > cache_size:  # persisted under a larger --cache-size / cache_size
            log.warning(
                "cache allocations total %s, more than the cache (%s): each is scaled down "
                "to %.0f%% of it (and its dataset evicted down to that) until they are "
                "lowered (silofs-ctl allocate-cache)",
                format_size(total),
                format_size(cache_size),
                100 * cache_size / total,
            )
        self.io: dict[str, int | None] = {
            k: v["bytes_per_s"] for k, v in _rows(store, "io:") if _valid_persisted_job(k)
        }
        self.modes: dict[str, str] = {k: str(v) for k, v in _rows(store, "mode:")}
        # Job registrations (a cluster scheduler's prolog: GPUs, f*, epochs, datasets;
        # PUT /v1/jobs/{job}), persisted so a daemon restart in the middle of a job does
        # not make the controller forget its GPUs. Removed by forgetting the job (the
        # epilog does, after unmounting).
        self.registrations: dict[str, dict] = {
            k: dict(v)
            for k, v in _rows(store, "job:")
            if isinstance(v, dict) and _valid_persisted_job(k)
        }
        # A cache allocation change checks the sum and then writes it (an await): one at
        # a time, or two concurrent PUTs could both pass the check and together exceed
        # the cache.
        self._lock = trio.Lock()
        self._changed = trio.Event()

    def mode(self, uri: str) -> str:
        """A dataset's admission mode: uniform unless set."""
        return self.modes.get(uri, "uniform")

    def quota_policy(
        self, datasets: Iterable[DatasetState], overrides: Mapping[str, int | None] | None = None
    ) -> QuotaPolicy:
        """Promise 1's inputs for the datasets the daemon holds: their allocations (by
        dataset id) and which of them are in lru mode. `overrides` (by URI) replace
        the allocations table's: in a cluster, this node's part of a dataset's share
        (None: the shared pool)."""
        datasets = list(datasets)
        table: dict[str, int | None] = {**self.scaled(), **(overrides or {})}
        by_id = {
            ds.id: size for ds in datasets if (size := table.get(ds.uri.canonical)) is not None
        }
        lru = frozenset(ds.id for ds in datasets if self.modes.get(ds.uri.canonical) == "lru")
        return QuotaPolicy(self.cache_size, by_id, lru)

    def scaled(self) -> dict[str, int]:
        """The cache allocations as the quota applies them: as set, unless together they
        exceed the cache (set under a larger one, before a restart with a smaller
        cache_size), then each in proportion, so the datasets together hold no more than
        the cache: kept as set, they held the old, larger cache on its disk."""
        total = sum(self.cache.values())
        if total <= self.cache_size:
            return self.cache
        return {k: v * self.cache_size // total for k, v in self.cache.items()}

    def notify(self) -> None:
        """Something the quota policy reads changed elsewhere (a cluster's shares): the
        enforcer looks again now."""
        self._changed.set()

    async def changed(self, timeout: float) -> None:
        """Return once a cache allocation changes, or after `timeout` seconds."""
        with trio.move_on_after(timeout):
            await self._changed.wait()
        self._changed = trio.Event()

    async def set_cache(self, uri: str, size: int | None) -> None:
        """Allocate `size` bytes of cache to a dataset (None: back to the shared pool);
        UsageError if all allocations would then exceed the cache."""
        async with self._lock:
            others = sum(v for k, v in self.cache.items() if k != uri)
            # Lowering one is let through while they still exceed a cache made smaller
            # since they were set: that is how they are brought back within it.
            lower = size is not None and size <= self.cache.get(uri, 0)
            if size is not None and others + size > self.cache_size and not lower:
                over = others + size - self.cache_size
                raise UsageError(
                    f"allocations would total {format_size(others + size)}, "
                    f"{format_size(over)} more than the cache "
                    f"({format_size(self.cache_size)})"
                )
            await self._put("cache:", uri, size, self.cache)
        log.info(
            "cache allocation of %s: %s", uri, "shared pool" if size is None else format_size(size)
        )
        self._changed.set()

    async def set_io(self, job: str, rate: int | None) -> None:
        """Allocate remote IO to a job (None: unlimited, but the job keeps its row)."""
        await self.writer.call(self.store.put_meta, f"io:{job}", {"bytes_per_s": rate})
        self.io[job] = rate
        log.info("remote IO allocation of job %s: %s", job, format_rate(rate))

    async def clear_io(self, job: str) -> bool:
        """Remove a job's remote IO allocation; False if it had none."""
        if job not in self.io:
            return False
        await self._put("io:", job, None, self.io)
        log.info("remote IO allocation of job %s removed", job)
        return True

    async def set_mode(self, uri: str, mode: str) -> str:
        """Set a dataset's admission mode; the mode it had. UsageError for another mode."""
        if mode not in ADMISSION_MODES:
            raise UsageError(f"admission mode must be uniform or lru, not {mode!r}")
        old = self.mode(uri)
        await self._put("mode:", uri, mode, self.modes)
        log.info("admission mode of %s: %s", uri, mode)
        return old

    async def register_job(self, name: str, info: dict) -> None:
        """Record what a cluster scheduler says of a job (checked by its route); replaces
        an earlier registration of the same name."""
        await self._put("job:", name, info, self.registrations)
        log.info("job %s registered: %s", name, info)

    async def forget_dataset(self, uri: str) -> None:
        """Drop a dataset's cache allocation and admission mode."""
        if uri in self.cache:
            await self.set_cache(uri, None)
        if uri in self.modes:
            await self._put("mode:", uri, None, self.modes)

    async def forget_job(self, name: str) -> None:
        """Drop a job's remote IO allocation and its registration."""
        for prefix, table in (("io:", self.io), ("job:", self.registrations)):
            if name in table:
                await self._put(prefix, name, None, table)

    async def _put(self, prefix: str, name: str, value: Any, table: dict[str, Any]) -> None:
        """Persist one row (None: delete it), then the table follows."""
        await self.writer.call(self.store.put_meta, f"{prefix}{name}", value)
        if value is None:
            table.pop(name, None)
        else:
            table[name] = value


def _rows(store: WritableStore, prefix: str) -> Iterable[tuple[str, Any]]:
    return ((k.removeprefix(prefix), v) for k, v in store.iter_meta(prefix))


def _valid_persisted_job(name: str) -> bool:
    """Allocations persisted before job names were checked may hold a name that breaks
    /metrics for everyone: skip it (the row stays in the env, unused)."""
    why = job_name_error(name)
    if why is not None:
        log.warning("ignoring the persisted IO allocation of job %r: %s", name, why)
    return why is None
