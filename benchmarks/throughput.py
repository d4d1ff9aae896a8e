"""Client-training throughput: the plain FedAvg loop against `bhfl run`, interleaved, same client trainings.

The workload is ../shared/bench/WORKLOAD.md (benchmarks/workload.py: 100 clients, tiny
BERT with dropout 0.1, SGD); its fingerprint is checked and printed first. The data
are generated and written once per invocation (an .npz for the loop, a prepared-data
folder for bhfl), outside every timed region. Then, for each setting (10x5: 10 clients
per round, 5 rounds; 50x3) and repetition, in turn (loop, bhfl, loop, bhfl, ...):

- loop: the spec's plain single-process FedAvg loop in a fresh Python process, given
  the cohorts and client seeds bhfl draws for the same experiment
  (``workload.bhfl_draws``), so both do exactly the same client trainings;
- bhfl: ``.venv/bin/bhfl run <workload config> --run-dir <fresh temp dir>`` in a
  fresh process, as a user runs it (its own Prefect server unless
  ``--prefect-api-url``; its local cluster of worker processes), on the workload's
  prepared-data folder with a flat FedAvg tree (``workload.workload_config``).

Figures per setting (median over the repetitions), and bhfl's ratio to the loop:

- wall cl/s: client trainings / (process start -> last aggregate): imports, Prefect,
  MLflow and worker start-up included;
- in-round cl/s: client trainings / (first client training -> last aggregate);
- start-up s: process start -> first client training; imports s: process start -> the
  end of the process's top-level imports; after imports s: the rest of the start-up;
- process s: process start -> exit, as the harness sees it (bhfl: the whole CLI,
  evaluation, MLflow logging and shutdown included);
- peak PSS MB: the highest sum of PSS (``memory_full_info().pss``) over the process and
  all its descendants, read every 1 s by a thread here (CPU every 0.1 s; benchmarks/_proc.py);
- CPU s/client: user + system seconds of the whole process tree (the last reading of
  every pid seen, so exited children count) per client training;
- GPU busy %: the mean of NVML's utilisation of GPU 0 read every 0.1 s in-round (first client
  training -> last aggregate); GPU MB: the peak of its memory in use; both only with a GPU,
  and a timeline of the busy share over the rounds is printed below the table;
- norm: the final model's L2 norm (the same trainings: both agree to float rounding;
  the max absolute difference per parameter and the test accuracies are printed below).

Process start is the process's creation time (psutil). The loop prints its own
timestamps; bhfl's come from its run record (``<run>/run.json``: ``timeline``), NaN
where the record has none.

GPU: ``--device cuda`` (the loop's device; give bhfl ``--set runtime.device=cuda``) and
``--model base`` (BERT-base dimensions for both).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _env import REPO, add_set_option, offline_quiet
from _proc import GpuSampler, TreeSampler

BASE_MODEL = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
Result = dict[str, Any]  # timestamps (epoch s), trainings, pss_mb, cpu_s, gpu (sampler), model (flat float32 array)
COLUMNS = {  # name -> (format, how it is computed from one run's result)
    "wall cl/s": ("{:.2f}", lambda r: r["trainings"] / (r["last_aggregate"] - r["process_start"])),
    "in-round cl/s": ("{:.2f}", lambda r: r["trainings"] / (r["last_aggregate"] - r["first_training"])),
    "start-up s": ("{:.1f}", lambda r: r["first_training"] - r["process_start"]),
    "imports s": ("{:.1f}", lambda r: r["imports_done"] - r["process_start"]),
    "after imports s": ("{:.1f}", lambda r: r["first_training"] - r["imports_done"]),
    "process s": ("{:.1f}", lambda r: r["exited"] - r["process_start"]),
    "peak PSS MB": ("{:.0f}", lambda r: r["pss_mb"]),
    "CPU s/client": ("{:.2f}", lambda r: r["cpu_s"] / r["trainings"]),
    "GPU busy %": ("{:.0f}", lambda r: r["gpu"].busy(r["first_training"], r["last_aggregate"])),
    "GPU MB": ("{:.0f}", lambda r: r["gpu"].peak_memory_mb()),
    "norm": ("{:.4f}", lambda r: r["norm"]),
}
TIMELINE = ("process_start", "imports_done", "first_training", "last_aggregate")


# ---------------------------------------------------------------- the loop, in its own process


def loop_child(data: Path, draws: Path, out: Path, device: str, model_size: dict[str, int]) -> None:
    """In a fresh process: the plain loop with the given draws; prints its timestamps as JSON, saves the model."""
    started = psutil.Process().create_time()
    import torch  # noqa: F401  (the loop's imports count in its wall time, as bhfl's do in bhfl's)
    import transformers.models.bert.modeling_bert  # noqa: F401
    from workload import Workload, fedavg_loop

    imported = time.time()
    with np.load(data) as z:
        clients = [(z[f"x{c}"], z[f"y{c}"]) for c in range(int(z["n"]))]
        work = Workload(clients, z["languages"].tolist(), (z["test_x"], z["test_y"]))
    plan = json.loads(draws.read_text())
    seeds = {
        (r, cid): seed
        for r, (cohort, row) in enumerate(zip(plan["cohorts"], plan["seeds"]), start=1)
        for cid, seed in zip(cohort, row)
    }
    result = fedavg_loop(work, plan["cohorts"], lambda r, cid: seeds[(r, cid)], device=device, model_size=model_size)
    np.save(out, result.flat.numpy())
    print(
        json.dumps(
            {
                "process_start": started,
                "imports_done": imported,
                "first_training": result.first_training,
                "last_aggregate": result.last_aggregate,
                "round_seconds": result.round_seconds,
            }
        )
    )


# ---------------------------------------------------------------- one measured run of each


def _measure(
    cmd: list[str], cwd: Path, env: dict[str, str] | None = None
) -> tuple[str, str, float, float, TreeSampler, GpuSampler]:
    """Run ``cmd`` to its end under a process-tree and a GPU sampler: (stdout, stderr, start, exit, samplers)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    started = psutil.Process(proc.pid).create_time()
    with TreeSampler(proc.pid) as sampler, GpuSampler() as gpu:
        stdout, stderr = proc.communicate()
    exited = time.time()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    return stdout, stderr, started, exited, sampler, gpu


def run_loop(data: Path, draws: Path, trainings: int, device: str, model_size: dict[str, int], folder: Path) -> Result:
    out = folder / "loop.npy"
    cmd = [
        sys.executable,
        __file__,
        "--loop-child",
        str(data),
        str(draws),
        str(out),
        "--device",
        device,
        "--model-size",
        json.dumps(model_size),
    ]
    stdout, _, _, exited, sampler, gpu = _measure(cmd, REPO / "benchmarks")
    times = json.loads(stdout.strip().splitlines()[-1])
    model = np.load(out)
    return {
        **times,
        "exited": exited,
        "trainings": trainings,
        "pss_mb": sampler.peak_pss_mb(),
        "cpu_s": sampler.cpu_s,
        "gpu": gpu,
        "model": model,
        "norm": float(np.linalg.norm(model.astype(np.float64))),
    }


def _bhfl_env(api_url: str | None) -> dict[str, str]:
    """The harness's environment with no Prefect server, Prefect home or MLflow store of its own (unless given)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI")}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def run_bhfl(
    config: Path,
    name: str,
    trainings: int,
    overrides: list[str],
    api_url: str | None,
    folder: Path,
    profile: Path | None = None,
) -> Result:
    """One ``bhfl run``; ``profile``: under py-spy, every process's stacks (idle threads too) in that file."""
    from bhfl_core.store.node_store import load_tensors

    run_dir = folder / "runs"
    spy = ["py-spy", "record", "--subprocesses", "--idle", "--threads", "--nonblocking", "--rate", "50"]
    spy += ["--format", "raw", "-o", str(profile), "--"]
    script = Path(sys.executable).with_name("bhfl")  # the installed command; from a bare checkout, the same module
    cmd = [
        *(spy if profile else []),
        *([str(script)] if script.exists() else [sys.executable, "-m", "flows.cli.main"]),
        "run",
        str(config),
        "--run-dir",
        str(run_dir),
        *[a for o in overrides for a in ("--set", o)],
    ]
    _, _, started, exited, sampler, gpu = _measure(cmd, REPO, _bhfl_env(api_url))
    (run_path,) = (run_dir / name).iterdir()
    timeline = json.loads((run_path / "run.json").read_text()).get("timeline") or {}
    model = load_tensors(run_path / "state" / "nodes" / "root.safetensors", ["model"])[0]["model"].numpy()
    return {
        **{k: float(timeline.get(k, math.nan)) for k in TIMELINE},
        "process_start": started,
        "exited": exited,
        "trainings": trainings,
        "pss_mb": sampler.peak_pss_mb(),
        "cpu_s": sampler.cpu_s,
        "gpu": gpu,
        "model": model,
        "norm": float(np.linalg.norm(model.astype(np.float64))),
    }


# ---------------------------------------------------------------- figures


def _median(values: list[float]) -> float:
    """Median of the values that are numbers (NaN: a figure the run did not record)."""
    known = [v for v in values if not math.isnan(v)]
    return float(np.median(known)) if known else math.nan


def medians(runs: list[Result]) -> dict[str, float]:
    return {name: _median([fn(r) for r in runs]) for name, (_, fn) in COLUMNS.items()}


def table(loop: dict[str, float], bhfl: dict[str, float]) -> str:
    """The figures of both and bhfl's ratio to the loop, one column per figure (none that neither recorded)."""
    columns = {c: fmt for c, (fmt, _) in COLUMNS.items() if not (math.isnan(loop[c]) and math.isnan(bhfl[c]))}
    width = max(len(c) for c in columns) + 2
    lines = [" " * 6 + "".join(f"{c:>{width}}" for c in columns)]
    for name, row in (("loop", loop), ("bhfl", bhfl)):
        lines.append(f"{name:6}" + "".join(f"{fmt.format(row[c]):>{width}}" for c, fmt in columns.items()))
    ratios = [f"{bhfl[c] / loop[c]:.2f}x" if loop[c] else "-" for c in columns]
    lines.append(f"{'ratio':6}" + "".join(f"{r:>{width}}" for r in ratios))
    return "\n".join(lines)


def report(
    setting: str,
    loops: list[Result],
    bhfls: list[Result],
    test: tuple[np.ndarray, np.ndarray],
    model_size: dict[str, int],
) -> None:
    import torch
    from workload import flat_accuracy

    print(f"\n{setting}: {loops[0]['trainings']} client trainings, median of {len(loops)} runs each, interleaved")
    print(table(medians(loops), medians(bhfls)))
    diff = max(float(np.abs(b["model"] - lp["model"]).max()) for b, lp in zip(bhfls, loops))
    acc = {
        name: flat_accuracy(torch.from_numpy(runs[0]["model"]), test, model_size)
        for name, runs in (("loop", loops), ("bhfl", bhfls))
    }
    rounds = ", ".join(f"{s:.2f}" for s in np.median([lp["round_seconds"] for lp in loops], axis=0))
    print(
        f"final models: max |bhfl - loop| per parameter {diff:.2e}; test accuracy loop {acc['loop']:.3f}, "
        f"bhfl {acc['bhfl']:.3f}; loop round times (s): {rounds}"
    )
    digests = sorted({hashlib.sha256(b["model"].tobytes()).hexdigest()[:16] for b in bhfls})
    print(f"bhfl's final model sha256: {', '.join(digests)} (one value: every repetition ended bit-identical)")
    for name, runs in (("loop", loops), ("bhfl", bhfls)):
        r = runs[0]
        busy = r["gpu"].timeline(r["first_training"], r["last_aggregate"])
        if busy:
            print(f"{name} GPU busy % over the rounds (20 equal slices, first run): {busy}")


# ---------------------------------------------------------------- the invocation


def write_inputs(root: Path, other_data: bool = False) -> tuple[Path, Path, tuple[np.ndarray, np.ndarray]]:
    """Generate the workload once: (the loop's .npz, bhfl's prepared folder, the test set); prints the fingerprint.

    ``other_data``: go on when numpy generates other data than the spec's (another numpy
    version): both sides still train the same clients, but figures compare with other
    machines' less well.
    """
    from workload import FINGERPRINT, fingerprint, generate, initial_model, write_prepared

    work = generate()
    fp = fingerprint(work, initial_model())
    print(f"workload fingerprint {fp}: {'as specified' if fp == FINGERPRINT else 'NOT the spec (' + FINGERPRINT + ')'}")
    if fp != FINGERPRINT and not other_data:
        raise SystemExit("the workload differs from the spec (numpy version?): the figures would not be comparable")
    data = root / "workload.npz"
    np.savez(
        data,
        n=len(work.clients),
        languages=np.array(work.languages),
        test_x=work.test[0],
        test_y=work.test[1],
        **{f"x{c}": x for c, (x, _) in enumerate(work.clients)},
        **{f"y{c}": y for c, (_, y) in enumerate(work.clients)},
    )
    return data, write_prepared(work, root / "prepared"), work.test


def write_setting(
    root: Path, prepared: Path, k: int, rounds: int, overrides: list[str], model_size: dict[str, int]
) -> tuple[Path, str, Path]:
    """bhfl's config file for one setting, its name, and the draws it makes (a JSON file for the loop)."""
    import yaml
    from workload import bhfl_draws, workload_config

    from bhfl_core.config.loader import load_config

    config = workload_config(prepared, k, rounds)
    if model_size:
        config["model"]["tiny"].update(model_size)
    path = root / f"{config['name']}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    cohorts, seed_of = bhfl_draws(load_config(path, overrides))
    draws = root / f"{config['name']}-draws.json"
    draws.write_text(
        json.dumps(
            {
                "cohorts": cohorts,
                "seeds": [[seed_of(r, c) for c in cohort] for r, cohort in enumerate(cohorts, start=1)],
            }
        )
    )
    return path, config["name"], draws


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    parser.add_argument("--settings", nargs="+", default=["10x5", "50x3"], help="KxR: K clients per round, R rounds")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved; figures are medians")
    parser.add_argument("--prefect-api-url", help="run bhfl against this running Prefect server (PREFECT_API_URL)")
    parser.add_argument("--device", default="cpu", help="the loop's device (cpu, cuda); give bhfl --set runtime.device")
    parser.add_argument("--model", choices=["tiny", "base"], default="tiny", help="base: BERT-base dimensions")
    add_set_option(parser)
    parser.add_argument(
        "--other-data", action="store_true", help="go on when this numpy generates other data than the spec's"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="run bhfl under py-spy (installed separately): collapsed stacks of every process and thread, idle "
        "time included, in DIR/<setting>-<repeat>.txt (sampling slows it slightly: not for the figures)",
    )
    parser.add_argument("--loop-child", nargs=3, metavar=("DATA", "DRAWS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--model-size", default="{}", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.loop_child:
        loop_child(*map(Path, args.loop_child), args.device, json.loads(args.model_size))
        return
    offline_quiet()
    size = BASE_MODEL if args.model == "base" else {}
    with tempfile.TemporaryDirectory(prefix="bhfl-throughput-") as tmp:
        root = Path(tmp)
        data, prepared, test = write_inputs(root, args.other_data)
        for setting in args.settings:
            k, rounds = (int(v) for v in setting.split("x"))
            config, name, draws = write_setting(root, prepared, k, rounds, args.overrides, size)
            loops, bhfls = [], []
            for i in range(args.repeats):
                folder = root / f"{setting}-{i}"
                folder.mkdir()
                loops.append(run_loop(data, draws, k * rounds, args.device, size, folder))
                profile = args.profile / f"{setting}-{i}.txt" if args.profile else None
                bhfls.append(run_bhfl(config, name, k * rounds, args.overrides, args.prefect_api_url, folder, profile))
            report(setting, loops, bhfls, test, size)


if __name__ == "__main__":
    main()
