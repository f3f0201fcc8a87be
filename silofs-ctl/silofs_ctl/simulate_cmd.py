"""`silofs-ctl simulate`: run a scenario under a scheduler and a cache system, print results.

Owns the command's options and its output (a table or JSON). Never: holds simulation
logic, or shows a traceback for a bad scenario (one line naming the file and line).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from types import FrameType

import click

from . import json_indent
from .plot import PlotError, plot_timeline, pyplot
from .policies import SCHEDULERS
from .scenario import ScenarioError, load_scenario
from .simulator import CACHE_CHOICES, SimResult, Simulation, SimulationError

log = logging.getLogger(__name__)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or math.isinf(seconds) or math.isnan(seconds):
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.2f}h"


def render(result: SimResult) -> str:
    head = ("job", "submit", "start", "finish", "JCT", "hit", "fair")
    rows = ["{:24} {:>8} {:>8} {:>8} {:>8} {:>6} {:>6}".format(*head)]
    for j in result.jobs:
        rows.append(
            f"{j.name[:24]:24} {fmt_duration(j.submit):>8} {fmt_duration(j.start):>8} "
            f"{fmt_duration(j.finish):>8} {fmt_duration(j.jct):>8} {j.hit_ratio:6.3f} "
            f"{j.fairness:6.3f}"
        )
    worst = result.worst
    rows.append("")
    if result.interrupted:
        rows.append(
            f"interrupted at {fmt_duration(result.until)} simulated: "
            f"{len(result.finished)} of {len(result.jobs)} jobs finished; JCT and makespan "
            "are of the finished jobs"
        )
    rows += [
        f"scheduler {result.scheduler}, cache {result.cache}, {len(result.jobs)} jobs",
        f"average JCT       {fmt_duration(result.avg_jct)}",
        f"makespan          {fmt_duration(result.makespan)}",
        f"average fairness  {result.avg_fairness:.3f}   "
        f"(worst job {worst.fairness if worst else math.nan:.3f}: {worst.name if worst else '-'})",
    ]
    return "\n".join(rows)


@click.command("simulate")
@click.argument("scenario", type=click.Path(dir_okay=False))
@click.option(
    "--scheduler",
    type=click.Choice(sorted(SCHEDULERS)),
    default="gavel",
    show_default=True,
    help="Cluster scheduler.",
)
@click.option(
    "--cache",
    type=click.Choice(CACHE_CHOICES),
    default="silod",
    show_default=True,
    help="silod: the scheduler allocates cache and IO with SiloD's estimator; "
    "others: the vanilla scheduler next to that cache system.",
)
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    help="Write a PNG: total throughput and remote IO, each job's rate, and the worst and "
    "average fairness ratio over time (needs matplotlib: pip install 'silofs[plot]').",
)
@click.option(
    "--interval",
    default=600.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Seconds between re-plans while caches fill (as the controller's loop).",
)
def simulate_cmd(
    scenario: str, scheduler: str, cache: str, as_json: bool, plot: str | None, interval: float
) -> None:
    """Simulate SCENARIO (TOML) on a flow-level model of a GPU cluster with remote IO.

    Prints each job's completion time (JCT), hit ratio and fairness ratio (its work over
    what the equal share of the cluster would have done in its lifetime), the average
    JCT, the makespan and the average fairness. The checkout's configs/scenarios/ has
    examples: `silofs-ctl simulate configs/scenarios/single-job.toml`.
    """
    if math.isnan(interval):
        # FloatRange(min=1) lets nan through (every comparison with it is false): the
        # run then stepped 5,000,000 times at t=0 for half a minute and "gave up".
        raise click.BadParameter("must be a number of seconds, not nan", param_hint="--interval")
    try:
        spec = load_scenario(scenario)
        if plot:
            pyplot()  # a missing matplotlib is said before the run, not after it
        sim = Simulation(spec, scheduler, cache, interval, job_rates=bool(plot))
        result = _run_until_done_or_interrupted(sim)
        if plot:
            title = f"{spec.name}: {scheduler} + {cache}"
            plot_timeline(
                result.timeline,
                spec.remote_io,
                title,
                plot,
                job_rates=result.job_rates,
                fairness=result.fairness_timeline,
            )
    except (ScenarioError, SimulationError, PlotError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json_indent.dumps(result.to_dict()))  # json.dumps(indent=2)'s text
    else:
        click.echo(render(result))
    if result.interrupted:
        sys.exit(130)


def _run_until_done_or_interrupted(sim: Simulation) -> SimResult:
    """Run; the first Ctrl-C stops after the current step and the results so far are
    printed, a second one interrupts at once (the default handler is back)."""

    def stop(signum: int, _frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, previous)
        sim.request_stop()
        # Not through logging: the handler may run while the main thread is inside a
        # write to stderr's buffer, and a buffered write from here would then fail
        # ("reentrant call"). One unbuffered write of one line cannot.
        os.write(2, b"silofs-ctl: interrupted: stopping after this step (Ctrl-C again to abort)\n")

    previous = signal.signal(signal.SIGINT, stop)
    log.info(
        "simulating %d jobs: %s + %s (Ctrl-C prints the results so far)",
        len(sim.all),
        sim.scheduler_name,
        sim.cache_name,
    )
    try:
        return sim.run()
    finally:
        signal.signal(signal.SIGINT, previous)
