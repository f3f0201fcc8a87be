"""`silofs-ctl controller run`: the long-running allocation loop, or one dry run of it.

Owns the command's options, signal handling and the allocation table it prints. Never:
holds planning logic (plan.py) or the loop (controller.py), or shows a traceback for a
bad config.
"""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType

import click

from silofs.units import count, format_rate, format_size

from .controller import Controller
from .controller_config import load_controller_config
from .plan import Plan
from .tomlcheck import ConfigError

log = logging.getLogger(__name__)


def render_plan(plan: Plan, down: dict[str, str]) -> str:
    rows = ["{:16} {:48} {:>12}".format("node", "dataset", "cache")]
    for node in sorted(plan.cache):
        c = plan.cluster_of(node)
        if c is not None and node != c.via:
            continue  # a cluster's shares are listed once, under its name
        label = node if c is None else c.name  # explained by the line below
        for dataset, nbytes in sorted(plan.cache[node].items()):
            rows.append(f"{label[:16]:16} {dataset[:48]:48} {format_size(nbytes):>12}")
    for c in sorted(plan.clusters.values(), key=lambda c: c.name):
        rows.append(
            f"cluster {c.name}: one cache over {', '.join(c.members)} "
            f"({format_size(int(c.pool))}); its shares are cluster-wide, pushed to {c.via}"
        )
    rows += [
        "",
        "{:24} {:16} {:>12} {:>12} {:>12}".format("job", "nodes", "f*", "remote IO", "per node"),
    ]
    for job in plan.jobs:
        per_node = None if job.io is None else job.io / max(1, len(job.nodes))
        rows.append(
            f"{job.name[:24]:24} {','.join(job.nodes)[:16]:16} "
            f"{format_rate(job.f_star) if job.f_star else '?':>12} "
            f"{format_rate(job.io):>12} {format_rate(per_node):>12}"
            + (f"  ({job.note})" if job.note else "")
        )
    if plan.queue:
        rows += [
            "",
            "{:24} {:>4} {:>12} {:>6} {:>24}  {}".format(
                "queued (SJF-SiloD order)", "gpus", "f*", "epochs", "slurm priority", "dataset"
            ),
        ]
    for q in plan.queue:
        job = q.job
        prio = "held" if job.held else str(job.priority)
        if q.new_priority is not None:
            prio += f" -> {q.new_priority}"
        epochs = f"{job.epochs:g}" if job.epochs else "?"
        rows.append(
            f"{job.name[:24]:24} {job.gpus:>4} "
            f"{format_rate(job.ideal_io) if job.ideal_io else '?':>12} {epochs:>6} {prio:>24}  "
            f"{q.dataset}" + (f"  ({q.note})" if q.note else "")
        )
    for node, why in sorted(down.items()):
        rows.append(f"node {node} not updated: {why}")
    return "\n".join(rows)


@click.group("controller")
def controller() -> None:
    """SiloD's controller for silofs node daemons."""


@controller.command("run")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="controller.toml: policy, remote IO, nodes and their sockets, jobs file, [slurm].",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the allocation table it would push (and the Slurm priorities it would set); exit.",
)
@click.option(
    "--once",
    is_flag=True,
    help="Plan and push once, then exit (status 1 if a node could not be updated).",
)
def run_cmd(config_path: str, dry_run: bool, once: bool) -> None:
    """Watch jobs and node daemons; push cache and remote IO allocations.

    Re-plans whenever the set of jobs changes (jobs file, or jobs seen on the daemons)
    and every interval; a node that is down is retried and does not stop the others.
    """
    try:
        config = load_controller_config(config_path)
        ctl = Controller(config)  # loads the [tls] files
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        if dry_run or once:
            plan = ctl.round(dry_run=dry_run, force=True)
            assert plan is not None
            click.echo(render_plan(plan, ctl.not_updated))
            for line in ctl.priority_lines:
                click.echo(f"slurm: {line}")
            if ctl.slurm_down:
                click.echo(f"slurm: not asked: {ctl.slurm_down}")
            if once and ctl.not_updated:
                sys.exit(1)
            return
        _stop_on_signals(ctl)
        log.warning(
            "controller running: policy %s, %s", config.policy, count(len(config.nodes), "node")
        )
        ctl.run()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        ctl.close()


def _stop_on_signals(ctl: Controller) -> None:
    def stop(signum: int, _frame: FrameType | None) -> None:
        log.warning("signal %d: stopping", signum)
        ctl.stop.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
