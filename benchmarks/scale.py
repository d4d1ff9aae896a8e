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
import shutil
import sys
import tempfile
import time
from pathlib import Path

# The harness in parts beside this command: _scale_case.py (a case's overrides and tree), _scale_measure.py
# (measuring a process: memory, output lines, phases), _scale_bhfl.py (a bhfl run and its records),
# _scale_loop.py (the plain-loop reference), _scale_table.py (medians and the table). This file is the invocation.
from _env import REPO, add_set_option, offline_quiet
from _scale_bhfl import run_bhfl
from _scale_case import Case, base_overrides, resolve
from _scale_loop import loop_child, run_loop
from _scale_measure import PHASE_PEAKS, Figures
from _scale_table import median, memory_lines, table


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
