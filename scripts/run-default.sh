#!/usr/bin/env bash
# Run the embedded default experiment (offline, CPU): bootstraps .venv on first use.
# Extra arguments go to `bhfl run`, e.g.  scripts/run-default.sh --set tree.root.rounds=2
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
exec .venv/bin/bhfl run configs/embedded.yaml "$@"
