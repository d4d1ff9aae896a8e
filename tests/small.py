"""A shrunken experiment config shared by the integration tests (same code paths, tiny sizes)."""

from pathlib import Path

from bhfl_core.config.loader import load_config

REPO = Path(__file__).resolve().parents[1]

SMALL = [
    "name=itest",
    "data.source.languages=[en, de, fr]",
    "data.clients_per_language=3",
    "data.sizes={median: 30, sigma: 0.5, min: 10, max: 60}",
    "data.proxy={train_per_language: 30, test_per_language: 20}",
    (
        "model.tiny={vocab_size: 400, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,"
        " intermediate_size: 64}"
    ),
    "model.max_length=32",
    "tree.groups={west: [en, fr], east: [de]}",
    "tree.root.rounds=2",
    "tree.edge.rounds=1",
    "tree.edge.cohort=2",
    "tree.client.train.epochs=1",
    "eval.every=1",
    # most tests read models, tables and MLflow, not figures: drawing them was about half of a small in-process run
    # (4.5-5.9 s against 9.2-9.9 s, 2 busy cores); the runs whose figures are checked turn them back on
    "eval.figures=false",
    "runtime.workers=2",
]


def small_config(*extra: str, config: str = "embedded.yaml"):
    return load_config(REPO / "configs" / config, [*SMALL, *extra])


def embedded_tree(*overrides: str, clients_per_language: int = 6):
    """The embedded default's tree with ``overrides``, built over ``clients_per_language`` clients of 10 rows each
    (no data prepared): for tests of how config keys resolve per node."""
    from bhfl_core.config.topology import ClientInfo, build_tree

    cfg = load_config(REPO / "configs" / "embedded.yaml", list(overrides))
    languages = cfg.data.source.languages
    return build_tree(
        cfg, [ClientInfo(f"{lang}-{i}", lang, 10) for lang in languages for i in range(clients_per_language)]
    )
