"""Plots of a simulation: the cluster's throughput and remote IO, each job's rate, and the
fairness ratio over time.

Owns the figure only. Never: runs simulations, or imports matplotlib at module load
(the CLI should not pay for it unless --plot is given; it is an optional dependency,
`pip install 'silofs[plot]'`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

_LEGEND_JOBS = 12  # name each job's line in a legend only up to this many jobs


class PlotError(Exception):
    """The figure could not be drawn or written."""


def pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs matplotlib (pip install 'silofs[plot]')") from None
    return plt


def plot_timeline(
    timeline: Sequence[tuple[float, float, float]],
    remote_io: float,
    title: str,
    path: str,
    job_rates: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    fairness: Sequence[tuple[float, float, float]] | None = None,
) -> None:
    """Step plots, in hours and MB/s: (time, throughput, remote IO) points of the cluster;
    with `job_rates`, each job's (time, rate) changes (SiloD's Figure 4: who gets the
    link and the cache); with `fairness`, (time, worst, average) of rate over equal-share
    rate (SiloD's Figure 13)."""
    plt = pyplot()
    panels = 1 + (job_rates is not None) + (fairness is not None)
    fig, axes = plt.subplots(panels, 1, figsize=(9, 3.2 * panels + 1), sharex=True, squeeze=False)
    axes = [row[0] for row in axes]
    ax = axes[0]
    hours = [t / 3600 for t, _, _ in timeline]
    ax.step(hours, [tp / 1e6 for _, tp, _ in timeline], where="post", label="total throughput")
    ax.step(hours, [io / 1e6 for _, _, io in timeline], where="post", label="remote IO")
    if not math.isinf(remote_io):
        ax.axhline(remote_io / 1e6, color="grey", linestyle=":", label="remote IO limit")
    ax.set_ylabel("MB/s")
    ax.set_title(title)
    ax.legend(loc="upper right")
    nxt = 1
    if job_rates is not None:
        ax = axes[nxt]
        nxt += 1
        named = len(job_rates) <= _LEGEND_JOBS
        for name, points in job_rates.items():
            if not points:
                continue
            ax.step(
                [t / 3600 for t, _ in points],
                [r / 1e6 for _, r in points],
                where="post",
                linewidth=1.2 if named else 0.4,
                label=name if named else None,
            )
        ax.set_ylabel("job rate (MB/s)")
        if named and job_rates:
            ax.legend(loc="upper right", fontsize="small")
    if fairness is not None:
        ax = axes[nxt]
        ax.step(
            [t / 3600 for t, _, _ in fairness],
            [w for _, w, _ in fairness],
            where="post",
            label="worst job",
        )
        ax.step(
            [t / 3600 for t, _, _ in fairness],
            [a for _, _, a in fairness],
            where="post",
            label="average",
        )
        ax.axhline(1.0, color="grey", linestyle=":", label="equal share")
        ax.set_ylabel("rate / equal-share rate")
        ax.legend(loc="upper right")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time (hours)")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise PlotError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
