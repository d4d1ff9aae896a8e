"""`bhfl compare --by-config / --baseline` on a real MLflow store, and the sweep figure of seed statistics.

The runs are made with ``MlflowClient`` in a throw-away SQLite store, with the tags,
params and parent-run metrics a finished experiment run has (flows/experiment.py
``_run_tags``, flows/tracking/tracker.py ``start``, flows/tracking/report.py), so no
experiment has to be trained. Expected numbers are worked out by hand below.
"""

import csv
import io
import math
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from typer.testing import CliRunner

from bhfl_core.algorithm.round_tail import VIRTUAL_TIME
from bhfl_core.analysis import seeds
from flows.cli.app import app
from flows.tracking.seed_plots import metric_vs_key, save_metric_plots
from flows.tracking.tracker import Tracker

pytestmark = pytest.mark.integration

PNG = b"\x89PNG\r\n\x1a\n"
T_975_2 = 4.302652730  # Student t quantile, 2 degrees of freedom (printed tables)
FEDADAM = {"tree.edge.opt_down.kind": "fedadam"}  # what the bhfl configs change from hierfavg
HALF = T_975_2 * 0.05 / math.sqrt(3)  # 95% half-width of 3 values with std 0.05: 0.12421


def _params(name: str, seed: int, **settings: str) -> dict[str, str]:
    """The flattened resolved config as Tracker.start logs it (a few keys of it)."""
    return {
        "name": name,
        "seed": str(seed),
        "runtime.workers": "auto",
        "runtime.executor": "local",
        "tree.edge.eta_down": "1.0",
        "tree.client.eta_down": "1.0",
        "tree.edge.opt_down.kind": "fedavg",
        **settings,
    }


def _run(client, experiment, name, seed, leaf, start, params=None, **metrics):
    """A finished experiment run with its node run; ``leaf``: client_on_own_clients accuracy mean."""
    params = params or _params(name, seed)
    run = client.create_run(
        experiment,
        run_name=name,
        start_time=start,
        tags={"bhfl.seed": str(seed), "bhfl.config_hash": f"h{start}", "bhfl.task": "classification"},
    )
    rid = run.info.run_id
    for key, value in params.items():
        client.log_param(rid, key, value)
    values = {
        "client_on_own_clients/accuracy_mean": leaf,
        "client_on_own_clients/accuracy_worst10": leaf - 0.3,
        "edge_on_own_clients/accuracy_mean": leaf - 0.1,
        "edge_on_own_clients/accuracy_worst10": leaf - 0.4,
        "root/union/accuracy": 0.5,
        "root/proxy/accuracy": 0.45,
        "proximity/share_clients_rank": 1.0,
        "comm/total_model_equivalents": 720.0,
        "comm/total_bytes": 6.0e8,
        VIRTUAL_TIME: 100.0,
        "time/total_s": 60.0 + seed,
        **metrics,
    }
    for key, value in values.items():
        if value is not None:
            client.log_metric(rid, key, value, step=0)
    node = client.create_run(experiment, run_name="root", tags={MLFLOW_PARENT_RUN_ID: rid, "bhfl.node": "root"})
    client.set_terminated(node.info.run_id, "FINISHED")
    client.set_terminated(rid, "FINISHED")
    return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """hierfavg and two bhfl configs (default, edge eta_down 0.5) over seeds 0, 1, 2, plus distractors."""
    root = tmp_path_factory.mktemp("seeds")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = Tracker(uri).client  # a store made the way runs make it
    hier = client.create_experiment("hierfavg")
    bhfl = client.create_experiment("bhfl")
    ids = {}
    for seed, leaf in enumerate((0.60, 0.70, 0.65)):
        ids["hierfavg", seed] = _run(client, hier, "hierfavg", seed, leaf, 1000 + seed)
    # an older run of bhfl seed 0: superseded by the re-run below
    ids["old"] = _run(client, bhfl, "bhfl", 0, 0.10, 1500, _params("bhfl", 0, **FEDADAM))
    for seed, leaf in enumerate((0.70, 0.75, 0.80)):
        # runtime keys differ between seeds: they do not change results, so one config
        params = _params("bhfl", seed, **{"runtime.workers": str(seed + 1), **FEDADAM})
        ids["bhfl", seed] = _run(client, bhfl, "bhfl", seed, leaf, 2000 + seed, params)
    for seed, leaf in enumerate((0.80, 0.85, 0.90)):
        params = _params("bhfl", seed, **{"tree.edge.eta_down": "0.5", **FEDADAM})
        union = None if seed == 2 else 0.55  # seed 2 lacks the root's number: n = 2 there
        ids["eta", seed] = _run(client, bhfl, "bhfl", seed, leaf, 3000 + seed, params, **{"root/union/accuracy": union})
    return root, uri, ids


def _invoke(root, *args):
    return CliRunner().invoke(app, ["compare", *args, "--run-dir", str(root)])


def _csv(path: Path) -> dict[str, dict[str, str]]:
    return {r["config"]: r for r in csv.DictReader(io.StringIO(path.read_text()))}


def test_by_config_rows_and_paired_differences(store, tmp_path):
    root, _, ids = store
    out = tmp_path / "table.csv"
    result = _invoke(root, "hierfavg", "bhfl", "--baseline", "hierfavg", "--csv", str(out))
    assert result.exit_code == 0, result.output
    text = result.output
    # hierfavg 0.60, 0.70, 0.65: mean 0.65, std 0.05; bhfl 0.70, 0.75, 0.80: mean 0.75, std 0.05
    assert f"| hierfavg | accuracy | 0, 1, 2 (3) | 0.6500 ± 0.0500 [{0.65 - HALF:.4f}, {0.65 + HALF:.4f}] |" in text
    bhfl_cell = f"0.7500 ± 0.0500 [{0.75 - HALF:.4f}, {0.75 + HALF:.4f}]"
    assert f"| bhfl eta_down=1.0 | accuracy | 0, 1, 2 (3) | {bhfl_cell} |" in text
    assert "| bhfl eta_down=0.5 | accuracy | 0, 1, 2 (3) | 0.8500 ± 0.0500" in text
    assert "0.5500 ± 0.0000 [0.5500, 0.5500] (n=2)" in text  # root on union: seed 2 has none
    # bhfl − hierfavg per seed: 0.10, 0.05, 0.15 -> +0.1000 ± 0.0500; eta 0.5: 0.20, 0.15, 0.25
    assert f"| bhfl eta_down=1.0 | 0, 1, 2 (3) | +0.1000 ± 0.0500 [{0.10 - HALF:+.4f}, {0.10 + HALF:+.4f}] |" in text
    assert f"| bhfl eta_down=0.5 | 0, 1, 2 (3) | +0.2000 ± 0.0500 [{0.20 - HALF:+.4f}, {0.20 + HALF:+.4f}] |" in text
    summary = " ".join(text.split())  # the console wraps long lines
    assert f"9 run(s) in 3 config(s); older runs of the same config and seed left out: {ids['old']};" in summary

    rows = _csv(out)
    assert set(rows) == {"hierfavg", "bhfl eta_down=1.0", "bhfl eta_down=0.5"}
    bhfl = rows["bhfl eta_down=1.0"]
    assert bhfl["run_ids"].split() == [ids["bhfl", s] for s in range(3)]
    assert (bhfl["n_runs"], bhfl["seeds"], bhfl["leaf_mean_n"]) == ("3", "0 1 2", "3")
    assert float(bhfl["leaf_mean_mean"]) == pytest.approx(0.75)
    assert float(bhfl["leaf_mean_std"]) == pytest.approx(0.05)
    assert float(bhfl["leaf_mean_hi"]) == pytest.approx(0.75 + HALF)
    assert float(bhfl["wall_s_mean"]) == pytest.approx(61.0)  # 60, 61, 62 s
    assert rows["bhfl eta_down=0.5"]["root_union_n"] == "2"
    paired = _csv(tmp_path / "table_paired.csv")
    assert set(paired) == {"bhfl eta_down=1.0", "bhfl eta_down=0.5"}
    d = paired["bhfl eta_down=0.5"]
    assert d["baseline"] == "hierfavg" and d["seeds"] == "0 1 2"
    assert float(d["leaf_mean_diff_mean"]) == pytest.approx(0.20)
    assert float(d["leaf_mean_diff_lo"]) == pytest.approx(0.20 - HALF)
    assert float(d["root_union_diff_mean"]) == pytest.approx(0.05) and d["root_union_diff_n"] == "2"


def test_run_ids_and_labels_as_baseline_and_one_seed(store, tmp_path):
    root, _, ids = store
    # a run id as baseline names its config; a label names one of two configs called bhfl
    one = [ids["hierfavg", 0], ids["eta", 0], ids["bhfl", 0]]
    result = _invoke(root, *one, "--baseline", ids["bhfl", 0], "--csv", str(tmp_path / "a.csv"))
    assert result.exit_code == 0, result.output
    assert "| hierfavg | accuracy | 0 (1) | 0.6000 |" in result.output  # one seed: its value, no interval
    assert "| hierfavg | 0 (1) | -0.1000 |" in result.output
    result = _invoke(root, "bhfl", "--baseline", "bhfl eta_down=0.5", "--csv", str(tmp_path / "b.csv"))
    assert result.exit_code == 0, result.output
    assert "| bhfl eta_down=1.0 | 0, 1, 2 (3) | -0.1000 ± 0.0000" in result.output
    result = _invoke(root, "bhfl", "hierfavg", "--by-config", "--csv", str(tmp_path / "c.csv"))
    assert result.exit_code == 0 and "vs " not in result.output and not (tmp_path / "c_paired.csv").exists()


def test_errors_name_the_offending_value(store, tmp_path):
    root, uri, _ = store
    result = _invoke(root, "hierfavg", "bhfl", "--baseline", "fedavg", "--csv", str(tmp_path / "x.csv"))
    assert result.exit_code == 2
    assert "--baseline fedavg: no config in the table has this label, name or run" in result.output
    assert "'bhfl eta_down=0.5'" in result.output
    result = _invoke(root, "bhfl", "--baseline", "bhfl", "--csv", str(tmp_path / "x.csv"))
    assert result.exit_code == 2
    assert "--baseline bhfl: 2 configs are named 'bhfl'; name one by its label: " in result.output
    client = MlflowClient(uri)
    lonely = client.create_experiment("lonely")
    _run(client, lonely, "lonely", 7, 0.5, 5000, _params("lonely", 7, **{"tree.client.eta_down": "0.1"}))
    result = _invoke(root, "lonely", "hierfavg", "--baseline", "lonely", "--csv", str(tmp_path / "x.csv"))
    assert result.exit_code == 2
    assert "baseline config 'lonely' (seeds [7]) shares no seed with any other config (hierfavg: [0, 1, 2])" in (
        " ".join(result.output.split())
    )
    noseed = client.create_experiment("noseed")
    run = client.create_run(noseed, run_name="noseed", tags={"bhfl.config_hash": "x"})
    client.set_terminated(run.info.run_id, "FINISHED")
    result = _invoke(root, "noseed", "--by-config", "--csv", str(tmp_path / "x.csv"))
    assert result.exit_code == 2
    assert f"run {run.info.run_id}: cannot tell its seed" in " ".join(result.output.split())


def test_plot_of_each_metric_against_each_swept_key(tmp_path):
    def row(a, b, seed, acc):
        params = {"seed": str(seed), "tree.edge.eta_down": a, "tree.root.opt_up.kind": b}
        return {"config": seeds.config_identity(params), "seed": seed, "run_id": f"{a}{b}{seed}", "acc": acc}, params

    grid = [(a, b) for a in ("0.3", "0.5", "1.0") for b in ("fedavg", "fedadam")]
    made = [row(a, b, 0, 0.5 + float(a) / 10) for a, b in grid]
    made += [row("0.3", "fedavg", s, 0.6) for s in (1, 2)]  # one config with 3 seeds, the others 1
    rows = [r for r, _ in made]
    groups = seeds.aggregate(rows, ["acc", "wall"])
    keys = ["tree.edge.eta_down", "tree.root.opt_up.kind"]
    settings = {r["config"]: {k: p[k] for k in keys} for r, p in made}
    fig = metric_vs_key(groups, settings, "tree.edge.eta_down", ["acc", "wall"], {"acc": "own model"})
    panel = fig.axes[0]
    assert panel.get_title() == "own model" and len(panel.get_lines()) >= 2  # one line per opt_up.kind
    paths = save_metric_plots(groups, settings, keys, ["acc"], tmp_path)
    assert [p.name for p in paths] == ["seeds_tree.edge.eta_down.png", "seeds_tree.root.opt_up.kind.png"]
    assert all(p.read_bytes().startswith(PNG) for p in paths)
    assert all(p.with_suffix(".svg").read_text().startswith("<?xml") for p in paths)  # vector copies beside them

    def top_of_bars(figure):
        return max(y for c in figure.axes[0].collections for seg in c.get_segments() for _, y in seg)

    # (0.3, fedavg): 0.53, 0.6, 0.6 -> mean 0.5767, t-interval up to 0.677; with the metric bounded at 0.61, cut there
    assert top_of_bars(fig) == pytest.approx(0.677, abs=1e-3)
    bounded = metric_vs_key(groups, settings, "tree.edge.eta_down", ["acc"], bounds={"acc": (0.0, 0.61)})
    assert top_of_bars(bounded) == pytest.approx(0.61)
    with pytest.raises(ValueError, match=r"no config has a value for 'tree.client.mu'"):
        metric_vs_key(groups, settings, "tree.client.mu", ["acc"])
