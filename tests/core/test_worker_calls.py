"""Worker calls name the ``WorkerRuntime`` method itself, and a client batch's shape travels as one ``BatchCall``.

mypy checks each call's arguments against its method (tasks/executor.py ``Executor.submit``,
scripts/lint.sh); these check what typing cannot: the method reaches the runtime of the slot
(in process here; on Dask workers in tests/flows/test_executor.py and the determinism tests),
it crosses to a Dask worker by reference (pickled by name), and a call describes itself by it.
"""

import pickle

import pytest
import torch

from bhfl_core.algorithm.contract import RoundPlan
from bhfl_core.algorithm.node_state import Caller
from bhfl_core.store.transfer import TensorRef
from tasks.client_training import BatchCall
from tasks.executor import InProcessExecutor, _Call, _what, slot
from tasks.training import train_clients
from tasks.worker import WorkerRuntime


def test_the_in_process_executor_calls_the_named_method_on_its_runtime():
    runtime = WorkerRuntime("w0", torch.device("cpu"))
    executor = InProcessExecutor(runtime)
    (only,) = executor.slots()
    assert only == slot(runtime.describe())
    assert executor.submit(only, WorkerRuntime.describe).result()["name"] == "w0"
    with pytest.raises(FileNotFoundError):  # the method's own error, through the future
        executor.submit(only, WorkerRuntime.initial_model, "/nonexistent/run").result()


def test_a_method_crosses_to_a_worker_by_name_and_names_the_call():
    assert pickle.loads(pickle.dumps(WorkerRuntime.train_clients)) is WorkerRuntime.train_clients
    plan, phi = RoundPlan(Caller("edge", 0)), TensorRef("/x", 4, "float32")
    training = _Call(WorkerRuntime.train_clients, ("/run", plan, ["c1", "c2"], phi, BatchCall()), {})
    assert (training.name, _what(training)) == ("train_clients", "training c1, c2")
    assert _what(_Call(WorkerRuntime.initial_model, ("/run",), {})) == "initial_model"


def test_a_batch_call_is_one_frozen_value_with_the_defaults_of_a_folded_batch():
    assert BatchCall() == BatchCall(fold=True, keep=0, select=None, whole_round=False)
    with pytest.raises(TypeError):
        BatchCall(True)  # type: ignore[misc]  # by keyword only
    with pytest.raises(ValueError, match="whole_round needs fold"):
        BatchCall(fold=False, whole_round=True)
    with pytest.raises(ValueError, match="a whole round in one batch, not 2"):
        train_clients(None, [(None, ["a"]), (None, ["b"])], "/run", None, None, BatchCall(whole_round=True))  # type: ignore[arg-type]
