"""The live controller's loop: poll the node daemons, re-plan when something changed, push.

Owns: the round (reload the jobs file, observe every node in parallel, plan when the set
of jobs changed or the interval passed, push), which nodes are down or refused, what
each node last accepted, and the long-running loop. The pieces live next to it:
controller_config.py (settings, jobs file), nodes.py (the node client), observe.py
(statuses, rates), plan.py (policy -> per-node allocations), push.py (sending them).
Never: schedules GPUs (jobs are started by whatever runs them; their GPUs and nodes are
facts here), talks to a daemon except through a NodeClient, or lets one node's failure
or one bad round stop the others.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .controller_config import ControllerConfig, JobEntry, load_jobs_file
from .nodes import ClientFactory, NodeError, socket_clients
from .observe import NodeSeen, RateTracker, Registration, parse_status
from .plan import Plan, plan_allocations
from .push import Pushed, push_plan
from .tomlcheck import ConfigError

log = logging.getLogger(__name__)


class Controller:
    """Poll, plan when something changed or the interval passed, push."""

    def __init__(self, config: ControllerConfig, factory: ClientFactory | None = None) -> None:
        self.config = config
        factory = factory or socket_clients(config)
        self.clients = {n.name: factory(n) for n in config.nodes}
        self.rates = RateTracker()
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(config.nodes)))
        self.down: dict[str, str] = {}  # unreachable nodes, and why
        self.refused: dict[str, str] = {}  # nodes that refused an update last round
        self.pushed: Pushed = {}
        self.entries: list[JobEntry] = []
        # (mtime, size) of the jobs file as last read; None: missing; "" : never looked
        self.jobs_stamp: tuple | str | None = ""
        self.signature: str | None = None
        self.next_round = 0.0
        self.stop = threading.Event()

    def observe(self) -> dict[str, NodeSeen]:
        """Every node's status, fetched in parallel; nodes that fail are skipped."""
        futures = {name: self.pool.submit(c.status) for name, c in self.clients.items()}
        seen: dict[str, NodeSeen] = {}
        for name, future in futures.items():
            try:
                seen[name] = parse_status(name, future.result())
            except (NodeError, KeyError, TypeError, ValueError) as exc:
                self._node_down(name, str(exc))
                continue
            if name in self.down:
                log.warning("node %s is back", name)
                del self.down[name]
        self.rates.update(seen, time.monotonic())
        return seen

    def _node_down(self, name: str, why: str) -> None:
        if self.down.get(name) != why:
            log.warning("node %s: %s (will retry)", name, why)
        self.down[name] = why
        self.pushed.pop(name, None)  # it may come back without them: push all again

    def reload_jobs(self) -> bool:
        """Re-read the jobs file if it changed; a broken file keeps the last good one."""
        path = self.config.jobs_file
        if not path:
            return False
        try:
            st = Path(path).stat()
            stamp: tuple | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp == self.jobs_stamp:
            return False
        self.jobs_stamp = stamp
        if stamp is None:
            log.warning("jobs file %s is missing; using jobs seen on the nodes only", path)
            self.entries = []
            return True
        try:
            self.entries = load_jobs_file(path)
        except ConfigError as exc:
            log.error("%s (keeping the previous jobs)", exc)
            return False
        log.info("jobs file: %d jobs", len(self.entries))
        return True

    def round(self, *, dry_run: bool = False, force: bool = False) -> Plan | None:
        """One poll; plans and pushes if the job set changed, the interval passed, or
        `force`. Returns the plan when it planned."""
        self.reload_jobs()
        seen = self.observe()
        entries = [*self.entries, *registered_entries(seen, {e.name for e in self.entries})]
        signature = _signature(entries, seen, self.rates.ideal)
        now = time.monotonic()
        if not force and signature == self.signature and now < self.next_round:
            return None
        plan = plan_allocations(self.config, entries, seen, self.rates.ideal)
        self.signature, self.next_round = signature, now + self.config.interval
        if dry_run:
            return plan
        report = push_plan(plan, self.clients, seen, self.pool, self.pushed)
        self.refused = {}
        for node, why in report.failed.items():
            if node not in report.unreachable:
                log.warning("node %s refused: %s", node, why)
                self.refused[node] = why
            else:
                self._node_down(node, why)
        if report.failed:
            self.next_round = now  # retry what did not land at the next poll
        # (a node that is down is polled every time anyway; it coming back re-plans)
        if report.pushed:
            log.info("pushed %d allocation changes", report.pushed)
        return plan

    @property
    def not_updated(self) -> dict[str, str]:
        """Nodes whose allocations may not be what the last plan says."""
        return {**self.refused, **self.down}

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.round()
            except Exception:  # one bad round must not end a long-running controller
                log.exception("controller round failed; retrying next poll")
            self.stop.wait(self.config.poll)

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        for client in self.clients.values():
            closer = getattr(client, "close", None)
            if closer:
                closer()


def registered_entries(seen: Mapping[str, NodeSeen], skip: set[str]) -> list[JobEntry]:
    """Jobs the daemons' registrations describe (a Slurm prolog runs on each node of a
    job and registers it there): on the nodes that hold a registration, with the most
    GPUs any of them reports (the job's total), and f*/epochs when one gives them.
    Names in ``skip`` (the jobs file's) are left out: a hand-written entry wins whole."""
    found: dict[str, tuple[Registration, list[str]]] = {}
    for node in sorted(seen):
        for reg in seen[node].registrations.values():
            if reg.name in skip:
                continue
            held = found.get(reg.name)
            if held is None:
                found[reg.name] = (reg, [node])
                continue
            best, nodes = held
            nodes.append(node)
            if reg.gpus > best.gpus or (best.ideal_io is None and reg.ideal_io is not None):
                found[reg.name] = (reg, nodes)
    return [
        JobEntry(
            name=name,
            dataset=reg.datasets[0],
            gpus=reg.gpus,
            ideal_io=reg.ideal_io if reg.ideal_io and reg.ideal_io > 0 else None,
            nodes=tuple(nodes),
            epochs=reg.epochs,
        )
        for name, (reg, nodes) in sorted(found.items())
    ]


def _signature(
    entries: Iterable[JobEntry], seen: Mapping[str, NodeSeen], ideal: Mapping[str, float]
) -> str:
    """Changes when the set of jobs (or what is known of them) changes."""
    parts = sorted(repr(e) for e in entries)
    parts += sorted(f"{n}:{j.name}:{j.dataset}" for n, s in seen.items() for j in s.jobs.values())
    parts += sorted(f"up:{n}" for n in seen)
    parts += sorted(f"ideal:{k}" for k in ideal)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
