#!/usr/bin/env bash
# The GPU checks in one command, for a GPU machine lent for minutes: install, then each check
# under its own time limit, one log per check and a summary under $OUT.
#
#   bash benchmarks/gpu_checks.sh [CHECK[:SECONDS] ...]     (default: datapath bert scale)
#
# Checks (docs/benchmarks.md, "On a GPU", has their figures so far):
#   datapath  benchmarks/datapath.py at 110M parameters, 8 clients, no TRAIN: ms a client, replace and
#             persistent, and the disk's write floor for a persistent client's state
#   bert      benchmarks/throughput.py, BERT-base 16x3, 1 worker: in-round and wall against the GPU loop
#   tiny      benchmarks/throughput.py, tiny model 50x3, 4 workers on the GPU
#   scale     benchmarks/scale.py, 10,000 clients, 100 and 1,000 a round, 1,000 trainings each, 4 workers
#   fourbit   the 4-bit NF4 backbone: its GPU test and benchmarks/backbone_memory.py --device cuda
#             (needs bitsandbytes: carry its wheels, below)
#
# Set-up first, every time: each wheel in the folders .whl*/ at the repository root is installed into
# the machine's python3 without an index and without dependencies (the machine's own CUDA torch and
# transformers stay); this checkout is not installed but put first on PYTHONPATH, for the workers too
# (the scripts start `python -m flows.cli...` where no `bhfl` command is installed). Make the folders
# here with scripts/offline_wheels.py, e.g.
#   .venv/bin/python scripts/offline_wheels.py .whl --have TARGET_PIP_LIST          # bhfl's run time
#   .venv/bin/python scripts/offline_wheels.py .whl-gpu --have TARGET_PIP_LIST \
#       --modules bhfl_core.config.loader bhfl_core.learning.local_train tests.core.test_backbone_precision \
#       --add bitsandbytes==0.50.2                                                    # the fourbit check
# A check that runs past its seconds is stopped (its log keeps what it printed) and the next one starts;
# the summary says which. OUT defaults to runs/gpu-checks; PYTHON to python3.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-runs/gpu-checks}"
py="${PYTHON:-python3}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
summary="$out/summary.txt"
: >"$summary"

# the default checks' limits add up to 9 minutes: with the set-up, one 10-minute call on a lent machine
declare -A default_s=([datapath]=90 [bert]=150 [tiny]=120 [scale]=300 [fourbit]=240)

check_datapath() { "$py" benchmarks/datapath.py --device cuda --sizes 110 --clients 8 --train-s 0; }
check_bert() {
  "$py" benchmarks/throughput.py --model base --settings 16x3 --repeats 1 --device cuda \
    --set runtime.device=cuda --other-data
}
check_tiny() {
  "$py" benchmarks/throughput.py --settings 50x3 --repeats 1 --device cuda --set runtime.device=cuda \
    --set runtime.workers_per_device=4 --other-data
}
check_scale() {
  "$py" benchmarks/scale.py --populations 10000 --cohorts 100 1000 --trainings 1000 --skip-loop \
    --set runtime.device=cuda --set runtime.workers_per_device=4
}
check_fourbit() {
  "$py" -m pytest -q -p no:cacheprovider tests/core/test_backbone_precision.py -k "4bit or quantization" &&
    "$py" benchmarks/backbone_memory.py --device cuda --models tiny base
}

setup() {
  local folder
  for folder in .whl*/; do
    [ -d "$folder" ] || continue
    "$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "$folder"*.whl || return
  done
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "transformers", transformers.__version__, "gpu", torch.cuda.is_available())'
  nproc
  git log -1 --format='commit %h %s' 2>/dev/null || true
}

run_check() {  # NAME SECONDS FUNCTION
  local started rc
  started=$(date +%s)
  timeout --kill-after=10 "$2" bash -c "$3" >"$out/$1.log" 2>&1
  rc=$?
  local why=""
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (stopped at its ${2} s)"
  echo "$1: exit $rc$why, $(($(date +%s) - started)) s" | tee -a "$summary"
}

export py
export -f setup check_datapath check_bert check_tiny check_scale check_fourbit
run_check setup 180 setup
if ! grep -q "^setup: exit 0" "$summary"; then
  tail -20 "$out/setup.log"
  exit 1
fi
[ $# -gt 0 ] || set -- datapath bert scale
for spec in "$@"; do
  name="${spec%%:*}"
  seconds="${spec#*:}"
  [ "$seconds" != "$spec" ] || seconds="${default_s[$name]:-}"
  if ! declare -F "check_$name" >/dev/null; then
    echo "$name: unknown check (known: ${!default_s[*]})" | tee -a "$summary"
    continue
  fi
  run_check "$name" "$seconds" "check_$name"
done
