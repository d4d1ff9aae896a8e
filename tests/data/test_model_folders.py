"""``model.name`` as a local folder that is not a usable model: one line naming the key and what is wrong.

Each mistake is caught before the work it would spoil: a missing folder, a file, a folder
without config.json or weights before anything starts (the CLI's preflight), not as a
hub error that suggests `hf download /the/path`; a tokenizer that is not the model's
when data preparation loads it, not as an IndexError in the first training step or
(a folder without tokenizer files, from which transformers builds a tokenizer of the
special tokens alone) as data where every word is the unknown token; a ``model.max_length``
past the model's position embeddings the same way.
"""

import json
import shutil

import pytest

from bhfl_core.learning.models import ModelSourceError
from data_prep.prepare import preflight, prepare_data
from tests.small import small_config

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A BERT folder in save_pretrained layout (random weights) whose tokenizer has 45 tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder = tmp_path_factory.mktemp("bert")
    tokens = SPECIAL + list("abcdefghijklmnopqrstuvwxyz") + [f"##{c}" for c in "aeioudnrstlmky"]
    backend = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    backend.normalizer, backend.pre_tokenizer = normalizers.BertNormalizer(), pre_tokenizers.BertPreTokenizer()
    keys = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")
    tokenizer = BertTokenizerFast(tokenizer_object=backend, **dict(zip(keys, SPECIAL, strict=True)))
    tokenizer.save_pretrained(folder)
    config = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), **config)).save_pretrained(folder)
    return folder, len(tokenizer)


def _broken(bert_dir, tmp_path, name, *remove):
    folder = tmp_path / name
    shutil.copytree(bert_dir[0], folder)
    for pattern in remove:
        for path in folder.glob(pattern):
            path.unlink()
    return folder


@pytest.mark.parametrize(
    "layout, message",
    [
        ("missing", r"model.name: the folder {folder} does not exist; a local model is a folder as save_pretrained"),
        ("file", r"model.name: {folder}/config.json is a file, not a model folder"),
        ("no-config", r"model.name: the folder {folder} has no config.json;"),
        ("no-weights", r"model.name: the folder {folder} has no weights \(\*.safetensors or pytorch_model\*.bin\)"),
    ],
)
def test_a_folder_that_is_no_model_is_named_before_any_work(bert_dir, tmp_path, layout, message):
    folder = {
        "missing": tmp_path / "nowhere" / "bert",
        "file": _broken(bert_dir, tmp_path, "file"),
        "no-config": _broken(bert_dir, tmp_path, "no-config", "config.json"),
        "no-weights": _broken(bert_dir, tmp_path, "no-weights", "*.safetensors"),
    }[layout]
    name = folder / "config.json" if layout == "file" else folder
    with pytest.raises(ModelSourceError, match=message.format(folder=folder)) as err:
        preflight(small_config(f"model.name={name}"), tmp_path / "cache")
    assert "hf download" not in str(err.value).split(";")[0]  # not a hub name that failed to download


@pytest.mark.parametrize(
    "damage, message",
    [
        ("tokenizer", r"the tokenizer of '{folder}' has no vocabulary \(its 5 tokens are its special tokens\)"),
        ("vocab", r"the tokenizer of '{folder}' has 45 tokens but the model's vocabulary .* has 30: ids 30..44"),
        ("positions", r"model.max_length: 32 tokens, but '{folder}' has position embeddings for 16 .*at most 16"),
    ],
)
def test_a_tokenizer_that_is_not_the_models_stops_the_preparation(bert_dir, tmp_path, damage, message):
    if damage == "tokenizer":
        folder = _broken(bert_dir, tmp_path, damage, "*token*", "vocab.txt", "special_tokens_map.json")
    else:
        folder = _broken(bert_dir, tmp_path, damage)
        config = json.loads((folder / "config.json").read_text())
        key = "vocab_size" if damage == "vocab" else "max_position_embeddings"
        (folder / "config.json").write_text(json.dumps({**config, key: 30 if damage == "vocab" else 16}))
    assert bert_dir[1] == 45
    cfg = small_config(f"model.name={folder}")
    preflight(cfg, tmp_path / "cache")  # the folder looks like a model
    with pytest.raises(ModelSourceError, match=f"^(model.name: )?{message.format(folder=folder)}"):
        prepare_data(cfg, tmp_path / "cache", log=lambda _: None)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # nothing half-prepared left


def test_the_usable_positions_of_a_roberta_type_model_leave_out_its_padding_offset():
    """XLM-R's position ids start at pad_token_id + 1: of 18 rows a sequence may use 16 (a real forward says so)."""
    import torch
    from transformers import BertConfig, XLMRobertaConfig, XLMRobertaModel

    from data_prep.tokenizer import _usable_positions

    size = dict(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    xlmr = XLMRobertaConfig(max_position_embeddings=18, pad_token_id=1, **size)
    assert _usable_positions(xlmr) == 16 and _usable_positions(BertConfig(max_position_embeddings=18, **size)) == 18
    model = XLMRobertaModel(xlmr).eval()
    model(torch.full((1, 16), 5))  # 16 tokens fit
    with pytest.raises((IndexError, RuntimeError)):  # (an index out of range in the embeddings)
        model(torch.full((1, 17), 5))  # 17 do not: the check must say 16, not 18
