"""Pipeline configs (bhfl_core/config/pipeline.py) and the pure side of warm starts (bhfl_core/store/warm_start.py)."""

from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.node_state import NodeState
from bhfl_core.config.base import ConfigError
from bhfl_core.config.pipeline import is_pipeline, load_pipeline, pipeline_from_dict, read_pipeline_yaml, with_init_from
from bhfl_core.config.schema import dump
from bhfl_core.config.topology import build_tree, placeholder_clients
from bhfl_core.store.node_store import StateStore
from bhfl_core.store.warm_start import (
    InitFrom,
    config_mismatch,
    copy_models,
    copy_plan,
    load_backbone,
    mismatch_reason,
    parse_init_from,
    save_backbone,
)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def _pipeline(stages, overrides=(), **top):
    return pipeline_from_dict({"name": "p", **top, "stages": stages}, overrides, source="p.yaml", base_dir=CONFIGS)


def _train_calls(config) -> float:
    """Client TRAIN calls of one run, from its tree (cohorts of equal-sized siblings)."""
    tree = build_tree(config, placeholder_clients(config))

    def calls(node) -> float:
        s = node.settings
        if node.is_leaf:
            return float(s.rounds)
        children = tree.children(node.id)
        cohort = len(children) if s.cohort is None else s.cohort
        cohort = cohort if isinstance(cohort, int) else round(cohort * len(children))
        return s.rounds * cohort * sum(calls(c) for c in children) / len(children)

    return calls(tree.root)


def test_groupperfl_stages_chain_and_keep_the_baselines_budget():
    pipeline = load_pipeline(CONFIGS / "groupperfl.yaml")
    assert pipeline.name == "groupperfl" and pipeline.names == ["global", "group", "personal"]
    global_, group, personal = pipeline.stages
    assert [s.config.name for s in pipeline] == ["groupperfl-global", "groupperfl-group", "groupperfl-personal"]
    assert (global_.source_stage, group.source_stage, personal.source_stage) == (None, "global", "group")
    assert group.config.model.init_from == "global:root" and personal.config.model.init_from == "group"
    assert global_.config.tree.flat and global_.config.tree.root.opt_up.kind == "fedadam"
    assert group.config.tree.edge.opt_up.kind == "fedadam" and group.config.tree.root.rounds == 1
    # the header's arithmetic: 200 + 90 + 30 = 320, the budget of fedavg.yaml / tempo.yaml
    assert [_train_calls(s.config) for s in pipeline] == [200, 90, 30]
    fedavg = pipeline_from_dict({"stages": {"x": {"base": "fedavg.yaml"}}}, base_dir=CONFIGS).stages[0].config
    assert _train_calls(fedavg) == 320
    # every stage trains its clients alike (2 epochs per TRAIN call, as the baselines)
    assert {s.config.tree.client.train.epochs for s in pipeline} == {2}
    # k-means groups, as the file's comment says
    kmeans = load_pipeline(CONFIGS / "groupperfl.yaml", ["data.clustering={kind: kmeans, clusters: 5}"])
    assert {n.id for n in build_tree(kmeans["group"].config, placeholder_clients(kmeans["group"].config))} >= {
        f"edge-c{i}" for i in range(5)
    }


def test_merge_order_base_then_shared_then_stage_then_overrides():
    stages = {
        "a": {"base": "embedded.yaml", "seed": 5},
        "b": {"base": "fedavg.yaml", "name": "own-name", "tree": {"root": {"rounds": 3}}},
        "c": None,
    }
    shared = {"seed": 2, "tree": {"root": {"rounds": 7}}, "data": {"clients_per_language": 4}}
    p = _pipeline(stages, shared=shared)
    a, b, c = p.stages
    assert (a.config.seed, b.config.seed, c.config.seed) == (5, 2, 2)  # the stage's own key beats shared
    assert (a.config.tree.root.rounds, b.config.tree.root.rounds) == (7, 3)  # shared beats the base file
    assert b.config.tree.flat and b.config.tree.root.cohort == 20  # the rest of the base is kept
    assert {s.config.data.clients_per_language for s in p} == {4}
    assert [s.config.name for s in p] == ["p-a", "own-name", "p-c"]  # base files' names do not leak in

    q = _pipeline(stages, ["seed=9", "stages.a.seed=11", "name=q", "shared.tree.root.rounds=6"], shared=shared)
    assert [s.config.seed for s in q] == [11, 9, 9]  # every stage, then one stage
    assert q.name == "q" and q.stages[0].config.name == "q-a"
    assert [s.config.tree.root.rounds for s in q] == [6, 3, 6]  # shared.* edits the file's shared section

    assert is_pipeline({"stages": {}}) and not is_pipeline({"name": "x", "tree": {}})


def test_dump_round_trips_through_pipeline_yaml():
    p = load_pipeline(CONFIGS / "groupperfl.yaml", ["seed=1"])
    again = pipeline_from_dict(p.dump(), source="pipeline.yaml")
    assert again == p


@pytest.mark.parametrize(
    ("data", "overrides", "expected"),
    [
        ({"stages": {"a": {}}, "tree": {}}, (), "p.yaml: tree: unknown top-level key of a pipeline"),
        ({"stages": {}}, (), "stages: expected a non-empty mapping"),
        ({"stages": {"a b": {}}}, (), "stages.a b: a stage name has letters, digits and _.- only"),
        (
            {"stages": {"a": {"tree": {"edge": {"roundz": 2}}}}},
            (),
            "p.yaml: stages.a: invalid config\ntree.edge.roundz",
        ),
        ({"stages": {"a": {}}}, ["stages.a.tree.root.rounds=0"], "p.yaml: stages.a: invalid config\ntree.root.rounds"),
        ({"stages": {"a": {}}}, ["stages.zz.seed=1"], "--set stages.zz.seed=1: p.yaml has no stage 'zz'"),
        ({"stages": {"a": {}}}, ["stages.a=1"], "name a key inside one stage"),
        ({"stages": {"a": {}, "b": {"name": "p-a"}}}, (), "stages.b: name: experiment name 'p-a' is also stage 'a'"),
        ({"stages": {"a": {"base": "nope.yaml"}}}, (), "stages.a.base: config file"),
        ({"shared": {"name": "x"}, "stages": {"a": {}}}, (), "shared.name"),
        ({"stages": {"a": {"tree": {"edge": {"cohort": 50}}}}}, (), "stages.a: tree.edge.cohort: cohort of 50"),
    ],
)
def test_mistakes_name_the_stage_and_the_key(data, overrides, expected):
    with pytest.raises(ConfigError) as err:
        pipeline_from_dict({"name": "p", **data}, overrides, source="p.yaml", base_dir=CONFIGS)
    assert expected in str(err.value)


def test_duplicate_stage_names_in_the_file_are_an_error(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nstages:\n  a: {seed: 1}\n  b: {}\n  a: {seed: 2}\n")
    with pytest.raises(ConfigError, match=r"p.yaml: line 5: key 'a' is written twice"):
        read_pipeline_yaml(path)
    with pytest.raises(ConfigError, match="not found"):
        load_pipeline(tmp_path / "missing.yaml")


def test_stage_references():
    flat = {"base": "fedavg.yaml", "tree": {"root": {"rounds": 1}}}
    p = _pipeline({"a": flat, "b": {"model": {"init_from": "a:root"}}, "c": {"model": {"init_from": "b"}}})
    assert [s.source_stage for s in p] == [None, "a", "b"]
    assert with_init_from(p["b"], "/runs/p-a/1").model.init_from == "/runs/p-a/1:root"
    assert with_init_from(p["c"], "/runs/p-b/1").model.init_from == "/runs/p-b/1"
    # a run folder is not a stage: left for the flows to find and check
    q = _pipeline({"a": {"model": {"init_from": "runs/x/20260101-000000-000:root"}}})
    assert q.stages[0].source_stage is None

    def error(stages):
        with pytest.raises(ConfigError) as err:
            _pipeline(stages)
        return str(err.value)

    later = error({"a": {"model": {"init_from": "b:root"}}, "b": {}})
    assert "stages.a: model.init_from: 'b:root': stage 'b' runs later (stages run in order: a, b)" in later
    assert "cannot start from itself" in error({"a": {"model": {"init_from": "a"}}})
    other_model = error({"a": {}, "b": {"model": {"init_from": "a:root", "tiny": {"hidden_size": 32}}}})
    assert (
        "stages.b: model.init_from: 'a:root': model.tiny.hidden_size differs: 64 in stage 'a', 32 here" in other_model
    )
    other_task = error({"a": {}, "b": {"model": {"init_from": "a"}, "data": {"task": "mlm"}}})
    assert "data.task differs: 'classification' in stage 'a', 'mlm' here" in other_task
    no_node = error({"a": flat, "b": {"model": {"init_from": "a:edge-de"}}})
    assert "stages.b: model.init_from: 'a:edge-de': stage 'a' has no node 'edge-de' (its servers: root" in no_node
    assert "a side of ':' is empty" in error({"a": {}, "b": {"model": {"init_from": "a:"}}})


def test_parse_init_from():
    assert parse_init_from("runs/x/20260101-000000-000:root") == InitFrom("runs/x/20260101-000000-000", "root")
    assert parse_init_from("/abs/run") == InitFrom("/abs/run")
    assert parse_init_from("/mnt/a:b/run") == InitFrom("/mnt/a:b/run")  # what follows the last ':' has a '/'
    assert parse_init_from("/mnt/a:b/run:edge-de") == InitFrom("/mnt/a:b/run", "edge-de")
    assert parse_init_from("global") == InitFrom("global") and str(InitFrom("r", "n")) == "r:n"
    for bad in ("", " ", ":root", "run:"):
        with pytest.raises(ConfigError, match=r"model\.init_from"):
            parse_init_from(bad)


def test_config_mismatch_names_the_first_differing_key_and_ignores_init_from():
    p = _pipeline({"a": {}, "b": {"model": {"max_length": 32, "init_from": "x"}}, "c": {"model": {"init_from": "y"}}})
    a, b, c = (dump(s.config) for s in p)
    assert config_mismatch(a, b) == ("model.max_length", 64, 32)
    assert config_mismatch(a, c) is None  # only init_from differs
    assert config_mismatch({**a, "seed": 3, "tree": {}}, c) is None  # other sections may differ


def test_a_lora_run_may_start_from_a_full_run_and_nothing_else_may_differ():
    p = _pipeline(
        {
            "full": {},
            "lora": {"model": {"adapter": {"r": 4}}},
            "lora8": {"model": {"adapter": {"r": 8}}},
            "wider": {"model": {"adapter": {"r": 4}, "tiny": {"hidden_size": 32}}},
            "mlm": {"model": {"adapter": None}, "data": {"task": "mlm"}},
        }
    )
    full, lora, lora8, wider, mlm = (dump(s.config) for s in p)
    assert config_mismatch(full, lora) is None  # full -> LoRA: the source model becomes the frozen backbone
    assert config_mismatch(full, wider) == ("model.tiny.hidden_size", 64, 32)  # any other model key still counts
    assert config_mismatch(full, mlm) == ("data.task", "classification", "mlm")
    assert config_mismatch(lora, full) == ("model.adapter", lora["model"]["adapter"], None)  # LoRA -> full: no
    assert config_mismatch(lora, lora8) == ("model.adapter.r", 4, 8)  # two adapters: the same settings only
    assert config_mismatch(lora, lora) is None
    for key in ("model.adapter", "model.adapter.r"):
        assert "from a full fine-tuning run (no model.adapter)" in mismatch_reason(key)
        assert "a full run cannot start from a LoRA run" in mismatch_reason(key)
    assert mismatch_reason("model.tiny.hidden_size").startswith("the model and data.task must be the same")


def test_stage_references_check_the_adapter_rule():
    def error(stages):
        with pytest.raises(ConfigError) as err:
            _pipeline(stages)
        return str(err.value)

    assert _pipeline({"a": {}, "b": {"model": {"init_from": "a:root", "adapter": {"r": 4}}}})["b"].source_stage == "a"
    reverse = error({"a": {"model": {"adapter": {"r": 4}}}, "b": {"model": {"init_from": "a:root"}}})
    assert "stages.b: model.init_from: 'a:root': model.adapter differs: " in reverse
    assert "a full run cannot start from a LoRA run" in reverse


def test_save_backbone_writes_the_node_model_once(tmp_path):
    source = StateStore(tmp_path / "src")
    source.save("root", NodeState(model=torch.arange(5.0), rounds_done=3))
    source.save("edge-de", NodeState(model=torch.arange(5.0) + 10))
    path = tmp_path / "run" / "backbone.safetensors"
    path.parent.mkdir()
    assert save_backbone(source, "edge-de", path)
    assert torch.equal(load_backbone(path), torch.arange(5.0) + 10)
    before = path.stat().st_mtime_ns
    assert not save_backbone(source, "root", path)  # a resumed run keeps the file its workers built on
    assert path.stat().st_mtime_ns == before and torch.equal(load_backbone(path), torch.arange(5.0) + 10)
    with pytest.raises(ConfigError, match=r"model\.init_from: the source run has no saved model of node 'fr-00'"):
        save_backbone(source, "fr-00", tmp_path / "run" / "other.safetensors")


def test_copy_models_model_only_root_last(tmp_path):
    source, target = StateStore(tmp_path / "src"), StateStore(tmp_path / "dst")
    full = NodeState(
        model=torch.arange(3.0),
        opt_up={"m": torch.ones(3), "step": torch.tensor(4)},
        opt_down={"step": torch.tensor(2)},
        rounds_done=6,
        exec_caller="root:5",
        exec_start=5,
        res_seen={"up0/edge-de": 3},
    )
    source.save("root", full)
    source.save("edge-de", NodeState(model=torch.arange(3.0) + 10, rounds_done=12))
    source.save("de-00", NodeState(model=torch.arange(3.0) + 20, rounds_done=2))

    single = copy_plan(InitFrom("run", "edge-de"), ["root", "edge-de"], "root")
    assert single == {"root": "edge-de"}
    assert copy_models(source, target, single) == ["root"]
    assert torch.equal(target.load_model("root"), torch.arange(3.0) + 10) and not target.has("edge-de")

    target = StateStore(tmp_path / "dst2")
    tree_plan = copy_plan(InitFrom("run"), ["root", "edge-de", "edge-fr", "de-00", "de-01"], "root")
    assert list(tree_plan)[-1] == "root"  # written last: "the store has a root" means the copy is complete
    written = copy_models(source, target, tree_plan)
    assert written == ["edge-de", "de-00", "root"]  # nodes the source never saved start empty
    for node in written:
        copied, original = target.load(node), source.load(node)
        assert torch.equal(copied.model, original.model)
        # fresh optimisers, round 0, no residual marks (the same tensor object compares by identity)
        assert copied == NodeState(model=copied.model)
    assert not target.has("edge-fr") and not target.has("de-01")

    with pytest.raises(ConfigError, match="no saved model of node 'root'"):
        copy_models(StateStore(tmp_path / "empty"), StateStore(tmp_path / "dst3"), tree_plan)
