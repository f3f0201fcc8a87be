"""What a simulation run yields: per-job results, the cluster's timelines, fairness.

Owns: JobResult and SimResult (and their JSON form), the recorder that keeps the
throughput timeline, the fairness timeline and per-job rate logs as a run goes, and the
fairness reference: each job's rate under an equal division of the cluster among the
jobs present (SiloD (EuroSys '23) Eq. 8-9), whose integral over the job's life its work
is compared with. Never: moves time or decides anything a job does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .model import POOL, Cluster
from .sim_job import SimJob

log = logging.getLogger(__name__)


@dataclass
class JobResult:
    name: str
    submit: float
    start: float | None
    finish: float | None
    bytes_read: float
    hit_bytes: float
    remote_bytes: float
    fairness: float
    epoch_hit_ratios: list[float]
    gpus: int = 0
    dataset: str = ""

    @property
    def jct(self) -> float | None:
        return None if self.finish is None else self.finish - self.submit

    @property
    def hit_ratio(self) -> float:
        return self.hit_bytes / self.bytes_read if self.bytes_read > 0 else 0.0


@dataclass
class SimResult:
    scenario: str
    scheduler: str
    cache: str
    jobs: list[JobResult]
    # (time, total data throughput, remote IO) from each instant to the next
    timeline: list[tuple[float, float, float]] = field(default_factory=list)
    # Stopped (Ctrl-C) before every job finished: JCT and makespan are of the finished
    # jobs, an unfinished job's fairness is of the work it did so far.
    interrupted: bool = False
    until: float = 0.0  # simulated time reached
    # the scenario's [cluster] cache: "cluster" (one cache across the nodes) or "per-node"
    node_caches: str = "cluster"
    # (time, worst, average) over the active jobs of rate / equal-share rate, at each plan
    fairness_timeline: list[tuple[float, float, float]] = field(default_factory=list)
    # per job, (time, rate) at each change; only when asked for (Simulation(job_rates=True))
    job_rates: dict[str, list[tuple[float, float]]] | None = None

    @property
    def finished(self) -> list[JobResult]:
        return [j for j in self.jobs if j.finish is not None]

    @property
    def avg_jct(self) -> float:
        done = self.finished
        return sum(j.jct or 0.0 for j in done) / len(done) if done else math.nan

    @property
    def makespan(self) -> float:
        done = self.finished
        if not done:
            return math.nan
        return max(j.finish or 0.0 for j in done) - min(j.submit for j in self.jobs)

    @property
    def avg_fairness(self) -> float:
        return sum(j.fairness for j in self.jobs) / len(self.jobs)

    @property
    def worst(self) -> JobResult | None:
        """The job with the lowest fairness ratio (what Eq. 9 lifts)."""
        return min(self.jobs, key=lambda j: j.fairness, default=None)

    def to_dict(self) -> dict:
        worst = self.worst
        return {
            "scenario": self.scenario,
            "scheduler": self.scheduler,
            "cache": self.cache,
            "node_caches": self.node_caches,
            "avg_jct_s": _finite(self.avg_jct),
            "makespan_s": _finite(self.makespan),
            "avg_fairness": self.avg_fairness,
            "worst_fairness": worst.fairness if worst else None,
            "worst_job": worst.name if worst else None,
            "interrupted": self.interrupted,
            "simulated_s": self.until,
            "jobs": [
                {
                    "name": j.name,
                    "gpus": j.gpus,
                    "dataset": j.dataset,
                    "submit_s": j.submit,
                    "start_s": j.start,
                    "finish_s": j.finish,
                    "jct_s": j.jct,
                    "hit_ratio": j.hit_ratio,
                    "epoch_hit_ratios": j.epoch_hit_ratios,
                    "remote_bytes": j.remote_bytes,
                    "fairness": j.fairness,
                }
                for j in self.jobs
            ],
            # the cluster from each instant to the next: total data rate and remote IO
            "timeline": [
                {"t_s": t, "throughput_bytes_per_s": rate, "remote_bytes_per_s": remote}
                for t, rate, remote in self.timeline
            ],
            # at each plan, rate / equal-share rate over the jobs present: worst and mean
            "fairness_timeline": [
                {"t_s": t, "worst": worst_ratio, "average": mean}
                for t, worst_ratio, mean in self.fairness_timeline
            ],
        }


def _finite(x: float) -> float | None:
    """JSON has no NaN: an average of nothing is null."""
    return None if math.isnan(x) else x


class Recorder:
    """The timelines of a run, kept as it goes."""

    def __init__(self, job_rates: bool) -> None:
        # (time, total data throughput, remote IO) from each instant to the next
        self.timeline: list[tuple[float, float, float]] = []
        # (time, worst, average) of rate / equal-share rate over the active jobs, at plans
        self.fairness_timeline: list[tuple[float, float, float]] = []
        # per job, (time, rate) at each change; None: not kept
        self.job_rates: dict[str, list[tuple[float, float]]] | None = {} if job_rates else None

    def totals(self, now: float, rate: float, remote: float) -> None:
        """The cluster's total data rate and remote IO from `now` on."""
        if abs(rate) < 1e-6:
            rate = 0.0
        if abs(remote) < 1e-6:
            remote = 0.0
        if self.timeline:
            _, last_rate, last_remote = self.timeline[-1]
            # the totals are kept by adding differences: equal up to rounding is equal
            if math.isclose(rate, last_rate, rel_tol=1e-9, abs_tol=1e-6) and math.isclose(
                remote, last_remote, rel_tol=1e-9, abs_tol=1e-6
            ):
                return
        self.timeline.append((now, rate, remote))

    def rate(self, name: str, now: float, rate: float) -> None:
        """Job `name` reads at `rate` from `now` on (when rates are kept)."""
        if self.job_rates is None:
            return
        points = self.job_rates.setdefault(name, [])
        if points and points[-1][1] == rate:
            return
        if points and points[-1][0] == now:
            points[-1] = (now, rate)  # changed twice at one instant: the last counts
        else:
            points.append((now, rate))

    def result(
        self,
        scenario: str,
        scheduler: str,
        cache: str,
        jobs: Sequence[SimJob],
        now: float,
        interrupted: bool,
        node_caches: str = "cluster",
    ) -> SimResult:
        """The results of `jobs` (every job of the scenario, each brought to `now`)."""
        self.timeline.append((now, 0.0, 0.0))
        return SimResult(
            scenario,
            scheduler,
            cache,
            [job_result(j) for j in sorted(jobs, key=lambda j: (j.spec.submit, j.name))],
            self.timeline,
            interrupted=interrupted,
            until=now,
            node_caches=node_caches,
            fairness_timeline=self.fairness_timeline,
            job_rates=self.job_rates,
        )


def job_result(job: SimJob) -> JobResult:
    """A job's results; its fairness is its work (so far, if unfinished) over the
    integral of its equal-share rate over its life."""
    return JobResult(
        name=job.name,
        submit=job.spec.submit,
        start=job.start,
        finish=job.finish,
        bytes_read=job.read,
        hit_bytes=job.hit_bytes,
        remote_bytes=job.remote_bytes,
        fairness=(job.work if job.finish is not None else job.read) / job.equal_integral
        if job.equal_integral > 0
        else 1.0,
        epoch_hit_ratios=job.epoch_hit_ratios,
        gpus=job.spec.gpus,
        dataset=job.spec.dataset,
    )


def equal_rates(reference: Cluster, readers: Mapping[str, int], active: Sequence[SimJob]) -> None:
    """Set each active job's equal-share rate: equal_share_perf of its view on the
    reference cluster with SiloD's estimator, in closed form for that cluster (one pool;
    a unit per dataset, read whole). `readers`: the active jobs per dataset.

    The equal cache of a dataset is its readers' per-reader shares added up, m x share
    here (equal_share_perf adds them one by one: the same to rounding); a job's rate
    then follows from its dataset and GPUs."""
    n = len(active)
    if not n:
        return
    gpus = reference.total_gpus / n
    per_reader = reference.pools.get(POOL, 0.0) / n
    io = reference.remote_io / n
    io_inf = math.isinf(io)
    units = reference.units
    miss: dict[str, float] = {}  # per dataset, 1 - min(1, c/d) (0: an empty dataset)
    for dataset, m in readers.items():
        size = units[dataset].size
        held = m * per_reader
        miss[dataset] = 0.0 if size <= 0 or not held < size else 1.0 - held / size
    for job in active:
        spec = job.spec
        share = 1.0
        if spec.gpus > 0:
            share = gpus / spec.gpus
            if not share < 1.0:  # min(1, gpus / job.gpus)
                share = 1.0
        value = f = share * spec.ideal_io
        part = miss[spec.dataset]
        if part > 0.0 and not io_inf:
            value = io / part
            if not value < f:
                value = f
        job.equal_rate = value if value > 0 else f
