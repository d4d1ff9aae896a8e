"""Scale: `bhfl run` from 100 to 10,000+ clients, phase by phase, against a plain loop doing the same trainings.

Each case is a population (``--populations``: clients in all) and a number of client
trainings per root round (``--cohorts``), on the embedded experiment
(``configs/embedded.yaml``: tiny model, 5 languages, root -> 2 intermediate servers -> one
edge server per language -> clients) changed only through ``--set`` overrides: clients per
language = population / languages, ``data.sizes: {median: 40, sigma: 0.8, min: 10, max:
200}``, root without proxy training, intermediate servers and edge servers 1 round per
execution, non-persistent clients (``--persistent``: persistent with ``tree.client.eta_down:
0.5``, so each keeps a state on disk that its next execution reads; with the embedded 1.0
a persistent client adopts its parent's model and bhfl writes nothing for it unless
``--eval-client-models``),
``eval: {every: 0, client_models: false}`` (``--eval-client-models``: true). The cohort is
per edge server (``tree.edge.cohort``), so it is solved from the resolved tree: clients
trained per root round = edge cohort x (what one unit of edge cohort gives per root round:
edges x edge rounds x intermediate rounds, from the config's own tree with a population of
that size); a figure the tree cannot give exactly is rounded to the nearest it can and
printed. Root rounds: ``--rounds``, or ``--trainings`` / clients per round. ``--set`` may
change any other key; ``data.clients_per_language``, ``tree.root.rounds`` and
``tree.edge.cohort`` are the benchmark's (set after yours).

bhfl: ``python -m flows.cli.app run configs/embedded.yaml --set ... --run-dir <fresh
folder>`` with this interpreter, from the repository root holding this file (and that root
first on ``PYTHONPATH``, for its workers too), so it measures this checkout; a fresh process,
its own Prefect server (unless ``--prefect-api-url``), its local workers, a cold data cache.

Figures per case (median over ``--repeats``; bhfl and loop interleaved):

- wall s: process start (psutil's creation time) -> process exit, as the harness sees it;
- the phases, which add up to wall s exactly (contiguous boundaries):
  start-up s: process start -> the experiment flow starts (imports, Prefect server, the
  CLI's checks); prepare s: flow start -> data ready (data generation, partition,
  tokenisation, written to the cache); set-up s: data ready -> first client training
  (MLflow runs, workers, the initial model, the first dispatch); train s: first client
  training -> last root aggregate; close s: last root aggregate -> the training phase
  returns (the root round's commit and logging, the subflows' ends); evaluate s: the final
  evaluation; report s: the rest until the process exits (run-level figures and files to
  MLflow, the report, Prefect and worker shutdown);
- after / train: (process exit - last aggregate) / train s (close + evaluate + report);
- cl/s wall, cl/s train: client trainings / wall s and / train s;
- peak PSS MB: the highest sum of PSS over the process and all its descendants (workers,
  Prefect server), read every ``--interval`` s (0.5) by a thread here (benchmarks/_proc.py);
  the line printed after each run gives the peak of each phase too (evaluate: from the last
  aggregate, close included);
- busy %: each worker's busy share of the training span (first training -> last
  aggregate), from the busy intervals the workers write (``<run>/timeline/busy/``), min-max
  over the workers (placement keeps them within 10% of each other when max/min <= 1.1);
- run MB, B/client: the run folder's size on disk (allocated blocks: node states,
  checkpoints, report, record) and that per client of the population; data MB: the
  prepared data cache the run used (not in the run folder);
- worker fds (``--persistent`` only): the most open file descriptors one worker process
  held at a sample.

Where the boundaries come from: the run's record (``<run>/run.json``, ``timeline``:
``process_start``, ``flow_start``, ``data_ready``, ``first_training``, ``last_aggregate``).
The final evaluation has no timeline mark: its start and end come from the run-level
figures the run logs to its MLflow parent run (``time/setup_s`` + ``time/train_s`` after
``flow_start``, then ``time/final_eval_s``); where those are missing, the end is the time
this harness read bhfl's stderr line ``evaluated N models after root round R`` (every line
of both pipes is timestamped on arrival; the printed check compares the two) and close s
is left out (folded into evaluate s). The trainings are counted from the edge servers'
``Training/clients`` in MLflow and checked against the plan.

The loop (``--skip-loop`` leaves it out): the same amount of work in one plain Python
process with no Prefect, MLflow or Dask, on the data bhfl prepared for the case (the run
folder is opened with the project's own loaders, tasks/context.py's ``RunContext``: data
generation stays outside its timing; a client's training rows as bhfl's worker loads them,
``LocalTrainer._data``, and the test rows as bhfl's evaluation does, ``RunContext.test_sets``,
so it keeps working when the shards' layout on disk changes): per round, the same number of
clients per edge server drawn at random (the same amount of work, not bhfl's draws), each
trained from the current global model on its training rows with the case's client
``train`` settings through bhfl's
``train_model`` (pure torch: same model, optimiser, epochs, batch size and padding trim,
1 torch thread like a bhfl worker), the new global = the example-weighted mean of the
round's models (FedAvg over all of them at once); then the final model scored once on
every client's test rows and the proxy test rows (bhfl scores every server model: 8 here).
Its phases: start-up = its imports, prepare = opening the run's data (manifest, tree),
set-up = building the model, then train, evaluate and report as above. Its peak PSS is
sampled the same way; one process training on one core (bhfl: 2 workers on 2 cores).

The harness and the processes it starts import bhfl from the checkout that holds this
file. Run (the issue's cases; the large ones take minutes and GBs):
    .venv/bin/python benchmarks/scale.py --populations 100 1000 10000 --cohorts 100 1000 --rounds 10
    .venv/bin/python benchmarks/scale.py --populations 10000 --cohorts 100 200 500 1000 --trainings 10000
    .venv/bin/python benchmarks/scale.py --populations 1000 --cohorts 100 --persistent --skip-loop
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
from _env import REPO, add_set_option, offline_quiet
from _proc import TreeSampler

SIZES = "{median: 40, sigma: 0.8, min: 10, max: 200}"
EVALUATED = re.compile(r"^evaluated \d+ models after root round \d+")
Figures = dict[str, Any]
# column -> (format, key of the figures); NaN / missing prints "-"
COLUMNS: dict[str, tuple[str, str]] = {
    "wall s": ("{:.1f}", "wall"),
    "start-up s": ("{:.1f}", "startup"),
    "prepare s": ("{:.1f}", "prepare"),
    "set-up s": ("{:.1f}", "setup"),
    "train s": ("{:.1f}", "train"),
    "close s": ("{:.1f}", "close"),
    "evaluate s": ("{:.1f}", "evaluate"),
    "report s": ("{:.1f}", "report"),
    "after / train": ("{:.0%}", "after_share"),
    "cl/s wall": ("{:.2f}", "cps_wall"),
    "cl/s train": ("{:.2f}", "cps_train"),
    "peak PSS MB": ("{:.0f}", "pss_mb"),
    "busy % min-max": ("{}", "busy"),
    "run MB": ("{:.1f}", "run_mb"),
    "B/client": ("{:.0f}", "bytes_per_client"),
    "data MB": ("{:.1f}", "data_mb"),
    "worker fds": ("{:.0f}", "worker_fds"),
}


# ---------------------------------------------------------------- the case: overrides and the tree they give


@dataclass(frozen=True)
class Case:
    population: int  # clients in all (languages x clients per language)
    asked: int  # clients per round asked for
    per_round: int  # client trainings per root round the tree gives
    edge_cohort: int
    unit: float  # trainings per root round per unit of edge cohort
    edges: tuple[str, ...]
    per_edge_round: int  # clients one edge server trains per root round
    per_language: int
    rounds: int
    overrides: tuple[str, ...]

    @property
    def trainings(self) -> int:
        return self.per_round * self.rounds

    @property
    def name(self) -> str:
        return f"scale-{self.population}x{self.per_round}"

    def describe(self) -> str:
        return (
            f"{self.population} clients ({len(self.edges)} edge servers x {self.per_language}), "
            f"tree.edge.cohort={self.edge_cohort}: {self.per_round} client trainings per root round "
            f"({self.per_edge_round} per edge server; asked {self.asked}), {self.rounds} root rounds = "
            f"{self.trainings} trainings"
        )


def base_overrides(args: argparse.Namespace) -> list[str]:
    """The issue's population-only changes of the embedded config (the benchmark's own keys come later)."""
    return [
        f"data.sizes={SIZES}",
        "tree.root.proxy_train=false",
        "tree.server.rounds=1",
        "tree.edge.rounds=1",
        f"tree.client.persistent={str(args.persistent).lower()}",
        # a persistent client with eta_down 1.0 adopts its parent's model: nothing of it is read again, so bhfl
        # writes no state for it (unless its model is scored); 0.5 mixes its own model in, read from disk
        *(["tree.client.eta_down=0.5"] if args.persistent else []),
        "eval.every=0",
        f"eval.client_models={str(args.eval_client_models).lower()}",
    ]


def _trainings_per_execution(tree: Any, node: Any) -> float:
    """Client trainings one execution of ``node`` makes (a server samples ``cohort`` of its children per round)."""
    if node.is_leaf:
        return 1.0
    children = tree.children(node.id)
    sampled = node.settings.cohort or len(children)
    mean = sum(_trainings_per_execution(tree, c) for c in children) / len(children)
    return node.settings.rounds * sampled * mean


def _tree(config: Path, overrides: list[str], per_language: int) -> tuple[Any, Any]:
    """The config with ``overrides`` (validated by bhfl's loader) and its tree over a population of that size."""
    from bhfl_core.config.loader import load_config
    from bhfl_core.config.topology import ClientInfo, build_tree

    cfg = load_config(config, overrides)
    languages = list(cfg.data.source.languages)
    clients = [ClientInfo(f"{lang}-{j:06d}", lang, 32) for lang in languages for j in range(per_language)]
    return cfg, build_tree(cfg, clients)


def resolve(
    args: argparse.Namespace, population: int, per_round: int, languages: int
) -> Case | str:  # a case, or why it is skipped
    from bhfl_core.algorithm.tree import Role

    per_language = population // languages
    if per_language < 1:
        return f"population {population} has fewer clients than the {languages} languages"
    sets = [*base_overrides(args), *args.overrides, f"data.clients_per_language={per_language}"]
    _, tree = _tree(args.config, [*sets, "tree.root.rounds=1", "tree.edge.cohort=1"], per_language)
    edges = [n for n in tree if n.role == Role.EDGE]
    unit = _trainings_per_execution(tree, tree.root) / tree.root.settings.rounds
    cohort = max(1, round(per_round / unit))
    smallest = min(len(e.children) for e in edges)
    if cohort > smallest:
        return f"{per_round} clients per round needs tree.edge.cohort={cohort}, above the {smallest} clients of an edge"
    given = round(cohort * unit)
    rounds = max(1, round(args.trainings / given)) if args.trainings else args.rounds
    sets += [f"tree.root.rounds={rounds}", f"tree.edge.cohort={cohort}"]
    _, tree = _tree(args.config, sets, per_language)  # the very config bhfl gets, validated
    check = _trainings_per_execution(tree, tree.root)
    if round(check) != given * rounds:
        raise RuntimeError(f"the resolved tree trains {check} clients, not {given * rounds}")
    per_edge = round(given / len(edges))  # each edge server's share of a root round (the loop draws as many)
    return Case(
        population=per_language * languages,
        asked=per_round,
        per_round=given,
        edge_cohort=cohort,
        unit=unit,
        edges=tuple(e.id for e in edges),
        per_edge_round=per_edge,
        per_language=per_language,
        rounds=rounds,
        overrides=(*sets, f"name=scale-{per_language * languages}x{given}"),
    )


# ---------------------------------------------------------------- measuring a process


class Sampler(TreeSampler):
    """benchmarks/_proc.py's process-tree sampler (CPU and PSS every ``interval`` s), plus each process's peak fds."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(pid, interval_s=interval, pss_interval_s=interval)
        self.fds: dict[int, int] = {}  # pid -> most open file descriptors seen

    def sample(self) -> None:
        super().sample()
        for proc in self._processes():
            try:
                self.fds[proc.pid] = max(self.fds.get(proc.pid, 0), proc.num_fds())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue


def _drain(stream: IO[str], into: list[tuple[float, str]]) -> threading.Thread:
    """Read ``stream`` line by line in a thread, each line with the wall time it arrived."""

    def read() -> None:
        for line in stream:
            into.append((time.time(), line.rstrip("\n")))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@dataclass
class Measured:
    started: float  # the process's creation time
    exited: float
    stdout: list[tuple[float, str]]
    stderr: list[tuple[float, str]]
    sampler: Sampler


def measure(cmd: list[str], env: dict[str, str], interval: float) -> Measured:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = psutil.Process(proc.pid).create_time()
    out: list[tuple[float, str]] = []
    err: list[tuple[float, str]] = []
    with Sampler(proc.pid, interval) as sampler:
        readers = [_drain(proc.stdout, out), _drain(proc.stderr, err)]  # type: ignore[arg-type]
        proc.wait()
        exited = time.time()
        for reader in readers:
            reader.join()
    if proc.returncode:
        tail = "\n".join(line for _, line in err[-60:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{tail}")
    return Measured(started, exited, out, err, sampler)


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """This checkout first on the path (workers included); no Prefect server, home or MLflow store of the caller's."""
    drop = ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    if args.prefect_api_url:
        env["PREFECT_API_URL"] = args.prefect_api_url
    return env


def disk_bytes(path: Path) -> int:
    """Allocated size on disk of everything under ``path`` (du's figure)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


PHASE_PEAKS = {  # figure -> (from, to) boundaries: the peak PSS within each stretch of the run
    "pss_startup": ("start", "flow"),
    "pss_prepare": ("flow", "data"),
    "pss_setup": ("data", "first"),
    "pss_train": ("first", "last"),
    "pss_evaluate": ("last", "eval_end"),
    "pss_report": ("eval_end", "exit"),
}


def phase_peaks(sampler: Sampler, t: dict[str, float], exited: float) -> Figures:
    """The peak PSS (MB) of each stretch of the run (a sample on a boundary counts in both)."""
    bounds = {**t, "exit": exited}
    return {key: sampler.peak_pss_mb(bounds[a], bounds[b]) for key, (a, b) in PHASE_PEAKS.items()}


def phases(t: dict[str, float], exited: float, trainings: int) -> Figures:
    """Phase seconds from boundaries ``t`` (absent ones NaN) and the figures derived from them."""
    nan = math.nan
    g = {k: t.get(k, nan) for k in ("start", "flow", "data", "first", "last", "eval_start", "eval_end")}
    close = g["eval_start"] - g["last"]
    evaluate = g["eval_end"] - g["eval_start"]
    if math.isnan(close):  # no start of the evaluation: close folded into evaluate
        evaluate = g["eval_end"] - g["last"]
    train = g["last"] - g["first"]
    wall = exited - g["start"]
    return {
        "wall": wall,
        "startup": g["flow"] - g["start"],
        "prepare": g["data"] - g["flow"],
        "setup": g["first"] - g["data"],
        "train": train,
        "close": close,
        "evaluate": evaluate,
        "report": exited - g["eval_end"],
        "after_share": (exited - g["last"]) / train,
        "cps_wall": trainings / wall,
        "cps_train": trainings / train,
        "trainings": trainings,
    }


# ---------------------------------------------------------------- bhfl


def _mlflow_figures(record: dict[str, Any], edges: tuple[str, ...]) -> tuple[dict[str, float], float]:
    """The parent run's step-0 figures (``time/*``, ...) and the client trainings the edge servers logged."""
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(record["tracking_uri"])
        metrics = dict(client.get_run(record["parent_run_id"]).data.metrics)
        runs = record.get("node_runs", {})
        counted = sum(
            m.value for e in edges if e in runs for m in client.get_metric_history(runs[e], "Training/clients")
        )
        return metrics, float(counted)
    except Exception as exc:  # (an MLflow that cannot be read: the stderr timestamps are the fallback)
        print(f"  (MLflow figures not read: {exc})")
        return {}, math.nan


def _busy(run_path: Path, workers: list[str], span: tuple[float, float]) -> dict[str, float]:
    """Each worker's busy share of ``span``, from the intervals the workers wrote in the run folder."""
    from bhfl_core.placement import utilisation
    from tasks.worker import busy_intervals

    intervals = busy_intervals(run_path)
    return {w: utilisation({w: intervals.get(w, [])}, 1, span)[0] for w in workers}


def run_bhfl(args: argparse.Namespace, case: Case, folder: Path) -> tuple[Figures, Path]:
    run_dir = folder / "runs"
    sets = [a for o in case.overrides for a in ("--set", o)]
    cmd = [sys.executable, "-m", "flows.cli.app", "run", str(args.config), "--run-dir", str(run_dir), *sets]
    m = measure(cmd, child_env(args), args.interval)
    (run_path,) = (run_dir / case.name).iterdir()
    record = json.loads((run_path / "run.json").read_text())
    timeline = record.get("timeline") or {}
    metrics, counted = _mlflow_figures(record, case.edges)
    flow = timeline.get("flow_start", math.nan)
    eval_start = flow + metrics.get("time/setup_s", math.nan) + metrics.get("time/train_s", math.nan)
    eval_end = eval_start + metrics.get("time/final_eval_s", math.nan)
    seen = [t for t, line in m.stderr if EVALUATED.match(line)]
    line_end = seen[-1] if seen else math.nan
    if math.isnan(eval_end):
        eval_end = line_end
    bounds = {
        "start": m.started,
        "flow": flow,
        "data": timeline.get("data_ready", math.nan),
        "first": timeline.get("first_training", math.nan),
        "last": timeline.get("last_aggregate", math.nan),
        "eval_start": eval_start,
        "eval_end": eval_end,
    }
    fig = phases(bounds, m.exited, case.trainings)
    workers = [w["name"] for w in record.get("workers", [])]
    busy = _busy(run_path, workers, (bounds["first"], bounds["last"])) if workers else {}
    worker_pids = {int(w["pid"]) for w in record.get("workers", []) if str(w.get("pid", "")).isdigit()}
    data_root = Path(json.loads((run_path / "data.json").read_text())["data_root"])
    run_bytes = disk_bytes(run_path)
    fig.update(
        {
            "pss_mb": m.sampler.peak_pss_mb(),
            **phase_peaks(m.sampler, bounds, m.exited),
            "cpu_s": m.sampler.cpu_s,
            "busy": (min(busy.values()), max(busy.values())) if busy else None,
            "run_mb": run_bytes / 2**20,
            "bytes_per_client": run_bytes / case.population,
            "data_mb": disk_bytes(data_root) / 2**20,
            "worker_fds": max((m.sampler.fds.get(p, 0) for p in worker_pids), default=math.nan),
            "counted": counted,
            "eval_line_lag": line_end - eval_end,
            "utilisation": metrics.get("runtime/worker_utilisation", math.nan),
            "all_busy": metrics.get("runtime/all_workers_busy", math.nan),
        }
    )
    return fig, run_path


# ---------------------------------------------------------------- the plain loop, in its own process


def loop_child(run_path: Path, plan: dict[str, Any]) -> None:
    """In a fresh process: the plain FedAvg loop on the run's prepared data; prints its timestamps as JSON."""
    started = psutil.Process().create_time()
    import numpy as np
    import torch

    from bhfl_core.algorithm.tree import Role
    from bhfl_core.learning.local_train import train_model
    from tasks.client_training import LocalTrainer
    from tasks.context import RunContext

    imported = time.time()
    ctx = RunContext.open(run_path)  # the run's config, data manifest and tree: the project's loaders
    cfg, tree = ctx.config, ctx.tree
    edges = [[c.id for c in tree.children(n.id)] for n in tree if n.role == Role.EDGE]
    data_ready = time.time()
    torch.set_num_threads(cfg.runtime.torch_threads or 1)
    device = torch.device("cpu")
    model = ctx.build_model(cfg.seed + cfg.model.init_seed_offset)
    # A client's training rows as bhfl's worker loads them (whatever the data layout on disk is).
    rows_of = LocalTrainer(ctx, model, device)._data
    params = [p for p in model.parameters() if p.requires_grad]
    global_weights = [p.detach().clone() for p in params]
    rng = np.random.default_rng(cfg.seed)
    per_edge = plan["per_edge"]
    first, trainings, examples = 0.0, 0, 0
    for _ in range(plan["rounds"]):
        cohort = [str(cid) for ids in edges for cid in rng.choice(ids, per_edge, replace=per_edge > len(ids)).tolist()]
        total, new = 0, [torch.zeros_like(w) for w in global_weights]
        for cid in cohort:
            first = first or time.time()
            node = tree[cid]
            rows = rows_of(node)[0]
            with torch.no_grad():
                for p, w in zip(params, global_weights):
                    p.copy_(w)
            result = train_model(model, rows, node.settings.train, int(rng.integers(2**31)), device)
            with torch.no_grad():
                for acc, p in zip(new, params):
                    acc.add_(p.detach(), alpha=float(result.examples))
            total += result.examples
            trainings += 1
        global_weights = [acc / max(total, 1) for acc in new]
        examples += total
    last = time.time()
    with torch.no_grad():
        for p, w in zip(params, global_weights):
            p.copy_(w)
    _, test, _ = ctx.test_sets("proxy")  # every client's test rows and the proxy test rows, as evaluation loads them
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(test["labels"]), cfg.eval.batch_size):
            batch = {k: v[i : i + cfg.eval.batch_size] for k, v in test.items()}
            if "attention_mask" in batch:
                width = int(batch["attention_mask"].sum(dim=1).max())
                batch = {k: v[:, :width] if v.dim() == 2 else v for k, v in batch.items()}
            labels = batch.pop("labels")
            correct += int((model(**batch).logits.argmax(-1) == labels).sum())
    done = time.time()
    print(
        json.dumps(
            {
                "start": started,
                "flow": imported,
                "data": data_ready,
                "first": first,
                "last": last,
                "eval_start": last,
                "eval_end": done,
                "trainings": trainings,
                "examples": examples,
                "accuracy": correct / max(len(test["labels"]), 1),
            }
        )
    )


def run_loop(args: argparse.Namespace, case: Case, run_path: Path) -> Figures:
    plan = {"rounds": case.rounds, "per_edge": case.per_edge_round}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--loop-child", str(run_path), json.dumps(plan)]
    m = measure(cmd, child_env(args), args.interval)
    t = json.loads(m.stdout[-1][1])
    fig = phases(t, m.exited, t["trainings"])
    fig["close"] = math.nan  # the loop's training ends where its evaluation starts
    fig.update(
        {
            "pss_mb": m.sampler.peak_pss_mb(),
            **phase_peaks(m.sampler, t, m.exited),
            "cpu_s": m.sampler.cpu_s,
            "accuracy": t["accuracy"],
            "examples": t["examples"],
        }
    )
    return fig


# ---------------------------------------------------------------- figures and the table


def median(runs: list[Figures]) -> Figures:
    """Per figure, the median over the runs of the values that are numbers (min-max pairs: medians of each)."""
    out: Figures = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        if all(isinstance(v, tuple) for v in values):
            out[key] = tuple(statistics.median(v[i] for v in values) for i in range(2))
            continue
        known = [v for v in values if isinstance(v, int | float) and not math.isnan(v)]
        out[key] = statistics.median(known) if known else math.nan
    return out


def cell(fmt: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, tuple):
        return f"{value[0]:.0%}-{value[1]:.0%}".replace("%", "")
    return fmt.format(value)


def table(rows: list[tuple[Case, str, Figures]], persistent: bool) -> str:
    columns = {c: spec for c, spec in COLUMNS.items() if persistent or c != "worker fds"}
    head = ["population", "clients/round", "trainings", "run", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, who, fig in rows:
        values = [cell(fmt, fig.get(key)) for fmt, key in columns.values()]
        start = [f"{case.population:,}", f"{case.per_round:,}", f"{round(fig['trainings']):,}", who]
        lines.append("| " + " | ".join([*start, *values]) + " |")
    return "\n".join(lines)


def memory_lines(rows: list[tuple[Case, str, Figures]]) -> list[str]:
    """bhfl's peak PSS relative to the smallest population at the same clients per round."""
    out = []
    for per_round in sorted({c.per_round for c, _, _ in rows}):
        same = sorted(
            ((c, f) for c, who, f in rows if who == "bhfl" and c.per_round == per_round), key=lambda x: x[0].population
        )
        if len(same) > 1:
            base = same[0][1]["pss_mb"]
            ratios = ", ".join(f"{c.population:,}: {f['pss_mb'] / base:.2f}x" for c, f in same)
            out.append(
                f"bhfl peak PSS at {per_round:,} clients/round, relative to {same[0][0].population:,} clients: {ratios}"
            )
    return out


# ---------------------------------------------------------------- the invocation


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    parser.add_argument("--populations", type=int, nargs="+", default=[100, 1000, 10000], help="clients in all")
    parser.add_argument("--cohorts", type=int, nargs="+", default=[100, 1000], help="client trainings per root round")
    rounds = parser.add_mutually_exclusive_group()
    rounds.add_argument("--rounds", type=int, default=2, help="root rounds (default 2)")
    rounds.add_argument("--trainings", type=int, help="client trainings in all: root rounds = this / clients per round")
    parser.add_argument("--persistent", action="store_true", help="persistent clients (their states on disk)")
    parser.add_argument("--eval-client-models", action="store_true", help="eval.client_models: true")
    add_set_option(parser)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "embedded.yaml", help="the base config")
    parser.add_argument("--skip-loop", action="store_true", help="no plain-loop reference")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case (figures: medians)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between PSS and CPU samples")
    parser.add_argument(
        "--prefect-api-url", help="run bhfl against this running Prefect server (its memory not counted)"
    )
    parser.add_argument("--out", type=Path, help="also write the markdown table (and the notes under it) here")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (their paths are printed)")
    parser.add_argument("--work-dir", type=Path, help="where the run folders go (default: the system's temp dir)")
    parser.add_argument("--loop-child", nargs=2, metavar=("RUN", "PLAN"), help=argparse.SUPPRESS)
    return parser.parse_args()


def _detail(case: Case, who: str, fig: Figures) -> str:
    peaks = ", ".join(f"{key[4:]} {fig[key]:.0f}" for key in PHASE_PEAKS)
    common = (
        f"  {who}: wall {fig['wall']:.1f} s, train {fig['train']:.1f} s, CPU {fig['cpu_s']:.1f} s, "
        f"peak PSS {fig['pss_mb']:.0f} MB ({peaks})"
    )
    if who == "loop":
        return common + f", {fig['examples']:,} examples, test accuracy {fig['accuracy']:.3f}"
    phase_sum = sum(
        v
        for k in ("startup", "prepare", "setup", "train", "close", "evaluate", "report")
        if not math.isnan(v := fig[k])
    )
    counted = fig["counted"]
    trained = "?" if math.isnan(counted) else f"{counted:.0f}"
    return (
        common + f"; phases sum {phase_sum:.1f} s; trainings counted {trained} of {case.trainings}; "
        f"'evaluated' line {fig['eval_line_lag']:+.2f} s after MLflow's evaluation end; "
        f"worker utilisation {fig['utilisation']:.2f}, all busy {fig['all_busy']:.2f}"
    )


def main() -> None:
    args = parse_args()
    if args.loop_child:
        loop_child(Path(args.loop_child[0]), json.loads(args.loop_child[1]))
        return
    offline_quiet()
    if str(REPO) not in sys.path:  # bhfl from this checkout here too (an editable install may point elsewhere)
        sys.path.insert(1, str(REPO))
    from bhfl_core.config.loader import load_config

    languages = len(load_config(args.config, [*base_overrides(args), *args.overrides]).data.source.languages)
    cases: list[Case] = []
    for population in args.populations:
        for per_round in args.cohorts:
            case = resolve(args, population, per_round, languages)
            if isinstance(case, str):
                print(f"skipped {population} x {per_round}: {case}")
            else:
                cases.append(case)
    work = Path(tempfile.mkdtemp(prefix="bhfl-scale-", dir=args.work_dir))
    rows: list[tuple[Case, str, Figures]] = []
    try:
        for case in cases:
            print(f"\n{case.describe()}\n  --set " + " --set ".join(case.overrides), flush=True)
            bhfl, loop = [], []
            for i in range(args.repeats):
                folder = work / f"{case.name}-{i}"
                folder.mkdir()
                fig, run_path = run_bhfl(args, case, folder)
                bhfl.append(fig)
                print(_detail(case, "bhfl", fig), flush=True)
                if not args.skip_loop:
                    loop.append(run_loop(args, case, run_path))
                    print(_detail(case, "loop", loop[-1]), flush=True)
                if args.keep:
                    print(f"  run folder: {run_path}")
                else:
                    shutil.rmtree(folder, ignore_errors=True)
            rows.append((case, "bhfl", median(bhfl)))
            if loop:
                rows.append((case, "loop", median(loop)))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if not rows:
        return
    extras = "".join(
        [", persistent clients" if args.persistent else "", ", client models scored" if args.eval_client_models else ""]
    )
    config = args.config.resolve()
    shown = config.relative_to(REPO) if config.is_relative_to(REPO) else config
    title = (
        f"bhfl run on {shown} ({'; '.join(args.overrides) or 'no extra --set'}{extras}); {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d')}; median of {args.repeats}; peak PSS of the process tree every {args.interval:g} s"
    )
    text = "\n".join([title, "", table(rows, args.persistent), "", *memory_lines(rows)])
    print("\n" + text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
