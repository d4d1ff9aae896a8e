"""The YAML snippets of the user docs load as written: a user copies them into a config, a pipeline or a sweep file.

One the validator refuses is a doc bug (docs/privacy.md's secure-aggregation block once set
``neighbours`` beside ``graph: complete``, which is refused). A config snippet is merged onto the
experiment it is written for: configs/fedavg.yaml (30 clients under the root) where it makes a
server asynchronous, else configs/embedded.yaml. The pipeline and sweep files are read with their
``base:`` paths where the docs put them: the pipeline in configs/, the sweep file one folder below
the repository.
"""

import re
from pathlib import Path

import pytest
import yaml

from bhfl_core.config.loader import config_from_dict, merge, read_yaml
from bhfl_core.config.pipeline import pipeline_from_dict
from bhfl_core.config.sweep import sweep_from_dict

ROOT = Path(__file__).resolve().parents[2]
CONFIG_PAGES = ("privacy.md", "evaluation.md")


def yaml_blocks(page: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)


CONFIG_SNIPPETS = [(page, block) for page in CONFIG_PAGES for block in yaml_blocks(page)]


@pytest.mark.parametrize(
    ("page", "block"), CONFIG_SNIPPETS, ids=[f"{page}-{i}" for i, (page, _) in enumerate(CONFIG_SNIPPETS)]
)
def test_a_config_snippet_loads_onto_its_experiment(page: str, block: str) -> None:
    snippet = yaml.safe_load(block)
    base = "fedavg.yaml" if "mode: async" in block else "embedded.yaml"
    data = merge(read_yaml(ROOT / "configs" / base), snippet)
    config_from_dict(data, source=f"docs/{page}")  # a ConfigError naming the key if the validator refuses it


def test_the_pipeline_file_of_docs_pipelines_loads() -> None:
    (block,) = yaml_blocks("pipelines.md")
    pipeline = pipeline_from_dict(yaml.safe_load(block), source="docs/pipelines.md", base_dir=ROOT / "configs")
    assert [s.name for s in pipeline.stages] == ["global", "group", "personal"]


def test_the_sweep_file_of_docs_sweeps_loads_with_its_labels() -> None:
    (block,) = yaml_blocks("sweeps.md")
    sweep = sweep_from_dict(yaml.safe_load(block), source="docs/sweeps.md", base_dir=ROOT / "sweeps")
    assert len(sweep) == 12 and sweep.baseline == "hierfavg,eta_down=1.0"  # 2 variants x 2 values x 3 seeds
    assert "hierfavg,eta_down=0.5,seed=1" in sweep.labels  # the label the page gives as its example
