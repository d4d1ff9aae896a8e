"""The task-kind registry: lookup, errors naming the task, each kind's model class, transform, scorer and metrics."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import load_config
from bhfl_core.config.schema import ModelConfig
from bhfl_core.learning import task_kinds
from bhfl_core.learning.batch_metrics import classification_batch, lm_batch
from bhfl_core.learning.local_train import grouped_confusions
from bhfl_core.learning.metrics import task_metrics
from bhfl_core.learning.mlm import MaskingSpec, grouped_lm_stats, mlm_transform
from bhfl_core.learning.models import build_model
from bhfl_core.learning.task_kinds import (
    TaskFacts,
    TaskKind,
    TaskMetrics,
    available_task_kinds,
    get_task_kind,
    register_task_kind,
)
from bhfl_core.rng import derive_seed
from data_prep.manifest import Manifest, Shard

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
TINY = ModelConfig(tiny={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32})
SPECIAL, MASK, VOCAB = (0, 1, 2, 3, 4), 4, 60


def _facts(task: str, mask_token_id: int | None = MASK, labels=("a", "b", "c")) -> TaskFacts:
    return TaskFacts(task, tuple(labels), VOCAB, SPECIAL, mask_token_id, 0.3, seed=11)


def _table(rows=13, width=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, width + 1, (rows,), generator=g)
    attention = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids = torch.randint(5, VOCAB, (rows, width), generator=g) * attention
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "token_type_ids": torch.zeros_like(ids),
        "labels": torch.randint(0, 3, (rows,), generator=g),
    }


def test_lookup_and_requirements():
    assert available_task_kinds() == ["classification", "mlm"]
    cls, mlm = get_task_kind("classification"), get_task_kind("mlm")
    assert (cls.name, cls.needs_labels, cls.needs_mask_token) == ("classification", True, False)
    assert (mlm.name, mlm.needs_labels, mlm.needs_mask_token) == ("mlm", False, True)


def test_unknown_task_names_it_and_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown task 'regression'; available: \['classification', 'mlm'\]"):
        get_task_kind("regression")
    with pytest.raises(ValueError, match="no evaluation metrics for task 'regression'"):
        task_metrics("regression")


def test_model_class_head_and_metrics_of_each_kind():
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

    cls, mlm = get_task_kind("classification"), get_task_kind("mlm")
    assert cls.model_class() is AutoModelForSequenceClassification and mlm.model_class() is AutoModelForMaskedLM
    assert cls.head(["x", "y"]) == {"num_labels": 2, "id2label": {0: "x", 1: "y"}, "label2id": {"x": 0, "y": 1}}
    assert mlm.head(["x", "y"]) == {}
    assert task_metrics("classification") is cls.metrics and task_metrics("mlm") is mlm.metrics
    assert (cls.metrics.task, cls.metrics.primary, cls.metrics.names) == (
        "classification",
        "accuracy",
        ("accuracy", "macro_f1"),
    )
    assert cls.metrics.better("macro_f1") and not mlm.metrics.better("perplexity")
    assert mlm.metrics.primary == "perplexity"
    confusions = torch.tensor([[[3, 1], [0, 2]], [[0, 0], [0, 0]]])
    for got, want in [
        (cls.metrics.batch(confusions), classification_batch(confusions)),
        (mlm.metrics.batch(torch.tensor([[6.0, 3.0]])), lm_batch(torch.tensor([[6.0, 3.0]]))),
    ]:
        assert got.keys() == want.keys()
        for k in got:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, equal_nan=True)


def test_batch_transforms_mask_like_mlm_transform_and_classification_has_none():
    assert get_task_kind("classification").batch_transform(_facts("classification", mask_token_id=None)) is None
    batch = {k: v for k, v in _table().items() if k != "labels"}
    got = get_task_kind("mlm").batch_transform(_facts("mlm"))(batch, torch.Generator().manual_seed(5))
    want = mlm_transform(MaskingSpec(SPECIAL, MASK, VOCAB, 0.3))(batch, torch.Generator().manual_seed(5))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    with pytest.raises(ValueError, match=r"the data of this run \(task 'mlm'\) has no mask token id"):
        get_task_kind("mlm").batch_transform(_facts("mlm", mask_token_id=None))


def test_scorers_are_the_grouped_statistics():
    data, groups = _table(), torch.randint(0, 3, (13,), generator=torch.Generator().manual_seed(1))
    classifier = build_model(TINY, "classification", ["a", "b", "c"], VOCAB, 0, 3)
    got = get_task_kind("classification").score(classifier, data, groups, 3, 4, CPU, _facts("classification"))
    assert torch.equal(got, grouped_confusions(classifier, data, groups, 3, 3, 4, CPU))
    lm = build_model(TINY, "mlm", [], VOCAB, 0, 3)
    got = get_task_kind("mlm").score(lm, data, groups, 3, 4, CPU, _facts("mlm"))
    want = grouped_lm_stats(
        lm,
        data,
        groups,
        3,
        4,
        CPU,
        derive_seed(11, "eval", "mlm-masks"),
        masking=MaskingSpec(SPECIAL, MASK, VOCAB, 0.3),
    )
    assert torch.equal(got, want) and float(got[:, 1].sum()) > 0


def test_registering_a_kind_makes_configs_and_manifests_accept_it(monkeypatch):
    monkeypatch.setattr(task_kinds, "_REGISTRY", dict(task_kinds._REGISTRY))
    cls = get_task_kind("classification")
    metrics = TaskMetrics("regression", lm_batch, ("loss",), {"loss": False}, "loss")
    kind = TaskKind(
        "regression",
        "AutoModelForSequenceClassification",
        lambda labels: {"num_labels": 1},
        lambda facts: None,
        cls.score,
        metrics,
    )
    assert register_task_kind(kind) is kind and get_task_kind("regression") is kind
    assert load_config(REPO / "configs" / "embedded.yaml", ["data.task=regression"]).data.task == "regression"
    with pytest.raises(ValueError, match="already registered"):
        register_task_kind(kind)
    with pytest.raises(ValueError, match="must be an identifier"):
        register_task_kind(TaskKind("not a name", "X", kind.head, kind.batch_transform, kind.score, kind.metrics))


def test_config_and_manifest_with_an_unknown_task_name_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "embedded.yaml", ["data.task=regression"])
    assert "data.task: unknown task 'regression'; available: ['classification', 'mlm']" in str(err.value)
    shard = Shard(path="x", size=0, label_hist=[])
    with pytest.raises(ValidationError) as err:
        Manifest(
            fingerprint="f",
            source="s",
            task="regression",
            labels=[],
            tokenizer="t",
            vocab_size=VOCAB,
            pad_token_id=0,
            clients=[],
            proxy_train=shard,
            proxy_test=shard,
            unused_pool_rows=0,
        )
    assert err.value.errors()[0]["loc"] == ("task",) and "unknown task 'regression'" in str(err.value)


def test_the_registry_and_the_config_schema_do_not_import_transformers():
    code = (
        "import sys, bhfl_core.learning.task_kinds; assert 'torch' not in sys.modules, 'torch'; "
        "import bhfl_core.config.schema; assert 'transformers' not in sys.modules, 'transformers'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
