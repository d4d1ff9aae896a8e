"""Statistics over seeds (bhfl_core/analysis/seeds.py), checked against numbers worked out by hand.

Student-t quantiles from the printed tables: t(0.975, 1) = 12.7062, t(0.975, 2) = 4.3027.
"""

import math

import pytest

from bhfl_core.analysis import seeds
from bhfl_core.analysis.seeds import SeedStatsError

T_975_1 = 12.706204736
T_975_2 = 4.302652730


def _row(config, seed, **values):
    return {"config": config, "seed": seed, "run_id": f"{config}-{seed}", **values}


def test_mean_std_and_t_interval_of_three_seeds():
    # 0.70, 0.75, 0.80: mean 0.75; squared deviations 0.0025 + 0 + 0.0025 = 0.005, / (3 - 1) -> std 0.05
    s = seeds.summarise([0.70, 0.75, 0.80])
    assert (s.n, s.missing) == (3, 0)
    assert s.mean == pytest.approx(0.75)
    assert s.std == pytest.approx(0.05)
    half = T_975_2 * 0.05 / math.sqrt(3)  # 4.3027 * 0.028868 = 0.12421
    assert half == pytest.approx(0.12421, abs=1e-5)
    assert s.half_width == pytest.approx(half, rel=1e-8)
    assert (s.lo, s.hi) == (pytest.approx(0.75 - half), pytest.approx(0.75 + half))
    assert s.has_interval


def test_nan_is_left_out_and_counted():
    # 0.70, NaN, 0.80: n = 2, mean 0.75, std = sqrt(0.05² + 0.05²) = 0.070711; half = 12.706 * 0.070711 / √2
    s = seeds.summarise([0.70, math.nan, 0.80])
    assert (s.n, s.missing) == (2, 1)
    assert s.mean == pytest.approx(0.75)
    assert s.std == pytest.approx(0.0707107, abs=1e-7)
    assert s.half_width == pytest.approx(T_975_1 * 0.05, rel=1e-8)  # = 0.63531


def test_one_run_has_no_spread_and_no_interval():
    s = seeds.summarise([0.7])
    assert (s.n, s.mean) == (1, 0.7)
    assert math.isnan(s.std) and math.isnan(s.half_width) and not s.has_interval
    none = seeds.summarise([math.nan, math.nan])
    assert (none.n, none.missing) == (0, 2) and math.isnan(none.mean)


def test_an_interval_past_a_bound_is_clipped_there_and_keeps_its_raw_ends():
    # accuracies 0.0 and 0.1 of two seeds: mean 0.05, std 0.070711, half = 12.7062 * 0.05 = 0.63531
    s = seeds.summarise([0.0, 0.1])
    i = seeds.interval(s, (0.0, 1.0))
    assert (i.lo, i.hi) == (0.0, pytest.approx(0.05 + T_975_1 * 0.05))  # [-0.58531, 0.68531] -> [0, 0.68531]
    assert (i.lo_raw, i.hi_raw) == (pytest.approx(0.05 - T_975_1 * 0.05), i.hi)
    assert (i.lo_clipped, i.hi_clipped, i.clipped) == (True, False, True)
    assert (s.mean, s.std) == (pytest.approx(0.05), pytest.approx(0.0707107, abs=1e-7))  # the statistics stay
    # the difference of two accuracies lies in [-1, 1]: +0.7 ± 2.54124 (0.5 and 0.9, std 0.28284) -> [-1, 1]
    d = seeds.interval(seeds.summarise([0.5, 0.9]), seeds.difference_bounds((0.0, 1.0)))
    assert seeds.difference_bounds((0.0, 1.0)) == (-1.0, 1.0)
    assert (d.lo, d.hi, d.lo_raw) == (-1.0, 1.0, pytest.approx(0.7 - T_975_1 * 0.2))
    # unbounded (perplexity) or no interval (one seed): nothing moves
    p = seeds.interval(seeds.summarise([300.0, 100.0]))
    assert (p.lo, p.hi, p.clipped) == (pytest.approx(200 - T_975_1 * 100), pytest.approx(200 + T_975_1 * 100), False)
    one = seeds.interval(seeds.summarise([0.9]), (0.0, 1.0))
    assert math.isnan(one.lo) and math.isnan(one.hi) and not one.clipped


def test_aggregate_groups_by_config_and_reads_missing_metrics_as_nan():
    rows = [
        _row("b", 2, acc=0.80, mb=1.0),
        _row("a", 0, acc=0.60, mb=2.0),
        _row("b", 0, acc=0.70, mb=float("nan")),
        _row("b", 1, acc="0.75"),  # CSV-style strings read as numbers; "mb" absent: missing
        _row("a", 1, acc=0.70, mb=2.0),
    ]
    groups = seeds.aggregate(rows, ["acc", "mb"])
    assert [g.config for g in groups] == ["b", "a"]  # first-seen order
    b, a = groups
    assert b.seeds == (0, 1, 2) and b.run_ids == ("b-0", "b-1", "b-2")
    assert b.metrics["acc"].mean == pytest.approx(0.75) and b.metrics["acc"].std == pytest.approx(0.05)
    assert (b.metrics["mb"].n, b.metrics["mb"].missing, b.metrics["mb"].mean) == (1, 2, 1.0)
    assert a.metrics["acc"].mean == pytest.approx(0.65) and a.metrics["mb"].std == 0.0


def test_paired_differences_over_common_seeds():
    # config b − baseline a per seed: 0.70-0.60, 0.75-0.70, 0.80-0.65 = 0.10, 0.05, 0.15 -> mean 0.10, std 0.05
    rows = [
        _row("a", 0, acc=0.60),
        _row("a", 1, acc=0.70),
        _row("a", 2, acc=0.65),
        _row("a", 9, acc=0.10),  # the baseline's extra seed is not paired
        _row("b", 0, acc=0.70),
        _row("b", 1, acc=0.75),
        _row("b", 2, acc=0.80),
        _row("c", 1, acc=0.90),
        _row("c", 2),  # no acc: seed 2 is common but leaves the pair out of acc's n
    ]
    b, c = seeds.paired(rows, ["acc"], baseline="a")
    assert (b.config, b.baseline, b.seeds) == ("b", "a", (0, 1, 2))
    d = b.metrics["acc"]
    assert (d.n, d.missing) == (3, 0)
    assert d.mean == pytest.approx(0.10) and d.std == pytest.approx(0.05)
    assert d.half_width == pytest.approx(T_975_2 * 0.05 / math.sqrt(3), rel=1e-8)
    assert c.seeds == (1, 2)
    assert (c.metrics["acc"].n, c.metrics["acc"].missing) == (1, 1)
    assert c.metrics["acc"].mean == pytest.approx(0.20) and math.isnan(c.metrics["acc"].half_width)


def test_paired_errors_name_the_baseline():
    rows = [_row("a", 0, acc=0.6), _row("b", 1, acc=0.7)]
    with pytest.raises(SeedStatsError, match=r"baseline config 'zz' is not among the configs \['a', 'b'\]"):
        seeds.paired(rows, ["acc"], baseline="zz")
    with pytest.raises(SeedStatsError, match=r"baseline config 'a' \(seeds \[0\]\) shares no seed.*b: \[1\]"):
        seeds.paired(rows, ["acc"], baseline="a")
    # one config without a common seed is reported (n = 0) while another has pairs
    rows.append(_row("c", 0, acc=0.8))
    b, c = seeds.paired(rows, ["acc"], baseline="a")
    assert b.seeds == () and b.metrics["acc"].n == 0 and c.metrics["acc"].mean == pytest.approx(0.2)


def test_bad_rows_are_named():
    with pytest.raises(SeedStatsError, match=r"config a: seed 0 twice \(runs a-0 and a-0\)"):
        seeds.aggregate([_row("a", 0), _row("a", 0)], ["acc"])
    with pytest.raises(SeedStatsError, match=r"run a-0: acc = 'high' is not a number"):
        seeds.aggregate([_row("a", 0, acc="high")], ["acc"])
    with pytest.raises(SeedStatsError, match=r"run x: seed 'one' is not an integer"):
        seeds.aggregate([{"config": "a", "seed": "one", "run_id": "x"}], ["acc"])
    with pytest.raises(SeedStatsError, match=r"run x: no 'config' identity"):
        seeds.aggregate([{"seed": 0, "run_id": "x"}], ["acc"])


def test_identity_ignores_seed_name_and_runtime_only():
    base = {"seed": "0", "name": "bhfl", "runtime.workers": "2", "tree.edge.eta_down": "1.0"}
    same = {**base, "seed": "3", "name": "bhfl-s3", "runtime.workers": "auto"}
    assert seeds.config_identity(base) == seeds.config_identity(same)
    assert seeds.config_identity(base) != seeds.config_identity({**base, "tree.edge.eta_down": "0.5"})
    # a pipeline's params: the same keys under stages.<stage>.
    stage = {"stages.pre.seed": "0", "stages.pre.runtime.device": "cpu", "stages.pre.tree.flat": "True"}
    assert seeds.config_identity(stage) == seeds.config_identity({**stage, "stages.pre.seed": "1"})
    assert not seeds.is_setting("stages.pre.name") and seeds.is_setting("stages.pre.tree.flat")


def test_labels_name_plus_the_keys_that_differ():
    def cfg(name, **keys):
        return name, {"seed": "0", "name": name, "tree.client.eta_down": "1.0", "tree.edge.eta_down": "1.0", **keys}

    configs = {
        "h": cfg("hierfavg", **{"tree.edge.opt_down.kind": "fedavg"}),
        "d": cfg("bhfl"),
        "e": cfg("bhfl", **{"tree.edge.eta_down": "0.5"}),
        "c": cfg("bhfl", **{"tree.client.eta_down": "0.5"}),
    }
    assert seeds.labels(configs) == {
        "h": "hierfavg",
        "d": "bhfl",  # the ablation's default: every key at the most common value
        "e": "bhfl edge.eta_down=0.5",
        "c": "bhfl client.eta_down=0.5",
    }
    # a 2 x 2 grid has no most common value: every config shows both keys
    grid = {f"{a}{b}": cfg("g", **{"tree.edge.eta_down": a, "tree.edge.lr": b}) for a in "12" for b in "34"}
    assert seeds.labels(grid)["13"] == "g eta_down=1 lr=3"
    assert seeds.differing_keys(c for _, c in grid.values()) == ["tree.edge.eta_down", "tree.edge.lr"]
