"""Training curves as a PNG: one subplot per metric, one line per run (like the paper's figures).

Used for a run's final curves artifact and by ``ragen compare`` (StarPO vs StarPO-S):

    histories = {"starpo": {"env/success": [(1, 0.1), (2, 0.3)]}, "starpo-s": {...}}
    plot_curves(histories, ["env/success", "actor/grad_norm"], Path("curves.png"), "Bandit")

matplotlib is imported inside the function and used through its object API on an Agg
canvas, so importing this module is free and no global backend or pyplot state is touched
(safe in Prefect's worker threads).
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["plot_curves"]


def plot_curves(
    histories: dict[str, dict[str, list[tuple[int, float]]]],
    metrics: list[str],
    out_path: Path,
    title: str,
    bands: dict[str, dict[str, list[tuple[int, float, float]]]] | None = None,
) -> Path:
    """Draw ``metrics`` for every run in ``histories`` (run -> metric -> [(step, value)]) into a PNG.

    A run without a metric is skipped in that subplot; an empty subplot says "no data". ``bands``
    (run -> metric -> [(step, low, high)]) shades a band around a line in its colour (a study's
    spread over seeds).
    Returns ``out_path``.
    """
    # lazily: matplotlib is slow to import (0.7 s) and only plotting needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not metrics:
        raise ValueError("plot_curves needs at least one metric")
    ncols = 1 if len(metrics) == 1 else 2
    nrows = math.ceil(len(metrics) / ncols)
    fig = Figure(figsize=(5.5 * ncols, 3.4 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    # a line style and marker per run, so identical curves (e.g. two runs at 0 success) stay visible
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    for ax, metric in zip(axes, metrics, strict=False):  # an odd count leaves the grid's last axis spare
        drawn = False
        for n, (run, series) in enumerate(histories.items()):
            points = sorted(series.get(metric, ()))
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            line, marker = styles[n % len(styles)]
            (drawn_line,) = ax.plot(steps, values, label=run, linewidth=1.6, linestyle=line,
                                    marker=marker if len(points) < 30 else None, markersize=4, alpha=0.85)
            spread = sorted((bands or {}).get(run, {}).get(metric, ()))
            if spread:
                xs, lows, highs = zip(*spread, strict=True)
                ax.fill_between(xs, lows, highs, color=drawn_line.get_color(), alpha=0.18, linewidth=0)
            drawn = True
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(metric, fontsize=10)
        ax.set_xlabel("iteration")
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    fig.suptitle(title)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png", dpi=100)
    return out_path
