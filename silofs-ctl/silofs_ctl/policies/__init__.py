"""Scheduling and cache policies behind one interface (base.Policy, base.CachePolicy).

Owns the registry from the names the CLI and the controller accept to policy objects.
Never: holds policy logic itself.
"""

from __future__ import annotations

from .alluxio import AlluxioCache
from .base import CachePolicy, Policy
from .coordl import CoordlCache
from .fifo import FifoPolicy
from .gavel import GavelPolicy
from .greedy import GreedyPolicy
from .quiver import QuiverCache
from .sjf import SjfPolicy

SCHEDULERS: dict[str, type[Policy]] = {
    "fifo": FifoPolicy,
    "sjf": SjfPolicy,
    "gavel": GavelPolicy,
}
# "silod" is not here: with it the scheduler itself decides cache and IO.
CACHES: dict[str, type[CachePolicy]] = {
    "coordl": CoordlCache,
    "alluxio": AlluxioCache,
    "quiver": QuiverCache,
}

__all__ = [
    "CACHES",
    "SCHEDULERS",
    "AlluxioCache",
    "CachePolicy",
    "CoordlCache",
    "FifoPolicy",
    "GavelPolicy",
    "GreedyPolicy",
    "Policy",
    "QuiverCache",
    "SjfPolicy",
]
