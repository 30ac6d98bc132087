#!/usr/bin/env bash
# The one GPU check: at most 6 minutes of wall time in all, sized for a short run on one GPU whose
# image has python3 with torch, transformers and pytest (no venv, no pip, no network; with or
# without pytest-timeout). Run from a plain checkout:
#
#   bash benchmarks/gpu_check.sh             # CUDA machine: every step below
#   bash benchmarks/gpu_check.sh --dry-run   # CPU: each step's collection or tiny version
#   bash benchmarks/gpu_check.sh --budget    # the steps' limits and their sum (<= 6 min)
#
# Steps, in order, each under `timeout -s INT -k GRACE LIMIT` (SIGINT: pytest still prints its
# failures and summary and writes its junit XML; SIGKILL only after GRACE more seconds):
#   probe      versions and devices
#   kernels    tests/gpu/test_gpu_kernels.py alone, CUDA_LAUNCH_BLOCKING=1: a sticky CUDA error
#              (an illegal address) cannot fail later tests and hide itself
#   gpu_tests  the rest of tests/gpu (a fresh process)
#   bench      benchmarks/bench_gpu.py: the bf16 table
# Inside the steps no wait is longer than 60 s (process groups, pool calls, the parity
# subprocess: tests/gpu/_gpu_fns.py), and pytest dumps every thread's stack once a test has run
# FAULT_S seconds (faulthandler_timeout), so a hang shows where it hangs.
#
# Written under $OUT (default ./gpu_check_out) as each step finishes, so a run cut short still
# returns what it did: gpu_check.log (everything printed), junit_kernels.xml, junit_gpu_tests.xml,
# parity_torchrun_1.json (the parity test's records; parity_dry_run.json on --dry-run),
# gpu_check_results.md (the benchmark table, rewritten after each row), gpu_check_summary.txt.
# PYTHON selects the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
DEST="${OUT:-$ROOT/gpu_check_out}"

# name limit_s grace_s: the only place a step's time is set (tests/unit/test_gpu_check.py sums it)
STEPS=(
  "probe 30 5"
  "kernels 60 10"
  "gpu_tests 150 10"
  "bench 85 5"
)
BUDGET_S=360
FAULT_S=45
BENCH_BUDGET_S=55 # bench_gpu.py starts no new row after this

total_s() {
  local sum=0 name limit grace
  for step in "${STEPS[@]}"; do
    read -r name limit grace <<<"$step"
    sum=$((sum + limit + grace))
  done
  echo "$sum"
}

if [[ "${1:-}" == "--budget" ]]; then
  for step in "${STEPS[@]}"; do echo "step $step"; done
  echo "total $(total_s) budget $BUDGET_S"
  (($(total_s) <= BUDGET_S))
  exit $?
fi
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
  DRY=1
elif [[ -n "${1:-}" ]]; then
  echo "usage: bash benchmarks/gpu_check.sh [--dry-run | --budget]" >&2
  exit 2
fi

mkdir -p "$DEST"
LOG="$DEST/gpu_check.log"
SUMMARY="$DEST/gpu_check_summary.txt"
: >"$LOG"
: >"$SUMMARY"
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export CPSHARD_GPU_CHECK_OUT="$DEST" # tests/gpu/test_gpu_parity_cli.py writes its JSON here
FAILED=0

# step NAME CMD...: run CMD under NAME's limit, its output appended to the log as it comes.
step() {
  local want="$1" name limit grace start rc
  shift
  for s in "${STEPS[@]}"; do
    read -r name limit grace <<<"$s"
    [[ "$name" == "$want" ]] && break
  done
  [[ "$name" == "$want" ]] || {
    echo "gpu_check.sh: no step $want" >&2
    exit 2
  }
  echo "=== step $want (limit ${limit}s + ${grace}s): $*" | tee -a "$LOG"
  start=$SECONDS
  timeout -s INT -k "$grace" "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  local what="ok"
  if ((rc == 124 || rc == 137)); then
    what="TIMED OUT"
  elif ((rc != 0)); then
    what="FAILED"
  fi
  ((rc == 0)) || FAILED=1
  echo "=== step $want: $what (exit $rc) in $((SECONDS - start))s" | tee -a "$LOG" "$SUMMARY"
}

# pytest_args NAME: the options of both pytest steps: the repo's config (its `timeout` key is
# declared by tests/conftest.py where pytest-timeout is absent), pytest-timeout off where present
# (the step limits bound the run), stacks dumped after FAULT_S s, every failure and skip reported.
pytest_args() {
  echo -p no:cacheprovider -p no:timeout -o "faulthandler_timeout=$FAULT_S" -rfEs --tb=short \
    "--junitxml=$DEST/junit_$1.xml"
}

step probe "$PY" -c '
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)
from importlib.metadata import PackageNotFoundError, version
for name in ("transformers", "numpy", "xxhash", "pytest", "pytest-timeout"):
    try:
        print(name, version(name))
    except PackageNotFoundError:
        print(name, "not installed")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i}", p.name, f"sm{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB")
    print("cudnn", torch.backends.cudnn.version())
else:
    print("no CUDA device")
'

if ((DRY)); then
  # shellcheck disable=SC2046  # pytest_args is words without spaces or globs
  step kernels "$PY" -m pytest $(pytest_args kernels) --collect-only tests/gpu/test_gpu_kernels.py
  # The GPU run's parity records come from its torchrun test; here the same CLI on 2 CPU ranks.
  step gpu_tests bash -c '"$1" -m pytest $2 --collect-only tests/gpu \
      --ignore=tests/gpu/test_gpu_kernels.py &&
    "$1" -m cpshard parity --ranks 2 --models llama --steps 1 --seq-len 32 \
      --methods all_gather --layouts round_robin --timeout 45 --no-progress --json "$3"' \
    _ "$PY" "$(pytest_args gpu_tests)" "$DEST/parity_dry_run.json"
  step bench "$PY" benchmarks/bench_gpu.py --dry-run --out "$DEST/gpu_check_results.md" \
    --budget-s "$BENCH_BUDGET_S"
else
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA device: run bash benchmarks/gpu_check.sh --dry-run on a CPU" | tee -a "$LOG"
    exit 1
  fi
  # shellcheck disable=SC2046
  CUDA_LAUNCH_BLOCKING=1 step kernels "$PY" -m pytest $(pytest_args kernels) \
    tests/gpu/test_gpu_kernels.py
  # shellcheck disable=SC2046
  step gpu_tests "$PY" -m pytest $(pytest_args gpu_tests) tests/gpu \
    --ignore=tests/gpu/test_gpu_kernels.py
  step bench "$PY" benchmarks/bench_gpu.py --out "$DEST/gpu_check_results.md" \
    --budget-s "$BENCH_BUDGET_S"
fi

echo "gpu_check.sh: $( ((FAILED)) && echo FAILED || echo ok) after ${SECONDS}s; files in $DEST" |
  tee -a "$LOG" "$SUMMARY"
exit "$FAILED"
