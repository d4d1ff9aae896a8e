#!/usr/bin/env bash
# Static checks, as CI runs them before the tests: ruff (lint + format) and mypy (strict
# for bhfl_core). Configuration: pyproject.toml. `--fix` applies ruff's fixes and formats.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
if [ "${1:-}" = "--fix" ]; then
  .venv/bin/ruff check --fix .
  .venv/bin/ruff format .
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
