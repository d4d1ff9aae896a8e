"""Compressed updates (``compression.py``): the compressors by hand, error feedback, and the engine's uplink.

Engine tree (tests/core/fake_tree.py): root -> A(a1 w=1, a2 w=3), B(b1 w=2, b2 w=2); TRAIN
adds a1=[1,0], a2=[0,2], b1=[2,2], b2=[4,0], root=[0,-1]. Here every client sends the top
1 of its 2 values (``topk``, fraction 0.5) with error feedback.
"""

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.compression import (
    CompressParams,
    compress_update,
    decode,
    encode,
    payload_bytes,
    received_model,
)
from bhfl_core.algorithm.contract import RoundPlan
from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.node_state import Caller, NodeState, RoundKey
from bhfl_core.algorithm.node_step import keeps_state
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import AddVectorHooks, settings, two_edge_tree
from tests.small import embedded_tree

INT8 = CompressParams("int8", block=2)
TOP1 = CompressParams("topk", fraction=0.5)
KEY = RoundKey("a1", 0, Caller("A", 0))


def test_int8_sends_one_byte_per_value_and_a_scale_per_block_and_decodes_within_one_step():
    x = torch.tensor([0.5, -1.0, 0.0, 0.0, 0.3])  # blocks of 2: [0.5, -1], [0, 0], [0.3]
    payload = encode(x, INT8, seed=7)
    assert payload["q"].dtype == torch.int8 and payload["q"].numel() == 5
    assert payload["scale"].tolist() == pytest.approx([1.0 / 127, 1.0, 0.3 / 127])  # all zero: any scale, q = 0
    assert payload_bytes(payload) == 5 + 3 * 4
    decoded = decode(payload, 5, INT8)
    step = torch.tensor([1 / 127, 1 / 127, 1e-30, 1e-30, 0.3 / 127])
    assert bool(((decoded - x).abs() < step).all())
    assert decoded[1].item() == -1.0 and decoded[4].item() == pytest.approx(0.3)  # a block's max is exact
    assert torch.equal(encode(x, INT8, seed=7)["q"], payload["q"])  # seeded
    assert any(not torch.equal(encode(x, INT8, seed=s)["q"], payload["q"]) for s in range(8, 20))


def test_int8_is_unbiased():
    x = torch.tensor([0.37, -0.81, 0.05, 1.0])
    params = CompressParams("int8", block=4)
    mean = torch.stack([decode(encode(x, params, seed=s), 4, params) for s in range(4000)]).mean(0)
    assert torch.allclose(mean, x, atol=3e-4)  # a step is 1/127; the mean of 4000 draws is within 1e-4-ish


def test_topk_keeps_the_largest_magnitudes_and_breaks_ties_by_the_lowest_index():
    x = torch.tensor([0.1, -3.0, 2.0, 0.5, -2.0])
    payload = encode(x, CompressParams("topk", fraction=0.4), seed=0)  # k = 2: -3, then 2 (index 2) over -2 (index 4)
    assert payload["index"].tolist() == [1, 2] and payload["value"].tolist() == [-3.0, 2.0]
    assert payload["index"].dtype == torch.int32 and payload_bytes(payload) == 2 * (4 + 4)
    assert decode(payload, 5, CompressParams("topk", fraction=0.4)).tolist() == [0.0, -3.0, 2.0, 0.0, 0.0]


def test_error_feedback_sends_what_earlier_payloads_left_out():
    phi = torch.tensor([10.0, 20.0])
    first = compress_update(phi + torch.tensor([1.0, 0.5]), phi, None, TOP1, 0, KEY)
    assert received_model(phi, first.payload, TOP1).tolist() == [11.0, 20.0]
    assert first.feedback is not None and first.feedback.tolist() == [0.0, 0.5]
    second = compress_update(phi + torch.tensor([0.2, 0.4]), phi, first.feedback, TOP1, 0, KEY)  # u + e = [0.2, 0.9]
    assert received_model(phi, second.payload, TOP1).tolist() == [10.0, pytest.approx(20.9)]
    assert second.feedback is not None and second.feedback.tolist() == [pytest.approx(0.2), 0.0]
    plain = compress_update(
        phi + torch.tensor([0.2, 0.4]), phi, first.feedback, replace(TOP1, error_feedback=False), 0, KEY
    )
    assert plain.feedback is None and received_model(phi, plain.payload, TOP1).tolist() == [10.0, pytest.approx(20.4)]


def _compressing_tree(client_uplink: CompressParams, persistent: bool = True):
    client = replace(settings(train=True, persistent=persistent), uplink=client_uplink)
    tree = two_edge_tree(client, root_rounds=2)
    for edge in ("A", "B"):
        node = tree[edge]
        aggregate = replace(node.settings.aggregate, compress=client_uplink)
        tree.nodes[edge] = replace(node, settings=replace(node.settings, aggregate=aggregate))  # type: ignore[index]
    return tree


@pytest.mark.parametrize("persistent", [True, False])  # the residual is the client's even when its model is not
def test_clients_send_their_top1_with_error_feedback_and_the_edges_fold_what_they_decode(tmp_path: Path, persistent):
    tree = _compressing_tree(TOP1, persistent)
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = AddVectorHooks(tree, store)
    execute_node(tree, tree.root, None, store, hooks, seed=0)
    # round 1 from phi = 0: a1 [1,0], a2 [0,2], b1 [2,0] (tie: index 0; keeps [0,2]), b2 [4,0]
    # A = [0.25, 1.5], B = (2*[2,0] + 2*[4,0]) / 4 = [3, 0]; root = [1.625, 0.75] + [0,-1]
    # round 2 from phi = [1.625, -0.25]: b1 sends top1 of [2,2] + [0,2] = [2,4]: [0,4], keeps [2,0]
    # A = phi + [0.25, 1.5] = [1.875, 1.25], B = phi + ([0,4] + [4,0]) / 2 = [3.625, 1.75]
    assert store.load_model("root").tolist() == [2.75, 0.5]
    b1 = store.load("b1")
    assert b1.feedback is not None and b1.feedback.tolist() == [2.0, 0.0]
    assert b1.sent["index"].tolist() == [1] and b1.sent["value"].tolist() == [4.0]
    assert b1.model is not None and b1.model.tolist() == [3.625, 1.75]  # its own model is not what it sent
    assert hooks.metrics[("B", 1)]["comm/up_bytes"] == 2 * 8.0  # two payloads of one int32 index and one value
    # executed again by the same caller (a crash after its commit): the payload it sent, not a new one
    again = execute_node(tree, tree["b1"], torch.tensor([1.625, -0.25]), store, hooks, 0, RoundPlan(Caller("B", 1)))
    assert again.theta.tolist() == [1.625, 3.75] and again.sent_bytes == 8


def test_a_client_keeps_its_state_for_error_feedback_only():
    client = replace(settings(train=True), persistent=False)
    assert not keeps_state(client, is_leaf=True)
    assert keeps_state(replace(client, uplink=TOP1), is_leaf=True)
    assert not keeps_state(replace(client, uplink=replace(INT8, error_feedback=False)), is_leaf=True)


def test_a_servers_compress_setting_reaches_each_of_its_children_as_their_uplink():
    tree = embedded_tree(
        "tree.edge.aggregate={compress: {kind: int8, block: 64}}", "tree.root.aggregate.compress.kind=topk"
    )
    params = CompressParams("int8", block=64)
    assert tree["edge-en"].settings.aggregate.compress == params
    assert all(tree[c].settings.uplink == params for c in tree["edge-en"].children)
    assert all(tree[s].settings.uplink == CompressParams("topk") for s in tree.root.children)
    assert tree.root.settings.uplink is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("tree.client.aggregate={compress: {kind: int8}}", "tree.client.aggregate.compress: compression is set where"),
        ("tree.edge.aggregate={compress: {kind: int4}}", "tree.edge.aggregate.compress.kind"),
        ("tree.edge.aggregate={compress: {kind: topk, fraction: 0}}", "tree.edge.aggregate.compress.fraction"),
        (
            "tree.edge.aggregate={compress: {kind: topk, fraction: 0.5}}",
            "tree.edge.aggregate.compress.fraction: 0.5 keeps ceil(0.5·n) of the update's n entries at 8 bytes",
        ),
        ("tree.root.aggregate={compress: {kind: topk, fraction: 0.99}}", "only one below 0.5 sends fewer bytes"),
    ],
)
def test_bad_compress_settings_are_rejected_naming_the_key(override, message):
    from bhfl_core.config.base import ConfigError

    with pytest.raises(ConfigError) as err:
        embedded_tree(override)
    assert message in str(err.value)


def test_topk_sends_fewer_bytes_than_the_dense_update_only_below_half_and_the_config_takes_only_those():
    """The refusal's threshold is the payload's: 8·ceil(f·n) bytes against 4·n for the n float32 values."""
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    dense = 4 * x.numel()
    for fraction, smaller in ((0.01, True), (0.49, True), (0.5, False), (0.9, False)):
        sent = payload_bytes(encode(x, CompressParams("topk", fraction=fraction), seed=0))
        assert sent == 8 * math.ceil(fraction * x.numel()) and (sent < dense) == smaller
    tree = embedded_tree("tree.edge.aggregate={compress: {kind: topk, fraction: 0.49}}")
    assert tree["edge-en"].settings.aggregate.compress == CompressParams("topk", fraction=0.49)
    assert embedded_tree("tree.edge.aggregate={compress: {kind: int8, fraction: 0.9}}")  # int8 does not read it


def test_the_communication_table_counts_payload_bytes_where_a_server_logged_them():
    from bhfl_core.analysis.communication import comm_rows

    tree = two_edge_tree(settings(train=True))
    history = {
        "A": {"comm/down_models": {0: 2.0}, "comm/up_models": {0: 2.0}, "comm/up_bytes": {0: 2.0 * (10 + 4)}},
        "B": {"comm/down_models": {0: 2.0}, "comm/up_models": {0: 2.0}},  # B's children sent float32 models
    }
    rows = {(r.node, r.direction): r.bytes for r in comm_rows(tree, history, num_params=10)}
    assert rows == {("A", "down"): 80.0, ("A", "up"): 28.0, ("B", "down"): 80.0, ("B", "up"): 80.0}
