"""Delivering a run folder's spooled tracking calls to a remote MLflow server: in order, once, in the background.

Why a thread of its own: training must not wait for the tracking server. The Tracker
only appends a call to the spool (spool.py, a few milliseconds) and a courier thread
sends the spool's calls in order. When the server is down the calls wait in the run
folder; when it answers again they arrive in the order they were made, each once, with
the times they were produced (metric timestamps, run end times).

Retries: MLflow's client retries a failed request itself, with exponential backoff
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, default 7, ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR``, 2:
a refused connection is tried again after 0, 4, 8, 16, 32, 64 and 120 s, about 4 minutes,
and each try waits up to ``MLFLOW_HTTP_REQUEST_TIMEOUT``, 120 s, for a hung server). bhfl
adds no loop inside that one: the courier makes one call at a time, and only when the
client gives up does it wait ``BHFL_TRACKING_RETRY_S`` (default 5 s) and send the same
call again. ``BHFL_TRACKING_WAIT_S`` (default 120 s) is how long the end of a run waits
for the calls still on their way before it says what was not delivered.

Exactly once: metric batches are the one kind of call that is not idempotent (tags,
params, statuses and artefacts are: sent twice, they leave one value). A batch sent before
(its ``.tried`` marker: it may have arrived although the answer, or the process, was lost)
or logged by a resumed attempt (``check``: a killed attempt may have logged it) is sent
only if its first point is not in the store; a batch is one transaction, all or nothing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import requests
import urllib3
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException

from bhfl_core.config.base import ConfigError
from flows import progress
from flows.tracking.spool import Call, Entry, Spool, Stage

RETRY_ENV, WAIT_ENV = "BHFL_TRACKING_RETRY_S", "BHFL_TRACKING_WAIT_S"
DEFAULT_RETRY_S, DEFAULT_WAIT_S = 5.0, 120.0
SLOW_S = 10.0  # a call unanswered this long: the user is told (MLflow's client may be retrying for minutes)
UNDELIVERED_EXIT = 3  # `bhfl run` / `bhfl resume` / `bhfl sync`: finished, but tracking calls are still pending


def remote(tracking_uri: str) -> bool:
    """Whether ``tracking_uri`` is a tracking server reached over the network (its calls are spooled)."""
    return urlparse(tracking_uri).scheme in ("http", "https", "databricks")


class TrackingUnavailable(ConfigError):
    """The tracking server could not be reached to create the run's MLflow runs (nothing was trained since)."""

    def __init__(self, uri: str, exc: BaseException) -> None:
        super().__init__(
            f"The MLflow tracking server {uri} cannot be reached ({short(exc)}), so the run's MLflow runs could "
            "not be created. Start the server (or point --tracking-uri / MLFLOW_TRACKING_URI at one that runs)."
        )


def _seconds(env: str, default: float) -> float:
    """A duration from the environment; a value that is not a number >= 0 is named in the error."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"{env}={raw!r}: expected a number of seconds >= 0")
    return value


def retry_s() -> float:
    return _seconds(RETRY_ENV, DEFAULT_RETRY_S)


def wait_s() -> float:
    return _seconds(WAIT_ENV, DEFAULT_WAIT_S)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def transient(exc: BaseException) -> bool:
    """A fault of the network or the server, worth sending again; False: the server refused the call itself."""
    for cause in _chain(exc):
        if isinstance(cause, requests.HTTPError) and cause.response is not None:  # an artefact upload's answer
            status = cause.response.status_code
            return status >= 500 or status in (408, 429)
        if isinstance(cause, (requests.RequestException, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)):
            return True
    if isinstance(exc, MlflowException):  # the server answered with an error of its own
        status = exc.get_http_status_code()
        return status >= 500 or status in (408, 429)
    return False


def short(exc: BaseException) -> str:
    """One line on what went wrong (MLflow's messages repeat the whole URL and urllib3's pool)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def logged(client: MlflowClient, run_id: str, point: Metric) -> bool:
    """Whether ``point``'s metric has a value at its step in the store (its batch arrived before)."""
    return any(m.step == point.step for m in client.get_metric_history(run_id, point.key))


def send(client: MlflowClient, call: Call, files: Path | None = None, *, tried: bool = False) -> None:
    """Make one tracking call (``files``: where a spooled call's artefacts wait; None: their own paths)."""
    op, run_id = call["op"], call.get("run_id", "")
    if op == "log_batch":
        metrics = [Metric(k, v, ts, step) for k, v, ts, step in call.get("metrics", [])]
        params = [Param(k, v) for k, v in call.get("params", [])]
        if metrics and (call.get("check") or tried) and logged(client, run_id, metrics[0]):
            return
        client.log_batch(run_id, metrics=metrics, params=params)
    elif op == "set_tag":
        client.set_tag(run_id, call["key"], call["value"])
    elif op == "set_experiment_tag":
        client.set_experiment_tag(call["experiment_id"], call["key"], call["value"])
    elif op == "update_run":
        client.update_run(run_id, status=call.get("status"), name=call.get("name"))
    elif op == "terminate":
        # MlflowClient.set_terminated, for a tracking server, looks the run up again and prints two lines
        # per run on stdout (the results channel); this is the store call it ends with
        client._tracking_client.store.update_run_info(
            run_id, run_status=RunStatus.from_string(call["status"]), end_time=call["end_time"], run_name=None
        )
    elif op == "log_text":
        client.log_text(run_id, call["text"], call["artifact_file"])
    elif op in ("log_artifact", "log_artifacts"):
        source = files / call["source"] if files is not None else Path(call["source"])
        log = client.log_artifact if op == "log_artifact" else client.log_artifacts
        log(run_id, str(source), call.get("artifact_path"))
    else:
        raise ValueError(f"unknown tracking call {op!r}")


@dataclass(frozen=True)
class Undelivered:
    """What a run could not deliver to its tracking server, and how the user delivers it."""

    run_path: Path
    uri: str
    pending: int
    rejected: int
    error: str

    def message(self) -> str:
        spool = Spool(self.run_path)
        parts = ["The run's files are complete (node models, report/); only its MLflow record is behind."]
        if self.pending:
            why = f"last error: {self.error}" if self.error else "it did not answer"
            parts.append(
                f"{self.pending} MLflow tracking call(s) could not be delivered to {self.uri} ({why}). They are "
                f"kept in order in {spool.pending}, each with the time its value was produced; once the server "
                f"answers, `bhfl sync {self.run_path}` (or `bhfl resume {self.run_path}`) delivers them, every "
                "metric point once."
            )
        if self.rejected:
            parts.append(
                f"{self.rejected} call(s) were refused by the server and set aside in {spool.rejected} "
                "(each with the server's answer); they are not sent again."
            )
        return " ".join(parts)


class Courier:
    """Sends a spool's calls in a background thread of one Tracker; several couriers of a run take turns.

    The user hears of an outage once (when a call has waited ``SLOW_S`` for an answer, or
    failed) and once more when the server answers again.
    """

    def __init__(self, client: MlflowClient, spool: Spool, uri: str, meanwhile: str = "training goes on") -> None:
        self.client, self.spool, self.uri = client, spool, uri
        self.meanwhile = meanwhile  # what goes on while the server is down (told with the outage)
        self.retry_s, self.wait_s = retry_s(), wait_s()  # (a bad value is named now, not at the end of the run)
        self.last_error = ""
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()
        self._down_since = 0.0  # when the server stopped answering (0: it answers)
        self._caught_up = 0  # calls delivered since then

    def post(self, call: Call, stage: Stage | None = None) -> None:
        """Queue ``call`` (durable on return) and see that it is on its way."""
        self.spool.add(call, stage)
        self.kick()

    def kick(self) -> None:
        with self._mutex:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="bhfl-tracking", daemon=True)
                self._thread.start()

    def wait(self, timeout_s: float | None = None, source: str = "") -> int:
        """Wait until the spool is empty or ``timeout_s`` (default ``BHFL_TRACKING_WAIT_S``) has passed; calls left.

        ``source``: where a given ``timeout_s`` came from (e.g. ``--wait``), named in the note.
        """
        timeout = self.wait_s if timeout_s is None else timeout_s
        source = WAIT_ENV if timeout_s is None else source
        started = time.monotonic()
        told = False
        self.kick()
        while (left := self.spool.count()) and time.monotonic() < started + timeout:
            if not told and time.monotonic() > started + 1.0:
                told = True
                progress.note(
                    f"waiting up to {timeout:.0f} s{f' ({source})' if source else ''} for {left} tracking call(s) on "
                    f"their way to {self.uri}"
                )
            time.sleep(0.05)
            self.kick()  # (a courier that found another delivering leaves; the other may be gone too)
        return left

    def _run(self) -> None:
        while True:
            with self.spool.delivering() as mine:
                if not mine:
                    return  # another courier delivers (and, before it leaves, looks again)
                self._deliver_all()
            if not self.spool.count():
                return

    def _outage(self, what: str) -> None:
        with self._mutex:
            if self._down_since:
                return
            self._down_since, self._caught_up = time.time(), 0
        progress.note(
            f"MLflow tracking server {self.uri} {what}; {self.meanwhile}, its tracking calls wait in "
            f"{self.spool.pending} and are delivered once it answers"
        )

    def _deliver_all(self) -> None:
        """Deliver until the spool is empty; after a network fault, pause and go on from the same call."""
        while True:
            try:
                for entry in self.spool.entries():
                    self._deliver(entry)
            except Exception as exc:  # the server did not answer, or not usefully: the call stays first in line
                self.last_error = short(exc)
                self._outage(f"not answering ({self.last_error})")
                time.sleep(self.retry_s)
                continue
            with self._mutex:
                down_since, self._down_since = self._down_since, 0.0
            if down_since:
                progress.note(
                    f"MLflow tracking server {self.uri} answers again after {time.time() - down_since:.0f} s: "
                    f"{self._caught_up} delayed tracking call(s) delivered"
                )
            return

    def _deliver(self, entry: Entry) -> None:
        tried = entry.tried
        self.spool.mark_tried(entry)
        slow = threading.Timer(SLOW_S, self._outage, (f"has not answered for {SLOW_S:.0f} s",))
        slow.daemon = True
        slow.start()
        try:
            send(self.client, entry.call, entry.files, tried=tried)
        except Exception as exc:
            if transient(exc):
                raise
            self.spool.reject(entry, short(exc))
            progress.note(
                f"MLflow tracking server {self.uri} refused a tracking call ({entry.call['op']}): {short(exc)}; "
                f"set aside in {self.spool.rejected}"
            )
            return
        finally:
            slow.cancel()
        self.spool.done(entry)
        self._caught_up += 1
