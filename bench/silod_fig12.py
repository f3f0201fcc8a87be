"""SiloD (EuroSys '23) Figures 12 and 13 on contended 4-week traces of a 400-GPU cluster.

Owns: the traces, built as §7.2 of the paper describes its simulation (50 nodes x 8
V100s, 250 GB of cache per node, one remote link of 2 GB/s or 4 GB/s, 4,000-5,000 jobs
arriving as a Poisson process over 4 weeks, the paper's job mix and datasets, one copy of
each dataset per team of 16 GPUs, ideal durations log-uniform from 0.5 to 96 h), with
bench/silod_scenarios.py's generator; runs of every scheduler x cache pair on each; and
the tables beside the paper's figures: Figure 12 (average JCT and makespan per pair,
each baseline's over SiloD's with the same scheduler) and Figure 13 (the time average of
Eq. 8's objective under Gavel: at each instant the worst over the jobs present of rate
over equal-share rate, the fairness timeline's `worst`, held between plans, averaged
from the first arrival to the last finish). Never: changes what the simulator does.

    python bench/silod_fig12.py                         # seeds 1-3 at 2 GB/s and 4 GB/s
    python bench/silod_fig12.py --seeds 7 8 --links 4GB/s --jobs 5000
    python bench/silod_fig12.py --pairs gavel:silod gavel:quiver --seeds 1
    python bench/silod_fig12.py --json > fig12.json     # every run, for scripts
    python bench/silod_fig12.py --plot fig12.png        # the two figures (matplotlib)
    python bench/silod_fig12.py --write-traces DIR      # the TOML files, then stop
    python bench/silod_fig12.py --nodes 12 --explain    # a quarter of the cluster, per class

--nodes N builds the cluster on N nodes with the link, the number of jobs and the teams
scaled by N/50 (the same load per GPU: the 12-node traces show what the 50-node ones do
in a fifth of the time). --explain adds, per run, the cluster's remote bytes and hit
ratio and, per model and dataset, the jobs' average JCT, data read, hit ratio and
remote bytes: where the link went.

A trace written with --write-traces runs alone with `silofs-ctl simulate FILE
--scheduler S --cache C --json`. --workers N runs N simulations at once (one process
each); CPU seconds per run are printed either way.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from silod_scenarios import TraceShape, generate_trace  # noqa: E402
from silofs_ctl.scenario import Scenario, parse_scenario  # noqa: E402
from silofs_ctl.simulator import (  # noqa: E402
    CACHE_CHOICES,
    SimResult,
    Simulation,
    SimulationError,
)

SCHEDULERS = ("fifo", "sjf", "gavel")
BASELINES = tuple(c for c in CACHE_CHOICES if c != "silod")
NODES, GPUS_PER_NODE, CACHE_PER_NODE, DAYS = 50, 8, "250GB", 28
TEAM_GPUS = 16  # one copy of each dataset per team of this many GPUs

# What the paper reports for its 400-GPU simulation (§7.2; 4 GB/s link, 4-week trace).
PAPER_FIG12 = (
    "SiloD improves average JCT by up to 7.4x and makespan by up to 2.57x over the "
    "baselines; over Quiver by up to 1.25x (average JCT) and 1.31x (makespan); only "
    "Gavel with Quiver has a slightly lower makespan than SiloD"
)
PAPER_FIG13 = {"silod": 2.56, "coordl": 1.51, "alluxio": 1.39, "quiver": 1.35}


@dataclass(frozen=True)
class Run:
    """One scheduler x cache pair on one trace."""

    trace: str
    scheduler: str
    cache: str
    avg_jct_h: float
    makespan_d: float
    eq8: float  # time-averaged worst rate / equal-share rate (Eq. 8's objective)
    finished: int
    jobs: int
    cpu_s: float
    steps: int
    error: str = ""  # the simulator gave up (its step limit): no figures
    # per model/dataset: (jobs, average JCT h, data read PB, hit ratio, remote PB)
    classes: dict[str, tuple[int, float, float, float, float]] = field(default_factory=dict)


def scaled(link: str, nodes: int) -> str:
    """The link for a cluster of `nodes` with the same bandwidth per GPU as `link` has
    at NODES (decimal units, as scenario files read them)."""
    m = re.fullmatch(r"([0-9.]+)\s*([MG])B/s", link)
    if not m:
        raise SystemExit(f"silod_fig12: cannot read link {link!r} (e.g. 2GB/s, 500MB/s)")
    mb = float(m.group(1)) * (1000 if m.group(2) == "G" else 1) * nodes / NODES
    return f"{mb:g}MB/s"


def shape(link: str, nodes: int = NODES) -> TraceShape:
    teams = nodes * GPUS_PER_NODE // TEAM_GPUS
    return TraceShape(
        nodes=nodes,
        gpus_per_node=GPUS_PER_NODE,
        cache_per_node=CACHE_PER_NODE,
        remote_io=link if nodes == NODES else scaled(link, nodes),
        days=DAYS,
        min_hours=0.5,
        max_hours=96.0,
        teams=teams,
    )


def trace_name(link: str, jobs: int, seed: int, nodes: int = NODES) -> str:
    where = "" if nodes == NODES else f"-{nodes}n"
    return f"fig12-{link.replace('/', '')}{where}-{jobs}-s{seed}"


def trace_text(link: str, jobs: int, seed: int, nodes: int = NODES) -> str:
    return generate_trace(jobs, seed, shape(link, nodes))


def by_class(result: SimResult) -> dict[str, tuple[int, float, float, float, float]]:
    """Per model/dataset (team copies together): jobs, average JCT (h) of those that
    finished, data read (PB), hit ratio, remote bytes (PB)."""
    groups: dict[str, list] = {}
    for j in result.jobs:
        key = f"{j.name.rsplit('-', 1)[0]}/{j.dataset.rsplit('-team', 1)[0]}"
        groups.setdefault(key, []).append(j)
    out = {}
    for key in sorted(groups):
        jobs = groups[key]
        done = [j.jct for j in jobs if j.jct is not None]
        read = sum(j.bytes_read for j in jobs)
        out[key] = (
            len(jobs),
            sum(done) / len(done) / 3600 if done else math.nan,
            read / 1e15,
            sum(j.hit_bytes for j in jobs) / read if read > 0 else math.nan,
            sum(j.remote_bytes for j in jobs) / 1e15,
        )
    return out


def eq8(result: SimResult) -> float:
    """The fairness timeline's worst, held from each plan to the next, averaged over the
    run (first arrival to last finish)."""
    points = result.fairness_timeline
    start = min(j.submit for j in result.jobs)
    end = start + result.makespan if not math.isnan(result.makespan) else result.until
    if not points or end <= start:
        return math.nan
    total = 0.0
    for (t0, worst, _), t1 in zip(points, [p[0] for p in points[1:]] + [end], strict=True):
        total += worst * max(0.0, min(t1, end) - max(t0, start))
    return total / (end - start)


def run_pair(text: str, name: str, pair: str) -> Run:
    scheduler, cache = pair.split(":")
    scenario: Scenario = parse_scenario(text, name)
    sim = Simulation(scenario, scheduler, cache)
    cpu = time.process_time()
    try:
        result = sim.run()
    except SimulationError as e:
        cpu = time.process_time() - cpu
        nan = math.nan
        return Run(
            name, scheduler, cache, nan, nan, nan, 0, len(scenario.jobs), cpu, sim.steps, str(e)
        )
    cpu = time.process_time() - cpu
    return Run(
        name,
        scheduler,
        cache,
        result.avg_jct / 3600,
        result.makespan / 86400,
        eq8(result),
        len(result.finished),
        len(result.jobs),
        cpu,
        sim.steps,
        classes=by_class(result),
    )


def _run_job(args: tuple[str, int, int, str, int]) -> Run:
    link, jobs, seed, pair, nodes = args
    name = trace_name(link, jobs, seed, nodes)
    return run_pair(trace_text(link, jobs, seed, nodes), name, pair)


def explain(runs: list[Run]) -> str:
    """Per run: where the link went (remote bytes and hit ratio, in all and per class)."""
    rows = []
    for r in runs:
        if r.error or not r.classes:
            continue
        read = sum(c[2] for c in r.classes.values())
        remote = sum(c[4] for c in r.classes.values())
        hits = sum(c[2] * c[3] for c in r.classes.values() if not math.isnan(c[3]))
        rows.append(
            f"== {r.trace} {r.scheduler}:{r.cache}: read {read:.2f} PB, remote {remote:.2f} PB, "
            f"hit ratio {hits / read if read else math.nan:.3f}"
        )
        head = f"  {'model/dataset':30} {'jobs':>5} {'avg JCT':>8} {'read':>8} {'hit':>6}"
        rows.append(f"{head} {'remote':>8}")
        for key, (n, jct, got, hit, rem) in r.classes.items():
            rows.append(f"  {key:30} {n:5} {jct:7.1f}h {got:5.2f} PB {hit:6.3f} {rem:5.2f} PB")
    return "\n".join(rows)


def progress(r: Run) -> None:
    """One line per finished run on stderr, with its figures: a long sweep cut short
    still leaves what it measured."""
    print(
        f"  {r.trace} {r.scheduler}:{r.cache} avg JCT {r.avg_jct_h:.1f}h makespan "
        f"{r.makespan_d:.1f}d Eq.8 {r.eq8:.2f} finished {r.finished}/{r.jobs} steps "
        f"{r.steps} cpu {r.cpu_s:.0f}s{' ' + r.error if r.error else ''}",
        file=sys.stderr,
        flush=True,
    )


def fig12_table(runs: list[Run]) -> str:
    """Per trace and scheduler: each cache's average JCT and makespan, and each
    baseline's over SiloD's (above 1: SiloD is better)."""
    rows = []
    head = f"{'scheduler':9} {'cache':8} {'avg JCT':>9} {'makespan':>9} {'JCT/SiloD':>9} "
    head += f"{'mk/SiloD':>8} {'Eq.8':>6} {'cpu':>6}"
    for trace in dict.fromkeys(r.trace for r in runs):
        rows += [f"== {trace}", head]
        for scheduler in SCHEDULERS:
            group = {r.cache: r for r in runs if r.trace == trace and r.scheduler == scheduler}
            silod = group.get("silod")
            for cache in CACHE_CHOICES:
                r = group.get(cache)
                if r is None:
                    continue
                jct = r.avg_jct_h / silod.avg_jct_h if silod else math.nan
                mk = r.makespan_d / silod.makespan_d if silod else math.nan
                unfinished = "" if r.finished == r.jobs else f"  ({r.jobs - r.finished} unfinished)"
                if r.error:
                    unfinished = f"  ({r.error})"
                rows.append(
                    f"{scheduler:9} {cache:8} {r.avg_jct_h:8.1f}h {r.makespan_d:8.1f}d "
                    f"{jct:9.2f} {mk:8.2f} {r.eq8:6.2f} {r.cpu_s:5.0f}s{unfinished}"
                )
    rows.append(f"paper (Figure 12): {PAPER_FIG12}")
    return "\n".join(rows)


def summary(runs: list[Run]) -> str:
    """Over every trace: SiloD's largest and smallest advantage per scheduler, whether
    its average JCT is the best or within 5% of the best, and whether its Eq. 8 under
    Gavel is the best."""
    rows = []
    traces = list(dict.fromkeys(r.trace for r in runs))
    for scheduler in SCHEDULERS:
        for base in BASELINES:
            jct, mk = [], []
            for trace in traces:
                pick = {
                    r.cache: r
                    for r in runs
                    if r.trace == trace and r.scheduler == scheduler and not r.error
                }
                if "silod" in pick and base in pick:
                    jct.append(pick[base].avg_jct_h / pick["silod"].avg_jct_h)
                    mk.append(pick[base].makespan_d / pick["silod"].makespan_d)
            if jct:
                rows.append(
                    f"{scheduler:6} {base:8} over SiloD: avg JCT {min(jct):.2f}-{max(jct):.2f}x, "
                    f"makespan {min(mk):.2f}-{max(mk):.2f}x"
                )
    for trace in traces:
        verdicts = []
        for scheduler in ("fifo", "sjf"):
            pick = {
                r.cache: r
                for r in runs
                if r.trace == trace and r.scheduler == scheduler and not r.error
            }
            if "silod" in pick and len(pick) > 1:
                best = min(r.avg_jct_h for r in pick.values())
                ratio = pick["silod"].avg_jct_h / best
                verdicts.append(f"{scheduler} JCT {ratio:.3f} of best")
        pick = {
            r.cache: r for r in runs if r.trace == trace and r.scheduler == "gavel" and not r.error
        }
        if "silod" in pick and len(pick) > 1:
            others = max(r.eq8 for c, r in pick.items() if c != "silod")
            verdicts.append(f"gavel Eq.8 {pick['silod'].eq8:.2f} vs next {others:.2f}")
        rows.append(f"{trace}: " + ", ".join(verdicts))
    return "\n".join(rows)


def fig13_table(runs: list[Run]) -> str:
    rows = ["Figure 13: time-averaged Eq. 8 objective under Gavel (paper beside)"]
    traces = list(dict.fromkeys(r.trace for r in runs))
    rows.append(f"{'cache':8} " + " ".join(f"{t[-22:]:>22}" for t in traces) + f" {'paper':>6}")
    for cache in CACHE_CHOICES:
        cells = []
        for trace in traces:
            pick = [
                r for r in runs if r.trace == trace and r.scheduler == "gavel" and r.cache == cache
            ]
            cells.append(f"{pick[0].eq8:22.2f}" if pick else f"{'-':>22}")
        rows.append(f"{cache:8} " + " ".join(cells) + f" {PAPER_FIG13[cache]:6.2f}")
    return "\n".join(rows)


def plot(runs: list[Run], path: str) -> None:
    """Figure 12 (average JCT and makespan per scheduler and cache, the first trace's
    shape; one bar group per trace) and Figure 13 (Eq. 8 under Gavel) in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / len(CACHE_CHOICES)
    for ax, metric, label in (
        (axes[0], "avg_jct_h", "average JCT (h)"),
        (axes[1], "makespan_d", "makespan (days)"),
    ):
        groups = [(t, s) for t in traces for s in SCHEDULERS]
        for i, cache in enumerate(CACHE_CHOICES):
            values = []
            for trace, scheduler in groups:
                pick = [
                    r for r in runs if (r.trace, r.scheduler, r.cache) == (trace, scheduler, cache)
                ]
                values.append(getattr(pick[0], metric) if pick else 0.0)
            ax.bar([g + i * width for g in range(len(groups))], values, width, label=cache)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{s}\n{t[-12:]}" for t, s in groups], fontsize=7)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    ax = axes[2]
    for i, cache in enumerate(CACHE_CHOICES):
        values = []
        for trace in traces:
            pick = [r for r in runs if (r.trace, r.scheduler, r.cache) == (trace, "gavel", cache)]
            values.append(pick[0].eq8 if pick else 0.0)
        ax.bar(
            [g + i * width for g in range(len(traces) + 1)],
            values + [PAPER_FIG13[cache]],
            width,
            label=cache,
        )
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(traces) + 1)])
    ax.set_xticklabels([t[-12:] for t in traces] + ["paper"], fontsize=7)
    ax.set_ylabel("time-averaged Eq. 8 (Gavel)")
    ax.legend(fontsize=8)
    fig.suptitle("SiloD (EuroSys '23) Figures 12 and 13, simulated")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--links", nargs="+", default=["2GB/s", "4GB/s"])
    parser.add_argument("--jobs", type=int, help="jobs per trace (default 4000 x nodes/50)")
    parser.add_argument(
        "--nodes", type=int, default=NODES, help="cluster size; link and teams scale with it"
    )
    parser.add_argument("--explain", action="store_true", help="remote bytes per class")
    parser.add_argument(
        "--pairs",
        nargs="+",
        metavar="SCHEDULER:CACHE",
        default=[f"{s}:{c}" for s in SCHEDULERS for c in CACHE_CHOICES],
    )
    parser.add_argument("--workers", type=int, default=1, help="simulations run at once")
    parser.add_argument("--json", action="store_true", help="every run as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw Figures 12 and 13")
    parser.add_argument("--write-traces", metavar="DIR", help="write the traces and stop")
    args = parser.parse_args(argv)
    if args.nodes < 2:
        parser.error("--nodes must be at least 2 (a team is 16 GPUs)")
    if args.jobs is None:
        args.jobs = round(4000 * args.nodes / NODES)
    if args.write_traces:
        out = Path(args.write_traces)
        out.mkdir(parents=True, exist_ok=True)
        for link in args.links:
            for seed in args.seeds:
                path = out / f"{trace_name(link, args.jobs, seed, args.nodes)}.toml"
                path.write_text(trace_text(link, args.jobs, seed, args.nodes))
                print(path)
        return 0
    work = [
        (link, args.jobs, seed, pair, args.nodes)
        for link in args.links
        for seed in args.seeds
        for pair in args.pairs
    ]
    runs: list[Run] = []
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            for run in pool.map(_run_job, work):
                runs.append(run)
                progress(run)
    else:
        for item in work:
            runs.append(_run_job(item))
            progress(runs[-1])
    if args.json:
        print(json.dumps([asdict(r) for r in runs], indent=1))
    else:
        print(fig12_table(runs))
        print()
        print(fig13_table(runs))
        print()
        print(summary(runs))
        if args.explain:
            print()
            print(explain(runs))
    if args.plot:
        plot(runs, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
