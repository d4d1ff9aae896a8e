"""``bhfl compare``: several experiment runs side by side, read from the MLflow store.

A reference is a parent run id (full, or a unique prefix of at least 8 characters: every
id printed is the full one), or an experiment name (its latest finished run; with
``--all`` every finished run of it). ``--by-config`` aggregates seeds instead: an
experiment name then stands for all its finished runs, grouped by config without the
seed (bhfl_core/analysis/seeds.py), one row per config with mean ± std and the 95%
interval, and ``--baseline`` adds paired differences against one config. ``--json``
gives the same as JSON. A pipeline (flows/pipeline.py) is one row by its name or run id:
its run holds its last stage's headlines, with communication and time summed over the
stages; a stage's run id gives that stage alone.

This module is the command's options and printing only: a sweep's report shows the same
tables and tracking may not import the CLI (docs/design.md, "The rooms"), so the runs,
read from MLflow and grouped by config, come from flows/tracking/run_comparison.py, and
the tables (markdown, CSV, JSON) from bhfl_core/analysis/comparison.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli.options import DEFAULT_RUN_DIR, FLAG, JsonOption, RunDirOption, TrackingOption
from flows.cli.shell import console, fail, print_json


def compare(
    runs: Annotated[
        list[str],
        typer.Argument(
            metavar="RUN_OR_EXPERIMENT",
            help="Experiment run ids (full, or a unique prefix of 8+ characters), or experiment names "
            "(their latest finished run; every finished run with --all).",
        ),
    ],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
    csv_path: Annotated[
        Path | None,
        typer.Option("--csv", metavar="FILE", show_default="RUN_DIR/compare.csv", help="Write the table as CSV here."),
    ] = None,
    target: Annotated[
        float | None,
        typer.Option("--target", help="Also show the virtual time at which the root first reached this on the union."),
    ] = None,
    every: Annotated[
        bool,
        typer.Option(
            "--all", metavar=FLAG, help="An experiment name stands for all its finished runs, not only the latest."
        ),
    ] = False,
    by_config: Annotated[
        bool,
        typer.Option(
            "--by-config",
            metavar=FLAG,
            help="One row per config over its seeds: mean ± std and 95% interval per number, n seeds. "
            "An experiment name then stands for all its finished runs.",
        ),
    ] = False,
    baseline: Annotated[
        str | None,
        typer.Option(
            "--baseline",
            metavar="CONFIG",
            help="Also paired differences (same seeds) of every config against this one: its label, name or a "
            "run id (implies --by-config; CSV beside --csv, *_paired.csv).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Compare runs side by side (markdown or JSON on stdout, CSV on disk): per-client, root and communication numbers.

    --by-config and --baseline aggregate seeds: mean ± std and 95% interval per config, paired differences.
    """
    from flows.records.run_record import default_tracking_uri

    uri = tracking_uri or default_tracking_uri(run_dir)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        fail(f"no MLflow store at {uri}; run `bhfl run` first or pass --tracking-uri")
    from mlflow import MlflowClient

    from bhfl_core.analysis.comparison import rows_json, to_csv, to_markdown
    from bhfl_core.store.atomic import write_text_atomic
    from flows.tracking.run_comparison import CompareError
    from flows.tracking.run_comparison import compare as compare_runs

    csv_out = csv_path or run_dir / "compare.csv"
    if by_config or baseline is not None:
        _compare_by_config(MlflowClient(uri), runs, target, baseline, csv_out, as_json)
        return
    try:
        rows = compare_runs(MlflowClient(uri), runs, target, every=every)
    except CompareError as exc:
        fail(str(exc))
    write_text_atomic(csv_out, to_csv(rows, target))
    if as_json:
        print_json(rows_json(rows, target))
    else:
        print(to_markdown(rows, target))
    console.print(f"\n{len(rows)} run(s) compared; CSV written to {csv_out}", highlight=False)


def _compare_by_config(
    client: Any, runs: list[str], target: float | None, baseline: str | None, csv_out: Path, as_json: bool
) -> None:
    """``--by-config`` / ``--baseline``: one row per config over its seeds (and paired differences), CSV beside."""
    from bhfl_core.analysis.comparison import by_config_csv, by_config_json, by_config_markdown, paired_csv
    from bhfl_core.store.atomic import write_text_atomic
    from flows.tracking.run_comparison import CompareError, compare_by_config

    try:
        result = compare_by_config(client, runs, target, baseline)
    except CompareError as exc:
        fail(str(exc))
    write_text_atomic(csv_out, by_config_csv(result, target))
    written = [csv_out]
    if result.baseline is not None:
        written.append(csv_out.with_name(f"{csv_out.stem}_paired{csv_out.suffix or '.csv'}"))
        write_text_atomic(written[-1], paired_csv(result, target))
    if as_json:
        print_json(by_config_json(result, target))
    else:
        print(by_config_markdown(result, target))
    left_out = f"; older runs of the same config and seed left out: {' '.join(result.superseded)}"
    console.print(
        f"\n{len(result.rows)} run(s) in {len(result.groups)} config(s)"
        f"{left_out if result.superseded else ''}; CSV written to {', '.join(map(str, written))}",
        highlight=False,
    )
