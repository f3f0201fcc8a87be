"""Plots of a simulation: total data throughput and remote IO over time.

Owns the figure only. Never: runs simulations, or imports matplotlib at module load
(the CLI should not pay for it unless --plot is given).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)


class PlotError(Exception):
    """The figure could not be drawn or written."""


def plot_timeline(
    timeline: Sequence[tuple[float, float, float]], remote_io: float, title: str, path: str
) -> None:
    """Step plot of (time, throughput, remote IO) points, in hours and MB/s."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs matplotlib (pip install 'silofs[plot]')") from None
    hours = [t / 3600 for t, _, _ in timeline]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.step(hours, [tp / 1e6 for _, tp, _ in timeline], where="post", label="total throughput")
    ax.step(hours, [io / 1e6 for _, _, io in timeline], where="post", label="remote IO")
    if remote_io != float("inf"):
        ax.axhline(remote_io / 1e6, color="grey", linestyle=":", label="remote IO limit")
    ax.set_xlabel("time (hours)")
    ax.set_ylabel("MB/s")
    ax.set_title(title)
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise PlotError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
