#!/usr/bin/env bash
# One prepared GPU check (at most ~8 minutes on one H200): the GPU test tier, then the bf16
# attention benchmark (dense and packed at cp=1 vs torch flash SDPA, several ranks on the one GPU).
#
# Usage, from anywhere inside the repository:
#   bash benchmarks/gpu_check.sh             # on a CUDA machine; table and test log also in
#                                            # $OUT (or ./): gpu_check_results.md, gpu_tests.log
#   bash benchmarks/gpu_check.sh --dry-run   # CPU: code paths of the benchmark only, tiny sizes
# PYTHON selects the interpreter (default python3). Runs from the source tree (PYTHONPATH=src).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
PY="${PYTHON:-python3}"

"$PY" - <<'PYEOF'
import torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device: {name}")
PYEOF

if [[ "${1:-}" == "--dry-run" ]]; then
  timeout 300 "$PY" benchmarks/bench_gpu.py --dry-run
  exit $?
fi

# addopts is cleared: the repo's addopts deselect the gpu marker and use --strict-config, which
# fails where pytest-timeout (the ini's `timeout`) is not installed.
# The full pytest log also goes to $OUT (the device runner returns only the output's tail).
DEST="${OUT:-$PWD}"  # $OUT: the device runner's output folder
timeout 300 "$PY" -m pytest tests/gpu -m gpu -q -o addopts="" -p no:cacheprovider -rs \
  --tb=short 2>&1 | tee "$DEST/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests/gpu exit code: $tests_rc (log in $DEST/gpu_tests.log)"

RESULTS="$DEST/gpu_check_results.md"
timeout 170 "$PY" benchmarks/bench_gpu.py --out "$RESULTS"
bench_rc=$?
echo "benchmark exit code: $bench_rc (table in $RESULTS)"
exit $(( tests_rc != 0 || bench_rc != 0 ))
