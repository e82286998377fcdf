#!/usr/bin/env bash
# The one GPU check, run on the H200 from the repository root:
#   tests (GPU tests included) -> benchmarks (JSON to $OUT/h200.json) -> notebooks (if nbmake is there).
# Logs go to $OUT (default: ./gpu_out). Meant to finish in well under 6 minutes.
set -u -o pipefail
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
status=0

echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)" | tee "$OUT/gpu_check.log"
# The package maps sparse_ref.kernels onto kernels/, so it must be installed (no network there: no deps).
if ! "$PY" -c "import sparse_ref.kernels.topk" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/gpu_check.log" 2>&1 \
    || { echo "pip install -e . failed (see $OUT/gpu_check.log)"; exit 1; }
fi

# Wheels carried in .whl/ (e.g. nbmake and its dependencies) go to /tmp/site, on PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$OUT/gpu_check.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

echo "== pytest tests (GPU tests included)" | tee -a "$OUT/gpu_check.log"
ignore=()
if ! "$PY" -c "import nbformat" 2>/dev/null; then  # the image has no nbformat: notebook-format tests can't import
  ignore=(--ignore=tests/test_notebooks.py)
  echo "   (nbformat missing here: tests/test_notebooks.py skipped)" | tee -a "$OUT/gpu_check.log"
fi
timeout 240 "$PY" -m pytest tests -x -q "${ignore[@]}" 2>&1 | tee "$OUT/pytest.log" | tail -n 25 || status=1

if [ "${BENCH:-1}" != "0" ]; then
  echo "== benchmarks" | tee -a "$OUT/gpu_check.log"
  timeout 150 "$PY" -m sparse_ref.bench all --out "$OUT/h200.json" 2>&1 | tee "$OUT/bench.log" || status=1
fi

if "$PY" -c "import nbmake" 2>/dev/null; then
  echo "== notebooks (nbmake)" | tee -a "$OUT/gpu_check.log"
  timeout 420 "$PY" -m pytest --nbmake --nbmake-timeout=400 notebooks -q --durations=0 2>&1 | tee "$OUT/nbmake.log" | tail -n 30 || status=1
else
  echo "== notebooks skipped: nbmake is not installed in this python (carry it as a wheel to run them)" \
    | tee -a "$OUT/gpu_check.log"
fi
echo "== done, status $status; logs in $OUT" | tee -a "$OUT/gpu_check.log"
exit $status
