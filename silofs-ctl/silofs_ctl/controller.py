"""The live controller's loop: poll the node daemons, re-plan when something changed, push.

Owns: the round (reload the jobs file, observe every node and ask slurmctld in
parallel, plan when the set of jobs changed or the interval passed, push, feed the
queue's SJF order back to Slurm), which nodes are down or refused, what each node last
accepted, the link a silent node may still be using (its last allocations, reserved
until it answers again), and the long-running loop. The pieces live next to it:
controller_config.py (settings, jobs file), nodes.py (the node client), observe.py
(statuses, rates), slurm.py (squeue, scontrol), plan.py (policy -> per-node
allocations, queue order), push.py (sending them).
Never: schedules GPUs (jobs are started by whatever runs them; their GPUs and nodes are
facts here; Slurm's priority is a hint Slurm weighs), talks to a daemon except through a
NodeClient, or lets one node's failure, slurmctld being down or one bad round stop the
others.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from silofs.records import shown
from silofs.units import count, format_rate, format_size

from .controller_config import ControllerConfig, JobEntry, load_jobs_file
from .nodes import ClientFactory, NodeError, socket_clients
from .observe import NodeSeen, RateTracker, Registration, parse_status
from .plan import Plan, plan_allocations
from .push import Pushed, push_plan
from .slurm import SlurmError, SlurmJob, SlurmSource, priority_targets
from .tomlcheck import ConfigError

log = logging.getLogger(__name__)


class Controller:
    """Poll, plan when something changed or the interval passed, push."""

    def __init__(self, config: ControllerConfig, factory: ClientFactory | None = None) -> None:
        self.config = config
        factory = factory or socket_clients(config)
        self.clients = {n.name: factory(n) for n in config.nodes}
        self.rates = RateTracker()
        # one worker per node, and one for squeue
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(config.nodes)) + 1)
        self.slurm = SlurmSource(config.slurm) if config.slurm else None
        self.slurm_down: str | None = None  # why slurmctld did not answer last time
        # slurmctld's last answer and when it was asked ([slurm] poll spares it a
        # squeue of the whole queue every controller poll)
        self.slurm_jobs: list[SlurmJob] = []
        self.slurm_asked: float | None = None
        # The queue order last fed back (job ids), and whether Slurm took it: a refused
        # order is not tried again until the order changes.
        self.fed: tuple[tuple[str, ...], bool] | None = None
        self.priority_lines: list[str] = []  # what the last round set (or would set)
        self.checked_scheduler = False  # whether Slurm's scheduler heeds priority
        self.down: dict[str, str] = {}  # unreachable nodes, and why
        self.refused: dict[str, str] = {}  # nodes that refused an update last round
        self.nodes = {n.name: n for n in config.nodes}
        # nodes whose configured cache is more than the daemon's, and the daemon's size
        # (said once per size: _check_budget)
        self.oversized: dict[str, float] = {}
        self.pushed: Pushed = {}
        # Each node's status as last seen, and the IO last planned for it: what a node
        # that stops answering may go on enforcing (_hold).
        self.last_seen: dict[str, NodeSeen] = {}
        self.last_io: dict[str, dict[str, int | None]] = {}
        # Silent nodes -> {job: bytes/s}: the IO allocations a node held when it stopped
        # answering. It may still serve and enforce them (only the control connection
        # may be down), so the plan divides the link minus these until it answers again.
        self.reserved: dict[str, dict[str, float]] = {}
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
                freed = self.reserved.pop(name, None)
                ends = f" (its reserved {format_rate(sum(freed.values()))} ends)" if freed else ""
                log.warning("node %s is back%s", name, ends)
                del self.down[name]
            self.last_seen[name] = seen[name]
            self._check_budget(name, seen[name])
        self.rates.update(seen, time.monotonic())
        return seen

    def _check_budget(self, name: str, status: NodeSeen) -> None:
        """Say once (per size) that a node's configured cache is more than its daemon
        has: the plan divides the daemon's (plan._budget), not what the config says."""
        config = self.nodes[name].cache
        size = status.cache_size
        if config is None or size is None or config <= size:
            self.oversized.pop(name, None)
            return
        if self.oversized.get(name) != size:
            log.warning(
                "node %s: cache = %s in the config is more than the daemon's cache (%s): "
                "planning with the daemon's",
                name,
                format_size(config),
                format_size(size),
            )
        self.oversized[name] = size

    def _node_down(self, name: str, why: str) -> None:
        if self.down.get(name) != why:
            log.warning("node %s: %s (will retry)", name, why)
        if name not in self.down:
            self._hold(name)
        self.down[name] = why
        self.pushed.pop(name, None)  # it may come back without them: push all again

    def _hold(self, name: str) -> None:
        """Reserve what a node that just stopped answering may go on fetching: per job
        it ran or was planned, the larger of what it last reported and what it last
        accepted from us. Unthrottled (null) allocations cannot be bounded and are not
        reserved (with a finite link the controller pushes none). Said once."""
        status = self.last_seen.get(name)
        memory = self.pushed.get(name, {})
        jobs = set(status.jobs if status else ()) | set(self.last_io.get(name, {}))
        held: dict[str, float] = {}
        for job in sorted(jobs):
            seen_job = status.jobs.get(job) if status else None
            known = [seen_job.allocation if seen_job else None, memory.get(("io", job))]
            rates = [float(r) for r in known if r is not None and r >= 0]
            if rates:
                held[job] = max(rates)
        if not held:
            return
        self.reserved[name] = held
        log.warning(
            "node %s: not answering; the %s of IO it was last allocated (%s) stays reserved "
            "on the link until it answers again or is removed from the config",
            name,
            format_rate(sum(held.values())),
            ", ".join(f"{shown(job)} {format_rate(rate)}" for job, rate in held.items()),
        )

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
        log.info("jobs file: %s", count(len(self.entries), "job"))
        # A node the config does not name is never planned for (plan.py plans only
        # configured nodes): a typo (gpu-1 for gpu-01) left the job out of the plan
        # without a word. Said once per change of the file.
        configured = {n.name for n in self.config.nodes}
        for entry in self.entries:
            unknown = [n for n in entry.nodes if n not in configured]
            if unknown:
                log.warning(
                    "jobs file %s: job %s names %s, not a node of the config's [[nodes]]: "
                    "not planned there",
                    path,
                    shown(entry.name),
                    ", ".join(shown(n) for n in unknown),
                )
        return True

    def round(self, *, dry_run: bool = False, force: bool = False) -> Plan | None:
        """One poll; plans and pushes if the job set changed, the interval passed, or
        `force`. Returns the plan when it planned."""
        self.reload_jobs()
        asked = self.pool.submit(self.ask_slurm) if self.slurm else None
        seen = self.observe()
        slurm_jobs = asked.result() if asked else []
        entries = [*self.entries, *registered_entries(seen, {e.name for e in self.entries})]
        configured = {n.name for n in self.config.nodes}
        entries += slurm_entries(slurm_jobs, {e.name for e in entries}, configured)
        queue = [j for j in slurm_jobs if j.pending and j.managed]
        signature = _signature(entries, seen, self.rates.ideal, queue)
        now = time.monotonic()
        if not force and signature == self.signature and now < self.next_round:
            return None
        plan = plan_allocations(self._plan_config(), entries, seen, self.rates.ideal, queue)
        self.signature, self.next_round = signature, now + self.config.interval
        if self.slurm and self.slurm.config.priority != "off":
            self.feed_priorities(plan, dry_run=dry_run)
        if dry_run:
            return plan
        report = push_plan(plan, self.clients, seen, self.pool, self.pushed)
        self.last_io.update({node: dict(plan.io.get(node, {})) for node in seen})
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
            log.info("pushed %s", count(report.pushed, "allocation change"))
        return plan

    def _plan_config(self) -> ControllerConfig:
        """The config the plan divides: the link less what silent nodes may still use."""
        held = sum(r for node in self.reserved.values() for r in node.values())
        if not held:
            return self.config
        return replace(self.config, remote_io=max(0.0, self.config.remote_io - held))

    def ask_slurm(self) -> list[SlurmJob]:
        """slurmctld's pending and running jobs; none (logged once) when it does not
        answer: the round goes on with what the daemons know."""
        assert self.slurm is not None
        now = time.monotonic()
        if self.slurm_asked is not None and now - self.slurm_asked < self.slurm.config.poll:
            return self.slurm_jobs
        self.slurm_asked = now
        try:
            self.slurm_jobs = self.slurm.jobs()
        except SlurmError as exc:
            if self.slurm_down != str(exc):
                log.warning("slurm: %s (planning with what the daemons know)", exc)
            self.slurm_down = str(exc)
            self.slurm_jobs = []
            return []
        if self.slurm_down is not None:
            log.warning("slurm: slurmctld answers again")
            self.slurm_down = None
        return self.slurm_jobs

    def feed_priorities(self, plan: Plan, *, dry_run: bool) -> None:
        """Give the managed pending jobs Slurm priorities in the plan's SJF order, when
        Slurm's order differs; at most max_priority_updates scontrol calls a round.
        priority = "log" (and --dry-run) only says what it would set."""
        assert self.slurm is not None
        cfg = self.slurm.config
        order = [q.job for q in plan.queue]
        targets = priority_targets(order)
        for q in plan.queue:
            q.new_priority = targets.get(q.job.id)
        ids = tuple(j.id for j in order if not j.held)  # the order wanted
        self.priority_lines = []
        if not targets:
            self.fed = (ids, True)
            return
        todo = [j for j in order if j.id in targets][: cfg.max_priority_updates]
        if not self.checked_scheduler:
            self.checked_scheduler = True
            if self.slurm.priority_ignored():
                log.warning(
                    "slurm: SchedulerType=sched/builtin with PriorityType=priority/basic "
                    "starts jobs in job id order whatever their priority: the SJF order "
                    "set here changes nothing (use priority/multifactor or sched/backfill)"
                )
        if dry_run or cfg.priority == "log":
            self.priority_lines = [
                f"would run: scontrol update JobId={j.id} Priority={targets[j.id]}"
                f" (now {j.priority})"
                for j in todo
            ]
            if not dry_run and self.fed != (ids, True):
                for line in self.priority_lines:
                    log.info("slurm: %s", line)
            self.fed = (ids, True)
            return
        if self.fed is not None and self.fed == (ids, False):
            return  # refused for this very order: wait until it changes
        done = 0
        for job in todo:
            try:
                self.slurm.set_priority(job.id, targets[job.id])
            except SlurmError as exc:
                log.warning(
                    "slurm: could not set job %s's priority (%s); setting priorities needs "
                    "Slurm operator or admin rights: leaving Slurm's order as it is",
                    job.id, exc,
                )  # fmt: skip
                self.fed = (ids, False)
                break
            done += 1
            self.slurm_asked = None  # the cached answer has the old priority
            self.priority_lines.append(
                f"set: scontrol update JobId={job.id} Priority={targets[job.id]}"
                f" (was {job.priority})"
            )
        else:
            self.fed = (ids, True)
            if len(todo) < len(targets):
                self.next_round = 0.0  # the rest at the next poll
        if done:
            log.info("slurm: set %s in SJF-SiloD order: %s", count(done, "priority", "priorities"),
                     ", ".join(f"{j.id}={targets[j.id]}" for j in todo[:done]))  # fmt: skip

    @property
    def not_updated(self) -> dict[str, str]:
        """Nodes whose allocations may not be what the last plan says (a silent node's
        line says what of the link it keeps reserved)."""
        down = dict(self.down)
        for node, held in self.reserved.items():
            down[node] += f" (its last {format_rate(sum(held.values()))} reserved on the link)"
        return {**self.refused, **down}

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


def slurm_entries(jobs: Iterable[SlurmJob], skip: set[str], configured: set[str]) -> list[JobEntry]:
    """Running managed jobs slurmctld knows and neither the jobs file nor a registration
    describes (a prolog that has not registered yet, a daemon restarted since): as
    their comment and Slurm's allocation say, on the nodes of theirs the controller
    knows (its node names must be Slurm's)."""
    return [
        JobEntry(
            name=job.name,
            dataset=job.datasets[0],
            gpus=job.gpus,
            ideal_io=job.ideal_io,
            nodes=tuple(n for n in job.nodes if n in configured),
            epochs=job.epochs,
        )
        for job in jobs
        if job.running and job.managed and job.name not in skip
    ]


def _signature(
    entries: Iterable[JobEntry],
    seen: Mapping[str, NodeSeen],
    ideal: Mapping[str, float],
    queue: Iterable[SlurmJob] = (),
) -> str:
    """Changes when the set of jobs (or what is known of them) changes."""
    parts = sorted(repr(e) for e in entries)
    parts += sorted(f"queued:{j.id}:{j.datasets}:{j.gpus}:{j.ideal_io}:{j.epochs}" for j in queue)
    parts += sorted(f"{n}:{j.name}:{j.dataset}" for n, s in seen.items() for j in s.jobs.values())
    parts += sorted(f"up:{n}" for n in seen)
    parts += sorted(
        f"cluster:{n}:{s.cluster.name}:{s.cluster.weight}:{s.cluster.total_weight}"
        for n, s in seen.items()
        if s.cluster is not None
    )
    parts += sorted(f"ideal:{k}" for k in ideal)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
