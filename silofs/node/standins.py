"""Dropping the copies a node made standing in for a member that was down, once it is back.

Owns when and how those copies go. While a chunk's home is down another member is its
home and admits it (WritableStore.elsewhere marks it a first eviction victim); once the
home answers again, reads of the chunk go there, and the copy here only inflates this
node's `cached` (status, the share it seems to fill) while the chunk is also cached at
its home: the cluster's holding of a dataset would read more than its share, and the
hit ratio share / dataset size (docs/SEMANTICS.md promise 7) would look exceeded. So the
prober (node/cluster.py) starts a sweep each time a member answers for the first time
or again after being down: it walks the first-eviction-victim rows in batches of one
small write txn each, serialised with admissions by the writer's lock, and deletes the
chunks whose configured home (placed(), from the member list in force when the sweep
began) is another member answering now: one that answered a ping sent after the offers
queued before the sweep were committed (node/cluster.py pings them; a member up there
may have died unnoticed, and copies of its chunks made since are the only ones). Never:
deletes a chunk placed at this node (membership may have changed since the copy was
made: it is this node's own now), or a chunk whose home has not answered since, or runs
on a read's path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from silofs.units import count, format_size

if TYPE_CHECKING:
    from silofs.node.store_write import WritableStore
    from silofs.node.writer import Writer

log = logging.getLogger(__name__)


async def sweep_standins(
    writer: Writer, store: WritableStore, homed_live: Callable[[bytes], bool]
) -> int:
    """Delete the stand-in copies `homed_live` names; the bytes freed. Offers queued before
    the call are committed first, so a copy admitted just before its home came back is
    among those found."""
    await writer.flush()
    after: bytes | None = b""
    freed = removed = 0
    while after is not None:
        f, n, after = await writer.with_usage(store.sweep_elsewhere, homed_live, after)
        freed += f
        removed += n
        await trio.sleep(0)  # between batches, admissions and requests go first
    if removed:
        log.info(
            "cluster: dropped %s (%s) held standing in for members back up",
            count(removed, "chunk"),
            format_size(freed),
        )
    return freed


def homed_live_by(
    placed: Callable[[bytes], str], answering: frozenset[str]
) -> Callable[[bytes], bool]:
    """Whether a chunk key is placed at one of `answering` (other members: never this
    node). A function of values taken now, for the writer's thread to call."""
    return lambda key: placed(key) in answering
