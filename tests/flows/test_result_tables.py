"""What a reader sees of a sweep and of a comparison over seeds, checked on tables built by hand.

- ``bhfl sweep``'s terminal table keeps every label whole at 80 columns: the labels are
  what tells the points apart (``eta_down=0.5`` from ``eta_down=1.0``), so the number
  columns give way and a long label wraps at its commas.
- ``bhfl compare --by-config`` clips the 95% interval of a bounded number (accuracy and
  shares in [0, 1], their differences in [-1, 1]) and marks the clipped end, in the
  markdown (with a footnote), the CSV and ``--json``; unbounded numbers (perplexity,
  communication) keep the t-interval as it is.

No run is trained and no MLflow store is read: the tables take the numbers directly.
Student-t quantile from the printed tables: t(0.975, 1) = 12.7062.
"""

import csv
import io
import math

import pytest
from rich.console import Console

from bhfl_core.analysis import seeds
from bhfl_core.analysis.comparison import (
    CLIPPED_NOTE,
    ByConfig,
    by_config_csv,
    by_config_json,
    by_config_markdown,
    headline,
)
from bhfl_core.config.sweep import load_sweep
from flows.cli.sweep import summary_table
from flows.cli.tables import print_table, results_width
from tests.small import REPO, SMALL

pytestmark = pytest.mark.integration  # tests/flows: the session's Prefect server starts (it is not used here)

T_975_1 = 12.706204736
HALF = T_975_1 * 0.05  # 95% half-width of two values 0.1 apart (std 0.070711): 0.63531


def _render(labels: list[str], width: int = 80) -> str:
    """The sweep's summary table for points ``labels`` (all finished, the same numbers), as text ``width`` wide."""
    result = {
        "name": "eta",
        "points": {label: {"status": "finished", "run_id": f"run-{i}"} for i, label in enumerate(labels)},
        "tasks": dict.fromkeys(labels, "classification"),
    }
    numbers = {
        "client_on_own_clients/accuracy_mean": 0.8312,
        "client_on_own_clients/accuracy_worst10": 0.6,
        "edge_on_own_clients/accuracy_mean": 0.8034,
        "edge_on_own_clients/accuracy_worst10": 0.495,
        "root/union/accuracy": 0.531,
        "time/total_s": 271.0,
    }
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(summary_table(result, dict.fromkeys(labels, numbers), console.width), soft_wrap=False)
    return console.export_text()


def test_sweep_table_keeps_the_differing_values_at_80_columns():
    sweep = load_sweep(REPO / "configs" / "embedded.yaml", SMALL, ["tree.edge.eta_down=0.5,1.0"], [0, 1], name="eta")
    labels = sweep.labels  # two configs that differ only in tree.edge.eta_down, two seeds each
    assert labels == ["eta_down=0.5,seed=0", "eta_down=0.5,seed=1", "eta_down=1.0,seed=0", "eta_down=1.0,seed=1"]
    text = _render(labels)
    assert all(label in text for label in labels)
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    assert all(number in text for number in ("0.831", "0.600", "0.803", "0.495", "0.531", "271"))


def test_a_label_longer_than_its_column_wraps_at_commas_never_cut():
    grid = ["tree.edge.eta_down=0.5,1.0", "tree.client.eta_down=0.5,1.0"]
    labels = load_sweep(REPO / "configs" / "embedded.yaml", SMALL, grid, [0], name="eta").labels
    assert "edge.eta_down=1.0,client.eta_down=0.5,seed=0" in labels  # 43 characters: more than 80 columns leave
    text = _render(labels)
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    cells = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]  # the label column
    assert "".join(cells) == "".join(labels)  # nothing dropped, nothing added: the breaks follow commas
    assert any(cell.endswith(",") for cell in cells)  # it did wrap
    parts = {part for label in labels for part in label.split(",")}
    assert all(any(part in cell for cell in cells) for part in parts)  # every key=value whole on one line


def test_a_table_printed_to_a_file_is_not_wrapped_at_80_columns(monkeypatch, capsys):
    """stdout redirected (not a terminal, no COLUMNS): the sweep table takes the width it needs, each label and
    each "mean / worst 10%" pair on one line (rich assumed 80 columns and wrapped them)."""
    grid = ["tree.edge.eta_down=0.5,1.0", "tree.client.eta_down=0.5,1.0"]
    labels = load_sweep(REPO / "configs" / "embedded.yaml", SMALL, grid, [0], name="eta").labels
    monkeypatch.delenv("COLUMNS", raising=False)
    result = {
        "name": "eta",
        "points": {label: {"status": "finished", "run_id": f"run-{i}"} for i, label in enumerate(labels)},
        "tasks": dict.fromkeys(labels, "classification"),
    }
    numbers = {"client_on_own_clients/accuracy_mean": 0.8312, "client_on_own_clients/accuracy_worst10": 0.6}
    print_table(summary_table(result, dict.fromkeys(labels, numbers), results_width()))
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) > 80
    assert all(any(label in line and "0.831 / 0.600" in line for line in lines) for label in labels)


def _by_config(values: dict[str, dict[str, list[float]]], metric: str, baseline: str | None = None) -> ByConfig:
    """A comparison of configs (label -> headline column -> one value per seed) in ``metric``, as compare builds it."""
    rows = [
        {seeds.CONFIG: config, seeds.SEED: seed, seeds.RUN: f"{config}-{seed}", **{c: v[seed] for c, v in cols.items()}}
        for config, cols in values.items()
        for seed in range(len(next(iter(cols.values()))))
    ]
    metrics = headline(None)
    groups = seeds.aggregate(rows, metrics)
    paired = seeds.paired(rows, metrics, baseline) if baseline else []
    return ByConfig(rows, groups, {c: c for c in values}, dict.fromkeys(values, metric), paired, baseline)


def test_intervals_of_bounded_numbers_are_clipped_and_marked():
    # bhfl, two seeds: own model 0.9, 1.0 -> 0.95 ± 0.0707, t-interval [0.31469, 1.58531] -> hi clipped to 1;
    # share of clients 0.0, 0.1 -> 0.05, [-0.58531, 0.68531] -> lo clipped to 0; MB 1, 3 -> 2 ± 1.41 [-10.71, 14.71]
    # (unbounded: kept); bhfl − hierfavg own model 0.5, 0.9 -> +0.7 ± 0.2828, [-1.84124, 3.24124] -> [-1, 1]
    values = {
        "bhfl": {"leaf_mean": [0.9, 1.0], "closer_is_better_share": [0.0, 0.1], "comm_mb": [1.0, 3.0]},
        "hierfavg": {"leaf_mean": [0.4, 0.1], "closer_is_better_share": [0.5, 0.5], "comm_mb": [1.0, 1.0]},
    }
    result = _by_config(values, "accuracy", baseline="hierfavg")
    text = by_config_markdown(result)
    assert f"| bhfl | accuracy | 0, 1 (2) | 0.9500 ± 0.0707 [{0.95 - HALF:.4f}, 1.0000†] |" in text
    assert f"| 0.0500 ± 0.0707 [0.0000†, {0.05 + HALF:.4f}] |" in text
    assert f"| 2.00 ± 1.41 [{2 - T_975_1:.2f}, {2 + T_975_1:.2f}] |" in text  # MB: no bound, no mark
    assert "| bhfl | 0, 1 (2) | +0.7000 ± 0.2828 [-1.0000†, +1.0000†] |" in text
    assert text.count(CLIPPED_NOTE) == 2  # under each table that has a clipped end
    # hierfavg's own model 0.4, 0.1 -> 0.25 ± 0.2121, [0.25 − 1.90593, 0.25 + 1.90593]: both ends clipped
    assert "| hierfavg | accuracy | 0, 1 (2) | 0.2500 ± 0.2121 [0.0000†, 1.0000†] |" in text

    (bhfl, _) = by_config_json(result)
    assert bhfl["stats"]["leaf_mean"] == {
        "n": 2,
        "mean": pytest.approx(0.95),
        "std": pytest.approx(0.0707107, abs=1e-7),
        "lo": pytest.approx(0.95 - HALF),
        "hi": 1.0,
        "lo_raw": pytest.approx(0.95 - HALF),
        "hi_raw": pytest.approx(0.95 + HALF),
    }
    assert bhfl["stats"]["comm_mb"]["lo"] == bhfl["stats"]["comm_mb"]["lo_raw"] == pytest.approx(2 - T_975_1)
    diff = bhfl["paired"]["diff"]["leaf_mean"]
    assert (diff["lo"], diff["hi"]) == (-1.0, 1.0)
    assert (diff["lo_raw"], diff["hi_raw"]) == (pytest.approx(0.7 - 0.2 * T_975_1), pytest.approx(0.7 + 0.2 * T_975_1))

    row = next(csv.DictReader(io.StringIO(by_config_csv(result))))
    assert (float(row["leaf_mean_hi"]), float(row["leaf_mean_hi_raw"])) == (1.0, pytest.approx(0.95 + HALF))


def test_perplexity_intervals_are_not_clipped():
    # 300, 100 -> 200 ± 141.42, [200 − 1270.62, 200 + 1270.62]: perplexity has no upper bound, and its
    # interval is reported as the t-interval, however few the seeds
    result = _by_config({"mlm": {"leaf_mean": [300.0, 100.0]}}, "perplexity")
    text = by_config_markdown(result)
    assert f"| 200.0000 ± 141.4214 [{200 - 100 * T_975_1:.4f}, {200 + 100 * T_975_1:.4f}] |" in text
    assert "†" not in text and CLIPPED_NOTE not in text
    stats = by_config_json(result)[0]["stats"]["leaf_mean"]
    assert stats["lo"] == stats["lo_raw"] and not math.isnan(stats["lo"])
