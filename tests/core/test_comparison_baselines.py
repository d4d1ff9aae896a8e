"""Trivial baselines in the comparison tables (bhfl_core/analysis/comparison.py), by hand."""

import math

import pytest

from bhfl_core.analysis import seeds
from bhfl_core.analysis.comparison import (
    BASELINE_COLUMNS,
    ByConfig,
    by_config_json,
    by_config_markdown,
    headline,
    rows_json,
    to_csv,
    to_markdown,
)


def _row(seed: int, root: float, base: float) -> dict[str, object]:
    row: dict[str, object] = {c: math.nan for c in headline(None)}
    row |= {c: math.nan for c in BASELINE_COLUMNS}
    row |= {"experiment": "bhfl", "run_id": f"r{seed}", "metric": "accuracy", "root_rounds": "8"}
    row |= {"root_union": root, "baseline_root_union": base, "baseline_kind": "majority"}
    return row | {seeds.CONFIG: "c", seeds.SEED: seed}


ROWS = [_row(0, 0.5, 0.10), _row(1, 0.6, 0.20)]


def test_each_run_row_is_followed_by_its_baseline_and_json_and_csv_carry_it():
    table = to_markdown(ROWS)
    lines = [line for line in table.splitlines() if line.startswith("| ↳ trivial baseline (majority)")]
    assert len(lines) == 2 and "| 0.1000 |" in lines[0] and "| 0.2000 |" in lines[1]
    assert "↳ trivial baseline: what a model that learnt nothing" in table
    first = rows_json(ROWS)[0]["baseline"]
    assert first["kind"] == "majority" and first["root_union"] == 0.1 and first["leaf_mean"] is None
    header, row0 = to_csv(ROWS).splitlines()[:2]
    assert header.endswith("baseline_kind,baseline_leaf_mean,baseline_leaf_worst10,baseline_parent_mean,"
                           "baseline_parent_worst10,baseline_root_union,baseline_root_proxy")  # fmt: skip
    assert row0.split(",")[-2] == "0.1"


def test_a_config_over_seeds_gets_its_baselines_mean_and_interval():
    groups = seeds.aggregate(ROWS, (*headline(None), *BASELINE_COLUMNS))
    result = ByConfig(ROWS, groups, {"c": "bhfl"}, {"c": "accuracy"})
    table = by_config_markdown(result)
    (line,) = [line for line in table.splitlines() if line.startswith("| ↳ trivial baseline")]
    # mean 0.15, std 0.0707; t(0.975, 1) = 12.7062: 0.15 ± 0.635 -> [-0.485, 0.785], clipped at 0
    assert "0.1500 ± 0.0707 [0.0000†, 0.7853]" in line
    stats = by_config_json(result)[0]["trivial_baseline"]
    assert stats["root_union"]["mean"] == pytest.approx(0.15) and stats["root_union"]["lo"] == 0.0
    assert stats["leaf_mean"]["n"] == 0
