"""MLflow tracking through ``MlflowClient`` with explicit run ids (thread-safe from tasks).

Layout in the store: one experiment per config ``name``; one parent run per
experiment run; under it a run per server node, nested like the tree (root ->
intermediate servers -> edge servers), tagged ``bhfl.node``, ``bhfl.level`` (depth,
root = 0) and ``bhfl.role``. Training metrics use ``step = node round``; evaluation
metrics are ``eval/<test_set>/<metric>`` with ``step = root round``.

A pipeline (flows/pipeline.py) adds a level on top: its run in an experiment named
after the pipeline, and each stage's parent run in that same experiment, nested under
it (pipeline -> stage -> root -> servers).

Kill-safety (a run SIGKILLed at any moment and resumed leaves the record an
uninterrupted run leaves): every run this module creates carries the tag
``bhfl.run_key``, a key the run folder's record holds *before* the runs are created,
so a resume adopts the runs a killed attempt created but never recorded instead of
creating a second set; and a tracker of a resumed attempt (``resumed=True``) logs a
metric batch only if its first point is not in the store yet (a batch is one
transaction: all of it or none is there), so nothing the killed attempt logged is
logged twice.

A remote tracking server (``http(s)://``, ``databricks``) may be down for a minute or for
good while the run trains: a tracker given its run folder (``run_path``) writes every call
to the folder's spool (spool.py), a courier thread delivers them in order (delivery.py), and
the metric points and tags it sends go to a journal (journal.py) it reads histories from,
so training never waits for the server and the report does not need it. Only creating the
runs needs the server (their ids are needed at once: ``TrackingUnavailable`` if it cannot
be reached). A local store (SQLite, a folder) is written directly.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mlflow import MlflowClient
from mlflow.entities import Metric, Run
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NOTE

from bhfl_core.algorithm.tree import Tree
from flows.services.store_templates import sqlite_from_template
from flows.tracking.delivery import Courier, TrackingUnavailable, Undelivered, remote, send, transient
from flows.tracking.journal import Journal
from flows.tracking.links import HEADLINE_VIEW_KEY, SHARED_VIEW_TAG, headline_view
from flows.tracking.spool import Call, Spool, Stage

_BATCH = 900  # MLflow accepts at most 1000 entities per log_batch
RUN_KEY_TAG = "bhfl.run_key"  # on every run a run folder creates: what a resume finds them by
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"  # what the UI reads


def sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of a local SQLite store URI (``sqlite:///path``), else None."""
    return Path(tracking_uri[len("sqlite:///") :]) if urlparse(tracking_uri).scheme == "sqlite" else None


def _artifact_root(tracking_uri: str) -> str | None:
    """A file artefact folder next to a local SQLite store; None lets a server decide."""
    db = sqlite_file(tracking_uri)
    return None if db is None else (db.parent / "mlartifacts").resolve().as_uri()


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


class Tracker:
    def __init__(self, tracking_uri: str, *, resumed: bool = False, run_path: Path | None = None) -> None:
        """``resumed``: this attempt continues a killed or failed one, whose points may be in the store.

        ``run_path``: the run folder; with a remote tracking server its calls go through the
        folder's spool and journal (the module's docstring). None: every call is made at once.
        """
        self.uri = tracking_uri
        self.resumed = resumed
        db = sqlite_file(tracking_uri)
        if db is None:
            self.client = MlflowClient(tracking_uri)
        else:  # a new local store starts as a copy of a migrated one (flows/services/store_templates.py)
            with sqlite_from_template(db, "mlflow", importlib.metadata.version("mlflow")):
                self.client = MlflowClient(tracking_uri)
        self.experiment_id = ""
        self.parent_id = ""
        self.node_runs: dict[str, str] = {}
        self.run_path = run_path
        self.courier: Courier | None = None
        self.journal: Journal | None = None
        self._journal_complete = False
        if run_path is not None and remote(tracking_uri):
            spool = Spool(run_path)
            spool.remove_partial_writes()
            self.courier, self.journal = Courier(self.client, spool, tracking_uri), Journal(spool.folder)
            if spool.count():  # what a killed or failed attempt left goes first
                self.courier.kick()

    # ------------------------------------------------------------------ writing: at once, or spooled

    def _post(self, call: Call, stage: Stage | None = None) -> None:
        """Make ``call`` now (a local store), or queue it for the courier (a remote server)."""
        if self.courier is None:
            send(self.client, call)
        else:
            self.courier.post(call, stage)

    def _tag(self, run_id: str, key: str, value: str) -> None:
        if self.journal is not None:
            self.journal.tags(run_id, {key: value})
        self._post({"op": "set_tag", "run_id": run_id, "key": key, "value": value})

    def _batched(self, run_id: str, metrics: Iterable[Metric] = (), params: Iterable[tuple[str, str]] = ()) -> None:
        """Metric batches of ``_BATCH`` points at most (one transaction each), then the params.

        A resumed attempt's batch is logged only if its first point is not in the store (``check``),
        and journaled only if not in the journal (an earlier attempt spooled it before journaling
        it), so the journal the report reads holds what the store holds.
        """
        metrics, params = list(metrics), list(params)
        for i in range(0, len(metrics), _BATCH):
            chunk = metrics[i : i + _BATCH]
            if self.resumed and self.journal is not None and self.journal.has(run_id, chunk[0]):
                continue
            rows = [[m.key, m.value, m.timestamp, m.step] for m in chunk]
            self._post({"op": "log_batch", "run_id": run_id, "metrics": rows, "check": self.resumed})
            if self.journal is not None:  # after the spool has it: a journaled batch is always sent
                self.journal.metrics(run_id, chunk)
        for i in range(0, len(params), 100):
            self._post({"op": "log_batch", "run_id": run_id, "params": [list(p) for p in params[i : i + 100]]})

    def close(self, wait: float | None = None) -> Undelivered | None:
        """Wait up to ``wait`` s (default ``BHFL_TRACKING_WAIT_S``) for calls on their way; None: all arrived."""
        if self.courier is None or self.run_path is None:
            return None
        pending = self.courier.wait(wait)
        rejected = self.courier.spool.rejected_count()
        if not pending and not rejected:
            return None
        return Undelivered(self.run_path, self.uri, pending, rejected, self.courier.last_error if pending else "")

    # ------------------------------------------------------------------ the runs

    def _experiment(self, name: str) -> str:
        """The id of the MLflow experiment ``name``, created (artefacts beside a local store) if new.

        Tagged as a model-training experiment (``EXPERIMENT_KIND``): the UI then opens it on
        its runs and charts, not on the GenAI views it picks for an experiment of unknown kind.
        """
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            return self.client.create_experiment(
                name, artifact_location=_artifact_root(self.uri), tags={EXPERIMENT_KIND: MODEL_TRAINING}
            )
        if EXPERIMENT_KIND not in exp.tags:
            self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        return exp.experiment_id

    def start(
        self,
        name: str,
        params: Mapping[str, Any],
        tree: Tree,
        tags: Mapping[str, str],
        description: str,
        *,
        run_key: str,
        run_name: str | None = None,
        experiment: str | None = None,
        parent_run_id: str | None = None,
    ) -> str:
        """Create the experiment run (the parent run; named ``run_name``, default ``name``) and a run per server.

        ``run_key``: the key the run folder recorded before this call (``ProcessRecord.run_key``); a
        resumed tracker first adopts the runs tagged with it (a killed attempt created them
        and died before recording their ids) and creates only those missing.
        ``experiment``: the MLflow experiment to create it in (default: ``name``);
        ``parent_run_id``: a run to nest it under (a pipeline stage under its pipeline's run).
        TrackingUnavailable: a remote server could not be reached.
        """
        if self.journal is not None:
            self.journal.begin()  # before the runs exist: it holds all they will be sent
        try:
            self.experiment_id = self._experiment(experiment or name)
            nesting = {MLFLOW_PARENT_RUN_ID: parent_run_id} if parent_run_id else {}
            adopted = self._adoptable(run_key)
            self.parent_id = self._create_or_adopt(
                adopted.get(""),
                run_name or name,
                {**tags, **nesting, MLFLOW_RUN_NOTE: description, RUN_KEY_TAG: run_key},
            )
            self._log_params(params)
            # parents before children: walk the tree top-down
            order = [tree.root]
            while order:
                node = order.pop(0)
                if node.is_leaf:
                    continue
                parent_run = self.parent_id if node.parent is None else self.node_runs[node.parent]
                self.node_runs[node.id] = self._create_or_adopt(
                    adopted.get(node.id),
                    node.id,
                    {
                        MLFLOW_PARENT_RUN_ID: parent_run,
                        RUN_KEY_TAG: run_key,
                        "bhfl.node": node.id,
                        "bhfl.level": str(node.depth),
                        "bhfl.role": node.role.value,
                        **({"bhfl.group": node.group} if node.group else {}),
                    },
                )
                order.extend(tree.children(node.id))
        except MlflowException as exc:
            if remote(self.uri) and transient(exc):
                raise TrackingUnavailable(self.uri, exc) from exc
            raise
        return self.parent_id

    def start_pipeline(
        self, name: str, params: Mapping[str, Any], tags: Mapping[str, str], description: str, *, run_key: str
    ) -> str:
        """Create (or adopt, see ``start``) a pipeline's run in the experiment ``name``: stages' runs nest under it."""
        self.experiment_id = self._experiment(name)
        adopted = self._adoptable(run_key).get("")
        tags = {**tags, MLFLOW_RUN_NOTE: description, RUN_KEY_TAG: run_key}
        self.parent_id = self._create_or_adopt(adopted, name, tags)
        self._log_params(params)
        return self.parent_id

    def _adoptable(self, run_key: str) -> dict[str, Run]:
        """The runs of this experiment tagged ``run_key`` by a killed attempt, by node ("" = the parent).

        Only a resumed tracker looks (a first attempt cannot have created any); where a kill
        left two candidates for one place (cannot happen: one attempt creates each once), the
        older is kept.
        """
        if not self.resumed:
            return {}
        found = self.client.search_runs(
            [self.experiment_id],
            f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
            max_results=50_000,
            order_by=["start_time DESC"],
        )
        return {run.data.tags.get("bhfl.node", ""): run for run in found}

    def _create_or_adopt(self, run: Run | None, name: str, tags: Mapping[str, str]) -> str:
        if run is None:
            run_id: str = self.client.create_run(self.experiment_id, run_name=name, tags=dict(tags)).info.run_id
            if self.journal is not None:
                self.journal.tags(run_id, tags)
            return run_id
        run_id = run.info.run_id
        if self.journal is not None:
            self.journal.tags(run_id, run.data.tags)
        for key, value in tags.items():  # a kill may have cut the creation short of nothing, but be sure
            if run.data.tags.get(key) != value:
                self._tag(run_id, key, value)
        if run.info.status != "RUNNING":
            self._post({"op": "update_run", "run_id": run_id, "status": "RUNNING"})
        return run_id

    def _log_params(self, params: Mapping[str, Any]) -> None:
        """The config as parent-run params.

        MLflow refuses a param logged again with another value, and a resume may change
        ``runtime.*`` (it does not change results): a resumed attempt logs only the params
        its killed predecessor had not logged; the run folder's config.yaml has the values
        in force.
        """
        flat = {k[:250]: v[:6000] for k, v in sorted(flatten(params).items())}
        if self.resumed:
            logged = self.client.get_run(self.parent_id).data.params
            flat = {k: v for k, v in flat.items() if k not in logged}
        self._batched(self.parent_id, params=flat.items())

    def reopen_run(self, experiment_id: str, run_id: str, resume_number: int) -> None:
        """Continue a run without node runs (a resumed pipeline's run): running again, tagged."""
        self.reopen(experiment_id, run_id, {}, resume_number)

    @classmethod
    def attach(
        cls,
        tracking_uri: str,
        experiment_id: str,
        parent_id: str,
        node_runs: Mapping[str, str],
        *,
        resumed: bool,
        run_path: Path | None = None,
    ) -> Tracker:
        """A tracker for runs that exist (a node execution rebuilds it from the run record and folder)."""
        tracker = cls(tracking_uri, resumed=resumed, run_path=run_path)
        tracker.experiment_id, tracker.parent_id, tracker.node_runs = experiment_id, parent_id, dict(node_runs)
        return tracker

    def reopen(self, experiment_id: str, parent_id: str, node_runs: Mapping[str, str], resume_number: int) -> None:
        """Continue an existing experiment run (``bhfl resume``): same parent and node runs, tagged."""
        self.experiment_id, self.parent_id, self.node_runs = experiment_id, parent_id, dict(node_runs)
        for run_id in [parent_id, *self.node_runs.values()]:
            self._post({"op": "update_run", "run_id": run_id, "status": "RUNNING"})
        self.tag_resume(resume_number)

    def tag_resume(self, resume_number: int) -> None:
        """Tag the parent run with the number of resumes and when this one started."""
        self._tag(self.parent_id, "bhfl.resumes", str(resume_number))
        self._tag(
            self.parent_id, f"bhfl.resume.{resume_number}", time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
        )

    # ------------------------------------------------------------------ metrics, tags, files

    def log_metrics(self, run_id: str, values: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self._batched(run_id, [Metric(k, float(v), now, step) for k, v in values.items() if not math.isnan(v)])

    def log_node(self, node_id: str, values: Mapping[str, float], step: int) -> None:
        """``values`` on the node's run (a client has none: nothing is logged).

        MLflow's run page makes a chart section of each metric-name prefix (all but the last
        ``/`` segment) and sorts them by code point: the training metrics are named
        ``Training/*`` so that, capitalised, they come before ``comm``, ``eval/*``, ``time``.
        """
        if node_id in self.node_runs:
            self.log_metrics(self.node_runs[node_id], values, step)

    def log_text(self, text: str, artifact_path: str, run_id: str | None = None) -> None:
        self._post({"op": "log_text", "run_id": run_id or self.parent_id, "text": text, "artifact_file": artifact_path})

    def log_artifact(self, path: Path, artifact_dir: str | None = None) -> None:
        call = {"op": "log_artifact", "run_id": self.parent_id, "artifact_path": artifact_dir}
        if self.courier is None:
            self._post({**call, "source": str(path)})
        else:  # a copy waits with the call: the file may change or go before it is delivered
            self._post({**call, "source": path.name}, lambda folder: shutil.copy2(path, folder / path.name))

    def log_artifacts(self, folder: Path, artifact_dir: str | None = None) -> None:
        """Every file under ``folder`` to the parent run (``artifact_dir`` None: the artefact root)."""
        call = {"op": "log_artifacts", "run_id": self.parent_id, "artifact_path": artifact_dir}
        if self.courier is None:
            self._post({**call, "source": str(folder)})
        else:
            self._post({**call, "source": "."}, lambda staged: shutil.copytree(folder, staged, dirs_exist_ok=True))

    def share_headline_view(self, metrics: Iterable[str]) -> None:
        """Save the experiment's run-list view with ``metrics`` as columns (``runs_link`` opens it).

        The UI shows no metric column by default (a run logs hundreds); this view shows the
        headlines. One tag per experiment, rewritten by each run: idempotent, so a resume may
        write it again.
        """
        view = headline_view(metrics)
        key = SHARED_VIEW_TAG + HEADLINE_VIEW_KEY
        self._post({"op": "set_experiment_tag", "experiment_id": self.experiment_id, "key": key, "value": view})

    def set_tags(self, tags: Mapping[str, str], run_id: str | None = None) -> None:
        for k, v in tags.items():
            self._tag(run_id or self.parent_id, k, v)

    def log_data_report(self, data_root: Path) -> None:
        """The prepared data's manifest and partition report (plots, summary) under ``data/`` of the parent run.

        Headline partition numbers also go in as parent-run metrics (``data/clients``,
        ``data/size_median``, ``data/label_skew_tv``, ...) and tags, so runs can be
        sorted and filtered by their data in the UI.
        """
        self.log_artifact(data_root / "manifest.json", "data")
        report = data_root / "report"
        if not report.is_dir():
            return
        self.log_artifacts(report, "data")
        summary = json.loads((report / "summary.json").read_text(encoding="utf-8"))
        sizes, skew, proxy = summary.get("sizes", {}), summary.get("label_skew", {}), summary.get("proxy", {})
        values = {
            "data/clients": summary.get("clients"),
            "data/edges": summary.get("edges"),
            "data/size_min": sizes.get("min"),
            "data/size_median": sizes.get("median"),
            "data/size_max": sizes.get("max"),
            "data/label_skew_tv": skew.get("tv_to_language_mean"),
            "data/proxy_train": proxy.get("train"),
            "data/proxy_test": proxy.get("test"),
            "data/unused_pool_rows": summary.get("unused_pool_rows"),
        }
        self.log_metrics(self.parent_id, {k: v for k, v in values.items() if v is not None}, step=0)
        self.set_tags(
            {"bhfl.task": str(summary.get("task", "")), "bhfl.data_source": str(summary.get("source", ""))[:5000]}
        )

    def describe(self, run_id: str, note: str) -> None:
        self._tag(run_id, MLFLOW_RUN_NOTE, note)

    def finish(self, status: str) -> None:
        """End the runs with ``status``, at this moment (also when the call reaches the server later)."""
        end_time = int(time.time() * 1000)
        for run_id in [*self.node_runs.values(), self.parent_id]:
            if run_id:
                self._post({"op": "terminate", "run_id": run_id, "status": status, "end_time": end_time})

    # ------------------------------------------------------------------ reading back

    def _from_journal(self) -> bool:
        """Whether reads come from the run folder's journal (complete: begun with the run), not the store."""
        if not self._journal_complete and self.journal is not None:
            self._journal_complete = self.journal.complete
        return self._journal_complete

    def points(self, run_id: str, key: str) -> list[Metric]:
        """Every value logged of ``key`` on ``run_id`` (all attempts of the run)."""
        if self._from_journal() and self.journal is not None:
            return self.journal.points(run_id, key)
        return list(self.client.get_metric_history(run_id, key))

    def metrics(self, run_id: str) -> dict[str, float]:
        """A run's latest metric values."""
        if self._from_journal() and self.journal is not None:
            return self.journal.latest(run_id)
        return dict(self.client.get_run(run_id).data.metrics)

    def history(self, run_id: str, key: str) -> dict[int, float]:
        """A metric's values by step; where a step was logged twice (a re-run round), the later write wins."""
        points = sorted(self.points(run_id, key), key=lambda m: (m.step, m.timestamp))
        return {m.step: m.value for m in points}

    def values_at(self, run_id: str, keys: Iterable[str], step: int) -> dict[str, float]:
        """The values of ``keys`` logged at ``step`` (those logged there; the earliest write if twice)."""
        out = {}
        for key in keys:
            at_step = [m for m in self.points(run_id, key) if m.step == step]
            if at_step:
                out[key] = min(at_step, key=lambda m: m.timestamp).value
        return out

    def note(self, run_id: str) -> str:
        """A run's description (the note the UI shows at the top of the run page)."""
        if self._from_journal() and self.journal is not None:
            return self.journal.run_tags(run_id).get(MLFLOW_RUN_NOTE, "")
        return self.client.get_run(run_id).data.tags.get(MLFLOW_RUN_NOTE, "")
