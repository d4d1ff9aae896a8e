"""``model.adapter`` checked before a run starts, on the module tree built without weights (adapter_check.py)."""

import pytest

from bhfl_core.config.base import SettingError
from bhfl_core.learning.adapter_check import check_adapter, names_modules
from tests.small import small_config


@pytest.mark.parametrize(
    "adapter, message",
    [
        ("{target_modules: [query, valeu]}", r"model\.adapter\.target_modules: no module .* 'valeu'"),
        ("{target_modules: [LayerNorm]}", r"model\.adapter\.target_modules: Target module LayerNorm"),
        ("{rank_pattern: {valu: 2}}", r"model\.adapter\.rank_pattern: 'valu' matches none"),
        ("{alpha_pattern: {key: 2}}", r"model\.adapter\.alpha_pattern: 'key' matches none"),
        ("{modules_to_save: [poolr]}", r"model\.adapter\.modules_to_save: no module .* 'poolr'"),
    ],
)
def test_an_adapter_option_matching_no_module_is_refused_from_the_config_alone(adapter, message):
    import torch

    model = small_config(f"model.adapter={adapter}").model
    assert names_modules(model.adapter)
    state = torch.random.get_rng_state()
    with pytest.raises(SettingError, match=message):
        check_adapter(model, "classification")
    assert torch.equal(torch.random.get_rng_state(), state)  # the meta build draws nothing of the process's generator


def test_a_local_folder_is_checked_from_its_config_json_and_an_uncached_hub_name_is_left_to_the_build(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=120, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24
    )
    BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    for task in ("classification", "mlm"):
        folder = small_config(f"model.name={tmp_path / 'bert'}", "model.adapter={r: 4, target_modules: [query, dense]}")
        assert check_adapter(folder.model, task) == []
        typo = small_config(f"model.name={tmp_path / 'bert'}", "model.adapter={rank_pattern: {qery: 2}}").model
        with pytest.raises(SettingError, match=r"model\.adapter\.rank_pattern: 'qery' matches none"):
            check_adapter(typo, task)
    # a hub name that is not in the Hugging Face cache: not fetched (no network call), checked when the run builds it
    hub = small_config("model.name=no-such-org/no-such-model", "model.adapter={target_modules: [nothing]}")
    assert check_adapter(hub.model, "classification") == []
    assert not names_modules(small_config("model.adapter={r: 4}").model.adapter)  # nothing named: the CLI builds none


def test_a_rank_above_the_adapted_layers_smallest_dimension_is_warned_with_the_largest_useful_rank():
    # the small config's tiny BERT: hidden 32, so query and value are 32 x 32; the intermediate dense 32 -> 64
    assert check_adapter(small_config("model.adapter={r: 32}").model, "classification") == []
    (warning,) = check_adapter(small_config("model.adapter={r: 40}").model, "classification")
    assert warning.startswith("model.adapter.r: rank 40 is above the smallest dimension of 2 adapted layer(s) (query, ")
    assert "32 is the largest rank that wastes none there" in warning
    pattern = small_config("model.adapter={r: 4, rank_pattern: {value: 48}}").model
    (warning,) = check_adapter(pattern, "classification")
    assert warning.startswith("model.adapter.rank_pattern: rank 48 is above the smallest dimension of 1 adapted layer")
    assert check_adapter(small_config().model, "classification") == []  # no adapters: nothing built
