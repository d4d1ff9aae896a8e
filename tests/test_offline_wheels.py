"""scripts/offline_wheels.py picks what an offline GPU machine needs: the run-time closure, no dev tools, no torch."""

import importlib.util
from pathlib import Path

from tests.small import REPO


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("offline_wheels", REPO / "scripts" / "offline_wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_closure_is_what_bhfl_runs_on_and_not_its_dev_tools():
    wheels = _script()
    closure = wheels.runtime_closure(wheels.installed(), set())
    # direct requirements, and requirements of requirements (sqlalchemy through prefect and mlflow, toolz through dask)
    assert {"prefect", "mlflow", "distributed", "datasets", "sqlalchemy", "alembic", "toolz", "torch"} <= closure
    assert not {"pytest", "ruff", "mypy", "hypothesis", "flwr"} & closure  # the dev extra and test-only tools
    assert {"pytest", "ruff"} <= wheels.runtime_closure(wheels.installed(), {"dev"})


def test_the_targets_own_packages_are_read_from_a_pip_freeze_or_a_list_of_names(tmp_path: Path):
    have = tmp_path / "have.txt"
    have.write_text("# the target\nPyYAML==6.0.2\nscikit_learn @ file:///wheels/x.whl\nnumpy>=2\ntyper\n\n")
    assert _script().target_has(have) == {"pyyaml", "scikit-learn", "numpy", "typer"}
    assert _script().TARGET_BUILDS.match("nvidia-cublas-cu12") and not _script().TARGET_BUILDS.match("torchvision")
