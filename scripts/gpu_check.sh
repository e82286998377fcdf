#!/usr/bin/env bash
# The one GPU check (`make gpu-check` runs it), from the repository root on a CUDA machine, in three stages:
#   tests      every kernel and engine test file, compiled, at each kernel's default launch knobs: the plan
#              boundaries, the GPU-only cases (FP8 and bf16 dots, CUDA graphs, pinned host memory, offload and the
#              engine at GPU sizes) and the lessons equal to the package;
#   notebooks  every notebook at GPU sizes (nbmake), beside the tests (the two share the cores: both mostly compile);
#   capabilities  the engine tests and notebook 07 with the backend an A100 (8.0) and a T4 (7.5) would choose
#              (SPARSE_REF_CAPABILITY: the fallbacks are the ones chosen, the results match), beside the others;
#   bench      every suite --quick in one process, after both (a smoke: it runs, its checks hold; no timing is kept).
# What lives elsewhere, and why: a test marked `knobs` (a kernel forced down a path at launch knobs other than its
# defaults, at interpreter sizes) and the sm_90 compile of every launch and GPU-shape variant run in the CPU suite
# and CI (`make test`, under both Tritons): they check exactness and compilability, which a GPU adds nothing to,
# and compiling each variant again here cost minutes. Properties draw 6 compiled examples each here (HYPOTHESIS_PROFILE
# gpu), 40 in the CPU suite.
#
#   bash scripts/gpu_check.sh                      # all three stages; logs and JSON in build/gpu-check/
#   STAGES="tests notebooks" OUT=/tmp/gc bash scripts/gpu_check.sh
#
# It runs the checkout as it is (sparse_ref is imported from the repository root; nothing is installed or
# copied). On a machine without network, carry the missing Python packages (nbmake and its dependencies) as
# wheels in .whl/ (README: "CI on your own GPU runner"): they are installed into a private folder first.
# Each stage has its own time limit (T_TESTS, T_NOTEBOOKS, T_BENCH seconds, set from a cold-cache run with
# margin), so a slow stage cannot eat the others. It ends with a table of the stages; the exit status is 0 only
# when every stage passed.
set -u -o pipefail
OUT="${OUT:-$PWD/build/gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
STAGES="${STAGES:-tests notebooks capabilities bench}"
cores=$(nproc 2>/dev/null || echo 4)
# The tests and the notebooks run at once: two thirds of the cores to the tests, the rest to the notebooks.
WORKERS="${WORKERS:-$(( cores > 5 ? cores * 2 / 3 : 2 ))}"
NB_WORKERS="${NB_WORKERS:-$(( cores - WORKERS > 1 ? cores - WORKERS : 1 ))}"
# Every test file that launches a kernel (the GPU-only cases among them).
KERNEL_TESTS="tests/test_topk.py tests/test_topk_parts.py tests/test_topk_plan.py tests/test_page_select.py
  tests/test_page_table.py tests/test_decode_attention.py tests/test_dsa_kernel.py tests/test_quest_kernel.py
  tests/test_quest_bounds.py tests/test_cuda_graph.py tests/test_engine.py tests/test_engine_graph.py
  tests/test_retrieval.py tests/test_dsa.py tests/test_indexer.py tests/test_bench.py tests/test_isolation.py
  tests/test_offload.py tests/test_swap_in.py tests/test_lessons.py tests/test_backend.py"
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

# One stage in the background: its command's output in $OUT/<name>.log, then "<status> <seconds>" in <name>.done.
stage() {
  local name=$1 limit=$2; shift 2
  ( start=$(date +%s); timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; rc=$?
    echo "$rc $(( $(date +%s) - start ))" >"$OUT/$name.done" ) &
}
wanted() { [[ " $STAGES " == *" $1 "* ]]; }
rm -f "$OUT"/*.done

if wanted tests; then
  log "== tests: kernel and engine tests, compiled, default knobs (not -m knobs), $WORKERS workers"
  HYPOTHESIS_PROFILE=gpu stage tests "${T_TESTS:-300}" "$PY" -m pytest ${TEST_FILES:-$KERNEL_TESTS} -m "not knobs" \
    -n "$WORKERS" --dist worksteal -q -p no:cacheprovider --durations=15
fi
if wanted notebooks; then
  if "$PY" -c "import nbmake" 2>/dev/null; then
    log "== notebooks: nbmake at GPU sizes, $NB_WORKERS workers"
    # the kernels' own profile: no start-up warning about unencrypted local TCP in every notebook's log
    mkdir -p /tmp/sparse_ref_ipython/profile_default
    echo 'c.IPKernelApp.log_level = "ERROR"' > /tmp/sparse_ref_ipython/profile_default/ipython_kernel_config.py
    IPYTHONDIR=/tmp/sparse_ref_ipython stage notebooks "${T_NOTEBOOKS:-300}" "$PY" -m pytest --nbmake \
      --nbmake-timeout=280 ${NOTEBOOK_FILES:-notebooks} -n "$NB_WORKERS" -q -p no:cacheprovider --durations=0
  else
    log "== notebooks: FAILED, nbmake is not installed (carry it and its dependencies as wheels in .whl/)"
    echo "1 0" >"$OUT/notebooks.done"
  fi
fi
if wanted capabilities; then
  log "== capabilities: the engine tests and notebook 07 as an A100 (8.0) and a T4 (7.5) would choose (simulated)"
  IPYTHONDIR=/tmp/sparse_ref_ipython PY="$PY" stage capabilities "${T_CAPABILITIES:-240}" bash -c 'for cap in 8.0 7.5; do
    echo "-- SPARSE_REF_CAPABILITY=$cap"; SPARSE_REF_CAPABILITY=$cap "$PY" -m pytest tests/test_engine.py \
      tests/test_backend.py --nbmake notebooks/07_end_to_end.ipynb -m "not knobs" -n 2 -q -p no:cacheprovider || exit 1
  done'
fi
wait
if wanted bench; then
  log "== bench smoke: every suite --quick, one process"
  stage bench "${T_BENCH:-240}" "$PY" -m sparse_ref.bench ${SUITES:-topk select quest decode dsa engine \
    offload_capacity offload_swap} ${BENCH_ARGS:---quick} --out "$OUT/bench_smoke.json"
  wait
fi

# The table: each stage's status, minutes and counts (pytest's last line; the bench's JSON rows).
status=0
log ""
log "$(printf '%-10s %-8s %8s  %s' stage status minutes counts)"
for name in tests notebooks capabilities bench; do
  wanted "$name" || continue
  read -r rc secs <"$OUT/$name.done" 2>/dev/null || { rc=1; secs=0; }
  [[ "$rc" == 0 ]] && result=passed || { result=FAILED; status=1; }
  [[ "$rc" == 124 ]] && result="TIMEOUT"
  if [[ "$name" == bench ]]; then
    counts=$("$PY" -c "import json, sys; d = json.load(open(sys.argv[1])); print(len(d['rows']), 'rows', d['suites_done'])" \
      "$OUT/bench_smoke.json" 2>/dev/null || echo "no JSON")
  else
    counts=$(grep -E '^=* ?[0-9]+ (passed|failed|error)' "$OUT/$name.log" 2>/dev/null | tr -d '=' | xargs | sed 's/) /); /g')
  fi
  log "$(printf '%-10s %-8s %8.1f  %s' "$name" "$result" "$(awk "BEGIN{print $secs/60}")" "$counts")"
  [[ "$rc" == 0 ]] || tail -n 40 "$OUT/$name.log"
done
total=$(( $(date +%s) - begin ))
log "$(printf '%-10s %-8s %8.1f  %s' total "$([[ $status == 0 ]] && echo passed || echo FAILED)" \
  "$(awk "BEGIN{print $total/60}")" "logs in $OUT")"
exit $status
