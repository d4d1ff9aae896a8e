"""A YAML boolean where a number is expected, or a number where a boolean is, is an error naming the key.

pydantic's lax mode read ``rounds: true`` as one round, ``lr: true`` as a learning rate of 1.0 and
``persistent: 1`` as true, silently. One validator of the shared base model (``bhfl_core/config/base.py``)
checks every key of every section, lists and mappings included.
"""

from pathlib import Path

import pytest
from pydantic import ValidationError

from bhfl_core.config.base import ConfigError, Strict
from bhfl_core.config.loader import load_config

EMBEDDED = Path(__file__).resolve().parents[2] / "configs" / "embedded.yaml"
NUMBER = "expected a number, got the boolean true (YAML's true/false/yes/no/on/off are booleans)"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("tree.root.rounds=true", f"tree.root.rounds: {NUMBER}"),
        ("tree.client.train.lr=true", f"tree.client.train.lr: {NUMBER}"),
        ("seed=yes", f"seed: {NUMBER}"),  # YAML 1.1: yes/on are booleans too
        ("data.sizes.median=on", f"data.sizes.median: {NUMBER}"),
        ("tree.edge.cohort=true", f"tree.edge.cohort: {NUMBER}"),  # an int or a float: neither takes a boolean
        ("runtime.workers=true", f"runtime.workers: {NUMBER}"),  # an int or "auto"
        ("tree.clock.sigma=false", "tree.clock.sigma: expected a number, got the boolean false"),
        ("tree.root.opt_up={kind: interp, alphas: [0.5, true]}", f"tree.root.opt_up.alphas: item 1: {NUMBER}"),
        ("model.adapter={rank_pattern: {query: true}}", f"model.adapter.rank_pattern: query: {NUMBER}"),
        ("tree.levels={true: {rounds: 2}}", f"tree.levels: key true: {NUMBER}"),
        ("tree.edge.persistent=1", "tree.edge.persistent: expected true or false, got the number 1"),
        (
            "tree.nodes.edge-de={persistent: 0}",
            "tree.nodes.edge-de.persistent: expected true or false, got the number 0",
        ),
        ("tree.root.proxy_train=1", "tree.root.proxy_train: expected true or false, got the number 1"),  # or "async"
        ("model.adapter={init_lora_weights: 1}", "model.adapter.init_lora_weights: expected true or false, got the"),
        ("runtime.parallel_subtrees=0.0", "runtime.parallel_subtrees: expected true or false, got the number 0.0"),
    ],
)
def test_a_boolean_for_a_number_and_a_number_for_a_boolean_are_refused(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(EMBEDDED, [override])
    assert f"\n{message}" in str(err.value)


def test_numbers_booleans_and_strings_where_they_belong_are_read_as_before(tmp_path):
    """``--set`` values and YAML files alike: PyYAML reads ``1e-3`` as a string, which stays a float's input."""
    config = load_config(
        EMBEDDED,
        [
            "tree.client.train.lr=1e-3",
            "tree.edge.cohort=0.5",
            "tree.root.persistent=false",
            "tree.server.proxy_train=async",
            "data.proxy.servers=[root, server]",
            "tree.levels.1.rounds=2",
            "model.adapter={init_lora_weights: gaussian, rank_pattern: {query: 2}}",
            "runtime.workers=3",
        ],
    )
    assert config.tree.client.train.lr == 1e-3 and config.tree.edge.cohort == 0.5
    assert config.tree.root.persistent is False and config.tree.server.proxy_train == "async"
    assert config.tree.levels[1].rounds == 2 and config.runtime.workers == 3
    assert config.model.adapter is not None and config.model.adapter.init_lora_weights == "gaussian"
    path = tmp_path / "c.yaml"
    path.write_text(
        f"base: {EMBEDDED}\ntree:\n  edge: {{cohort: 4, persistent: true}}\n  client: {{train: {{lr: 1e-3}}}}\n"
    )
    config = load_config(path, ["model.adapter={init_lora_weights: false}"])
    assert config.tree.edge.cohort == 4 and isinstance(config.tree.edge.cohort, int) and config.tree.edge.persistent
    assert config.tree.client.train.lr == 1e-3 and config.model.adapter.init_lora_weights is False


def test_a_key_that_takes_a_boolean_or_a_number_takes_both():
    """The check is the shared base model's, for any section: a union with both kinds keeps both (none ships yet)."""

    class Mixed(Strict):
        either: bool | int = 0
        number: float = 0.0

    assert Mixed(either=True).either is True and Mixed(either=3).either == 3
    with pytest.raises(ValidationError, match="number\n  Value error, expected a number, got the boolean false"):
        Mixed(number=False)
