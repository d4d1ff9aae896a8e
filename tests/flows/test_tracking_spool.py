"""The run folder's tracking spool and journal on their own: order, kill leftovers, network faults told apart."""

import errno

import pytest
import requests
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

from flows.tracking.delivery import transient
from flows.tracking.journal import Journal
from flows.tracking.spool import Spool

pytestmark = pytest.mark.integration  # (tests/flows: the fast lane skips the folder; these take milliseconds)


def test_calls_come_back_in_order_and_a_number_is_never_used_twice(tmp_path):
    spool = Spool(tmp_path)
    for i in range(3):
        spool.add({"op": "set_tag", "key": f"k{i}"})
    entries = list(spool.entries())
    assert [e.call["key"] for e in entries] == ["k0", "k1", "k2"]
    for entry in entries:
        spool.done(entry)
    assert spool.count() == 0
    later = spool.add({"op": "set_tag", "key": "k3"})  # an empty folder does not start the numbers again
    assert later.seq == 4


def test_what_a_killed_add_leaves_is_removed_and_complete_calls_stay(tmp_path):
    spool = Spool(tmp_path)
    staged = spool.add({"op": "log_artifacts", "source": "."}, lambda folder: (folder / "report.md").write_text("r"))
    assert (staged.files / "report.md").read_text() == "r"
    # a kill while writing the next call: its temporary file, and files staged for a call never written
    (spool.pending / ".000000002.json.ab12.tmp").write_text("{")
    (spool.pending / "000000003.files").mkdir()
    spool.remove_partial_writes()
    assert sorted(p.name for p in spool.pending.iterdir()) == ["000000001.files", "000000001.json"]
    spool.reject(next(spool.entries()), "refused")  # set aside with its files and the server's answer
    assert spool.count() == 0 and spool.rejected_count() == 1
    assert (spool.rejected / "000000001.files" / "report.md").exists()


def test_journal_skips_a_line_a_kill_cut_short_and_goes_on(tmp_path):
    journal = Journal(tmp_path)
    journal.begin()
    journal.metrics("run", [Metric("loss", 1.0, 10, 1)])
    with open(journal.path, "ab") as fh:  # killed halfway through an append
        fh.write(b'{"run": "run", "m": [["loss", 2.0')
    journal.metrics("run", [Metric("loss", 3.0, 30, 3)])
    journal.tags("run", {"note": "hello"})
    assert journal.complete
    assert [(m.step, m.value) for m in journal.points("run", "loss")] == [(1, 1.0), (3, 3.0)]
    assert journal.latest("run") == {"loss": 3.0} and journal.run_tags("run") == {"note": "hello"}
    assert not Journal(tmp_path / "elsewhere").complete  # no journal: its run reads from the server


def test_journal_appends_keep_a_current_read_cache_current_and_another_writer_is_seen(tmp_path):
    # a resumed attempt asks `has` before each batch it appends: the cache takes its own appends (no re-read of
    # the whole journal per batch), and a line another writer appended is still read
    journal = Journal(tmp_path)
    journal.begin()
    journal.metrics("run", [Metric("loss", 1.0, 10, 1)])
    assert journal.has("run", Metric("loss", 0.0, 0, 1))  # the cache is built here
    journal.metrics("run", [Metric("loss", 2.0, 20, 2)])
    journal.tags("run", {"note": "hi"})
    stat = journal.path.stat()
    assert journal._cache is not None and journal._cache[0] == (stat.st_size, stat.st_mtime_ns)  # still current
    assert journal.has("run", Metric("loss", 0.0, 0, 2)) and journal.run_tags("run") == {"note": "hi"}
    Journal(tmp_path).metrics("run", [Metric("loss", 3.0, 30, 3)])  # another writer (another thread's journal)
    journal.metrics("run", [Metric("loss", 4.0, 40, 4)])
    fresh = Journal(tmp_path)
    assert [(m.step, m.value) for m in journal.points("run", "loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert journal.points("run", "loss") == fresh.points("run", "loss")


def _wrapped(cause: BaseException) -> MlflowException:
    """How MLflow's client reports a failed request: its own exception, the transport's as context."""
    try:
        raise cause
    except BaseException:
        try:
            raise MlflowException("API request failed")
        except MlflowException as exc:
            return exc


def _http_error(status: int) -> requests.HTTPError:
    response = requests.Response()
    response.status_code = status
    return requests.HTTPError(f"{status}", response=response)


@pytest.mark.parametrize(
    ("exc", "again"),
    [
        (_wrapped(requests.ConnectionError("refused")), True),  # the server is down
        (_wrapped(requests.ReadTimeout("no answer")), True),  # hung
        (_wrapped(ConnectionResetError(errno.ECONNRESET, "reset")), True),  # died mid-answer
        (_http_error(503), True),  # an artefact upload, server overloaded
        (_http_error(400), False),
        (MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE), True),
        (MlflowException("no such run", error_code=RESOURCE_DOES_NOT_EXIST), False),
        (MlflowException("bad value", error_code=INVALID_PARAMETER_VALUE), False),
        (FileNotFoundError("a staged file went missing"), False),
    ],
)
def test_network_faults_are_sent_again_and_refusals_are_not(exc, again):
    assert transient(exc) is again
