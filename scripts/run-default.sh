#!/usr/bin/env bash
# Run the README's main experiment, configs/bhfl.yaml (B-HFL with partial aggregation down at the
# edge servers: the configuration the README's 3-seed tables recommend), offline on CPU; its base,
# configs/embedded.yaml, stays the CLI's default experiment. Bootstraps .venv on first use.
# Extra arguments go to `bhfl run`, e.g.  scripts/run-default.sh --set tree.root.rounds=2
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
exec .venv/bin/bhfl run configs/bhfl.yaml "$@"
