#!/usr/bin/env bash
# The one GPU check, run from the repository root on a CUDA machine:
#   kernel tests compiled -> benchmarks (JSON per suite) -> notebooks at GPU sizes (nbmake).
#
#   STAGES="tests bench notebooks" OUT=gpu_out bash scripts/gpu_check.sh
#
# Each stage has its own time limit (T_TESTS, T_BENCH, T_NOTEBOOKS seconds), so a slow stage cannot
# eat the others; logs and bench JSON go to $OUT. Works without installing the package (a GPU box
# may have no network and an older setuptools): sparse_ref is assembled in /tmp with kernels/ as
# sparse_ref/kernels, the same mapping pyproject.toml installs. Wheels carried in .whl/ (nbmake and
# its dependencies) are installed into /tmp/site.
set -u -o pipefail
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
STAGES="${STAGES:-tests bench notebooks}"
status=0
log() { echo "$*" | tee -a "$OUT/gpu_check.log"; }

log "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
if ! "$PY" -c "import sparse_ref.kernels.topk" 2>/dev/null; then
  src=/tmp/sparse_ref_src
  rm -rf "$src" && mkdir -p "$src" && cp -r sparse_ref "$src/" && cp -r kernels "$src/sparse_ref/kernels"
  export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$OUT/gpu_check.log" 2>&1 && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu_check.log"

if [[ " $STAGES " == *" tests "* ]]; then
  log "== pytest: kernel tests, compiled (GPU-only tests included)"
  files=$(ls tests/test_{topk,page_select,page_table,decode_attention,dsa_kernel,quest_kernel,quest_fused,cuda_graph}.py 2>/dev/null)
  timeout "${T_TESTS:-240}" "$PY" -m pytest $files -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -n 25 \
    || status=1
fi

if [[ " $STAGES " == *" bench "* ]]; then
  log "== benchmarks"
  for suite in ${SUITES:-topk select quest decode dsa}; do
    timeout "${T_SUITE:-150}" "$PY" -m sparse_ref.bench "$suite" ${BENCH_ARGS:---quick} --out "$OUT/h200_$suite.json" \
      2>&1 | tee "$OUT/bench_$suite.log" | tail -n 30 || status=1
  done
fi

if [[ " $STAGES " == *" notebooks "* ]]; then
  if "$PY" -c "import nbmake" 2>/dev/null; then
    log "== notebooks (nbmake, GPU sizes)"
    timeout "${T_NOTEBOOKS:-420}" "$PY" -m pytest --nbmake --nbmake-timeout=400 notebooks -q -p no:cacheprovider \
      --durations=0 2>&1 | tee "$OUT/nbmake.log" | tail -n 30 || status=1
  else
    log "== notebooks skipped: nbmake is not installed (carry it and its dependencies as wheels in .whl/)"
  fi
fi
log "== done, status $status; logs in $OUT"
exit $status
