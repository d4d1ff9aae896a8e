"""Nested ``tree.groups`` (trees of any depth) and per-depth settings (``tree.levels``)."""

from pathlib import Path

import pytest

from bhfl_core.algorithm.tree import Role
from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import load_config
from bhfl_core.config.topology import ClientInfo, build_tree, placeholder_clients

REPO = Path(__file__).resolve().parents[2]
MIXED = "tree.groups={europe: {west: [en, fr], south: [es]}, east: [de, ru]}"


def _tree(*overrides: str, config: str = "embedded.yaml", sizes: dict[str, int] | None = None):
    cfg = load_config(REPO / "configs" / config, list(overrides))
    sizes = sizes or {}
    clients = [
        ClientInfo(f"{lang}-{i}", lang, sizes.get(lang, 10) + i) for lang in cfg.data.source.languages for i in range(4)
    ]
    return build_tree(cfg, clients)


def test_deep_example_is_a_five_level_tree():
    cfg = load_config(REPO / "configs" / "deep.yaml")
    tree = build_tree(cfg, placeholder_clients(cfg))
    by_depth: dict[int, set[str]] = {}
    for node in tree:
        by_depth.setdefault(node.depth, set()).add(node.role.value)
    assert by_depth == {0: {"root"}, 1: {"server"}, 2: {"server"}, 3: {"edge"}, 4: {"client"}}
    assert tree.root.children == ("west", "east")
    assert tree["west"].children == ("atlantic", "iberia") and tree["east"].children == ("central", "slavic")
    assert tree["atlantic"].children == ("edge-en", "edge-fr") and tree["edge-en"].parent == "atlantic"
    assert tree.ancestors("de-00") == ["edge-de", "central", "east", "root"]
    assert tree.distance("en-00", "ru-00") == 8
    # per-depth settings: continents train on their proxy share, regions keep half of their own model
    assert all(tree[g].settings.train is not None for g in ("west", "east"))
    assert all(tree[g].settings.opt_down.eta == 0.5 for g in ("atlantic", "iberia", "central", "slavic"))
    assert tree["west"].settings.opt_down.eta == 1.0 and tree["edge-en"].settings.opt_down.eta == 1.0


def test_nested_groups_ids_parents_depths_roles_weights():
    tree = _tree(MIXED, sizes={"en": 10, "fr": 20, "es": 30, "de": 40, "ru": 50})
    expected = {  # node: (role, depth, parent, children)
        "root": (Role.ROOT, 0, None, ("europe", "east")),
        "europe": (Role.SERVER, 1, "root", ("west", "south")),
        "east": (Role.SERVER, 1, "root", ("edge-de", "edge-ru")),  # a sibling holding languages directly
        "west": (Role.SERVER, 2, "europe", ("edge-en", "edge-fr")),
        "south": (Role.SERVER, 2, "europe", ("edge-es",)),
        "edge-en": (Role.EDGE, 3, "west", ("en-0", "en-1", "en-2", "en-3")),
        "edge-es": (Role.EDGE, 3, "south", ("es-0", "es-1", "es-2", "es-3")),
        "edge-de": (Role.EDGE, 2, "east", ("de-0", "de-1", "de-2", "de-3")),
    }
    for node_id, (role, depth, parent, children) in expected.items():
        node = tree[node_id]
        assert (node.role, node.depth, node.parent, node.children) == (role, depth, parent, children), node_id
    assert tree["en-1"].depth == 4 and tree["de-1"].depth == 3 and tree["de-1"].role is Role.CLIENT
    # weights: training examples of the subtree (10+11+12+13 for en, ...)
    assert tree["edge-en"].weight == 46 and tree["west"].weight == 46 + 86
    assert tree["europe"].weight == 46 + 86 + 126 and tree["east"].weight == 166 + 206
    assert tree.root.weight == sum(c.weight for c in tree.clients())
    assert tree["europe"].group == "europe" and tree["edge-es"].group == "es"
    assert len(tree.servers()) == 1 + 4 + 5 and len(tree.clients()) == 20


def test_one_layer_groups_build_the_same_tree_as_before():
    """The one-layer form: same ids, depths, order of nodes (the determinism tests rely on it)."""
    tree = _tree()
    assert list(tree.nodes)[-3:] == ["europe-west", "europe-east", "root"]
    assert list(tree.nodes)[:6] == ["en-0", "en-1", "en-2", "en-3", "edge-en", "de-0"]
    assert {n.depth for n in tree if n.role is Role.EDGE} == {2} and {n.depth for n in tree.clients()} == {3}
    assert tree["europe-west"].children == ("edge-en", "edge-fr", "edge-es")  # the group's listed order
    flat = _tree("tree.groups={}")
    assert {n.depth for n in flat if n.role is Role.EDGE} == {1} and flat["edge-de"].parent == "root"


def test_level_then_depth_then_node_precedence():
    tree = _tree(
        MIXED,
        "tree.server.rounds=2",
        "tree.server.eta_up=0.5",
        "tree.levels.2.rounds=3",
        "tree.levels.2.opt_up={kind: fedadam}",
        "tree.nodes.south.rounds=4",
    )
    assert (tree["europe"].settings.rounds, tree["east"].settings.rounds) == (2, 2)  # tree.server
    assert tree["west"].settings.rounds == 3 and tree["south"].settings.rounds == 4  # levels, then nodes
    assert tree["west"].settings.opt_up.kind == "fedadam" and tree["europe"].settings.opt_up.kind == "fedavg"
    assert tree["west"].settings.opt_up.eta == 0.5  # keys tree.levels.2 does not set come from tree.server
    assert tree["edge-en"].settings.rounds == 2 and tree["edge-de"].settings.rounds == 2  # edges: tree.edge
    # --set reaches the integer key a YAML file wrote (levels: {2: ...}) instead of adding a second one
    cfg = load_config(REPO / "configs" / "deep.yaml", ["tree.levels.2.rounds=2"])
    assert set(cfg.tree.levels) == {1, 2}
    assert cfg.tree.levels[2].rounds == 2 and cfg.tree.levels[2].eta_down == 0.5


def test_depth_selectors_for_residuals_and_proxy_holders():
    tree = _tree(
        "tree.groups={europe: {west: [en, fr], south: [es]}, east: {central: [de], slavic: [ru]}}",
        "tree.residuals.up=[{from: edge, to: depth:1}]",
        "tree.residuals.down=[{from: root, to: depth:2}]",
        "data.proxy.servers=[root, 'depth:2']",
        "tree.levels.2.proxy_train=true",
    )
    assert [link.target for link in tree["edge-en"].settings.res_up] == ["europe"]
    assert [link.target for link in tree["edge-ru"].settings.res_up] == ["east"]
    assert [link.target for link in tree.root.settings.res_down] == ["west", "south", "central", "slavic"]
    assert dict(tree["south"].settings.res_in)["down0"] == tree["south"].settings.opt_down
    assert tree["slavic"].settings.train is not None and tree["east"].settings.train is None
    # residuals across several levels: edges straight to the root, by level name
    deep = _tree(MIXED, "tree.residuals.up=[{from: edge, to: root}]")
    assert all([link.target for link in deep[f"edge-{lang}"].settings.res_up] == ["root"] for lang in ("en", "de"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["tree.groups={europe: {west: [en, fr, xx], east: [de]}, rest: [es, ru]}"],
            "tree.groups.europe.west: language 'xx' is not in data.source.languages",
        ),
        (
            ["tree.groups={europe: {west: [en, fr], east: [de, en]}, rest: [es, ru]}"],
            "tree.groups.europe.east: language 'en' is already under group 'west'",
        ),
        (
            ["tree.groups={europe: {west: [en, fr], east: [de]}, west: [es, ru]}"],
            "tree.groups.west: group name 'west' is already used at tree.groups.europe.west",
        ),
        (["tree.groups={europe: {west: {}}, rest: [en]}"], "tree.groups.europe.west: an intermediate server needs"),
        (["tree.groups={europe: {west: []}}"], "tree.groups.europe.west: an intermediate server needs"),
        (["tree.groups={europe: {west: 3}}"], "tree.groups.europe.west: a group holds a list of languages"),
        (["tree.groups={europe: {de: [de]}}"], "tree.groups.europe.de: a group name must differ from 'root'"),
        (["tree.groups={europe: {root: [de]}}"], "tree.groups.europe.root: a group cannot be called 'root'"),
        (
            ["tree.groups={europe: {west: [en, fr]}, east: [de]}"],
            "tree.groups: languages ['es', 'ru'] are not under any intermediate server",
        ),
        (["tree.levels.0.rounds=2"], "tree.levels.0: depth 0 is the root; its settings are tree.root"),
        (["tree.levels.2.rounds=2"], "tree.levels.2: no intermediate server at depth 2 (root = 0)"),
        (["tree.groups={}", "tree.levels.1.rounds=2"], "tree.levels.1: no intermediate server at depth 1"),
        (
            [MIXED, "tree.levels.2.cohort=3"],
            "tree.levels.2.cohort: cohort of 3 is larger than the 2 children of node 'west'",
        ),
        ([MIXED, "tree.levels.1.proxy_train=true"], "tree.levels.1.proxy_train: node 'europe' has no proxy split"),
        ([MIXED, "tree.levels.2.roundz=2"], "tree.levels.2.roundz: unknown key"),
        (
            [MIXED, "tree.residuals.up=[{from: depth:3, to: root}]"],
            "tree.residuals.up[0].from: 'de-00' is a client",  # depth 3 holds edges and east's clients
        ),
        ([MIXED, "tree.residuals.down=[{from: root, to: depth:9}]"], "'depth:9' matches no node"),
        ([MIXED, "data.proxy.servers=[root, 'depth:7']"], "data.proxy.servers[1]: 'depth:7': no server at that depth"),
    ],
)
def test_nested_errors_name_the_key_path(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "embedded.yaml", overrides)
    assert message in str(err.value)
    assert "(top level)" not in str(err.value)
