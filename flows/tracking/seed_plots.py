"""Sweep figures: each headline metric against one swept key, mean over seeds with its 95% interval.

A sweep varies a few config keys over a grid; for each of them a figure shows how every
headline metric moves with that key's value, one line per combination of the other
keys' values, so an interaction (a key that helps only with another setting) is
visible as lines that cross. The points are ``bhfl_core.analysis.seeds.GroupStats``
(one per config) and the error bars their 95% t-intervals; a config with one seed is
drawn without a bar (no interval from one run). Same conventions as plots.py:
``Figure`` objects, no pyplot state.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from bhfl_core.analysis.seeds import Bounds, GroupStats, Summary, interval
from data_prep.figures import MIN_FONT_PT, save_png

Settings = Mapping[str, Mapping[str, str]]  # config id -> swept key -> its value there


def _numeric(values: Sequence[str]) -> list[float] | None:
    try:
        return [float(v) for v in values]
    except ValueError:
        return None


def metric_vs_key(
    groups: Sequence[GroupStats],
    settings: Settings,
    key: str,
    metrics: Sequence[str],
    titles: Mapping[str, str] | None = None,
    bounds: Mapping[str, Bounds | None] | None = None,
) -> Figure:
    """One panel per metric: the metric (mean, 95% interval bars) against ``key``, a line per other-key combination.

    ``settings``: each config's values of the swept keys (configs without ``key`` are
    left out, e.g. a baseline outside the grid); the other keys in it make the lines.
    Numeric values are placed on a numeric axis, others in first-seen order.
    ``titles``: metric -> panel title (default: the metric). ``bounds``: metric -> the values
    it can take; its bars stop there, as the tables' intervals do (``seeds.interval``).
    """
    points = [g for g in groups if key in settings.get(g.config, {})]
    if not points:
        swept = sorted({k for s in settings.values() for k in s})
        raise ValueError(f"no config has a value for {key!r}; swept keys: {swept}")
    values = list(dict.fromkeys(settings[g.config][key] for g in points))
    numbers = _numeric(values)
    position = dict(zip(values, numbers if numbers is not None else range(len(values))))
    lines: dict[str, list[GroupStats]] = {}
    for g in points:
        others = ", ".join(f"{k}={v}" for k, v in sorted(settings[g.config].items()) if k != key)
        lines.setdefault(others, []).append(g)
    cols = min(len(metrics), 3)
    rows = math.ceil(len(metrics) / cols)
    fig = Figure(figsize=(4.6 * cols, 3.4 * rows + 0.6 * (len(lines) > 1)), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, metric in zip(axes, metrics):
        for label, line in lines.items():
            drawn = [(position[settings[g.config][key]], g.metrics[metric]) for g in line if g.metrics[metric].n > 0]
            drawn.sort(key=lambda point: point[0])
            if not drawn:
                continue
            ax.errorbar(
                [x for x, _ in drawn],
                [s.mean for _, s in drawn],
                yerr=_bars([s for _, s in drawn], (bounds or {}).get(metric)),
                marker="o",
                markersize=4,
                capsize=3,
                label=label or "mean over seeds",
            )
        ax.set_title((titles or {}).get(metric, metric), fontsize=9)
        ax.set_xlabel(key, fontsize=9)
        if numbers is None:
            ax.set_xticks(range(len(values)), values, fontsize=MIN_FONT_PT)
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)
    handles, names = axes[0].get_legend_handles_labels()
    if len(lines) > 1 and handles:
        fig.legend(handles, names, loc="outside lower center", fontsize=MIN_FONT_PT, ncols=min(len(lines), 3))
    fig.suptitle(f"Mean over seeds with 95% confidence interval, by {key}", fontsize=10)
    return fig


def _bars(summaries: Sequence[Summary], bounds: Bounds | None) -> list[list[float]]:
    """Error bars below and above each mean: to its interval's ends, clipped to ``bounds`` (none from one seed)."""
    ends = [interval(s, bounds) if s.has_interval else None for s in summaries]
    below = [s.mean - i.lo if i is not None else 0.0 for s, i in zip(summaries, ends, strict=True)]
    above = [i.hi - s.mean if i is not None else 0.0 for s, i in zip(summaries, ends, strict=True)]
    return [below, above]


def save_metric_plots(
    groups: Sequence[GroupStats],
    settings: Settings,
    keys: Sequence[str],
    metrics: Sequence[str],
    folder: Path,
    titles: Mapping[str, str] | None = None,
    bounds: Mapping[str, Bounds | None] | None = None,
) -> list[Path]:
    """``metric_vs_key`` for each swept key, saved as ``folder/seeds_<key>.png``; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for key in keys:
        path = folder / f"seeds_{re.sub(r'[^A-Za-z0-9_.-]+', '_', key)}.png"
        save_png(metric_vs_key(groups, settings, key, metrics, titles, bounds), path, tight=False)
        paths.append(path)
    return paths
