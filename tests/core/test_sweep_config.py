"""Sweep specs: expansion order, labels, config hashes, precedence, and errors that name the key."""

from pathlib import Path

import pytest
import yaml

from bhfl_core.config.base import ConfigError
from bhfl_core.config.sweep import (
    config_hash,
    is_sweep,
    load_sweep,
    parse_grid_option,
    parse_seeds,
    short_keys,
    sweep_from_dict,
    sweep_from_dump,
    with_overrides,
)
from tests.small import REPO, SMALL

CONFIGS = REPO / "configs"


def _sweep(data, *, overrides=(), grid=(), seeds=None, name=None):
    return sweep_from_dict(data, [*SMALL, *overrides], grid, seeds, name, source="s.yaml", base_dir=CONFIGS)


def test_grid_times_seeds_in_order_with_stable_labels_and_distinct_hashes():
    sweep = _sweep(
        {"name": "eta", "base": "embedded.yaml", "grid": {"tree.edge.eta_down": [1.0, 0.5]}, "seeds": [0, 1, 2]}
    )
    assert sweep.name == "eta"
    assert sweep.labels == [f"eta_down={v},seed={s}" for v in ("1.0", "0.5") for s in (0, 1, 2)]
    for point in sweep:
        assert point.config.tree.edge.eta_down == point.values["tree.edge.eta_down"]
        assert point.config.seed == point.values["seed"]
        assert point.config.name == "itest"  # the experiments keep their config's name
    assert len({p.hash for p in sweep}) == 6
    again = _sweep(
        {"name": "eta", "base": "embedded.yaml", "grid": {"tree.edge.eta_down": [1.0, 0.5]}, "seeds": [0, 1, 2]}
    )
    assert [(p.label, p.hash) for p in again] == [(p.label, p.hash) for p in sweep]


def test_variants_cross_the_grid_and_take_their_own_base():
    sweep = _sweep(
        {
            "name": "mech",
            "base": "embedded.yaml",
            "configs": {"hier": {"base": "hierfavg.yaml"}, "down": {"set": {"tree.client.eta_down": 0.5}}},
            "grid": {"tree.edge.eta_down": [1.0, 0.5]},
        }
    )
    assert sweep.labels == ["hier,eta_down=1.0", "hier,eta_down=0.5", "down,eta_down=1.0", "down,eta_down=0.5"]
    assert sweep["down,eta_down=0.5"].config.tree.client.eta_down == 0.5
    assert sweep["down,eta_down=0.5"].values == {"config": "down", "tree.edge.eta_down": 0.5}
    hier, down = sweep["hier,eta_down=1.0"].config, sweep["down,eta_down=1.0"].config
    assert not hier.tree.root.proxy_train and down.tree.root.proxy_train  # hierfavg.yaml's, embedded.yaml's
    assert hier.name == down.name == "itest"  # SMALL's --set name wins over the bases'


def test_precedence_base_then_set_then_overrides_then_grid_then_seed():
    sweep = _sweep(
        {"base": "embedded.yaml", "set": {"tree.server.rounds": 3, "tree.client.eta_down": 0.3}, "seeds": [4]},
        overrides=["tree.client.eta_down=0.7"],
    )
    (point,) = sweep.points
    assert point.config.tree.server.rounds == 3 and point.config.tree.client.eta_down == 0.7 and point.config.seed == 4
    assert point.label == "seed=4" and sweep.name == "s"  # default name: the file's stem


def test_the_hash_ignores_how_a_run_runs_but_not_what_it_computes():
    sweep = _sweep({"base": "embedded.yaml", "seeds": [0]})
    config = sweep.points[0].config
    moved = config.model_copy(update={"runtime": config.runtime.model_copy(update={"workers": 7})})
    assert config_hash(moved) == config_hash(config)
    assert config_hash(config.model_copy(update={"seed": 1})) != config_hash(config)
    resumed = with_overrides(sweep, ["runtime.workers=1"], sweep.labels, "sweep.yaml")
    assert resumed.points[0].config.runtime.workers == 1 and resumed.points[0].hash == sweep.points[0].hash


def test_dump_round_trips_every_point():
    sweep = _sweep({"base": "embedded.yaml", "grid": {"tree.client.eta_down": [1, 0.5]}, "seeds": [0, 1]})
    again = sweep_from_dump(yaml.safe_load(yaml.safe_dump(sweep.dump(), sort_keys=False)), "sweep.yaml")
    assert [(p.label, p.hash, p.values) for p in again] == [(p.label, p.hash, p.values) for p in sweep]


def test_cli_form_sweeps_an_experiment_config(tmp_path):
    sweep = load_sweep(
        CONFIGS / "embedded.yaml", SMALL, ["tree.edge.eta_down=1.0,0.5", "tree.client.eta_down=0.5,1"], [0]
    )
    assert sweep.name == "itest-sweep"  # <experiment name>-sweep
    assert sweep.labels[0] == "edge.eta_down=1.0,client.eta_down=0.5,seed=0" and len(sweep) == 4
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"base": str(CONFIGS / "embedded.yaml"), "seeds": [0, 1]}))
    assert is_sweep(yaml.safe_load(spec.read_text()))
    from_file = load_sweep(spec, SMALL, seeds=[5])  # --seeds replaces the file's
    assert from_file.labels == ["seed=5"] and from_file.name == "s"


def test_option_parsers():
    assert parse_grid_option("tree.edge.eta_down=1.0, 0.5") == ("tree.edge.eta_down", [1.0, 0.5])
    assert parse_grid_option("data.sizes={median: 30, min: 10},{median: 60, min: 10}")[1][1] == {
        "median": 60,
        "min": 10,
    }
    assert parse_seeds("0,1,2") == [0, 1, 2] and parse_seeds("0-3") == [0, 1, 2, 3]
    assert short_keys(["tree.edge.eta_down", "tree.client.eta_down", "seed_x"]) == {
        "tree.edge.eta_down": "edge.eta_down",
        "tree.client.eta_down": "client.eta_down",
        "seed_x": "seed_x",
    }


@pytest.mark.parametrize(
    ("data", "kwargs", "names"),
    [
        ({"base": "embedded.yaml", "grid": {"tree.edge.eta_dwn": [1, 2]}}, {}, ["tree.edge.eta_dwn", "unknown key"]),
        ({"base": "embedded.yaml", "grid": {"tree.edge.eta_down": []}}, {}, ["grid.tree.edge.eta_down", "non-empty"]),
        ({"base": "embedded.yaml", "grid": {"tree.edge.eta_down": [1, 1.0]}}, {}, ["same experiment"]),
        ({"base": "embedded.yaml", "grid": {"seed": [1, 2]}}, {}, ["grid.seed", "seeds"]),
        ({"base": "embedded.yaml", "seeds": [0, "one"]}, {}, ["seeds", "integers"]),
        ({"base": "embedded.yaml", "seeds": [0, 0]}, {}, ["seeds", "twice"]),
        ({"base": "nope.yaml", "seeds": [0]}, {}, ["base", "nope.yaml", "not found"]),
        ({"seeds": [0]}, {}, ["base"]),
        ({"base": "embedded.yaml", "seeds": [0], "tree": {}}, {}, ["tree", "unknown top-level key"]),
        ({"base": "embedded.yaml"}, {}, ["nothing to sweep"]),
        ({"base": "embedded.yaml", "configs": {"a b": {}}}, {}, ["configs.a b", "variant name"]),
        ({"base": "embedded.yaml", "configs": {"a": {"tree": {}}}}, {}, ["configs.a", "tree", "unknown key"]),
        (
            {"base": "embedded.yaml", "grid": {"tree.root.rounds": [1, 2]}},
            {"overrides": ["tree.root.rounds=3"]},
            ["grid.tree.root.rounds", "also set"],
        ),
        ({"base": "embedded.yaml", "seeds": [0, 1]}, {"overrides": ["seed=3"]}, ["seed is also set"]),
        ({"base": "embedded.yaml", "seeds": [0], "name": "itest"}, {}, ["name", "'itest'"]),
        ({"base": "embedded.yaml", "grid": {"tree.server.rounds": [2, 0]}}, {}, ["rounds=0", "tree.server.rounds"]),
    ],
)
def test_mistakes_are_config_errors_naming_the_key(data, kwargs, names):
    with pytest.raises(ConfigError) as info:
        _sweep(data, **kwargs)
    message = str(info.value)
    assert message.startswith("s.yaml")
    for name in names:
        assert name in message, message


def test_a_typo_for_grid_in_a_file_names_the_key_not_an_empty_sweep(tmp_path):
    typo = tmp_path / "s.yaml"  # `gird:` makes it an experiment file, whose unknown key is the mistake
    typo.write_text(f"base: {CONFIGS / 'embedded.yaml'}\ngird:\n  tree.edge.eta_down: [1.0, 0.5]\n")
    with pytest.raises(ConfigError, match=r"gird.*unknown key"):
        load_sweep(typo)


def test_a_pipeline_is_not_swept_and_the_error_says_so(tmp_path):
    """`bhfl sweep PIPELINE.yaml` (or a sweep whose base: is one) said "shared: unknown key, stages: unknown key"."""
    pipeline = CONFIGS / "groupperfl.yaml"
    for spec in (pipeline, tmp_path / "s.yaml"):
        (tmp_path / "s.yaml").write_text(f"base: {pipeline}\nseeds: [0, 1]\n")
        with pytest.raises(ConfigError) as err:
            load_sweep(spec, seeds=[0, 1])
        message = str(err.value)
        assert f"{pipeline} is a pipeline (top-level stages:)" in message and "unknown key" not in message, message
        assert f"`bhfl run {pipeline} --set seed=1`" in message


def test_option_mistakes_name_the_option():
    with pytest.raises(ConfigError, match=r"--grid 'tree.edge.eta_down'"):
        parse_grid_option("tree.edge.eta_down")
    with pytest.raises(ConfigError, match=r"--seeds '0,x'.*'x'"):
        parse_seeds("0,x")
    with pytest.raises(ConfigError, match=r"--grid tree.edge.eta_down.*non-empty"):
        load_sweep(CONFIGS / "embedded.yaml", SMALL, ["tree.edge.eta_down="])
    missing = Path("/nonexistent/sweep.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_sweep(missing)


def test_baseline_names_a_config_of_the_sweep_and_labels_drop_only_the_seed():
    from bhfl_core.config.sweep import config_label

    assert config_label("hierfavg,eta_down=0.5,seed=1") == "hierfavg,eta_down=0.5"
    assert config_label('x={"a":1,"b":2},seed=0') == 'x={"a":1,"b":2}'  # commas inside a value stay
    assert config_label("seed=2") == "" and config_label("hierfavg") == "hierfavg"
    sweep = _sweep(
        {
            "name": "mech",
            "base": "embedded.yaml",
            "configs": {"hier": {"base": "hierfavg.yaml"}, "down": {"set": {"tree.client.eta_down": 0.5}}},
            "seeds": [0, 1],
            "baseline": "hier",
        }
    )
    assert sweep.baseline == "hier" and sweep_from_dump(sweep.dump(), "x").baseline == "hier"
    with pytest.raises(ConfigError, match=r"s.yaml: baseline: 'fedavg' is not a config of this sweep.*'hier', 'down'"):
        _sweep(
            {"base": "embedded.yaml", "configs": {"hier": {"base": "hierfavg.yaml"}, "down": {}}, "baseline": "fedavg"}
        )
