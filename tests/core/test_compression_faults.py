"""Compression that never hides a fault (``compression.py``): non-finite updates, secure aggregation with top-k,
rounding draws that depend on the sender and not on the device.

Engine tree (tests/core/fake_tree.py): root -> A(a1 w=1, a2 w=3), B(b1 w=2, b2 w=2); TRAIN adds a1=[1,0],
a2=[0,2], b1=[2,2], b2=[4,0], root=[0,-1]. One root round from 0: every update but b1's is 1-sparse and exact in
int8 (block 2), so a compressed round decodes to the uncompressed one.
"""

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.compression import (
    LEVELS,
    CompressParams,
    NonFiniteUpdate,
    compress_update,
    decode,
    encode,
    received_model,
    rounding_draws,
)
from bhfl_core.algorithm.engine import execute_node, send_up
from bhfl_core.algorithm.node_state import Caller, NodeResult, NodeState, RoundKey
from bhfl_core.algorithm.privacy_params import ZeroingParams
from bhfl_core.algorithm.zeroing_rule import NONFINITE, ZEROED
from bhfl_core.config.base import ConfigError
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import AddVectorHooks, settings, two_edge_tree
from tests.core.test_robust_config import tree as config_tree

INT8 = CompressParams("int8", block=2)
TOP1 = CompressParams("topk", fraction=0.5)
KEY = RoundKey("b1", 3, Caller("B", 1))
NAN_UPDATE = torch.tensor([0.5, math.nan, 0.25, -1.0])  # blocks of 2: [0.5, nan] is faulty, [0.25, -1] is not


@pytest.mark.parametrize("params", [INT8, TOP1], ids=["int8", "topk"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_update_raises_naming_the_sender_and_its_round(params, bad):
    phi = torch.zeros(4)
    theta = torch.tensor([0.5, bad, 0.25, -1.0])
    with pytest.raises(NonFiniteUpdate, match=r"^b1: its update to send up after round 3 \(called by B:1\) has 1 non"):
        compress_update(theta, phi, None, params, 0, KEY)
    feedback = torch.tensor([0.0, 0.0, math.nan, 0.0])  # a residual that is not finite is caught the same way
    with pytest.raises(NonFiniteUpdate, match="b1: "):
        compress_update(torch.ones(4), phi, feedback, params, 0, KEY)


def test_a_nonfinite_update_is_sent_as_it_is_for_the_parents_zeroing_and_the_residual_is_kept():
    phi, feedback = torch.zeros(4), torch.tensor([0.0, 0.0, 0.125, 0.0])
    theta = NAN_UPDATE - feedback
    int8 = compress_update(theta, phi, feedback, replace(INT8, nonfinite="send"), 0, KEY)
    scale = int8.payload["scale"]
    assert math.isnan(scale[0]) and scale[1].item() == pytest.approx(1.0 / LEVELS)  # the faulty block's scale: NaN
    assert int8.payload["q"][:2].tolist() == [0, 0]  # and its values 0 (a NaN cast to int8 is undefined)
    decoded = received_model(phi, int8.payload, INT8)
    assert decoded[:2].isnan().all() and decoded[2:].tolist() == [pytest.approx(0.25, abs=1 / LEVELS), -1.0]
    assert int8.feedback is feedback  # nothing of this update was delivered: the residual stays as it was
    topk = compress_update(theta, phi, None, CompressParams("topk", fraction=0.25, nonfinite="send"), 0, KEY)
    assert topk.payload["index"].tolist() == [1] and topk.payload["value"].isnan().all()  # NaN ranks first
    assert topk.feedback is None  # no residual yet: still none
    inf = encode(torch.tensor([1.0, -math.inf, 3.0, math.inf]), CompressParams("topk", fraction=0.5), 0)
    assert inf["index"].tolist() == [1, 3] and inf["value"].tolist() == [-math.inf, math.inf]


class NanHooks(AddVectorHooks):
    """b1's TRAIN diverges: its model is NaN."""

    def train(self, node, theta, key, plan):
        out = super().train(node, theta, key, plan)
        return NodeResult(torch.full_like(out.theta, math.nan)) if node.id == "b1" else out


def _tree(uplink: CompressParams | None, zeroing: bool):
    client = replace(settings(train=True), uplink=uplink)
    tree = two_edge_tree(client)
    for edge in ("A", "B"):
        node = tree[edge]
        wrappers = (ZeroingParams(math.inf),) if zeroing else ()
        aggregate = replace(node.settings.aggregate, compress=uplink, wrappers=wrappers)
        tree.nodes[edge] = replace(node, settings=replace(node.settings, aggregate=aggregate))  # type: ignore[index]
    return tree


def _run(tmp_path: Path, uplink: CompressParams | None, zeroing: bool) -> tuple[StateStore, AddVectorHooks]:
    tree = _tree(uplink, zeroing)
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = NanHooks(tree, store)
    execute_node(tree, tree.root, None, store, hooks, seed=0)
    return store, hooks


@pytest.mark.parametrize("params", [INT8, TOP1], ids=["int8", "topk"])
def test_a_diverged_client_under_a_compressing_edge_stops_the_run_naming_it(tmp_path: Path, params):
    with pytest.raises(NonFiniteUpdate, match=r"^b1: .* after round 0 \(called by B:0\)"):
        _run(tmp_path, params, zeroing=False)


@pytest.mark.parametrize("params", [INT8, TOP1], ids=["int8", "topk"])
def test_with_zeroing_at_the_edge_a_diverged_compressed_client_is_zeroed_and_counted_as_uncompressed(
    tmp_path: Path, params
):
    store, hooks = _run(tmp_path / "c", replace(params, nonfinite="send"), zeroing=True)
    plain, plain_hooks = _run(tmp_path / "u", None, zeroing=True)  # models sent as they are, b1's NaN
    assert hooks.metrics[("B", 0)][ZEROED] == hooks.metrics[("B", 0)][NONFINITE] == 1.0
    assert hooks.metrics[("A", 0)][ZEROED] == 0.0
    # B = (2 * [0, 0] (b1 zeroed: the model it was sent) + 2 * [4, 0]) / 4; A = ([1, 0] + 3 * [0, 2]) / 4
    assert store.load_model("B").tolist() == plain.load_model("B").tolist() == [2.0, 0.0]
    assert store.load_model("A").tolist() == plain.load_model("A").tolist() == [0.25, 1.5]
    assert store.load_model("root").tolist() == plain.load_model("root").tolist() == [1.125, -0.25]
    assert store.load("b1").feedback is None  # its NaN is not kept as a residual
    assert plain_hooks.metrics[("B", 0)][ZEROED] == 1.0
    assert hooks.metrics[("B", 0)]["comm/up_bytes"] == 2 * (2 + 4 if params.kind == "int8" else 8)  # the usual size


def test_zeroing_or_dp_at_the_parent_makes_its_children_send_a_nonfinite_update_and_nothing_else_does():
    t = config_tree("tree.edge.aggregate={compress: {kind: int8}, wrap: [zeroing]}")
    assert t["en-00"].settings.uplink == CompressParams("int8", nonfinite="send")
    listed = config_tree("tree.edge.aggregate={wrap: [{compress: {kind: topk}}, {zeroing: {max_norm: 3}}]}")
    assert listed["en-00"].settings.uplink == CompressParams("topk", nonfinite="send")
    plain = config_tree("tree.edge.aggregate={compress: {kind: int8}}", "tree.server.aggregate={wrap: [zeroing]}")
    assert plain["en-00"].settings.uplink == CompressParams("int8")  # zeroing above its parent does not count
    assert plain["en-00"].settings.uplink.nonfinite == "error"
    private = config_tree(
        "tree.edge.aggregate={compress: {kind: int8}}", "tree.edge.privacy={clip: 1, noise_multiplier: 1}"
    )
    assert private["en-00"].settings.uplink.nonfinite == "send"  # dp folds a non-finite update as zero, counted


@pytest.mark.parametrize(
    "overrides",
    [
        ["tree.edge.aggregate={compress: {kind: topk}}", "tree.edge.secure_aggregation={threshold: 2}"],
        ["tree.edge.aggregate={compress: {kind: topk}, wrap: [{secagg: {threshold: 2}}]}"],
    ],
)
def test_secure_aggregation_with_topk_is_refused_naming_both_keys(overrides):
    with pytest.raises(ConfigError) as err:
        config_tree(*overrides)
    message = str(err.value)
    assert message.startswith("tree.edge.aggregate.compress.kind: topk cannot be combined with tree.edge.")
    assert "secure_aggregation" in message or "wrap[0].secagg" in message
    assert "dense" in message


def test_secure_aggregation_with_int8_is_accepted():
    t = config_tree("tree.edge.aggregate={compress: {kind: int8}}", "tree.edge.secure_aggregation={threshold: 2}")
    assert t["en-00"].settings.uplink == CompressParams("int8") and t["edge-en"].settings.aggregate.secagg is not None
    assert config_tree("tree.edge.aggregate={compress: {kind: topk}}", "tree.root.secure_aggregation={threshold: 2}")


def test_int8_rounds_with_draws_from_a_cpu_generator_seeded_by_the_seed():
    x = torch.randn(10, generator=torch.Generator().manual_seed(3))
    params = CompressParams("int8", block=4)  # blocks of 4, 4, 2 (padded with zeros to 4)
    payload = encode(x, params, seed=11)
    by_hand = torch.rand((3, 4), generator=torch.Generator().manual_seed(11), dtype=torch.float32)
    assert torch.equal(rounding_draws((3, 4), 11), by_hand)
    rows = torch.cat([x, torch.zeros(2)]).view(3, 4)
    scale = rows.abs().amax(dim=1) / LEVELS
    q = torch.floor(rows / scale.view(-1, 1) + by_hand).clamp(-LEVELS, LEVELS).to(torch.int8)
    assert torch.equal(payload["q"], q.view(-1)[:10]) and torch.equal(payload["scale"], scale)
    assert torch.allclose(decode(payload, 10, params), x, atol=float(scale.max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: a CUDA generator draws other numbers")
def test_a_gpu_worker_sends_the_payload_a_cpu_worker_sends():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    cpu = encode(x, CompressParams("int8", block=64), seed=5)
    gpu = encode(x.cuda(), CompressParams("int8", block=64), seed=5)
    assert torch.equal(gpu["q"].cpu(), cpu["q"]) and torch.equal(gpu["scale"].cpu(), cpu["scale"])


CALLER = Caller("A", 0)


def _sent(node_id: str, round_: int = 0, caller: Caller = CALLER, seed: int = 0) -> torch.Tensor:
    """What ``node_id`` sends (int8) for the same update as every other sender."""
    phi = torch.zeros(64)
    theta = torch.linspace(-1.0, 1.0, 64) / 3  # values between the int8 steps: the rounding draws matter
    state = NodeState(model=theta, rounds_done=round_ + 1, exec_start=round_)
    uplink = CompressParams("int8", block=64)
    sent = send_up(state, phi, replace(settings(), uplink=uplink), RoundKey(node_id, round_, caller), seed)
    return sent.sent["q"]


def test_each_sender_round_and_caller_draws_its_own_rounding_for_the_same_update():
    a1 = _sent("a1")
    assert torch.equal(a1, _sent("a1"))  # seeded: the same sender, round and caller send the same payload
    assert not torch.equal(a1, _sent("a2"))  # two children with the same update send different payloads
    assert not torch.equal(a1, _sent("a1", round_=1))
    assert not torch.equal(a1, _sent("a1", caller=Caller("A", 1)))
    assert not torch.equal(a1, _sent("a1", seed=1))
