"""Tree settings that a node would read as nothing are refused, naming the key, instead of running another algorithm.

A user's QA pass over ``tree:`` found keys accepted where they mean nothing (a cohort or proxy training at a
client, a down step at the root or at a node that keeps no model, more residuals a round than the sender has
children) and a misnamed ``data.proxy.servers`` entry told as the root's missing proxy split. Each case is the
one-line ``ConfigError``.
"""

from pathlib import Path

import pytest

from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import load_config
from bhfl_core.config.pipeline import is_pipeline, load_pipeline
from bhfl_core.config.sweep import load_sweep
from bhfl_core.config.topology import build_tree, placeholder_clients
from bhfl_core.config.yaml_reader import read_yaml_file

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["tree.client.cohort=3"], "tree.client.cohort: 'en-00' is a client, which has no children to sample"),
        (["tree.nodes.de-01={cohort: 0.5}"], "tree.nodes.de-01.cohort: 'de-01' is a client, which has no children"),
        (["tree.client.sampling=poisson"], "tree.client.sampling: 'en-00' is a client, which has no children"),
        (["tree.client.proxy_train=true"], "tree.client.proxy_train: proxy training is for servers"),
        (["tree.nodes.ru-02={proxy_train: true}"], "tree.nodes.ru-02.proxy_train: proxy training is for servers"),
        (
            ["tree.client.persistent=false", "tree.client.eta_down=0.5"],
            "tree.client.eta_down: 'en-00' is not persistent (tree.client.persistent: false): it starts every "
            "execution from its parent's model",
        ),
        (
            ["tree.nodes.fr-03={persistent: false}", "tree.client.opt_down={kind: fedadam}"],
            "tree.client.opt_down: 'fr-03' is not persistent (tree.nodes.fr-03.persistent: false)",
        ),
        (["tree.edge.persistent=false", "tree.edge.eta_down=0"], "tree.edge.eta_down: 'edge-en' is not persistent"),
        (["tree.root.eta_down=0.5"], "tree.root.eta_down: the root has no parent: no model comes down to it"),
        (["tree.nodes.root={opt_down: {kind: interp}}"], "tree.nodes.root.opt_down: the root has no parent"),
        (
            ["tree.residuals.up=[{from: edge, to: root, k: 7}]"],
            "tree.residuals.up[0].k: 7 models a round is more than the 6 children of 'edge-en'",
        ),
        (
            ["tree.residuals.up=[{from: europe-east, to: root, k: 3}]"],
            "tree.residuals.up[0].k: 3 models a round is more than the 2 children of 'europe-east'",
        ),
        # the root trains on its proxy split (embedded.yaml): the misnamed holder is the mistake to tell
        (["data.proxy.servers=[en-00]"], "data.proxy.servers[0]: 'en-00' is not a server"),
        (["data.proxy.servers=[client]"], "data.proxy.servers[0]: 'client' is not a server"),
        (["data.proxy.servers=[edge-xx]"], "data.proxy.servers[0]: 'edge-xx' is not a server"),
        (["data.proxy.servers=['depth:4']"], "data.proxy.servers[0]: 'depth:4': no server at that depth"),
    ],
)
def test_settings_a_node_would_not_read_are_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "embedded.yaml", overrides)
    assert message in str(err.value)


def test_the_same_keys_where_they_apply_are_accepted():
    """Each refusal above is about where a key is written, not the key: the same values at a node that reads them."""
    accepted = [
        ["tree.edge.cohort=3", "tree.nodes.edge-de={cohort: 0.5}"],
        ["tree.edge.sampling=poisson", "tree.edge.cohort=0.5", "tree.client.cohort=null"],
        ["tree.client.persistent=false"],  # adopting the parent's model (eta_down 1, fedavg) is what it does
        ["tree.client.persistent=false", "tree.client.eta_down=1.0", "tree.client.opt_down={kind: fedavg}"],
        ["tree.client.eta_down=0.5", "tree.edge.persistent=false"],  # persistent clients under non-persistent edges
        ["tree.root.persistent=false", "tree.root.opt_down={kind: fedavg}", "tree.root.eta_down=1"],
        ["tree.residuals.up=[{from: edge, to: root, k: 6}]"],
        ["data.proxy.servers=[root, edge-en, 'depth:1']", "tree.nodes.edge-en={proxy_train: true}"],
    ]
    for overrides in accepted:
        config = load_config(CONFIGS / "embedded.yaml", overrides)
        tree = build_tree(config, placeholder_clients(config))
        assert tree.root.children == ("europe-west", "europe-east")
    poisson = build_tree(config := load_config(CONFIGS / "embedded.yaml", accepted[1]), placeholder_clients(config))
    assert poisson["edge-en"].settings.poisson_rate == 0.5 and poisson["en-00"].settings.poisson_rate is None
    holders = load_config(CONFIGS / "embedded.yaml", accepted[-1])
    assert build_tree(holders, placeholder_clients(holders))["edge-en"].settings.train is not None


def test_an_asynchronous_server_ignores_the_cohort_it_inherits_even_one_above_its_children():
    """docs/config.md ``mode``: at an async server ``cohort`` is not used; FedBuff calls every free child. A user
    shrinking configs/async-fedbuff.yaml (which inherits fedavg.yaml's cohort 20) to 4 clients was refused."""
    shrunk = ["data.source.languages=[en, de]", "data.clients_per_language=2"]
    with pytest.raises(ConfigError, match=r"tree\.root\.cohort: cohort of 20 is larger than the 4 children"):
        load_config(CONFIGS / "fedavg.yaml", shrunk)  # a synchronous root samples it: still refused
    config = load_config(CONFIGS / "async-fedbuff.yaml", shrunk)
    root = build_tree(config, placeholder_clients(config)).root
    assert root.settings.asynchronous is not None and root.settings.cohort is None and len(root.children) == 4


@pytest.mark.parametrize(
    ("config", "overrides", "message"),
    [
        ("embedded", ["tree.edge.buffer=3"], "tree.edge.buffer: buffer is read only by asynchronous servers"),
        ("embedded", ["tree.root.concurrency=8"], "'root' runs synchronously (tree.root.mode: sync)"),
        ("embedded", ["tree.client.staleness={kind: constant}"], "tree.client.staleness: staleness is read only"),
        ("embedded", ["tree.nodes.en-00={concurrency: 2}"], "'en-00' is a client, which never run"),
        # a per-node entry is written for that node: refused even at the default value
        ("embedded", ["tree.nodes.edge-de={buffer: 2}"], "tree.nodes.edge-de.buffer: buffer is read only"),
        # depth 1 is asynchronous with a buffer of its own: tree.server's is read by the synchronous regions only
        (
            "deep",
            ["tree.server.buffer=1", "tree.levels.1={mode: async, buffer: 1}"],
            "tree.server.buffer: buffer is read only by asynchronous servers (mode: async, FedBuff), and 'atlantic', "
            "'iberia', 'central' and 1 more run synchronously (tree.server.mode: sync); drop the key, or set it where "
            "mode: async is (one a base config sets is undone by tree.server.buffer=2)",
        ),
        # a synchronous root over configs/async-fedbuff.yaml still carries its FedBuff keys
        ("async-fedbuff", ["tree.root.mode=sync"], "tree.root.concurrency: concurrency is read only"),
        (
            "bhfl-async",
            ["tree.nodes.edge-de={cohort: 2}"],
            "tree.nodes.edge-de.cohort: 'edge-de' runs asynchronously (tree.edge.mode: async): FedBuff calls "
            "children as others finish and samples no cohort, so cohort 2 would never be used",
        ),
        ("deep", ["tree.levels.1={mode: async, cohort: 1}"], "tree.levels.1.cohort: 'west', 'east' run async"),
    ],
)
def test_a_key_only_the_other_mode_reads_is_refused_where_written(config, overrides, message):
    """``buffer``, ``concurrency``, ``staleness`` are the asynchronous engine's; a cohort is a synchronous round's."""
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / f"{config}.yaml", overrides)
    assert message in str(err.value)


def _tree(config: str, overrides: list[str]):
    loaded = load_config(CONFIGS / f"{config}.yaml", overrides)
    return build_tree(loaded, placeholder_clients(loaded))


def test_a_mode_key_is_accepted_where_one_of_its_readers_runs_in_that_mode():
    """A level's value applies to an asynchronous node among synchronous ones; a level holding the default is what a
    saved config writes; a level of no node (edge servers in a flat tree) and a level cohort are not checked."""
    mixed = _tree("embedded", ["tree.edge.buffer=3", "tree.nodes.edge-de={mode: async}"])
    assert mixed["edge-de"].settings.asynchronous.buffer == 3 and mixed["edge-en"].settings.asynchronous is None
    depth = _tree("deep", ["tree.server.buffer=1", "tree.levels.1.mode=async"])  # depth 1 reads it, depth 2 is sync
    assert depth["west"].settings.asynchronous.buffer == 1 and depth["atlantic"].settings.asynchronous is None
    assert _tree("embedded", ["tree.nodes.edge-de={mode: async, concurrency: 1}"])["edge-de"].settings.asynchronous
    defaults = _tree("embedded", ["tree.edge.buffer=2", "tree.client.staleness={}"])  # what a saved config writes
    assert defaults["edge-de"].settings.asynchronous is None
    assert _tree("fedavg", ["tree.edge.buffer=3"]).root.settings.asynchronous is None  # flat: no edge servers
    back = _tree("async-fedbuff", ["tree.root.mode=sync", "tree.root.concurrency=4", "tree.root.buffer=2"])
    assert back.root.settings.asynchronous is None and back.root.settings.cohort == 20  # the message's remedy works
    assert _tree("bhfl-async", ["tree.nodes.edge-de={cohort: null}"])["edge-de"].settings.cohort is None
    levels = _tree("deep", ["tree.levels.1.mode=async", "tree.server.cohort=1"])  # ignored at depth 1, read at 2
    assert levels["west"].settings.cohort is None and levels["atlantic"].settings.cohort == 1


def test_every_shipped_config_and_sweep_point_still_loads():
    """The checks above refuse nothing shipped (bhfl-dp-large.yaml without its DP: calibrating it takes ~15 s)."""
    for path in sorted(CONFIGS.glob("*.yaml")):
        if is_pipeline(read_yaml_file(path)):
            load_pipeline(path)
        else:
            load_config(path, ["tree.edge.privacy=null"] if path.name == "bhfl-dp-large.yaml" else [])
    points = sum(len(load_sweep(path).points) for path in sorted((CONFIGS / "sweeps").glob("*.yaml")))
    assert points == 36 + 30 + 12 + 12 + 12
