"""Named federated-LoRA aggregation (``model.adapter.aggregation``), the ab-mean error, per-node ranks, peft options.

bhfl_core/algorithm/adapter_rule.py (the ``adapter`` wrapper: ``ab-mean``'s error, ``exact``),
adapter_fold.py (layout, ``cap_rank``), learning/lora_options.py (peft's options, ``ffa``).
Toys are checked against products computed by hand; models are real peft models built
from the small config.
"""

import math

import pytest
import torch

from bhfl_core.algorithm.adapter_fold import AdapterBlock, AdapterFold, ProductSteps, RankCap, cap_rank
from bhfl_core.algorithm.adapter_rule import AB_ERROR, TRUNCATION_ERROR, AdapterRule
from bhfl_core.algorithm.aggregation import WeightedSum
from bhfl_core.algorithm.aggregation_rule import FoldedRound, MeanRule
from bhfl_core.algorithm.node_opt import NodeOptParams
from bhfl_core.algorithm.node_state import Caller, NodeState, RoundKey
from bhfl_core.algorithm.node_step import PendingResidual, node_up
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.tree import NodeSettings, TrainParams
from bhfl_core.config.adapter_caveats import exact_caveats
from bhfl_core.config.base import ConfigError, SettingError
from bhfl_core.config.topology import build_tree, placeholder_clients
from bhfl_core.learning.adapter_layout import adapter_layout, with_adapter_layout
from bhfl_core.learning.local_train import train_model
from bhfl_core.learning.params import get_flat, set_flat
from tests.core.test_adapters import _lora_layers, _model
from tests.small import small_config

KEY = RoundKey(0, "edge", 0)
CPU = torch.device("cpu")

# one adapted 2 x 3 matrix (scaling s = 2) and a head of 2 values: [A (r x 3) | B (2 x r) | head]
RANK1 = AdapterBlock("toy", a_offset=0, b_offset=3, rank=1, fan_in=3, fan_out=2, scaling=2.0)
RANK2 = AdapterBlock("toy", a_offset=0, b_offset=6, rank=2, fan_in=3, fan_out=2, scaling=2.0)


def _fold(rule, models_and_weights):
    partial = rule.start(KEY.as_caller())
    for i, (model, weight) in enumerate(models_and_weights):
        rule.contribute(partial, f"c{i}", model, weight)
    return partial


def _rule(block: AdapterBlock, aggregation: str, size: int) -> AdapterRule:
    fold = AdapterFold(aggregation, (block,), size)
    rule = rule_for(AggregateParams(adapter=fold))
    assert isinstance(rule, AdapterRule) and isinstance(rule.inner, MeanRule)
    return rule


# client 1: A = [1 0 0], B = [1 2]^T, head [1 0]; client 2: A = [0 1 0], B = [3 -1]^T, head [0 1]; weights 1 and 3
C1 = torch.tensor([1.0, 0, 0, 1, 2, 1, 0])
C2 = torch.tensor([0.0, 1, 0, 3, -1, 0, 1])
# by hand: M = (1·2·B1A1 + 3·2·B2A2) / 4 = [[0.5, 4.5, 0], [1, -1.5, 0]]; mean(A) = [.25 .75 0], mean(B) = [2.5 -.25]
M = torch.tensor([[0.5, 4.5, 0.0], [1.0, -1.5, 0.0]], dtype=torch.float64)
NAIVE = 2 * torch.tensor([[2.5], [-0.25]], dtype=torch.float64) @ torch.tensor([[0.25, 0.75, 0.0]], dtype=torch.float64)


def test_ab_mean_keeps_the_mean_and_reports_its_error_against_the_hand_product():
    rule = _rule(RANK1, "ab-mean", 7)
    done = rule.finalize(_fold(rule, [(C1, 1.0), (C2, 3.0)]), KEY)
    assert torch.equal(done.input, (C1 + 3 * C2) / 4)  # the mean's bits: the wrapper only measures
    # ||M - s·mean(B)·mean(A)||² = 2·0.75² + 2·1.125² = 3.65625; ||M||² = 23.75
    assert done.metrics[AB_ERROR] == pytest.approx(math.sqrt(3.65625 / 23.75), rel=1e-6)
    assert float(torch.linalg.norm(M - NAIVE) ** 2) == pytest.approx(3.65625)


def test_exact_refactorises_the_mean_product_and_reports_what_rank_r_leaves_out():
    rule = _rule(RANK1, "exact", 7)
    done = rule.finalize(_fold(rule, [(C1, 1.0), (C2, 3.0)]), KEY)
    a, b = done.input[:3].double().view(1, 3), done.input[3:5].double().view(2, 1)
    assert torch.equal(done.input[5:], torch.tensor([0.25, 0.75]))  # the head: the mean
    # M·M^T = [[20.5, -6.25], [-6.25, 3.25]]: eigenvalues (23.75 ± sqrt(23.75² - 4·27.5625)) / 2
    small = (23.75 - math.sqrt(23.75**2 - 4 * 27.5625)) / 2
    assert done.metrics[TRUNCATION_ERROR] == pytest.approx(math.sqrt(small / 23.75), rel=1e-6)
    # the best rank-1 product (Eckart-Young): what is left of M is the smaller singular value, and nothing else
    assert float(torch.linalg.norm(M - 2 * b @ a)) == pytest.approx(math.sqrt(small), rel=1e-5)
    assert float(torch.linalg.norm(a)) == pytest.approx(float(torch.linalg.norm(b)), rel=1e-5)  # sqrt(S/s) both
    # rank 2 holds any 2 x 3 product: s·B·A is the hand mean itself
    c1 = torch.tensor([1.0, 0, 0, 0, 0, 0, 1, 0, 2, 0, 1, 0])  # A = [[1 0 0], [0 0 0]], B = [[1 0], [2 0]]
    c2 = torch.tensor([0.0, 1, 0, 0, 0, 0, 3, 0, -1, 0, 0, 1])
    rule2 = _rule(RANK2, "exact", 12)
    done2 = rule2.finalize(_fold(rule2, [(c1, 1.0), (c2, 3.0)]), KEY)
    a2, b2 = done2.input[:6].double().view(2, 3), done2.input[6:10].double().view(2, 2)
    assert torch.allclose(2 * b2 @ a2, M, atol=1e-6) and done2.metrics[TRUNCATION_ERROR] < 1e-7


def test_exact_keeps_a_alive_where_the_products_are_zero_and_folds_alike_split_and_wired():
    rule = _rule(RANK1, "exact", 7)
    zero_b = [torch.tensor([1.0, 2, 0, 0, 0, 1, 1]), torch.tensor([3.0, 0, 1, 0, 0, 0, 0])]
    done = rule.finalize(_fold(rule, [(zero_b[0], 1.0), (zero_b[1], 1.0)]), KEY)
    assert torch.equal(done.input[:5], torch.tensor([2.0, 1, 0.5, 0, 0]))  # no product: ab-mean's A, B zero
    # two workers' partials, wired and merged, give the bits of one fold
    one = rule.finalize(_fold(rule, [(C1, 1.0), (C2, 3.0)]), KEY)
    left, right = _fold(rule, [(C1, 1.0)]), _fold(rule, [(C2, 3.0)])
    into = rule.start(KEY.as_caller())
    for part in (left, right):
        rule.merge(into, rule.unwire(*rule.wire(part)))
    split = rule.finalize(into, KEY)
    assert torch.equal(split.input, one.input) and split.metrics == one.metrics
    closed = _fold(rule, [(C1, 1.0), (C2, 3.0)])
    assert rule.close(closed)
    assert torch.equal(rule.finalize(rule.unwire(*rule.wire(closed)), KEY).input, one.input)


def test_a_capped_rank_zero_pads_the_fold_and_truncates_an_exact_factorisation():
    cap = RankCap(1, (RANK2,), 12)
    # A = [[1 2 3], [4 5 6]], B = [[7 8], [9 10]], head [11 12]
    v = torch.arange(1.0, 13.0)
    assert torch.equal(cap_rank(v, cap), torch.tensor([1.0, 2, 3, 0, 0, 0, 7, 0, 9, 0, 11, 12]))
    assert cap_rank(v, None) is v
    # HetLoRA: a rank-1 child and a rank-2 child; the parent's mean is the zero-padded one, component by component
    small, big = cap_rank(v, cap), -v
    done = _rule(RANK2, "ab-mean", 12).finalize(_fold(_rule(RANK2, "ab-mean", 12), [(small, 1.0), (big, 1.0)]), KEY)
    assert torch.equal(done.input, torch.tensor([0.0, 0, 0, -2, -2.5, -3, 0, -4, 0, -5, 0, 0]))
    # FlexLoRA: an exact parent's factors are ordered by singular value, so a rank-1 child gets the best rank-1 part
    rule = _rule(RANK2, "exact", 12)
    exact = rule.finalize(_fold(rule, [(v, 1.0), (torch.flip(v, (0,)), 2.0)]), KEY).input
    child = cap_rank(exact, cap).double()
    product = 2 * child[6:10].view(2, 2) @ child[:6].view(2, 3)
    full = 2 * exact[6:10].double().view(2, 2) @ exact[:6].double().view(2, 3)
    u, s, vh = torch.linalg.svd(full)
    assert torch.allclose(product, s[0] * u[:, :1] @ vh[:1], atol=1e-5)


def test_a_capped_server_stays_at_its_rank_after_folding_an_up_residual_of_a_higher_rank():
    # a rank-1 server (RANK2 layout: [A 2x3 | B 2x2 | head 2]) with no children's change (mean = its model) and
    # an up-residual from a rank-2 node, folded by FedAvg at eta 1: theta + (residual - theta) = the residual,
    # whose second row of A and column of B must be cut like everything else the node holds
    cap = RankCap(1, (RANK2,), 12)
    own = cap_rank(torch.zeros(12), cap)
    report = FoldedRound(WeightedSum(), [], {}, [])
    report.partial.add(own, 1.0)
    residual = WeightedSum()
    residual.add(torch.arange(1.0, 13.0), 1.0)
    inbox = {"up0": PendingResidual(residual, {"up0/c9": 0})}
    settings = NodeSettings(rank=cap, res_in=(("up0", NodeOptParams()),))
    state, _, _ = node_up(NodeState(model=own), report, inbox, settings, KEY)
    # by hand: A = [[1 2 3], [0 0 0]], B = [[7 0], [9 0]], head [11 12]
    assert state.theta.tolist() == [1.0, 2, 3, 0, 0, 0, 7, 0, 9, 0, 11, 12]


def test_a_client_of_rank_r_trains_only_its_r_components():
    model = _model("model.adapter={r: 4, alpha: 8}")
    blocks, size = adapter_layout(model)
    cap = RankCap(2, blocks, size)
    start = cap_rank(torch.randn(size, generator=torch.Generator().manual_seed(3)) * 0.1, cap)
    set_flat(model, start)
    gen = torch.Generator().manual_seed(0)
    data = {
        "input_ids": torch.randint(5, 400, (16, 12), generator=gen),
        "attention_mask": torch.ones(16, 12, dtype=torch.long),
        "labels": torch.randint(0, 10, (16,), generator=gen),
    }
    train_model(model, data, TrainParams(lr=0.05, batch_size=4), seed=1, device=CPU)
    trained = get_flat(model)
    assert not torch.equal(trained, start) and torch.equal(cap_rank(trained, cap), trained)  # the rest stayed zero


def test_the_layout_locates_a_and_b_and_the_tree_gets_it_where_a_server_folds_products():
    model = _model("model.adapter={r: 4, alpha: 8}")
    blocks, size = adapter_layout(model)
    flat, params = get_flat(model), dict(model.named_parameters())
    assert size == flat.numel() and [b.name.rsplit(".", 1)[-1] for b in blocks] == ["query", "value"]
    for b in blocks:
        a, bb = params[f"{b.name}.lora_A.default.weight"], params[f"{b.name}.lora_B.default.weight"]
        assert torch.equal(flat[b.a_offset : b.a_offset + a.numel()].view_as(a), a)
        assert torch.equal(flat[b.b_offset : b.b_offset + bb.numel()].view_as(bb), bb)
        assert (b.rank, b.fan_in, b.fan_out, b.scaling) == (4, 32, 32, 2.0)
    exact = "model.adapter={r: 4, alpha: 8, aggregation: exact}"
    cfg = small_config(exact, "tree.nodes.edge-en.adapter_rank=2", "tree.edge.eta_down=0.3")
    tree = with_adapter_layout(build_tree(cfg, placeholder_clients(cfg)), model)
    servers = [n for n in tree if not n.is_leaf]
    assert all(n.settings.aggregate.adapter == AdapterFold("exact", blocks, size) for n in servers)
    assert tree["edge-de"].settings.products == ProductSteps(blocks, size) and tree["root"].settings.products is None
    assert all(n.settings.aggregate.adapter is None for n in tree if n.is_leaf)
    assert tree["edge-en"].settings.rank == RankCap(2, blocks, size) and tree["root"].settings.rank is None
    default = small_config("model.adapter={r: 4, alpha: 8}")  # ab-mean without the metric: the plain mean rule
    assert all(
        isinstance(rule_for(n.settings.aggregate), MeanRule)
        for n in build_tree(default, placeholder_clients(default))
        if not n.is_leaf
    )


def test_ffa_freezes_a_identically_everywhere_and_the_mean_of_b_is_the_mean_product():
    one, two = (_model("model.adapter={r: 4, alpha: 8, aggregation: ffa}") for _ in range(2))
    a_of = lambda m: {n: p for n, p in m.named_parameters() if ".lora_A." in n}  # noqa: E731
    assert a_of(one) and all(not p.requires_grad for p in a_of(one).values())
    assert all(torch.equal(p, a_of(two)[n]) for n, p in a_of(one).items())  # the same draws from the seed
    assert adapter_layout(one)[0] == ()  # nothing for the adapter wrapper to fold
    gen = torch.Generator().manual_seed(2)
    clients = [torch.randn(get_flat(one).numel(), generator=gen) for _ in range(2)]

    def deltas(vector):
        set_flat(one, vector)
        return {
            n: (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).double() * layer.scaling["default"]
            for n, layer in _lora_layers(one).items()
        }

    by_hand = [deltas(c) for c in clients]
    mean = rule_for(AggregateParams()).start(Caller("edge", 0))
    rule = rule_for(AggregateParams())
    rule.contribute(mean, "c0", clients[0], 1.0)
    rule.contribute(mean, "c1", clients[1], 3.0)
    merged = deltas(rule.finalize(mean, KEY).input)
    for name, delta in merged.items():
        assert torch.allclose(delta, (by_hand[0][name] + 3 * by_hand[1][name]) / 4, atol=1e-6)


def test_peft_options_reach_the_built_model():
    model = _model(
        "model.adapter={r: 4, rank_pattern: {value: 2}, alpha_pattern: {'layer.0.attention.self.query': 12},"
        " use_rslora: true, use_dora: true, init_lora_weights: gaussian, modules_to_save: [pooler]}"
    )
    config = model.peft_config["default"]
    assert config.rank_pattern == {"value": 2} and config.use_rslora and config.use_dora
    assert config.init_lora_weights == "gaussian" and "pooler" in config.modules_to_save
    layers = {name.rsplit(".", 1)[-1]: layer for name, layer in _lora_layers(model).items()}
    assert layers["value"].r == {"default": 2} and layers["query"].r == {"default": 4}
    assert layers["query"].scaling["default"] == pytest.approx(12 / 2)  # rsLoRA: alpha / sqrt(r)
    assert layers["value"].scaling["default"] == pytest.approx(16 / math.sqrt(2))
    # gaussian: A ~ N(0, 1/r), past the default's kaiming-uniform bound 1/sqrt(fan_in)
    assert float(layers["query"].lora_A["default"].weight.detach().abs().max()) > 1 / math.sqrt(32)
    default = _lora_layers(_model("model.adapter={r: 4}"))
    assert all(float(x.lora_A["default"].weight.detach().abs().max()) <= 1 / math.sqrt(32) for x in default.values())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_magnitude_vector" in n for n in trainable) and any(
        "pooler.modules_to_save" in n for n in trainable
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.adapter={rank_pattern: {valu: 2}}"], r"model\.adapter\.rank_pattern: 'valu' matches none"),
        (["model.adapter={alpha_pattern: {key: 2}}"], r"model\.adapter\.alpha_pattern: 'key' matches none"),
        (["model.adapter={modules_to_save: [poolr]}"], r"model\.adapter\.modules_to_save: no module .* 'poolr'"),
        # peft: a NoMatchingPeftModuleError traceback, and a typo beside a real name dropped silently
        (
            ["model.adapter={target_modules: [nomatch]}"],
            r"target_modules: no module .* 'nomatch' .*: classifier, dense, key",
        ),
        (["model.adapter={target_modules: [query, valeu]}"], r"model\.adapter\.target_modules: .* 'valeu'"),
        (["model.adapter={target_modules: [LayerNorm]}"], r"model\.adapter\.target_modules: Target module LayerNorm"),
    ],
)
def test_an_option_peft_would_ignore_is_refused_naming_the_key(overrides, message, tmp_path):
    from flows.cli.errors import explain

    with pytest.raises(SettingError, match=message) as err:  # found once the model is built: the run has started
        _model(*overrides)
    (tmp_path / "config.yaml").touch()  # a run folder: a resume keeps its config, so it would meet the key again
    told = explain(err.value, tmp_path)
    assert told is not None and "start a new run with the key fixed" in told and "bhfl resume" not in told


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.adapter={aggregation: fedit}"], r"model\.adapter\.aggregation: Input should be 'ab-mean', 'ffa'"),
        (["model.adapter={aggregation: ffa, error_metric: true}"], r"model\.adapter\.error_metric: it measures"),
        (
            ["model.adapter={aggregation: exact}", "tree.edge.aggregate={kind: median}"],
            r"model\.adapter\.aggregation: exact .* tree\.edge\.aggregate\.kind is median",
        ),
        (
            ["model.adapter={aggregation: exact}", "tree.edge.privacy={clip: 1.0, noise_multiplier: 1.0}"],
            r"model\.adapter\.aggregation: exact .* tree\.edge\.privacy",
        ),
        (
            ["model.adapter={aggregation: exact}", "tree.edge.mode=async"],
            r"model\.adapter\.aggregation: exact .* tree\.edge\.mode is async",
        ),
        (
            ["model.adapter={r: 4}", "tree.client.adapter_rank=8"],
            r"tree\.client\.adapter_rank: 8 is above model\.adapter\.r \(4\)",
        ),
        (["tree.nodes.edge-en.adapter_rank=2"], r"tree\.nodes\.edge-en\.adapter_rank: a LoRA rank needs LoRA adapters"),
        (
            ["model.adapter={aggregation: ffa}", "tree.client.adapter_rank=2"],
            r"tree\.client\.adapter_rank: with model\.adapter\.aggregation: ffa",
        ),
        # pissa/olora move the adapters' start out of the frozen weights: a cut would remove part of the backbone
        (
            ["model.adapter={r: 4, init_lora_weights: pissa}", "tree.nodes.en-01.adapter_rank=2"],
            r"tree\.nodes\.en-01\.adapter_rank: with model\.adapter\.init_lora_weights: pissa",
        ),
        (
            ["model.adapter={r: 4, init_lora_weights: olora}", "tree.client.adapter_rank=2"],
            r"tree\.client\.adapter_rank: with model\.adapter\.init_lora_weights: olora",
        ),
    ],
)
def test_bad_adapter_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        small_config(*overrides)


def test_fedsa_clients_keep_their_own_b_and_share_a(tmp_path):
    from dataclasses import replace

    from bhfl_core.algorithm.adapter_fold import OwnB
    from bhfl_core.algorithm.engine import execute_node
    from bhfl_core.algorithm.node_state import NodeResult, NodeState
    from bhfl_core.algorithm.tree import Node, Role, Tree
    from bhfl_core.store.node_store import StateStore
    from tests.core.fake_tree import AddVectorHooks, settings

    steps = {"c1": C1, "c2": C2}

    class Hooks(AddVectorHooks):
        def train(self, node, theta, key, plan):
            return NodeResult(theta + steps[node.id])

    client = replace(settings(train=True, persistent=False), own_b=OwnB((RANK1,), 7))
    nodes = {c: Node(c, Role.CLIENT, 1, "root", (), client, w) for c, w in (("c1", 1.0), ("c2", 3.0))}
    nodes["root"] = Node("root", Role.ROOT, 0, None, ("c1", "c2"), settings(rounds=2), 4.0)
    tree = Tree(nodes=nodes, root_id="root")
    store = StateStore(tmp_path)
    theta0 = torch.tensor([0.5, 0, 0, 1, 1, 0, 0])  # A = [.5 0 0], B = [1 1]^T
    store.save("root", NodeState(model=theta0))
    execute_node(tree, tree.root, None, store, Hooks(tree, store), seed=0)
    # round 1: each client from theta0, theta1 = theta0 + (C1 + 3 C2) / 4; round 2: each client from theta1 with
    # the B it trained in round 1 (theta0's B + its step), then its step again
    theta1 = theta0 + (C1 + 3 * C2) / 4
    b = slice(3, 5)
    for c in ("c1", "c2"):
        mine = store.load(c).theta
        expected = theta1 + steps[c]
        expected[b] = theta0[b] + 2 * steps[c][b]
        assert torch.equal(mine, expected), c
    ends = [store.load(c).theta for c in ("c1", "c2")]
    assert torch.equal(store.load("root").theta, (ends[0] + 3 * ends[1]) / 4)  # A (and the mean B) shared
    cfg = small_config("model.adapter={r: 4, aggregation: fedsa}")
    built = build_tree(cfg, placeholder_clients(cfg))
    assert all((n.settings.own_b is not None) == n.is_leaf for n in built)


def test_a_lora_run_made_before_these_keys_existed_still_warm_starts_one(tmp_path):
    import yaml

    from bhfl_core.config.schema import dump
    from bhfl_core.store.warm_start import config_mismatch
    from flows.records.warm_source import _source_config

    target = dump(small_config("model.adapter={r: 4, alpha: 8}"))
    old = {**target, "model": {**target["model"], "adapter": {"kind": "lora", "r": 4, "alpha": 8, "dropout": 0.0}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert config_mismatch(old, target) is not None  # as written, the keys added since would differ
    assert config_mismatch(_source_config("RUN", tmp_path), target) is None


def test_exact_with_a_rank_above_the_matrix_size_keeps_the_rows_without_a_direction():
    block = AdapterBlock("toy", a_offset=0, b_offset=9, rank=3, fan_in=3, fan_out=2, scaling=2.0)
    gen = torch.Generator().manual_seed(5)
    children = [torch.randn(15, generator=gen) for _ in range(2)]
    rule = _rule(block, "exact", 15)
    out = rule.finalize(_fold(rule, [(children[0], 1.0), (children[1], 1.0)]), KEY).input.double()
    a, b = out[:9].view(3, 3), out[9:].view(2, 3)
    by_hand = sum(2 * c[9:].double().view(2, 3) @ c[:9].double().view(3, 3) for c in children) / 2
    assert torch.allclose(2 * b @ a, by_hand, atol=1e-5)  # a 2 x 3 product has 2 directions: nothing truncated
    assert torch.equal(out[6:9], ((children[0][6:9] + children[1][6:9]) / 2).double())  # A's third row: the mean
    assert torch.equal(b[:, 2], torch.zeros(2))


def test_exact_warns_at_each_key_whose_step_stays_on_the_factors_and_nowhere_else():
    """Under exact the folds and the linear steps (FedAvg's eta, residual folding) combine products; each written key
    whose step still mixes two models' A and B (an optimiser other than FedAvg, down or up or on a residual, Ditto,
    error feedback, a residual accumulator averaging several models) gets one warning naming it; FedAvg at any eta
    and a down-residual received every round get none, and the same keys under ab-mean none."""
    exact = "model.adapter={r: 4, alpha: 8, aggregation: exact}"
    mixing = (
        "tree.edge.eta_down=0.3",
        "tree.nodes.west.eta_up=0.5",
        "tree.nodes.edge-fr.opt_down={kind: fedadam}",
        "tree.nodes.edge-en.opt_up={kind: fedadam}",
        "tree.residuals.up=[{from: edge, to: root}]",
        # root -> de-01: its edge samples 2 of 3 clients, so rounds pile up; root -> edge: fedadam;
        # west -> edge-en: received every round by FedAvg, exact
        "tree.residuals.down=[{from: root, to: de-01}, {from: root, to: edge, opt: {kind: fedadam}},"
        " {from: west, to: edge-en}]",
        "tree.client.personal={lr: 0.01, mu: 0.1}",
        "tree.root.aggregate={kind: mean, compress: {kind: int8}}",
    )
    warned = [w.split(": ", 1)[0] for w in exact_caveats(small_config(exact, *mixing))]
    assert sorted(warned) == sorted(
        [
            "tree.nodes.edge-fr.opt_down",
            "tree.nodes.edge-en.opt_up",
            "tree.residuals.up[0]",
            "tree.residuals.down[0]",
            "tree.residuals.down[1]",
            "tree.client.personal",
            "tree.root.aggregate",
        ]
    )
    linear = ("tree.edge.eta_down=0.3", "tree.nodes.west.eta_up=0.5", "tree.residuals.down=[{from: west, to: edge-en}]")
    assert exact_caveats(small_config(exact, *linear)) == []
    assert (
        exact_caveats(
            small_config(exact, "tree.root.aggregate={kind: mean, compress: {kind: int8, error_feedback: false}}")
        )
        == []
    )
    assert exact_caveats(small_config("model.adapter={r: 4, alpha: 8}", *mixing)) == []


def test_an_adapted_embedding_is_located_folded_capped_and_frozen_like_a_linear_layer():
    """peft keeps an embedding's A and B as parameters (``lora_embedding_A``, ``r x vocab``; ``_B``, ``dim x r``) and
    adds ``(B·A)^T``: the layout locates them, so exact folds, rank caps and FedSA's own B cover the embedding too
    (they left it to the plain mean of A and B), and ffa freezes its A."""
    adapter = "model.adapter={r: 4, alpha: 8, target_modules: [query, value, word_embeddings]}"
    model = _model(adapter)
    set_flat(model, torch.randn(get_flat(model).numel(), generator=torch.Generator().manual_seed(3)))
    blocks, size = adapter_layout(model)
    assert [b.name.rsplit(".", 1)[-1] for b in blocks] == ["word_embeddings", "query", "value"]
    embedding, flat = blocks[0], get_flat(model)
    assert (embedding.rank, embedding.fan_in, embedding.fan_out, embedding.scaling) == (4, 400, 32, 2.0)
    a = flat[embedding.a_offset : embedding.a_offset + 4 * 400].view(4, 400).double()
    b = flat[embedding.b_offset : embedding.b_offset + 32 * 4].view(32, 4).double()
    layer = _lora_layers(model)[embedding.name]
    assert torch.allclose(2.0 * b @ a, layer.get_delta_weight("default").double().T, atol=1e-6)  # peft's own update
    capped = cap_rank(flat, RankCap(2, blocks, size)).view(-1)
    assert not capped[embedding.a_offset + 2 * 400 : embedding.a_offset + 4 * 400].any()  # A's rows 2, 3
    assert not capped.view(-1)[embedding.b_offset : embedding.b_offset + 128].view(32, 4)[:, 2:].any()  # B's columns
    ffa = _model(adapter.replace("}", ", aggregation: ffa}"))
    assert not [n for n, p in ffa.named_parameters() if "lora_embedding_A" in n and p.requires_grad]
    assert adapter_layout(ffa)[0] == ()
