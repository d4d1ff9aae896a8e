"""What is federated: the whole model, LoRA adapters, or adapters with 8-bit updates, at BERT-base size.

The same `bhfl run` is made three times on the throughput workload (../shared/bench/
WORKLOAD.md through benchmarks/workload.py: flat FedAvg over its 100 clients, here with
BERT-base dimensions and K clients a round for R rounds). The model's parameter count is
printed from the full run's vector, not written here: BERT-base's 110M counts its
30,522-token vocabulary; the run's tokenizer, trained on the workload's text, has about
7.6k (91.8M parameters on 2026-11-25):

- full: every parameter trained, stored, sent and aggregated (today's default);
- lora: ``model.adapter={r: 8, alpha: 16}``: the adapters (query, value) and the head;
- lora+int8: the same, and the clients send their root an 8-bit quantised update with
  error feedback (``tree.root.aggregate={compress: {kind: int8}}``).

Clients are persistent with ``eta_down: 0.5`` (they keep a state file, as in B-HFL's
trees), so the node-state bytes are those of a run whose clients remember.

Figures per variant, from the run itself:

- federated values: the length of the vector that travels (the root's saved model);
- bytes per model sent up: the report's communication table (``eval/communication.csv``),
  up rows, bytes over models: ``4 n`` for float32 vectors, the payloads' size when
  compressed;
- node-state bytes: the size of the run's ``state/nodes`` folder at the end (every node's
  model, optimiser states, error-feedback residuals and payloads);
- in-round cl/s: client trainings / (first client training -> last aggregate), from the
  run record's timeline; peak PSS MB of the whole process tree (benchmarks/_proc.py).

Accuracy is not the point here (a random backbone trains poorly through adapters); the
LoRA table on the embedded data (docs/results.md) is. Usage::

    .venv/bin/python benchmarks/federated_params.py [--setting 4x2] [--model base|tiny] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import tempfile
from pathlib import Path

from _env import offline_quiet
from throughput import BASE_MODEL, run_bhfl, write_inputs, write_setting

VARIANTS = {
    "full": [],
    "lora": ["model.adapter={r: 8, alpha: 16}"],
    "lora+int8": ["model.adapter={r: 8, alpha: 16}", "tree.root.aggregate={compress: {kind: int8}}"],
}
PERSISTENT = ["tree.client.persistent=true", "tree.client.eta_down=0.5"]


def _sent_per_model(run_path: Path) -> float:
    with (run_path / "report" / "eval" / "communication.csv").open() as fh:
        up = [r for r in csv.DictReader(fh) if r["direction"] == "up"]
    return sum(float(r["bytes"]) for r in up) / sum(float(r["models"]) for r in up)


def _state_bytes(run_path: Path) -> int:
    return sum(p.stat().st_size for p in (run_path / "state" / "nodes").glob("*.safetensors"))


def measure(config: Path, name: str, trainings: int, overrides: list[str], folder: Path) -> dict[str, float]:
    result = run_bhfl(config, name, trainings, overrides, None, folder)
    (run_path,) = (folder / "runs" / name).iterdir()
    return {
        "federated values": float(result["model"].size),
        "bytes/model up": _sent_per_model(run_path),
        "node-state MB": _state_bytes(run_path) / 1e6,
        "in-round cl/s": trainings / (result["last_aggregate"] - result["first_training"]),
        "peak PSS MB": result["pss_mb"],
    }


def table(rows: dict[str, dict[str, float]]) -> str:
    columns = list(next(iter(rows.values())))
    width = max(len(c) for c in columns) + 2
    lines = [" " * 10 + "".join(f"{c:>{width}}" for c in columns)]
    for variant, row in rows.items():
        cells = [f"{row[c]:,.0f}" if row[c] >= 100 else f"{row[c]:.3g}" for c in columns]
        lines.append(f"{variant:10}" + "".join(f"{cell:>{width}}" for cell in cells))
    full = rows["full"]
    for variant, row in rows.items():
        if variant != "full":
            ratios = ", ".join(f"{c} {row[c] / full[c]:.3g}x" for c in columns if full[c] and not math.isnan(row[c]))
            lines.append(f"{variant} / full: {ratios}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", default="4x2", help="KxR: K clients per round, R rounds")
    parser.add_argument("--model", choices=["tiny", "base"], default="base")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--other-data", action="store_true", help="go on when numpy generates other data")
    args = parser.parse_args()
    offline_quiet()
    size = BASE_MODEL if args.model == "base" else {}
    k, rounds = (int(v) for v in args.setting.split("x"))
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bhfl-federated-params-") as tmp:
        root = Path(tmp)
        _, prepared, _ = write_inputs(root, args.other_data)
        for variant, extra in VARIANTS.items():
            config, name, _ = write_setting(root, prepared, k, rounds, [], size)  # (the loop's draws: unused)
            overrides = [*PERSISTENT, *extra, *args.overrides]
            folder = root / variant
            folder.mkdir()
            rows[variant] = measure(config, name, k * rounds, overrides, folder)
            print(f"{variant}: {json.dumps(rows[variant])}", flush=True)
    parameters = rows["full"]["federated values"]  # the full run federates every parameter
    print(f"\n{args.model} model ({parameters / 1e6:.1f}M parameters), {args.setting} (K clients a round x R rounds)")
    print(table(rows))


if __name__ == "__main__":
    main()
