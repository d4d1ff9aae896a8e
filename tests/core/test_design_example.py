"""docs/design.md's "An aggregation rule ... in one file" is complete: its example, dropped as one file into a copy
of ``bhfl_core/algorithm/``, is found, registered, named by a config and folds a round to the unweighted mean."""

import re
import shutil
import subprocess
import sys

from tests.small import REPO

CHECK = """
import torch
from bhfl_core.algorithm.aggregation_rule import fold_results
from bhfl_core.algorithm.contract import ChildResult
from bhfl_core.algorithm.node_state import RoundKey
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import available_rules, rule_for
from bhfl_core.config.loader import load_config
from bhfl_core.config.topology import build_tree, placeholder_clients

assert "unweighted_mean" in available_rules(), available_rules()
config = load_config(sys.argv[1], ["tree.edge.aggregate={kind: unweighted_mean}"])
assert build_tree(config, placeholder_clients(config))["edge-en"].settings.aggregate.kind == "unweighted_mean"
rule, key = rule_for(AggregateParams("unweighted_mean")), RoundKey("edge-en", 0)
models = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, -2.0]), "c": torch.tensor([2.0, 3.0])}
results = []
for member, weight in (("a", 1.0), ("b", 50.0), ("c", 7.0)):  # example weights it must ignore
    partial = rule.start(key.as_caller())
    rule.contribute(partial, member, models[member], weight)
    results.append(ChildResult(members=(member,), partial=rule.unwire(*rule.wire(partial))))
done = rule.finalize(fold_results(rule, key, results, ["a", "b", "c", "edge-en"]).partial, key)
print(done.input.tolist(), done.state, done.metrics)
"""


def test_the_documented_rule_is_one_file_that_a_config_can_name(tmp_path):
    text = (REPO / "docs" / "design.md").read_text()
    section = text[text.index("**An aggregation rule (how children's models are folded), in one file.**") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None and "register_rule(" in code.group(1)
    shutil.copytree(REPO / "bhfl_core", tmp_path / "bhfl_core", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "bhfl_core" / "algorithm" / "unweighted_mean_rule.py").write_text(code.group(1))
    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + CHECK, str(REPO / "configs" / "embedded.yaml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[2.0, 1.0] {} {}"  # (a + b + c) / 3, not weighted by examples
