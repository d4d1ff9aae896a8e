"""A LoRA experiment at BERT-base (or XLM-R base) size: full fine-tuning against LoRA folded three ways.

What a user with a downloaded checkpoint runs: a model folder in ``save_pretrained``
layout (benchmarks/_lora_folders.py: BERT-base or XLM-R base dimensions and embedding
rows, random weights, a tokenizer trained on the generated corpus; the hub cannot be
reached here) given as ``model.name: DIR`` to ``bhfl run`` (the real CLI: its own
Prefect server, MLflow store, 2 CPU workers) on the generated multilingual corpus, in a
tree shrunk to fit 2 cores (``SHRINK``: 3 languages x 2 clients, root -> 3 edge servers,
2 root rounds of 1 edge round with both clients, 32 tokens). Variants (``VARIANTS``):

- full: configs/bhfl.yaml, every parameter trained, sent and aggregated;
- ab-mean, ffa, exact: configs/bhfl-lora.yaml (r 8 on query and value, lr 0.03) with
  ``model.adapter.aggregation`` set (docs/algorithm.md, "LoRA adapters: how A and B are
  folded"); ab-mean logs its error (``error_metric: true``), exact its truncation error.

Per variant, mean ± std over the seeds (``seed``: data, model and every draw):

- values/model: what one model sent up carries (communication.csv: up bytes / models / 4);
- MB/round: every byte sent, up and down, over the run / root rounds;
- root union, edge own, client own: the report's accuracies (root on the union of client
  tests; each edge's model on its clients' tests, mean; each client's own model);
- ab err / trunc err: ``adapter/ab_error`` / ``adapter/truncation_error``, mean over every
  server and round (MLflow);
- wall s: process start -> exit of ``bhfl run`` (start-up, evaluation, report included);
- peak PSS MB: the highest summed PSS of its process tree (benchmarks/_proc.py).

Accuracy on a random backbone is weak, more so through adapters (docs/results.md). Usage::

    .venv/bin/python benchmarks/lora_experiment.py [--architecture bert|xlmr] [--model base|tiny]
        [--model-dir DIR] [--seeds 0 1 2] [--variants full ab-mean ffa exact] [--jobs 1] [--set KEY=VALUE ...]

``--model-dir DIR``: a model folder of your own (``save_pretrained`` layout with its
tokenizer, e.g. a downloaded mBERT or XLM-R) used as it is instead of a random one: the
accuracy columns then compare the folds on a pretrained backbone.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from _env import REPO, add_set_option, offline_quiet
from _lora_folders import write_folder
from throughput import run_bhfl

SHRINK: dict[str, Any] = {
    "data": {
        "source": {"languages": ["en", "de", "fr"]},
        "clients_per_language": 2,
        "sizes": {"median": 40, "sigma": 0.3, "min": 20, "max": 60},
        "proxy": {"train_per_language": 20, "test_per_language": 20},
    },
    "model": {"max_length": 32},
    "tree": {
        "groups": {},
        "root": {"rounds": 2},
        "edge": {"rounds": 1, "cohort": 2},
        "client": {"train": {"epochs": 1}},
    },
    "eval": {"every": 0},
}
VARIANTS = {  # name -> (base config, overrides)
    "full": ("bhfl.yaml", []),
    "ab-mean": ("bhfl-lora.yaml", ["model.adapter.aggregation=ab-mean", "model.adapter.error_metric=true"]),
    "ffa": ("bhfl-lora.yaml", ["model.adapter.aggregation=ffa"]),
    "exact": ("bhfl-lora.yaml", ["model.adapter.aggregation=exact"]),
}
ACCURACY = {
    "root union": "root/union/accuracy",
    "edge own": "edge_on_own_clients/accuracy_mean",
    "client own": "client_on_own_clients/accuracy_mean",
}
ERRORS = {"ab err": "adapter/ab_error", "trunc err": "adapter/truncation_error"}
COLUMNS = ["values/model", "MB/round", *ACCURACY, *ERRORS, "wall s", "peak PSS MB"]


def write_config(folder: Path, variant: str, model_dir: Path) -> tuple[Path, str]:
    """The variant's config: its base config with ``SHRINK`` and ``model.name: model_dir``; (path, name)."""
    base, _ = VARIANTS[variant]
    name = f"lora-exp-{variant}"
    config = {"base": str(REPO / "configs" / base), "name": name, **SHRINK}
    config["model"] = {**SHRINK["model"], "name": str(model_dir)}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, name


def communication(run_path: Path) -> dict[str, float]:
    """Values per model sent up and MB sent per root round, from the report's communication table."""
    with (run_path / "report" / "eval" / "communication.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    up = [r for r in rows if r["direction"] == "up"]
    rounds = len({r["round"] for r in rows if r["node"] == "root"})
    return {
        "values/model": sum(float(r["bytes"]) for r in up) / sum(float(r["models"]) for r in up) / 4,
        "MB/round": sum(float(r["bytes"]) for r in rows) / rounds / 1e6,
    }


def logged(run_path: Path) -> dict[str, float]:
    """The run's final accuracies and its servers' mean adapter errors (NaN: not logged), from MLflow."""
    from mlflow import MlflowClient

    record = json.loads((run_path / "run.json").read_text())
    client = MlflowClient(record["tracking_uri"])
    final = client.get_run(record["parent_run_id"]).data.metrics
    figures = {column: final.get(key, math.nan) for column, key in ACCURACY.items()}
    for column, key in ERRORS.items():
        values = [m.value for run in record["node_runs"].values() for m in client.get_metric_history(run, key)]
        figures[column] = statistics.fmean(values) if values else math.nan
    return figures


def measure(folder: Path, variant: str, seed: int, model_dir: Path, overrides: list[str]) -> dict[str, float]:
    """One ``bhfl run`` of ``variant`` with ``seed``: its figures (``COLUMNS``); its run folder is removed after."""
    config, name = write_config(folder, variant, model_dir)
    work = folder / f"{variant}-{seed}"
    work.mkdir()
    sets = [f"seed={seed}", *VARIANTS[variant][1], *overrides]
    result = run_bhfl(config, name, 0, sets, None, work)
    (run_path,) = (work / "runs" / name).iterdir()
    figures = {
        **communication(run_path),
        **logged(run_path),
        "wall s": result["exited"] - result["process_start"],
        "peak PSS MB": result["pss_mb"],
    }
    shutil.rmtree(work)  # a full BERT-base run's node states are gigabytes
    return figures


def _cell(values: list[float]) -> str:
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return "–"
    mean = statistics.fmean(known)
    text = f"{mean:,.0f}" if abs(mean) >= 100 else f"{mean:.3g}"
    if len(known) > 1 and (std := statistics.stdev(known)) > 0:  # counts of values and bytes do not vary
        text += f" ± {std:,.0f}" if abs(mean) >= 100 else f" ± {std:.2g}"
    return text


def table(runs: dict[str, list[dict[str, float]]]) -> str:
    """A markdown table, one row per variant: mean ± std over its seeds (one seed: the value)."""
    lines = ["| variant | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for variant, rows in runs.items():
        lines.append(f"| {variant} | " + " | ".join(_cell([r[c] for r in rows]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def parameters(model_dir: Path) -> int:
    """The backbone's parameter count (``AutoModel``: embeddings and encoder, no task head)."""
    from transformers import AutoConfig, AutoModel

    return sum(p.numel() for p in AutoModel.from_config(AutoConfig.from_pretrained(model_dir)).parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architecture", choices=["bert", "xlmr"], default="bert")
    parser.add_argument("--model", choices=["base", "tiny"], default="base")
    parser.add_argument("--model-dir", type=Path, help="use this model folder (with its tokenizer) as it is")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (1: wall time and memory are one run's)")
    add_set_option(parser)
    args = parser.parse_args()
    offline_quiet()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory(prefix="bhfl-lora-experiment-") as tmp:
        folder = Path(tmp)
        if args.model_dir is not None:
            from transformers import AutoTokenizer

            model_dir = args.model_dir.resolve()
            vocabulary, label = len(AutoTokenizer.from_pretrained(model_dir)), str(model_dir)
        else:
            model_dir = folder / f"{args.architecture}-{args.model}"
            vocabulary = write_folder(args.architecture, args.model, model_dir)
            label = f"{args.architecture} {args.model}"
        print(f"model folder: {label}, {parameters(model_dir):,} backbone parameters, "
              f"tokenizer {vocabulary:,} pieces", flush=True)  # fmt: skip
        cases = [(seed, variant) for seed in args.seeds for variant in args.variants]  # seed-major, as printed
        with ThreadPoolExecutor(args.jobs) as pool:  # threads: each waits on its own `bhfl run` process
            done = pool.map(lambda case: measure(folder, case[1], case[0], model_dir, args.overrides), cases)
            for (seed, variant), figures in zip(cases, done, strict=True):
                runs[variant].append(figures)
                print(f"{variant} seed {seed}: {json.dumps(figures)}", flush=True)
    print(f"\n{label}, seeds {' '.join(map(str, args.seeds))}: mean ± std over seeds")
    print(table(runs))


if __name__ == "__main__":
    main()
