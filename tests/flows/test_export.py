"""``bhfl export``: a node's final model as a plain transformers folder (LoRA adapters merged), or its adapters
in peft's layout (a client's personal ones too), with its tokenizer."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bhfl_core.learning.params import get_flat, set_flat
from bhfl_core.store.node_store import StateStore
from flows.cli.export import ExportError, export_model
from flows.experiment import PLAIN_CALLS, run_experiment
from tasks.context import RunContext
from tests.small import REPO, small_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("export")
    return {
        name: Path(
            run_experiment(small_config("runtime.executor=inprocess", *extra), base / name, orchestration=PLAIN_CALLS)[
                "run_path"
            ]
        )
        for name, extra in (
            ("full", ["tree.root.rounds=1"]),
            # Ditto clients: each keeps a personal model (adapters and head), exported with --personal
            ("lora", ["tree.root.rounds=1", "model.adapter={r: 4}", "tree.client.personal={mu: 0.1}"]),
        )
    }


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, vocab, (4, 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_a_full_model_exports_as_the_nodes_parameters_with_the_runs_tokenizer(runs, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = export_model(runs["full"], "edge-en", tmp_path / "edge-en")
    loaded = AutoModelForSequenceClassification.from_pretrained(out)
    assert torch.equal(get_flat(loaded), StateStore(runs["full"] / "state").load_model("edge-en"))
    manifest = RunContext.open(runs["full"]).manifest
    assert len(AutoTokenizer.from_pretrained(out)) == manifest.vocab_size
    assert sorted(loaded.config.id2label.values()) == sorted(manifest.labels)


def test_a_lora_model_exports_merged_and_predicts_as_the_adapted_model(runs, tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = export_model(runs["lora"], "root", tmp_path / "root")
    merged = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert not [n for n, _ in merged.named_parameters() if "lora_" in n]  # a plain transformers model
    ctx = RunContext.open(runs["lora"])
    adapted = ctx.build_model(0)
    set_flat(adapted, ctx.store.load_model("root"))
    adapted.eval()
    batch = _batch(ctx.manifest.vocab_size)
    with torch.no_grad():
        assert torch.allclose(merged(**batch).logits, adapted(**batch).logits, atol=1e-5)


def _node_model(run: Path, node: str, personal: bool = False):
    ctx = RunContext.open(run)
    model = ctx.training_model()
    set_flat(model, ctx.store.load_model(node, personal=personal))
    return model.eval(), ctx.manifest.vocab_size


def test_lora_adapters_export_in_peft_layout_and_load_with_peft_and_transformers(runs, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    out = export_model(runs["lora"], "root", tmp_path / "root", "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors", "base", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k or ".classifier." in k for k in keys), keys  # adapters and head only
    node, vocab = _node_model(runs["lora"], "root")
    batch = _batch(vocab)
    with torch.no_grad():
        expected = node(**batch).logits
        with_peft = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(out / "base"), out)
        base = AutoModelForSequenceClassification.from_pretrained(out / "base")
        base.load_adapter(str(out))  # transformers' PEFT integration
        # the same modules in the same order: equal to float rounding of a different code path (2e-6 measured)
        assert torch.allclose(with_peft.eval()(**batch).logits, expected, atol=1e-5)
        assert torch.allclose(base.eval()(**batch).logits, expected, atol=1e-5)
        # the config names the base it was written with: peft's Auto class finds it alone
        from peft import AutoPeftModelForSequenceClassification

        assert with_peft.peft_config["default"].base_model_name_or_path == str(out / "base")
        assert torch.allclose(
            AutoPeftModelForSequenceClassification.from_pretrained(out)(**batch).logits, expected, atol=1e-5
        )
        # the products s·B·A move the logits well beyond that tolerance (3.5e-4 measured), so a scaling (alpha/r)
        # applied twice or not at all on either side would fail the comparisons above
        for name, p in node.named_parameters():
            if "lora_B" in name:
                p.zero_()
        assert (node(**batch).logits - expected).abs().max() > 1e-4


def test_a_ditto_clients_personal_adapters_export_and_a_node_without_them_is_named(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    store = StateStore(runs["lora"] / "state")
    assert not torch.equal(store.load_model("en-01", personal=True), store.load_model("en-01"))
    out = export_model(runs["lora"], "en-01", tmp_path / "en-01", "adapter", personal=True)
    loaded = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(out / "base"), out, is_trainable=True
    )
    assert torch.equal(get_flat(loaded), store.load_model("en-01", personal=True))
    merged = export_model(runs["lora"], "en-01", tmp_path / "merged", personal=True)
    node, vocab = _node_model(runs["lora"], "en-01", personal=True)
    with torch.no_grad():
        plain = AutoModelForSequenceClassification.from_pretrained(merged).eval()
        assert torch.allclose(plain(**_batch(vocab)).logits, node(**_batch(vocab)).logits, atol=1e-5)
    with pytest.raises(ExportError, match=r"--personal: node 'root' of .* has no personal model"):
        export_model(runs["lora"], "root", tmp_path / "x", "adapter", personal=True)
    with pytest.raises(ExportError, match=r"--format adapter: .* is a full fine-tuning run"):
        export_model(runs["full"], "root", tmp_path / "x", "adapter")
    assert not (tmp_path / "x").exists()


def test_bad_export_requests_are_one_clear_message_and_leave_nothing(runs, tmp_path):
    with pytest.raises(ExportError, match=r"--node: .* has no node 'edge-xx'"):
        export_model(runs["full"], "edge-xx", tmp_path / "x")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ExportError, match=r"--to: .*taken already exists"):
        export_model(runs["full"], "root", tmp_path / "taken")
    cli = [
        sys.executable,
        "-m",
        "flows.cli.app",
        "export",
        str(runs["full"]),
        "--node",
        "nope",
        "--to",
        str(tmp_path / "y"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cli, check=False, cwd=REPO, capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "has no node 'nope'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "y").exists() and not list(tmp_path.glob(".*partial"))


def test_a_run_without_its_data_and_a_destination_under_a_file_are_one_clear_message(runs, tmp_path):
    """A run stopped before its data were prepared (a config.yaml, no data.json), a run whose data cache is gone,
    and ``--to`` under a file: each an ExportError naming it (the CLI's one line, exit 2), nothing written."""
    import shutil

    from bhfl_core.store.run_layout import CONFIG_FILE, DATA_POINTER

    early = tmp_path / "early"
    early.mkdir()
    shutil.copy(runs["full"] / CONFIG_FILE, early / CONFIG_FILE)
    with pytest.raises(ExportError, match=r"early: the run stopped before its data were prepared"):
        export_model(early, "root", tmp_path / "a")
    (early / DATA_POINTER).write_text('{"data_root": "%s"}' % (tmp_path / "gone"))
    with pytest.raises(ExportError, match=r"early: its prepared data cannot be read .*gone.manifest\.json"):
        export_model(early, "root", tmp_path / "b")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ExportError, match=r"--to: .*file is a file, not a folder"):
        export_model(runs["full"], "root", tmp_path / "file" / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["early", "file"]


def test_exporting_a_run_that_did_not_finish_says_the_model_is_its_last_saved_not_its_final(
    runs, tmp_path, monkeypatch
):
    import json
    import shutil

    from typer.testing import CliRunner

    from flows.cli.app import app

    monkeypatch.setattr(os, "environ", os.environ.copy())  # the CLI's defaults (PREFECT_HOME...) stay in this test
    failed = tmp_path / "failed"
    shutil.copytree(runs["full"], failed, ignore=shutil.ignore_patterns("transfer"))
    record = json.loads((failed / "run.json").read_text())
    (failed / "run.json").write_text(json.dumps({**record, "status": "failed"}))
    for run, out, note in ((failed, tmp_path / "a", True), (runs["full"], tmp_path / "b", False)):
        done = CliRunner().invoke(app, ["export", str(run), "--to", str(out), "--run-dir", str(tmp_path)])
        assert done.exit_code == 0 and out.is_dir()
        assert (f"note: {run} is failed: this is root's last saved model, not its final one" in done.stderr) == note


def test_what_a_named_base_lacks_outside_the_adapter_file_is_what_makes_the_export_write_its_own(tmp_path):
    """``models.missing_weights`` and the match against peft's ``modules_to_save`` (``export._under``), on folders
    saved from one head and loaded for another kind's: a classifier on an MLM checkpoint lacks its pooler beside
    its head (carried), a masked LM on a classifier checkpoint lacks its prediction head (not carried)."""
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    from bhfl_core.learning.models import missing_weights
    from flows.cli.export import _under

    dims = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 24}
    BertForMaskedLM(BertConfig(vocab_size=120, **dims)).save_pretrained(tmp_path / "mlm")
    BertForSequenceClassification(BertConfig(vocab_size=120, num_labels=3, **dims)).save_pretrained(tmp_path / "cls")
    labels, carried = ["a", "b", "c"], ["classifier", "score"]  # peft's modules_to_save for SEQ_CLS

    def lacking(folder: str, task: str) -> list[str]:
        model = small_config(f"model.name={tmp_path / folder}").model
        return [key for key in missing_weights(model, task, labels) if not _under(key, carried)]

    assert lacking("mlm", "classification") == ["bert.pooler.dense.bias", "bert.pooler.dense.weight"]
    assert lacking("cls", "classification") == []  # its head is new only in its values: carried by the adapters
    assert lacking("mlm", "mlm") == []
    assert "cls.predictions.transform.dense.weight" in lacking("cls", "mlm")
    assert _under("bert.pooler.dense.weight", ["pooler"]) and not _under("bert.pooler_x.weight", ["pooler"])
