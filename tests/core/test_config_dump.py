"""A config dumped and read back (a run's config.yaml on resume, a sweep point or pipeline stage inside its flow,
a served deployment's parameters) builds the same tree as the config it came from.

Per-node and per-depth entries inherit what they leave out from the level, and ``cohort: null`` written in one
means "all children": a dump that wrote every key of an entry turned each inherited cohort into all children
(a resumed run trained other cohorts than the run it resumed).
"""

from bhfl_core.config.loader import config_from_dict
from bhfl_core.config.schema import dump
from bhfl_core.config.sweep import config_hash
from bhfl_core.config.topology import ClientInfo, build_tree
from bhfl_core.config.tree_schema import NodeOverride
from tests.small import small_config

OVERRIDES = ("tree.nodes.edge-de={eta_down: 0.5}", "tree.levels={1: {rounds: 2}}", "tree.edge.cohort=2")


def _cohorts(config) -> dict[str, int | float | None]:
    clients = [ClientInfo(f"{lang}-{i}", lang, 10) for lang in ("en", "de", "fr") for i in range(3)]
    tree = build_tree(config, clients)
    return {node_id: node.settings.cohort for node_id, node in tree.nodes.items()}


def test_an_entry_that_leaves_the_cohort_out_keeps_the_levels_after_a_dump():
    config = small_config(*OVERRIDES)
    again = config_from_dict(dump(config), [], source="config.yaml")
    assert _cohorts(config)["edge-de"] == 2  # inherited from tree.edge
    assert _cohorts(again) == _cohorts(config)
    assert dump(config)["tree"]["nodes"]["edge-de"] == {"eta_down": 0.5}  # what was written, nothing more


def test_a_written_cohort_null_still_means_all_children_after_a_dump():
    config = small_config("tree.nodes.edge-de={eta_down: 0.5, cohort: null}", "tree.edge.cohort=2")
    again = config_from_dict(dump(config), [], source="config.yaml")
    assert _cohorts(config)["edge-de"] is None and _cohorts(again)["edge-de"] is None
    assert _cohorts(again)["edge-en"] == 2
    assert config_hash(config) != config_hash(small_config("tree.nodes.edge-de={eta_down: 0.5}", "tree.edge.cohort=2"))


def test_a_run_saved_by_an_earlier_version_resumes_with_the_cohorts_it_started_with():
    """Its config.yaml lists every key of each entry, ``cohort: null`` among them."""
    config = small_config(*OVERRIDES)
    saved = dump(config)
    for section in ("nodes", "levels"):
        for entry in saved["tree"][section].values():
            entry.update({key: entry.get(key) for key in NodeOverride.model_fields})
    assert saved["tree"]["nodes"]["edge-de"]["cohort"] is None
    assert _cohorts(config_from_dict(saved, [], source="config.yaml")) == _cohorts(config)


def test_the_sweep_hash_is_the_one_runs_recorded_before_the_dump_changed():
    """Taken by the earlier code over every key of each entry: a sweep resumed across the change still finds
    its finished runs."""
    assert config_hash(small_config(*OVERRIDES[:2])) == "bbe8fad511bb498a"
