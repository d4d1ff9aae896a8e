#!/usr/bin/env bash
# Run the test suite: bootstraps .venv on first use. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PREFECT_SERVER_ANALYTICS_ENABLED=false
exec .venv/bin/python -m pytest "$@"
