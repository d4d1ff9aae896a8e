"""The report's figures stay readable and bounded at scale: 4,000 clients draw a figure of the size 400 do."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from bhfl_core.analysis.eval_plan import EvalPlan
from bhfl_core.analysis.evaluation import Evaluation
from bhfl_core.analysis.matrix_axes import ModelRef, client_order
from bhfl_core.analysis.model_values import MatrixBuilder, Scored
from bhfl_core.analysis.proximity import analyse
from data_prep.figures import save_png
from flows.tracking import plots
from tests.core.test_eval_plan import CLS, big_tree


def evaluation(clients_per_edge: int) -> Evaluation:
    """Every server and every client's model of a 2 x 2-edge tree, each client's model on its plan (8 a ring)."""
    tree = big_tree(2, 2, clients_per_edge)
    plan = EvalPlan(tree, seed=0, clients=None, per_ring=8)
    builder = MatrixBuilder(tree, CLS)
    rng = np.random.default_rng(0)
    values = []
    for node in tree:
        targets = plan.server_targets() if not node.is_leaf else plan.client_targets(node.id)
        assert targets is not None
        right = torch.from_numpy(rng.integers(0, 11, len(targets.clients) + 1))
        blocks = torch.zeros(len(targets.clients) + 1, 2, 2, dtype=torch.int64)
        blocks[:, 0, 0], blocks[:, 0, 1] = right, 10 - right
        values.append(builder.values(Scored(ModelRef.of_node(node.id), targets.clients, targets.weights, blocks)))
    return Evaluation(tree, CLS, values)


def drawn(ev: Evaluation, folder) -> dict[str, tuple[tuple[int, int], int]]:
    """Each figure's PNG size in pixels and its SVG's bytes."""
    prox = analyse(ev)
    figures = {
        "heatmap": plots.heatmap(ev),
        "proximity": plots.proximity_plot(ev, prox),
        "clients_histogram": plots.clients_histogram(ev),
    }
    out = {}
    for name, fig in figures.items():
        save_png(fig, folder / f"{name}.png")
        with Image.open(folder / f"{name}.png") as image:
            out[name] = (image.size, (folder / f"{name}.svg").stat().st_size)
    return out


def test_figures_do_not_grow_with_the_clients(tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir()
    large.mkdir()
    few = drawn(evaluation(100), small)  # 400 clients: past the heatmap's cell-per-client limit already
    many = drawn(evaluation(1000), large)  # 4,000 clients, 4,000 client models, ~10^5 (model, client) pairs
    assert len(client_order(big_tree(2, 2, 1000))) == 4000
    for name, ((width, height), svg) in many.items():
        (w0, h0), _ = few[name]
        assert width <= 1.05 * w0 and height <= 1.05 * h0, (name, few[name], many[name])
        # a scatter shows at most MAX_POINTS points (4,000 pairs reach it): a few MB of SVG at most
        assert width * height <= 12_000_000 and svg <= 3_000_000, (name, few[name], many[name])
    assert many["heatmap"][1] <= 2 * few["heatmap"][1]  # a cell per edge server, not per client
