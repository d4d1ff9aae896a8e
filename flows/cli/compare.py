"""``bhfl compare``: several experiment runs side by side, read from the MLflow store.

A reference is a parent run id (full, or a unique prefix of at least 8 characters: every
id printed is the full one), or an experiment name (its latest finished run; with
``--all`` every finished run of it). ``--by-config`` aggregates seeds instead
(``compare_by_config``): an experiment name then stands for all its finished runs,
grouped by config without the seed (bhfl_core/analysis/seeds.py), one row per config
with mean ± std and the 95% interval, and ``--baseline`` adds paired differences
against one config. ``--json`` gives the same as JSON (``rows_json``, ``by_config_json``).
A pipeline (flows/pipeline.py) is one row by its name or run id: its run holds its
last stage's headlines, with communication and time summed over the stages; a stage's
run id gives that stage alone.

What the command shows is built below the CLI, because a sweep's report
(flows/tracking/sweep_report.py) shows the same and tracking may not import the CLI
(docs/design.md, "The rooms"): the runs, read from MLflow and grouped by config, come
from flows/tracking/run_comparison.py; the tables (markdown, CSV, JSON) from
bhfl_core/analysis/comparison.py. The command's options and printing are ``compare``
in flows/cli/app.py, which takes all of it from here.
"""

from __future__ import annotations

from bhfl_core.analysis.comparison import (
    CLIPPED_NOTE,
    ByConfig,
    by_config_csv,
    by_config_json,
    by_config_markdown,
    headline,
    paired_csv,
    rows_json,
    to_csv,
    to_markdown,
)
from flows.tracking.run_comparison import CompareError, compare, compare_by_config

__all__ = [
    "CLIPPED_NOTE",
    "ByConfig",
    "CompareError",
    "by_config_csv",
    "by_config_json",
    "by_config_markdown",
    "compare",
    "compare_by_config",
    "headline",
    "paired_csv",
    "rows_json",
    "to_csv",
    "to_markdown",
]
