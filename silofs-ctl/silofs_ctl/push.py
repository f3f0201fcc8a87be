"""Pushing a plan: per node, only what differs from what the node holds, nodes in parallel.

Owns: the diff between a Plan and a node's status (or what the node last accepted, for
what it does not list), the PUTs (every node's shrinks, then every node's grows), holding
back the IO grows that IO shrinks which did not land were to pay for (the link total
holds for what the nodes enforce), and the report of what landed, what was refused and
which nodes were unreachable. A cluster's cache shares go to its one `via` member (the
PUT is the same as a node's own allocation; the daemon takes it as the cluster-wide
share and passes it on), diffed against the shares that member holds; its other
members get only their jobs' IO. Never: plans, retries within a round (the next round
does), or lets one node's failure stop the others.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from silofs.units import format_rate

from .nodes import NodeClient, NodeError
from .observe import NodeSeen
from .plan import Plan

log = logging.getLogger(__name__)


@dataclass
class PushReport:
    pushed: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)
    # bytes/s of IO grows withheld this round because shrinks did not land (_clamp)
    held_back: float = 0.0


# What each node last accepted from us: node -> {("cache" | "io", name): value}.
Pushed = dict[str, dict[tuple[str, str], int | None]]


@dataclass(frozen=True)
class Update:
    kind: str  # "cache" | "io"
    name: str  # dataset URI or job
    value: int | None  # what the plan gives (None: unthrottled)
    current: float | None  # what the node holds now (-1: none known; None: unthrottled)
    shrink: bool


def push_plan(
    plan: Plan,
    clients: Mapping[str, NodeClient],
    seen: Mapping[str, NodeSeen],
    pool: ThreadPoolExecutor,
    pushed: Pushed | None = None,
) -> PushReport:
    """Send each node what differs from what it reports; nodes in parallel, a failing
    node only loses its own updates (the next round retries it).

    Every node's shrinks go before any node's grows: a node's cache grow needs the room
    its shrinks free, and an IO grow on one node is paid for by IO shrinks that may be
    on others. An IO shrink that did not land (refused, or the node stopped answering)
    leaves the node enforcing its old, larger rate, so the IO grows of the round give
    that difference back (_clamp): the link total the plan kept holds for what the
    nodes enforce, in that round and in every round a node goes on refusing."""
    report = PushReport()
    memory = pushed if pushed is not None else {}
    updates = {
        node: _updates(plan, seen[node], memory.setdefault(node, {}))
        for node in clients
        if node in seen and (plan.cache.get(node) or plan.io.get(node))
    }
    refused: dict[str, list[str]] = {}
    shrinks = {node: [u for u in ups if u.shrink] for node, ups in updates.items()}
    landed = _push_all(clients, shrinks, pool, memory, report, refused)
    over = 0.0  # bytes/s nodes enforce beyond the plan: shrinks that did not land
    stuck: set[str] = set()
    for node, ups in shrinks.items():
        for u in ups:
            if u.kind == "io" and u not in landed[node]:
                over += math.inf if u.current is None else u.current - (u.value or 0)
                stuck.add(node)
    grows = {
        node: [u for u in ups if not u.shrink]
        for node, ups in updates.items()
        if node not in report.unreachable
    }
    if over > 0:
        grows = _clamp(grows, over, stuck, report)
    _push_all(clients, grows, pool, memory, report, refused)
    for node, why in refused.items():
        if node not in report.failed:
            more = f" (and {len(why) - 1} more)" if len(why) > 1 else ""
            report.failed[node] = why[0] + more
    return report


def _updates(
    plan: Plan, status: NodeSeen, memory: dict[tuple[str, str], int | None]
) -> list[Update]:
    """What differs between the plan and what the node reports or, for what it does not
    report (a job with no mount there yet), what it last accepted; sorted cache before
    IO, by name."""
    node = status.name
    updates: list[Update] = []
    cluster = plan.cluster_of(node)
    cache = plan.cache.get(node, {}) if cluster is None or cluster.via == node else {}
    for dataset, nbytes in cache.items():
        current = _cache_now(status, dataset, memory, clustered=cluster is not None)
        if current is None or int(current) != nbytes:
            shrink = current is not None and current >= 0 and nbytes < current
            updates.append(Update("cache", dataset, nbytes, current, shrink))
    for job, rate in plan.io.get(node, {}).items():
        seen_job = status.jobs.get(job)
        current = seen_job.allocation if seen_job else memory.get(("io", job), -1)
        if current != (None if rate is None else float(rate)):
            # null is unlimited: going to it is a grow, leaving it a shrink
            shrink = rate is not None and (current is None or (current >= 0 and rate < current))
            updates.append(Update("io", job, rate, current, shrink))
    updates.sort(key=lambda u: (u.kind, u.name))
    return updates


def _clamp(
    grows: dict[str, list[Update]], over: float, stuck: set[str], report: PushReport
) -> dict[str, list[Update]]:
    """The IO grows scaled so that together they grow `over` bytes/s less than planned
    (none at all if that is all of them): what the nodes then enforce sums to no more
    than the plan. A grow to unthrottled cannot be bounded and is withheld; one that
    scales to what the node holds is dropped. The next round re-reads what the nodes
    enforce and clamps again while the refusal lasts."""
    wanted = sum(
        u.value - max(u.current or 0.0, 0.0)
        for ups in grows.values()
        for u in ups
        if u.kind == "io" and u.value is not None
    )
    scale = max(0.0, wanted - over) / wanted if wanted > 0 else 0.0
    clamped: dict[str, list[Update]] = {}
    for node, ups in grows.items():
        kept: list[Update] = []
        for u in ups:
            if u.kind == "io" and u.value is not None:
                base = max(u.current or 0.0, 0.0)
                value = int(base + (u.value - base) * scale)
                report.held_back += u.value - value
                if value != u.current:
                    kept.append(replace(u, value=value))
            elif u.kind == "io":
                report.held_back = math.inf
            else:
                kept.append(u)
        clamped[node] = kept
    log.warning(
        "IO shrinks on %s did not land: %s enforced beyond the plan, so this round's IO "
        "grows (%s) are held back by %s to keep the link total",
        ", ".join(f"node {node}" for node in sorted(stuck)),
        _rate(over),
        _rate(wanted),
        _rate(report.held_back),
    )
    return clamped


def _rate(rate: float) -> str:
    return "unthrottled IO" if math.isinf(rate) else format_rate(rate)


def _push_all(
    clients: Mapping[str, NodeClient],
    updates: dict[str, list[Update]],
    pool: ThreadPoolExecutor,
    memory: Pushed,
    report: PushReport,
    refused: dict[str, list[str]],
) -> dict[str, set[Update]]:
    """Push each node its updates, nodes in parallel; returns what landed per node."""
    futures = {
        node: pool.submit(_push_node, clients[node], ups, memory.setdefault(node, {}))
        for node, ups in updates.items()
        if ups
    }
    landed: dict[str, set[Update]] = {node: set() for node in updates}
    for node, future in futures.items():
        done, why, lost = future.result()
        landed[node] = done
        report.pushed += len(done)
        if why:
            refused.setdefault(node, []).extend(why)
        if lost is not None:
            report.failed[node] = lost
            report.unreachable.add(node)
    return landed


def _push_node(
    client: NodeClient, updates: list[Update], memory: dict[tuple[str, str], int | None]
) -> tuple[set[Update], list[str], str | None]:
    """(updates that landed, refusals, why the node became unreachable or None). An
    unreachable node ends its round; a refused update is reported and the node's other
    updates still go out."""
    done: set[Update] = set()
    refused: list[str] = []
    for u in updates:
        try:
            if u.kind == "cache":
                client.put_cache(u.name, int(u.value or 0))
            else:
                client.put_io(u.name, u.value)
        except NodeError as exc:
            if exc.unreachable:
                return done, refused, str(exc)
            refused.append(f"{u.name}: {exc}")
            continue
        memory[(u.kind, u.name)] = u.value
        done.add(u)
    return done, refused, None


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
