"""A LoRA run warm-started from a full fine-tuning run (``model.init_from``; bhfl_core/store/warm_start.py).

Three small runs in this process: ``full`` (no adapter), ``lora`` (``model.adapter``,
``model.init_from`` = ``full``, tree-shaped: the root's model is the backbone) and
``offset`` (LoRA, no warm start, ``model.init_seed_offset: 1``: its initial model is
seeded apart from the backbone its workers train on, which export must use).
"""

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from bhfl_core.config.base import ConfigError
from bhfl_core.learning.models import build_model
from bhfl_core.learning.params import get_flat, set_flat
from bhfl_core.store.node_store import StateStore
from bhfl_core.store.run_layout import BACKBONE_FILE
from bhfl_core.store.transfer import TensorRef, Transfer
from bhfl_core.store.warm_start import load_backbone
from flows.cli.export import export_model
from flows.experiment import PLAIN_CALLS, run_experiment
from flows.records.warm_source import resolve_init_from, saved_nodes, warm_start
from tasks.context import RunContext
from tasks.worker import _model_key
from tests.small import small_config

pytestmark = pytest.mark.integration

SMALL_RUN = ["runtime.executor=inprocess", "runtime.transfer=run_folder", "tree.root.rounds=1", "eval.every=0"]
LORA = "model.adapter={r: 4}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("backbone")

    def run(name: str, *extra: str) -> Path:
        config = small_config(f"name={name}", *SMALL_RUN, *extra)
        return Path(run_experiment(config, base, orchestration=PLAIN_CALLS)["run_path"])

    full = run("full")
    return {
        "full": full,
        "lora": run("lora", LORA, f"model.init_from={full}"),
        "offset": run("offset", LORA, "model.init_seed_offset=1"),
    }


def _base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A peft model's frozen weights under the plain model's names (no adapters, not the trained head copy)."""
    return {
        name.replace(".base_layer", "").replace(".original_module", ""): p.detach()
        for name, p in model.get_base_model().named_parameters()
        if "lora_" not in name and "modules_to_save" not in name
    }


def _full_model(run: Path) -> dict[str, torch.Tensor]:
    """The full run's root model, by parameter name."""
    model = RunContext.open(run).training_model()
    set_flat(model, StateStore(run / "state").load_model("root"))
    return {n: p.detach() for n, p in model.named_parameters()}


def test_the_full_runs_root_is_the_frozen_backbone_and_only_adapters_are_stored(runs):
    source = StateStore(runs["full"] / "state").load_model("root")
    backbone = runs["lora"] / BACKBONE_FILE
    assert torch.equal(load_backbone(backbone), source)
    ctx = RunContext.open(runs["lora"])
    full = _full_model(runs["full"])
    frozen = _base_weights(ctx.build_model(ctx.config.seed))
    assert frozen.keys() == full.keys()
    assert all(torch.equal(p, full[n]) for n, p in frozen.items())
    # every saved node holds the adapters and the head only: no full-model state was copied
    adapters = get_flat(ctx.training_model()).numel()
    nodes = saved_nodes(ctx.store)
    assert "root" in nodes and len(nodes) > 4
    assert {ctx.store.load_model(n).numel() for n in nodes} == {adapters}
    assert adapters < source.numel() / 20
    # a resume warm-starts again only while the root is unsaved; even then the backbone is kept as it is
    before = backbone.stat().st_mtime_ns
    assert warm_start(ctx) == [] and backbone.stat().st_mtime_ns == before


def test_a_workers_cached_model_is_keyed_by_the_backbone_file(runs, tmp_path):
    copy = tmp_path / "copy"  # the same config (init_from included), another backbone file
    shutil.copytree(runs["lora"], copy, ignore=shutil.ignore_patterns("transfer"))
    key = _model_key(RunContext.open(runs["lora"]))
    assert str(runs["lora"] / BACKBONE_FILE) in key and _model_key(RunContext.open(copy)) != key


def test_the_first_round_starts_from_the_source_head_and_fresh_adapters(runs):
    ctx = RunContext.open(runs["lora"])
    model = ctx.training_model()
    sent = Transfer.get(TensorRef(str(runs["lora"] / "state" / "transfer" / "root.down"), get_flat(model).numel()))
    set_flat(model, sent)  # what the root sent down in its first round: its starting model
    full = _full_model(runs["full"])
    head = {n.rsplit(".", 1)[-1]: p for n, p in model.named_parameters() if "modules_to_save" in n}
    assert head.keys() == {"weight", "bias"}
    assert all(torch.equal(p, full[f"classifier.{k}"]) for k, p in head.items())
    cfg, m = ctx.config, ctx.manifest
    fresh = build_model(
        cfg.model, m.task, m.labels, m.vocab_size, m.pad_token_id, cfg.seed + cfg.model.init_seed_offset
    )
    drawn = dict(fresh.named_parameters())
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and all(torch.equal(p, drawn[n]) for n, p in adapters.items())  # seeded as in any run


def _merged(run: Path, out: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    loaded = AutoModelForSequenceClassification.from_pretrained(export_model(run, "root", out))
    return {n: p.detach() for n, p in loaded.named_parameters()}


def _untouched(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights that neither merged adapters (query, value) nor the trained head change."""
    return {
        n: p for n, p in weights.items() if not n.startswith("classifier") and ".query." not in n and ".value." not in n
    }


def test_export_merges_the_adapters_into_the_backbone_the_workers_trained_on(runs, tmp_path):
    merged = _untouched(_merged(runs["lora"], tmp_path / "lora"))
    full = _full_model(runs["full"])
    assert merged and all(torch.equal(p, full[n]) for n, p in merged.items())  # the source's weights
    ctx = RunContext.open(runs["lora"])
    m = ctx.manifest
    seeded = _base_weights(build_model(ctx.config.model, m.task, m.labels, m.vocab_size, m.pad_token_id, 0))
    assert not torch.equal(
        merged["bert.embeddings.word_embeddings.weight"], seeded["bert.embeddings.word_embeddings.weight"]
    )
    # a LoRA run with init_seed_offset: the backbone is the workers' (seed), not the initial model's (seed + 1)
    merged = _untouched(_merged(runs["offset"], tmp_path / "offset"))
    ctx = RunContext.open(runs["offset"])
    trained_on = _base_weights(ctx.training_model())
    assert all(torch.equal(p, trained_on[n]) for n, p in merged.items())
    initial = _base_weights(ctx.build_model(ctx.config.seed + ctx.config.model.init_seed_offset))
    assert not torch.equal(
        merged["bert.embeddings.word_embeddings.weight"], initial["bert.embeddings.word_embeddings.weight"]
    )


def test_other_differences_and_a_lora_source_for_a_full_run_are_rejected_naming_the_key(runs):
    def error(source: str, *extra: str) -> str:
        config = small_config(*SMALL_RUN, *extra, f"model.init_from={runs[source]}")
        with pytest.raises(ConfigError) as err:
            resolve_init_from(config, runs[source].parents[1])
        return str(err.value)

    wider = error("full", LORA, "model.tiny.hidden_size=64")
    assert wider.startswith(
        f"model.init_from: '{runs['full']}': model.tiny.hidden_size differs: 32 in the source run, 64 here"
    )
    reverse = error("lora")
    assert reverse.startswith(f"model.init_from: '{runs['lora']}': model.adapter differs: ")
    assert "a full run cannot start from a LoRA run" in reverse
    other_rank = error("lora", "model.adapter={r: 8}")
    assert "model.adapter.r differs: 4 in the source run, 8 here" in other_rank


def test_a_lora_run_from_a_warm_started_lora_run_carries_its_backbone_with_its_adapters(runs, tmp_path):
    """``lora``'s adapters were trained on ``full``'s weights: a LoRA run started from ``lora`` must build on them
    too, not on the seeded backbone (it did, silently, before the backbone file was carried over)."""
    import yaml

    from bhfl_core.store.run_layout import CONFIG_FILE, STATE_DIR

    chain = tmp_path / "chain"  # a new run of lora's config with init_from = lora, before its warm start
    shutil.copytree(runs["lora"], chain, ignore=shutil.ignore_patterns(STATE_DIR, BACKBONE_FILE))
    config = yaml.safe_load((chain / CONFIG_FILE).read_text())
    config["model"]["init_from"] = str(runs["lora"])
    (chain / CONFIG_FILE).write_text(yaml.safe_dump(config))
    ctx = RunContext.open(chain)
    assert len(warm_start(ctx)) == len(saved_nodes(StateStore(runs["lora"] / "state")))
    assert torch.equal(load_backbone(chain / BACKBONE_FILE), load_backbone(runs["lora"] / BACKBONE_FILE))
    # the same model: the adapters and the backbone they were trained on
    assert torch.equal(_root_logits(ctx), _root_logits(RunContext.open(runs["lora"])))
    # a resume killed between the backbone file and the root's copy copies the nodes again
    ctx.store.node_path("root").unlink()
    assert "root" in warm_start(ctx)


def _root_logits(run: RunContext) -> torch.Tensor:
    model = run.training_model().eval()
    set_flat(model, run.store.load_model("root"))
    return model(input_ids=torch.arange(5, 17)[None]).logits
