"""Pushing a plan: per node, only what differs from what the node holds, nodes in parallel.

Owns: the diff between a Plan and a node's status (or what the node last accepted, for
what it does not list), the PUTs, and the report of what landed, what was refused and
which nodes were unreachable. A cluster's cache shares go to its one `via` member (the
PUT is the same as a node's own allocation; the daemon takes it as the cluster-wide
share and passes it on), diffed against the shares that member holds; its other
members get only their jobs' IO. Never: plans, retries within a round (the next round
does), or lets one node's failure stop the others.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .nodes import NodeClient, NodeError
from .observe import NodeSeen
from .plan import Plan

log = logging.getLogger(__name__)


@dataclass
class PushReport:
    pushed: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)


# What each node last accepted from us: node -> {("cache" | "io", name): value}.
Pushed = dict[str, dict[tuple[str, str], int | None]]


def push_plan(
    plan: Plan,
    clients: Mapping[str, NodeClient],
    seen: Mapping[str, NodeSeen],
    pool: ThreadPoolExecutor,
    pushed: Pushed | None = None,
) -> PushReport:
    """Send each node what differs from what it reports; nodes in parallel, a failing
    node only loses its own updates (the next round retries it)."""
    report = PushReport()
    memory = pushed if pushed is not None else {}
    futures = {
        node: pool.submit(_push_node, clients[node], plan, seen[node], memory.setdefault(node, {}))
        for node in clients
        if node in seen and (plan.cache.get(node) or plan.io.get(node))
    }
    for node, future in futures.items():
        try:
            count, refused = future.result()
        except NodeError as exc:
            report.failed[node] = str(exc)
            report.unreachable.add(node)
            continue
        report.pushed += count
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            report.failed[node] = refused[0] + more
    return report


def _push_node(
    client: NodeClient, plan: Plan, status: NodeSeen, memory: dict[tuple[str, str], int | None]
) -> tuple[int, list[str]]:
    """(updates pushed, refusals). Pushes what differs from what the node reports or, for
    what it does not report (a job with no mount there yet), from what it last accepted.
    An unreachable node raises and ends its round; a refused update is reported and the
    node's other updates still go out."""
    node = status.name
    # (shrinks first?, kind, name, value): the node refuses a cache allocation that would
    # take its allocations over its cache size, so every shrink must land before any
    # grow or a grow sorted before the shrink that makes room for it waits a round.
    updates: list[tuple[bool, str, str, int | None]] = []
    cluster = plan.cluster_of(node)
    cache = plan.cache.get(node, {}) if cluster is None or cluster.via == node else {}
    for dataset, nbytes in cache.items():
        current = _cache_now(status, dataset, memory, clustered=cluster is not None)
        if current is None or int(current) != nbytes:
            shrink = current is not None and current >= 0 and nbytes < current
            updates.append((not shrink, "cache", dataset, nbytes))
    for job, rate in plan.io.get(node, {}).items():
        seen_job = status.jobs.get(job)
        current = seen_job.allocation if seen_job else memory.get(("io", job), -1)
        if current != (None if rate is None else float(rate)):
            # null is unlimited: going to it is a grow, leaving it a shrink
            shrink = rate is not None and (current is None or (current >= 0 and rate < current))
            updates.append((not shrink, "io", job, rate))
    updates.sort(key=lambda u: u[:3])  # shrinks, then grows; cache before IO; by name
    count, refused = 0, []
    for _, kind, name, value in updates:
        try:
            if kind == "cache":
                client.put_cache(name, int(value or 0))
            else:
                client.put_io(name, value)
        except NodeError as exc:
            if exc.unreachable:
                raise
            refused.append(f"{name}: {exc}")
            continue
        memory[(kind, name)] = value
        count += 1
    return count, refused


def _cache_now(
    status: NodeSeen,
    dataset: str,
    memory: dict[tuple[str, str], int | None],
    *,
    clustered: bool,
) -> float | None:
    """What a node holds for a dataset now: its allocation, or in a cluster the dataset's
    cluster-wide share (its datasets' own allocation column is the node-local one); -1
    when it lists none and we never set one."""
    if clustered and status.cluster is not None:
        shares = status.cluster.shares
        if dataset in shares:
            return shares[dataset]
        return memory.get(("cache", dataset), -1)
    held = status.datasets.get(dataset)
    return held.allocation if held else memory.get(("cache", dataset), -1)
