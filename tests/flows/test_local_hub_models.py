"""Hub models from a local folder in ``save_pretrained`` layout, as a user who downloaded mBERT or XLM-R has one.

The folders are built here from configs (random weights, small) with tokenizers trained on
the embedded corpus: a BERT-architecture one (WordPiece) and an XLM-R-architecture one
(SentencePiece-style Unigram). The whole pipeline runs on each through ``model.name: DIR``:
data preparation with the folder's tokenizer, ``AutoModelFor...from_pretrained`` (a new
head where the folder has none), training, evaluation, the report.
"""

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from bhfl_core.store.node_store import load_tensors
from data_prep.manifest import Manifest
from flows.experiment import PLAIN_CALLS, run_experiment
from tests.small import small_config

pytestmark = pytest.mark.integration


def _corpus() -> list[str]:
    from data_prep.embedded import generate_pool

    texts = []
    for language in ("en", "de", "fr"):
        pool = generate_pool(0, language, 150, 0.5, 0.5)
        texts += [f"{title} {body}" for title, body in zip(pool["news_title"], pool["news_body"], strict=True)]
    return texts


def _bert_folder(folder: Path, texts: list[str]) -> int:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=600, special_tokens=special))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = BertTokenizerFast(tokenizer_object=tok, **{k: v for k, v in zip(_BERT_KEYS, special, strict=True)})
    fast.save_pretrained(folder)
    config = BertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    BertForMaskedLM(config).save_pretrained(folder)  # encoder + MLM head, like a pretraining checkpoint
    return tok.get_vocab_size()


_BERT_KEYS = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")


def _xlmr_folder(folder: Path, texts: list[str]) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import XLMRobertaConfig, XLMRobertaForMaskedLM, XLMRobertaTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=600, special_tokens=special, unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    fast = XLMRobertaTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
        unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
    )  # fmt: skip
    fast.save_pretrained(folder)
    config = XLMRobertaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )  # fmt: skip
    XLMRobertaForMaskedLM(config).save_pretrained(folder)
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    root, texts = tmp_path_factory.mktemp("hub-models"), _corpus()
    return {
        "bert": (root / "bert", _bert_folder(root / "bert", texts)),
        "xlmr": (root / "xlmr", _xlmr_folder(root / "xlmr", texts)),
    }


LORA = "model.adapter={r: 4, alpha: 8}"


@pytest.mark.parametrize(
    "arch, task, head, adapter",
    [
        ("bert", "classification", "BertForSequenceClassification", None),
        ("xlmr", "classification", "XLMRobertaForSequenceClassification", None),
        ("xlmr", "mlm", "XLMRobertaForMaskedLM", None),
        ("bert", "classification", "BertForSequenceClassification", LORA),
        ("xlmr", "classification", "XLMRobertaForSequenceClassification", LORA),
    ],
)
def test_the_pipeline_runs_on_a_local_save_pretrained_folder(folders, tmp_path, arch, task, head, adapter):
    from transformers import AutoConfig

    from bhfl_core.learning.models import with_adapter

    folder, vocab = folders[arch]
    sets = [f"model.name={folder}", f"data.task={task}", "tree.root.rounds=1", "runtime.executor=inprocess"]
    config = small_config(*sets, *([adapter] if adapter else []))
    result = run_experiment(config, tmp_path, orchestration=PLAIN_CALLS)
    run_path = Path(result["run_path"])
    data_root = Path(json.loads((run_path / "data.json").read_text())["data_root"])
    manifest = Manifest.read(data_root)  # data prepared with the folder's tokenizer
    params = MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.params
    assert params["model.name"] == str(folder)
    root = load_tensors(run_path / "state" / "nodes" / "root.safetensors", ["model"])[0]["model"]
    model = with_adapter(_load(folder, task, head), config.model)
    assert root.numel() == sum(p.numel() for p in model.parameters() if p.requires_grad)  # the folder's model
    if adapter:  # only the adapters and the head travel and are stored: a small share of the model
        assert root.numel() < sum(p.numel() for p in model.parameters()) / 10
    assert AutoConfig.from_pretrained(folder).vocab_size == vocab == manifest.vocab_size
    assert manifest.pad_token_id == (1 if arch == "xlmr" else 0)  # <pad> / [PAD] of that tokenizer
    if task == "mlm":
        assert manifest.mask_token_id == 4  # <mask>
    report = (run_path / "report" / "report.md").read_text()
    assert f"model {folder}" in report
    if adapter:  # the BERT folder has no pooler (saved from BertForMaskedLM): the run drew it from its seed
        _exported_adapters_predict_as_the_run(run_path, folder, tmp_path / "adapters", own_base=arch == "bert")


def _exported_adapters_predict_as_the_run(run_path: Path, folder: Path, out: Path, own_base: bool) -> None:
    """``bhfl export --format adapter`` loaded with peft on the base its config names predicts as the run's model.

    The BERT folder lacks the pooler the classifier reads: the export writes the run's base
    under ``out/base`` and names it (named the folder, peft's load drew another pooler: logits
    0.068 apart). The XLM-R classifier uses no pooler and its head travels with the adapters:
    the folder itself stays the base.
    """
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForSequenceClassification

    from bhfl_core.learning.params import set_flat
    from flows.cli.export import export_model
    from tasks.context import RunContext

    export_model(run_path, "root", out, "adapter")
    named = PeftConfig.from_pretrained(str(out)).base_model_name_or_path
    ctx = RunContext.open(run_path)
    ours = ctx.training_model().eval()
    set_flat(ours, ctx.store.load_model("root"))
    base = AutoModelForSequenceClassification.from_pretrained(named, num_labels=len(ctx.manifest.labels))
    theirs = PeftModel.from_pretrained(base, str(out)).eval()
    ids = torch.randint(5, ctx.manifest.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        gap = float((theirs(**batch).logits - ours(**batch).logits).abs().max())
    assert gap == 0.0, gap  # the same modules, weights and order: equal (0.0 measured; 0.044 without DIR/base)
    assert named == str(out / "base" if own_base else folder) and (out / "base").is_dir() == own_base


def _load(folder: Path, task: str, head: str):
    import transformers

    cls = getattr(transformers, head)
    return cls.from_pretrained(folder, num_labels=10) if task == "classification" else cls.from_pretrained(folder)


def test_a_lora_run_is_bit_identical_in_process_and_on_two_workers(folders, tmp_path):
    from tests.flows.kill_chain import node_files

    folder, _ = folders["bert"]
    runs = [
        run_experiment(small_config(f"model.name={folder}", LORA, *extra), tmp_path / name, orchestration=PLAIN_CALLS)
        for name, extra in (("one", ["runtime.executor=inprocess"]), ("two", ["runtime.executor=local"]))
    ]
    first, second = (node_files(Path(r["run_path"])) for r in runs)
    assert first == second and len(first) > 9
