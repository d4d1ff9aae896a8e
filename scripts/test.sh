#!/usr/bin/env bash
# Run the test suite: bootstraps .venv on first use. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PREFECT_SERVER_ANALYTICS_ENABLED=false
# two pytest-xdist workers (BHFL_TEST_WORKERS; 0: one process): most of the suite waits on
# subprocesses and servers, so two workers overlap that on 2 cores; units: tests/conftest.py
exec .venv/bin/python -m pytest -n "${BHFL_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder \
  --max-worker-restart 0 "$@"  # a worker that dies (a timeout) ends the run, rather than leaving it waiting
