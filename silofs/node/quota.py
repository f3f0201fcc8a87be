"""The quota each dataset may fill, and the shrink plan when allocations change.

Owns promise 1's arithmetic: uniform admission up to a dataset's allocation; datasets
without an allocation share what is left, first come first served. Pure: a frozen view
handed to the writer thread. Never touches LMDB and never evicts (the Writer does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from silofs.cache.store import Usage


@dataclass(frozen=True)
class QuotaPolicy:
    """A frozen view of the allocations, safe to hand to the writer thread."""

    cache_size: int
    allocations: Mapping[int, int] = field(default_factory=dict)  # dataset id -> bytes
    lru: frozenset[int] = frozenset()  # datasets in irregular-access (LRU) mode

    def quota(self, dsid: int, usage: Mapping[int, Usage]) -> int:
        if dsid in self.allocations:
            return self.allocations[dsid]
        shared = self.cache_size - sum(self.allocations.values())
        others = sum(u.bytes for d, u in usage.items() if d != dsid and d not in self.allocations)
        return max(0, shared - others)

    def excess(self, usage: Mapping[int, Usage]) -> dict[int, int]:
        """Datasets over their quota, with the size each must shrink to.

        A plan: once every entry is applied, every dataset fits its quota and no more
        was evicted than that needs. Allocated datasets shrink to their allocation. The
        unallocated ones share one pool; when it overflows, the datasets registered last
        (highest ids) give back first: first come, first served.
        """
        out: dict[int, int] = {}
        for dsid, u in usage.items():
            if dsid in self.allocations and u.bytes > self.allocations[dsid]:
                out[dsid] = self.allocations[dsid]
        pool = {d: u.bytes for d, u in usage.items() if d not in self.allocations}
        over = sum(pool.values()) - max(0, self.cache_size - sum(self.allocations.values()))
        for dsid in sorted(pool, reverse=True):
            if over <= 0:
                break
            cut = min(over, pool[dsid])
            if cut > 0:
                out[dsid] = pool[dsid] - cut
                over -= cut
        return out
