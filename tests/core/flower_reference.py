"""Flower's own aggregation functions (flwr 1.42.0, ``flwr/server/strategy/aggregate.py``), the robust rules' reference.

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
