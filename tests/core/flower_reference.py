"""Flower's own aggregation functions (flwr 1.42.0, ``flwr/server/strategy/aggregate.py``), the robust rules'
reference, and its server-optimiser strategies (FedAdam, FedYogi, FedAdagrad, FedAvgM), NODEOPT's.

scripts/bootstrap.sh installs flwr without its dependencies (they conflict with ours:
flwr pins fastapi<0.139), so the ``flwr`` package itself cannot be imported (its
``__init__`` needs grpc). That one module needs only numpy at run time: it is loaded
here from the installed file, alone, with its two imports from the rest of Flower
(types used in annotations and in functions not called here) stood in for while it
loads. The functions are Flower's code, unchanged.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from importlib.metadata import distribution

import numpy as np

VERSION = "1.42.0"


def _load() -> types.ModuleType:
    dist = distribution("flwr")
    if dist.version != VERSION:
        raise RuntimeError(f"the tests compare against flwr {VERSION}, found {dist.version} (scripts/bootstrap.sh)")
    path = dist.locate_file("flwr/server/strategy/aggregate.py")
    stand_ins = {
        "flwr": types.ModuleType("flwr"),
        "flwr.common": types.ModuleType("flwr.common"),
        "flwr.server": types.ModuleType("flwr.server"),
        "flwr.server.client_proxy": types.ModuleType("flwr.server.client_proxy"),
    }
    common, proxy = stand_ins["flwr.common"], stand_ins["flwr.server.client_proxy"]
    common.FitRes = object  # type: ignore[attr-defined]
    common.NDArray = np.ndarray  # type: ignore[attr-defined]
    common.NDArrays = list  # type: ignore[attr-defined]
    common.parameters_to_ndarrays = None  # type: ignore[attr-defined]
    proxy.ClientProxy = object  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location("flower_aggregate", str(path))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, before in saved.items():
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before
    return module


flower = _load()
aggregate_median = flower.aggregate_median
aggregate_trimmed_avg = flower.aggregate_trimmed_avg
aggregate_krum = flower.aggregate_krum


class _FitRes:
    """What Flower's strategies read of a client's fit result: its parameters and its example count."""

    def __init__(self, parameters: list[np.ndarray], num_examples: int) -> None:
        self.parameters = parameters
        self.num_examples = num_examples


def _load_strategies() -> dict[str, type]:
    """Flower's server-optimiser strategies (``fedopt.py``, ``fedadam.py``, ``fedyogi.py``, ``fedadagrad.py``,
    ``fedavgm.py``), their code unchanged, the NODEOPT references.

    Loaded as ``_load`` loads ``aggregate.py``: from the installed files, with what they import from the rest
    of Flower stood in for while they load. Parameters are plain lists of arrays (``ndarrays_to_parameters``
    and back are the identity), and the base class ``FedAvg`` is reduced to what these strategies use of it:
    its constructor's ``initial_parameters`` and its ``aggregate_fit``, Flower's ``aggregate`` (the
    example-weighted mean) over the results.
    """
    dist = distribution("flwr")
    folder = dist.locate_file("flwr/server/strategy")

    class FedAvg:
        def __init__(self, *, initial_parameters: list[np.ndarray], **_: object) -> None:
            self.initial_parameters = initial_parameters
            self.accept_failures = True
            self.fit_metrics_aggregation_fn = None

        def aggregate_fit(
            self, server_round: int, results: list[tuple[object, _FitRes]], failures: list[object]
        ) -> tuple[list[np.ndarray] | None, dict[str, object]]:
            if not results:
                return None, {}
            return aggregate_fn([(r.parameters, r.num_examples) for _, r in results]), {}

    aggregate_fn = flower.aggregate
    package = types.ModuleType("flwr.server.strategy")
    package.__path__ = [str(folder)]
    common = types.ModuleType("flwr.common")
    for name in ("FitRes", "MetricsAggregationFn", "NDArrays", "Parameters", "Scalar"):
        setattr(common, name, object)
    common.ndarrays_to_parameters = common.parameters_to_ndarrays = lambda x: x  # type: ignore[attr-defined]
    fedavg_module = types.ModuleType("flwr.server.strategy.fedavg")
    fedavg_module.FedAvg = FedAvg  # type: ignore[attr-defined]
    stand_ins = {
        "flwr": types.ModuleType("flwr"),
        "flwr.common": common,
        "flwr.server": types.ModuleType("flwr.server"),
        "flwr.server.client_proxy": types.ModuleType("flwr.server.client_proxy"),
        "flwr.server.client_manager": types.ModuleType("flwr.server.client_manager"),
        "flwr.supercore": types.ModuleType("flwr.supercore"),
        "flwr.server.strategy": package,
        "flwr.server.strategy.fedavg": fedavg_module,
        "flwr.server.strategy.aggregate": flower,
    }
    stand_ins["flwr.server.client_proxy"].ClientProxy = object  # type: ignore[attr-defined]
    stand_ins["flwr.server.client_manager"].ClientManager = object  # type: ignore[attr-defined]
    stand_ins["flwr.supercore"].log = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    classes: dict[str, type] = {}
    loaded: list[str] = []
    try:
        for module_name, class_name in [
            ("fedopt", "FedOpt"),
            ("fedadam", "FedAdam"),
            ("fedyogi", "FedYogi"),
            ("fedadagrad", "FedAdagrad"),
            ("fedavgm", "FedAvgM"),
        ]:
            full = f"flwr.server.strategy.{module_name}"
            spec = importlib.util.spec_from_file_location(full, str(folder / f"{module_name}.py"))
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[full] = module  # fedadam's ``from .fedopt import FedOpt`` finds it here
            loaded.append(full)
            spec.loader.exec_module(module)
            classes[class_name] = getattr(module, class_name)
    finally:
        for name in [*stand_ins, *loaded]:
            sys.modules.pop(name, None)
        for name, before in saved.items():
            if before is not None:
                sys.modules[name] = before
    return classes


def server_strategy(name: str, initial: list[np.ndarray], **params: float) -> object:
    """A Flower strategy (``FedAdam``, ``FedYogi``, ``FedAdagrad``, ``FedAvgM``) starting from ``initial``."""
    return _STRATEGIES[name](initial_parameters=initial, **params)


def server_round(strategy: object, rnd: int, models: list[np.ndarray], examples: list[int]) -> np.ndarray:
    """One ``aggregate_fit`` of ``strategy`` over one-array client models; returns its new model."""
    results = [(None, _FitRes([m], n)) for m, n in zip(models, examples, strict=True)]
    new, _ = strategy.aggregate_fit(rnd, results, [])  # type: ignore[attr-defined]
    assert new is not None
    return new[0]


_STRATEGIES = _load_strategies()
