"""``bhfl export``: a node's final model as a plain transformers folder (LoRA adapters merged), with its tokenizer."""

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
        for name, extra in (("full", ["tree.root.rounds=1"]), ("lora", ["tree.root.rounds=1", "model.adapter={r: 4}"]))
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
