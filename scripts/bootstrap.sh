#!/usr/bin/env bash
# Create .venv at the repository root (if missing) and install the project into it.
# On machines without an NVIDIA GPU, torch==2.13.0 (CPU wheel) is installed first so
# that resolving the project never pulls the multi-GB CUDA wheels. Re-running is cheap:
# the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $($py --version)" >&2
  "$py" -m venv .venv
fi
stamp=.venv/.bhfl-installed
want="$(cat pyproject.toml "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"  # this script's installs count too
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
quiet_pip() {  # drop the "Location ... is ignored" noise some pip configs print; keep real errors
  .venv/bin/python -m pip install --quiet "$@" 2>&1 | { grep -v "is ignored: it is neither" >&2 || true; }
  return "${PIPESTATUS[0]}"
}
quiet_pip --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "[bootstrap] no NVIDIA GPU: installing the CPU build of torch 2.13.0 first" >&2
  quiet_pip "torch==2.13.0"
fi
echo "[bootstrap] installing bhfl and its dependencies (first time: ~1-2 minutes)" >&2
quiet_pip -e ".[dev]"
# Tests only: Flower's own aggregation functions are the reference for the robust rules
# (tests/core/flower_reference.py loads flwr/server/strategy/aggregate.py alone). Without
# its dependencies: flwr 1.42.0 pins fastapi<0.139 (we need >=0.139, for prefect), and
# would replace protobuf, typer, rich, starlette and uvicorn; that one module needs numpy only.
quiet_pip --no-deps "flwr==1.42.0"
echo "$want" > "$stamp"
