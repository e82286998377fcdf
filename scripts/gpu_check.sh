#!/usr/bin/env bash
# The one GPU check (`make gpu-check` runs it), from the repository root on a CUDA machine:
#   kernel tests compiled, the GPU-only cases included -> every notebook at GPU sizes (nbmake) -> a bench smoke.
#
#   bash scripts/gpu_check.sh                      # all three stages; logs and JSON in build/gpu-check/
#   STAGES="tests notebooks" OUT=/tmp/gc bash scripts/gpu_check.sh
#
# It runs the checkout as it is (sparse_ref is imported from the repository root; nothing is installed or
# copied). On a machine without network, carry the missing Python packages (nbmake and its dependencies) as
# wheels in .whl/ (README: "CI on your own GPU runner"): they are installed into a private folder first.
# Tests and notebooks run in parallel (pytest-xdist, WORKERS processes on the one GPU, default: the cores less
# two): test files whole (--dist loadfile), so each file's kernels compile in one process, not in every one.
# Each stage has its own time limit (T_TESTS, T_NOTEBOOKS, T_BENCH seconds, set from a cold-cache run with
# margin), so a slow stage cannot eat the others. The exit status is 0 only when every stage passed.
set -u -o pipefail
OUT="${OUT:-$PWD/build/gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
STAGES="${STAGES:-tests notebooks bench}"
cores=$(nproc 2>/dev/null || echo 4)
WORKERS="${WORKERS:-$(( cores > 3 ? cores - 2 : 1 ))}"
status=0
# Every test file that launches a kernel (the GPU-only cases among them) and the sm_90 compile under this Triton.
KERNEL_TESTS="tests/test_topk.py tests/test_topk_parts.py tests/test_topk_plan.py tests/test_page_select.py
  tests/test_page_table.py tests/test_decode_attention.py tests/test_dsa_kernel.py tests/test_quest_kernel.py
  tests/test_quest_bounds.py tests/test_cuda_graph.py tests/test_engine.py tests/test_engine_graph.py
  tests/test_retrieval.py tests/test_dsa.py tests/test_indexer.py tests/test_bench.py tests/test_isolation.py
  tests/test_offload.py tests/test_swap_in.py tests/test_lessons.py tests/test_aot_compile.py"
log() { echo "$*" | tee -a "$OUT/gpu_check.log"; }
# SGLang's top-k library (make peers), when carried: the bench times it beside ours (sparse_ref/bench/peers.py).
SGL_LIB="build/peers/sgl_kernel_sm90/common_ops.abi3.so"
[[ -z "${SPARSE_REF_SGL_KERNEL_LIB:-}" && -f "$SGL_LIB" ]] && export SPARSE_REF_SGL_KERNEL_LIB="$PWD/$SGL_LIB"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's sparse_ref, whatever else is installed
if ls .whl/*.whl >/dev/null 2>&1; then
  site="${WHEEL_SITE:-/tmp/sparse_ref_site}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    >>"$OUT/gpu_check.log" 2>&1 || { log "== could not install the wheels in .whl/ (see $OUT/gpu_check.log)"; exit 1; }
  export PYTHONPATH="$site:$PYTHONPATH"
fi
begin=$(date +%s)
log "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" \
  | tee -a "$OUT/gpu_check.log"

if [[ " $STAGES " == *" tests "* ]]; then
  log "== pytest: kernel and engine tests, compiled (the GPU-only cases included), $WORKERS workers"
  start=$(date +%s)
  timeout "${T_TESTS:-600}" "$PY" -m pytest ${TEST_FILES:-$KERNEL_TESTS} -n "$WORKERS" --dist loadfile -q \
    -p no:cacheprovider --durations=10 2>&1 | tee "$OUT/pytest.log" | tail -n 25 || status=1
  log "   tests: $(( $(date +%s) - start )) s"
fi

if [[ " $STAGES " == *" notebooks "* ]]; then
  if "$PY" -c "import nbmake" 2>/dev/null; then
    log "== notebooks (nbmake, GPU sizes)"
    start=$(date +%s)
    # the kernels' own profile: no start-up warning about unencrypted local TCP in every notebook's log
    mkdir -p /tmp/sparse_ref_ipython/profile_default
    echo 'c.IPKernelApp.log_level = "ERROR"' > /tmp/sparse_ref_ipython/profile_default/ipython_kernel_config.py
    IPYTHONDIR=/tmp/sparse_ref_ipython timeout "${T_NOTEBOOKS:-300}" "$PY" -m pytest --nbmake --nbmake-timeout=280 ${NOTEBOOK_FILES:-notebooks} \
      -n "$(( WORKERS < 11 ? WORKERS : 11 ))" -q -p no:cacheprovider --durations=0 2>&1 | tee "$OUT/nbmake.log" \
      | tail -n 30 || status=1
    log "   notebooks: $(( $(date +%s) - start )) s"
  else
    log "== notebooks: FAILED, nbmake is not installed (carry it and its dependencies as wheels in .whl/)"
    status=1
  fi
fi

if [[ " $STAGES " == *" bench "* ]]; then
  log "== bench smoke (--quick, every suite in one process)"
  start=$(date +%s)
  timeout "${T_BENCH:-300}" "$PY" -m sparse_ref.bench ${SUITES:-topk select quest decode dsa engine offload_capacity \
    offload_swap} ${BENCH_ARGS:---quick} --out "$OUT/bench_smoke.json" 2>&1 | tee "$OUT/bench.log" | tail -n 40 \
    || status=1
  log "   bench: $(( $(date +%s) - start )) s"
fi
log "== done, status $status, $(( $(date +%s) - begin )) s in all; logs in $OUT"
exit $status
