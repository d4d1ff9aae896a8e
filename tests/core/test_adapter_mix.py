"""``model.adapter.aggregation: exact`` in the linear steps: FedAvg's eta and residual folding combine products.

bhfl_core/algorithm/adapter_mix.py, wired into node_step.node_down / node_up / fold_residuals and marked per node
by config/adapter_settings.product_steps. Toy layouts; every expected product is formed by hand from the inputs'
factors (``s·B·A``), and the truncation is checked against a full SVD of the formed matrix (Eckart-Young).
"""

import math
from dataclasses import replace

import pytest
import torch

from bhfl_core.algorithm.adapter_fold import AdapterBlock, AdapterFold, ProductSteps
from bhfl_core.algorithm.adapter_mix import DOWN_STEP_TRUNCATION, STEP_TRUNCATION
from bhfl_core.algorithm.adapter_rule import refactorise
from bhfl_core.algorithm.aggregation import WeightedSum
from bhfl_core.algorithm.aggregation_rule import FoldedRound
from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.node_opt import NodeOptParams
from bhfl_core.algorithm.node_state import Caller, NodeState, RoundKey
from bhfl_core.algorithm.node_step import PendingResidual, node_down, node_up
from bhfl_core.algorithm.tree import NodeSettings
from bhfl_core.config.topology import build_tree, placeholder_clients
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import AddVectorHooks, settings, two_edge_tree
from tests.small import small_config

CALLER = Caller("parent", 0)
KEY = RoundKey(0, "node", 0)

# two blocks whose rank covers the whole matrix (any combination fits), then a head of 2:
# P: A 2x3 at 0, B 2x2 at 6 (s = 2); Q: A 2x2 at 10, B 3x2 at 14 (s = 0.5); head at 20
P = AdapterBlock("p", a_offset=0, b_offset=6, rank=2, fan_in=3, fan_out=2, scaling=2.0)
Q = AdapterBlock("q", a_offset=10, b_offset=14, rank=2, fan_in=2, fan_out=3, scaling=0.5)
FIT = ProductSteps((P, Q), 22)
# one block of rank 2 in a 5 x 4 matrix (a mix of two rank-2 products needs up to 4), then a head of 2
T = AdapterBlock("t", a_offset=0, b_offset=8, rank=2, fan_in=4, fan_out=5, scaling=2.0)
TRUNC = ProductSteps((T,), 20)


def _a(v, b):
    return v[b.a_offset : b.a_offset + b.rank * b.fan_in].view(b.rank, b.fan_in)


def _b(v, b):
    return v[b.b_offset : b.b_offset + b.fan_out * b.rank].view(b.fan_out, b.rank)


def _product(v, b):
    return b.scaling * _b(v, b).double() @ _a(v, b).double()


def _random(steps, seed):
    return torch.randn(steps.size, generator=torch.Generator().manual_seed(seed))


def _rotated(v, steps, angle):
    """The same products in another basis: B·G, G^T·A with G a rotation followed by a reflection."""
    c, s = math.cos(angle), math.sin(angle)
    g = torch.tensor([[c, -s], [s, c]]) @ torch.tensor([[1.0, 0.0], [0.0, -1.0]])
    out = v.clone()
    for b in steps.blocks:
        _a(out, b).copy_(g.T @ _a(v, b))
        _b(out, b).copy_(_b(v, b) @ g)
    return out


def _off(v, expected):
    """The products of ``v`` against ``expected`` (one matrix a block), relative, all blocks together."""
    num = sum(float(torch.linalg.norm(_product(v, b) - m) ** 2) for b, m in expected.items())
    return math.sqrt(num / sum(float(torch.linalg.norm(m) ** 2) for m in expected.values()))


def _down(own, phi, steps, eta=0.3, inbox=None, res_eta=None):
    res_in = (("down0", NodeOptParams(eta=res_eta)),) if res_eta is not None else ()
    settings = NodeSettings(opt_down=NodeOptParams(eta=eta), res_in=res_in, products=steps)
    state, metrics = node_down(NodeState(model=own), phi, inbox or {}, settings, CALLER)
    assert (DOWN_STEP_TRUNCATION in metrics) == (steps is not None and state.theta is not phi)  # what it mixed
    return state.theta


def _inbox(kind, model):
    total = WeightedSum()
    total.add(model, 1.0)
    return {kind: PendingResidual(total, {f"{kind}/x": 0})}


def test_eta_down_mixes_the_products_of_two_bases_not_their_factors():
    own = _random(FIT, 0)
    same = _rotated(own, FIT, 1.0)  # the parent holds the same products in another basis
    for b in FIT.blocks:
        assert torch.allclose(_product(same, b), _product(own, b), atol=1e-5)
    plain = torch.lerp(own, same, 0.3)
    truth = {b: _product(own, b) for b in FIT.blocks}  # 0.7·M + 0.3·M
    assert _off(plain, truth) > 0.3  # factor by factor the product moves although neither model's did
    mixed = _down(own, same, FIT)
    assert _off(mixed, truth) < 1e-6
    assert torch.equal(mixed[20:], plain[20:])  # the head: the plain step, bit for bit
    assert _off(_down(own, same, None), truth) == pytest.approx(_off(plain, truth))  # without exact: as before
    # any two products fit these ranks: the result is 0.7·M_own + 0.3·M_parent itself
    parent = _random(FIT, 1)
    mixed = _down(own, parent, FIT)
    assert _off(mixed, {b: 0.7 * _product(own, b) + 0.3 * _product(parent, b) for b in FIT.blocks}) < 1e-6


def test_products_spanning_at_most_r_directions_are_mixed_exactly_and_dead_rows_keep_the_plain_a():
    parent = _random(TRUNC, 2)
    fresh = _random(TRUNC, 3)
    _b(fresh, T).zero_()  # a node whose B is still zero: its product is nothing
    mixed = _down(fresh, parent, TRUNC)
    assert _off(mixed, {T: 0.3 * _product(parent, T)}) < 1e-6
    twin = _rotated(parent, TRUNC, 2.0)  # identical products in another basis
    assert _off(_down(twin, parent, TRUNC), {T: _product(parent, T)}) < 1e-6
    other = _random(TRUNC, 4)
    _b(other, T).zero_()
    both_zero = _down(fresh, other, TRUNC)  # no product at all: the plain step's A, B zero (the fold's rule)
    assert torch.equal(both_zero, torch.lerp(fresh, other, 0.3))


def test_a_mix_beyond_rank_r_is_its_best_rank_r_approximation_and_the_up_step_logs_what_it_left_out():
    own, parent = _random(TRUNC, 5), _random(TRUNC, 6)
    target = 0.4 * _product(own, T) + 0.6 * _product(parent, T)
    u, s, vh = torch.linalg.svd(target)  # the formed 5 x 4 matrix: rank 4
    best = u[:, :2] * s[:2] @ vh[:2]
    report = FoldedRound(WeightedSum(), [], {}, [])
    report.partial.add(parent, 1.0)
    settings = NodeSettings(opt_up=NodeOptParams(eta=0.6), products=TRUNC)
    state, _, metrics = node_up(NodeState(model=own), report, {}, settings, KEY)
    mixed = state.theta
    assert torch.allclose(_product(mixed, T), best, atol=1e-5)
    assert metrics[STEP_TRUNCATION] == pytest.approx(float((s[2:] ** 2).sum().sqrt() / s.norm()), rel=1e-6)
    # the singular values are split evenly between B and A, largest first (what cap_rank keeps)
    assert torch.allclose(_b(mixed, T).norm(dim=0), _a(mixed, T).norm(dim=1), rtol=1e-5)
    assert torch.allclose(_b(mixed, T).double().norm(dim=0) ** 2 * 2, s[:2], rtol=1e-5)
    assert torch.equal(mixed[18:], torch.lerp(own, parent, 0.6)[18:])
    # the same mix on the way down (eta_down 0.6 from the parent's model): the same cut, on its own metric line
    down = NodeSettings(opt_down=NodeOptParams(eta=0.6), products=TRUNC)
    state, metrics = node_down(NodeState(model=own), parent, {}, down, CALLER)
    assert torch.allclose(_product(state.theta, T), best, atol=1e-5)
    assert metrics == {DOWN_STEP_TRUNCATION: pytest.approx(float((s[2:] ** 2).sum().sqrt() / s.norm()), rel=1e-6)}


def test_a_down_steps_truncation_is_logged_with_its_executions_first_round(tmp_path):
    # edge A: 2 rounds an execution, eta_down 0.5 under exact, over a 1 x 1 "adapter" (B at 1, A at 0): its
    # products are scalars, so rank 1 leaves nothing out (0); the line comes with the first round of the execution
    # that mixes (the second: the first adopts the root's model), and only with it
    one = AdapterBlock("one", a_offset=0, b_offset=1, rank=1, fan_in=1, fan_out=1, scaling=1.0)
    tree = two_edge_tree(settings(train=True), root_rounds=2)
    edge = replace(tree["A"].settings, rounds=2, opt_down=NodeOptParams(eta=0.5), products=ProductSteps((one,), 2))
    tree.nodes["A"] = replace(tree["A"], settings=edge)  # type: ignore[index]
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.tensor([1.0, 2.0])))
    hooks = AddVectorHooks(tree, store)
    execute_node(tree, tree.root, None, store, hooks, seed=0)
    logged = {r: m.get(DOWN_STEP_TRUNCATION) for (node, r), m in hooks.metrics.items() if node == "A"}
    assert logged == {0: None, 1: None, 2: 0.0, 3: None}


def test_residual_folding_combines_products_and_base_cancels():
    own, phi, residual = _random(FIT, 7), _random(FIT, 8), _random(FIT, 9)
    residual_rotated = _rotated(residual, FIT, 0.5)
    # theta_0 = lerp(own, phi, 0.3) + (lerp(own, R, 0.5) - own): products 0.2·M_own + 0.3·M_phi + 0.5·M_R
    theta = _down(own, phi, FIT, inbox=_inbox("down0", residual_rotated), res_eta=0.5)
    by_hand = {b: 0.2 * _product(own, b) + 0.3 * _product(phi, b) + 0.5 * _product(residual, b) for b in FIT.blocks}
    assert _off(theta, by_hand) < 1e-6
    plain = torch.lerp(own, phi, 0.3) + (torch.lerp(own, residual_rotated, 0.5) - own)
    assert torch.equal(theta[20:], plain[20:])
    assert _off(plain, by_hand) > 0.1  # factor by factor
    # adopting the parent's model and a residual at eta 1 (phi + R - own): up too, at a server with eta_up 1
    report = FoldedRound(WeightedSum(), [], {}, [])
    report.partial.add(phi, 1.0)
    settings = NodeSettings(res_in=(("up0", NodeOptParams()),), products=FIT)
    state, _, metrics = node_up(NodeState(model=own), report, _inbox("up0", residual_rotated), settings, KEY)
    by_hand = {b: _product(phi, b) + _product(residual, b) - _product(own, b) for b in FIT.blocks}
    assert _off(state.theta, by_hand) < 1e-6 and metrics[STEP_TRUNCATION] < 1e-7


def test_adoption_stays_the_parents_tensor_and_other_nodes_get_no_product_steps():
    own, phi = _random(FIT, 10), _random(FIT, 11)
    assert _down(own, phi, FIT, eta=1.0) is phi  # FedAvg at eta 1 adopts the model it receives, bit for bit
    report = FoldedRound(WeightedSum(), [], {}, [])
    report.partial.add(phi, 1.0)
    state, _, metrics = node_up(NodeState(model=own), report, {}, NodeSettings(products=FIT), KEY)
    assert torch.equal(state.theta, phi) and STEP_TRUNCATION not in metrics

    exact = "model.adapter={r: 4, alpha: 8, aggregation: exact}"
    mixing = ("tree.edge.eta_down=0.3", "tree.nodes.west.eta_up=0.5", "tree.residuals.down=[{from: root, to: de-01}]")
    cfg = small_config(exact, *mixing)
    marked = {n.id for n in build_tree(cfg, placeholder_clients(cfg)) if n.settings.products is not None}
    assert marked == {"edge-en", "edge-de", "edge-fr", "west", "de-01"}
    for other in (small_config(exact), small_config("model.adapter={r: 4, alpha: 8}", *mixing)):
        assert all(n.settings.products is None for n in build_tree(other, placeholder_clients(other)))
    adam = small_config(exact, "tree.edge.opt_down={kind: fedadam}", "tree.edge.eta_down=0.3")  # stays warned
    assert all(n.settings.products is None for n in build_tree(adam, placeholder_clients(adam)))


def test_the_mix_has_the_same_bits_whatever_the_thread_count():
    """A server's step runs in the orchestrator at its thread count (cores left over by the workers), a client's in a
    worker at runtime.torch_threads: LAPACK's QR of the 3072 x 24 stack of B's gave other bits at 1 and 2 threads
    (BERT's intermediate layer's shape), the mix must not."""
    block = AdapterBlock("wide", a_offset=0, b_offset=8 * 768, rank=8, fan_in=768, fan_out=3072, scaling=2.0)
    steps = ProductSteps((block,), 8 * (768 + 3072))
    own, phi, residual = (_random(steps, seed) for seed in (12, 13, 14))
    threads = torch.get_num_threads()
    try:
        bits = []
        for n in (1, 2):
            torch.set_num_threads(n)
            bits.append(_down(own, phi, steps, inbox=_inbox("down0", residual), res_eta=1.0))  # 3 products: K = 24
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bits[0], bits[1])


def test_the_fold_refactorises_to_the_same_bits_whatever_the_callers_thread_count():
    """The fold's SVD runs in the orchestrator at the threads its cores leave over; LAPACK's SVD of a 320 x 320
    matrix gives other bits at 1, 2 and 4 threads, the refactorised model must not (one_thread.py)."""
    n, rank = 320, 4
    block = AdapterBlock("wide", a_offset=0, b_offset=rank * n, rank=rank, fan_in=n, fan_out=n, scaling=2.0)
    fold = AdapterFold("exact", (block,), 2 * rank * n)
    generator = torch.Generator().manual_seed(3)
    mean = torch.randn(2 * rank * n, generator=generator)
    mean_product = torch.randn(n * n, generator=generator)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            results.append(refactorise(fold, mean, mean_product))
            assert torch.get_num_threads() == count  # the caller's count is restored
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r[0], results[0][0]) and r[1] == results[0][1] for r in results[1:])
