"""``data.source.kind: prepared``: a federated dataset already in bhfl's prepared form, used in place.

The folder is written here the way an outside tool would (``datasets`` ``save_to_disk``
shards and a ``Manifest``), with the shape of the throughput workload: shards of
``input_ids`` and ``labels`` only (no attention mask, no token types), empty client
test splits, and the held-out test set as the proxy test split. It goes through the
real ``prepare_data`` path, then into training and the grouped evaluation.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from datasets import Dataset, Features, Sequence, Value

from bhfl_core.config.base import ConfigError
from bhfl_core.learning.local_train import grouped_confusions, planned_steps, train_model
from data_prep.manifest import MANIFEST_NAME, ClientEntry, Manifest, Shard
from data_prep.prepare import preflight, prepare_data
from tasks.context import RunContext
from tests.small import small_config

LANGUAGES = ("en", "de", "fr")  # small_config's languages: its tree.groups name them
SEQ, VOCAB, LABELS = 16, 50, 4
FEATURES = Features({"input_ids": Sequence(Value("int64"), length=SEQ), "labels": Value("int64")})
CPU = torch.device("cpu")


def write_folder(folder, proxy_test=12):
    """A prepared folder: 2 clients per language (train only, empty test shards), a proxy test split."""
    rng = np.random.default_rng(0)

    def shard(n, relative):
        labels = rng.integers(0, LABELS, n)
        Dataset.from_dict(
            {"input_ids": rng.integers(2, VOCAB, (n, SEQ)).tolist(), "labels": labels.tolist()}, features=FEATURES
        ).save_to_disk(str(folder / relative))
        return Shard(path=relative, size=n, label_hist=np.bincount(labels, minlength=LABELS).tolist())

    clients = [
        ClientEntry(
            id=f"{lang}-{j:02d}",
            language=lang,
            edge=f"edge-{lang}",
            cluster=lang,
            train=shard(10 + 7 * j, f"clients/{lang}-{j:02d}/train"),
            test=shard(0, f"clients/{lang}-{j:02d}/test"),
        )
        for lang in LANGUAGES
        for j in range(2)
    ]
    Manifest(
        fingerprint="outside-0001",
        source="an outside tool",
        task="classification",
        labels=[f"t{k}" for k in range(LABELS)],
        tokenizer="none (token ids)",
        vocab_size=VOCAB,
        pad_token_id=0,
        clients=clients,
        proxy_train=shard(0, "proxy/train"),
        proxy_test=shard(proxy_test, "proxy/test"),
        unused_pool_rows=0,
    ).write(folder)
    return folder


def prepared_config(path, *extra, languages="[en, de, fr]"):
    return small_config(f"data.source={{kind: prepared, path: '{path}', languages: {languages}}}", *extra)


def test_folder_is_used_in_place_for_training_and_evaluation(tmp_path):
    folder = write_folder(tmp_path / "outside")
    cfg = prepared_config(folder)
    logs: list[str] = []
    prepared = prepare_data(cfg, tmp_path / "cache", log=logs.append)
    assert prepared.cached and prepared.root == folder.resolve()
    assert prepared.manifest.fingerprint == "outside-0001"
    assert not (tmp_path / "cache").exists()  # nothing loaded, partitioned, tokenised or copied
    assert any("prepared data" in line and "no tokenisation" in line for line in logs)

    ctx = RunContext(tmp_path / "run", cfg, prepared.root, prepared.manifest)
    tree = ctx.tree  # edges and clusters from the manifest; tree.groups over the source's languages
    assert tree["edge-de"].parent == "east" and tree["edge-fr"].parent == "west"
    assert tree["edge-en"].children == ("en-00", "en-01")

    client = ctx.manifest.clients.by_id("fr-01")
    data = ctx.shard(client.train.path)
    assert set(data) == {"input_ids", "labels"}  # no attention_mask / token_type_ids
    model = ctx.build_model(cfg.seed)
    before = [p.detach().clone() for p in model.parameters()]
    params = tree["fr-01"].settings.train
    result = train_model(model, data, params, seed=1, device=CPU)
    assert result.steps == planned_steps(client.train.size, params) and np.isfinite(result.loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

    names, tests, groups = ctx.test_sets("proxy")  # every client test split is empty
    assert names == [c.id for c in prepared.manifest.clients] + ["proxy"]
    assert len(tests["labels"]) == 12 and set(groups.tolist()) == {len(names) - 1}
    confusion = grouped_confusions(model, tests, groups, len(names), LABELS, batch_size=5, device=CPU)
    assert confusion[:-1].sum() == 0 and confusion[-1].sum() == 12


def test_relative_path_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    write_folder(tmp_path / "data" / "outside")
    monkeypatch.chdir(tmp_path)
    prepared = prepare_data(prepared_config("data/outside"), tmp_path / "cache", log=lambda _: None)
    assert prepared.root == (tmp_path / "data" / "outside").resolve()


def _no_manifest(folder):
    (folder / MANIFEST_NAME).unlink()


def _not_json(folder):
    (folder / MANIFEST_NAME).write_text("{ this is not json")


def _no_clients_key(folder):
    data = json.loads((folder / MANIFEST_NAME).read_text())
    del data["clients"]
    (folder / MANIFEST_NAME).write_text(json.dumps(data))


def _shard_gone(folder):
    shutil.rmtree(folder / "clients" / "de-01" / "train")


def _shard_not_saved_by_datasets(folder):
    (folder / "proxy" / "test" / "state.json").unlink()


@pytest.mark.parametrize(
    "damage, pattern",
    [
        (_no_manifest, r"^data.source.path: .*outside has no manifest.json; it must be a prepared-data folder"),
        (_not_json, r"^data.source.path: .*outside/manifest.json is not a valid manifest \(top level: Invalid JSON"),
        (_no_clients_key, r"^data.source.path: .*manifest.json is not a valid manifest \(clients: Field required\)"),
        (_shard_gone, r"^data.source.path: shard\(s\) named in .*manifest.json are missing, .*: clients/de-01/train$"),
        (_shard_not_saved_by_datasets, r"^data.source.path: .*\(no state.json\).*: proxy/test$"),
    ],
)
def test_a_damaged_folder_is_one_line_naming_the_key_and_the_file(tmp_path, damage, pattern):
    folder = write_folder(tmp_path / "outside")
    damage(folder)
    cfg = prepared_config(folder)
    for check in (
        lambda: prepare_data(cfg, tmp_path / "cache", log=lambda _: None),
        lambda: preflight(cfg, tmp_path / "cache"),
    ):  # the CLI's check before anything starts
        with pytest.raises(ConfigError, match=pattern) as err:
            check()
        assert "\n" not in str(err.value)


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.source.path: .*nowhere does not exist"):
        prepare_data(prepared_config(tmp_path / "nowhere"), tmp_path / "cache", log=lambda _: None)
    (tmp_path / "manifest.json").write_text("{}")  # the manifest given instead of its folder
    with pytest.raises(ConfigError, match=r"^data.source.path: .*manifest.json is a file; it must be a prepared-data"):
        prepare_data(prepared_config(tmp_path / "manifest.json"), tmp_path / "cache", log=lambda _: None)


@pytest.mark.parametrize(
    "extra, languages, pattern",
    [
        (
            (),
            "[en, de]",
            r"^data.source.languages: \['de', 'en'\] but the clients of .* have languages \['de', 'en', 'fr'\]",
        ),
        (("data.task=mlm",), "[en, de, fr]", r"^data.task: 'mlm' but the data in .* is for task 'classification'"),
    ],
)
def test_config_must_match_the_manifest(tmp_path, extra, languages, pattern):
    folder = write_folder(tmp_path / "outside")
    cfg = prepared_config(folder, "tree.groups={}", *extra, languages=languages)
    with pytest.raises(ConfigError, match=pattern):
        prepare_data(cfg, tmp_path / "cache", log=lambda _: None)


@pytest.mark.parametrize(
    "source, key",
    [
        ("{kind: prepared, languages: [en]}", "path"),
        ("{kind: prepared, path: somewhere}", "languages"),
    ],
)
def test_path_and_languages_are_required(source, key):
    # (the location may carry the union's tag, data.source.prepared.<key>: bhfl_core/config/loader.py's _UNIONS)
    with pytest.raises(ConfigError, match=rf"data\.source\.(prepared\.)?{key}: Field required"):
        small_config(f"data.source={source}", "tree.groups={}")


@pytest.mark.integration
def test_an_experiment_runs_end_to_end_on_a_prepared_folder(tmp_path):
    """The whole pipeline (no Prefect, this process's worker): training, evaluation with empty client
    test splits, report."""
    from flows.experiment import PLAIN_CALLS, run_experiment

    folder = write_folder(tmp_path / "outside")
    cfg = prepared_config(
        folder, "tree.root.rounds=1", "tree.root.proxy_train=false", "eval.every=0", "runtime.executor=inprocess"
    )
    result = run_experiment(cfg, tmp_path / "runs", orchestration=PLAIN_CALLS)
    assert 0.0 <= result["headline"]["root/proxy/accuracy"] <= 1.0  # the proxy test split is scored
    assert not (tmp_path / "runs" / "cache").exists()

    from mlflow import MlflowClient

    tags = MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.tags
    assert tags["bhfl.data_fingerprint"] == "outside-0001"  # the manifest's, not the folder's name

    with pytest.raises(ConfigError, match="has no proxy train split"):  # proxy training needs a proxy train split
        run_experiment(
            prepared_config(folder, "tree.root.rounds=1", "runtime.executor=inprocess"),
            tmp_path / "runs",
            orchestration=PLAIN_CALLS,
        )
