# sparse_ref: two commands do everything.
#   make tutorial   set up .venv, execute every notebook, write executed copies + HTML to build/
#   make test       set up .venv, run pytest on tests/ and nbmake on notebooks/
# Other targets: setup, demo (python -m sparse_ref.demo), lint, clean-notebooks, clean.

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

.PHONY: setup tutorial demo test lint clean-notebooks clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
ifeq ($(HAS_GPU),1)
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION) triton==$(TRITON_VERSION)
else
	@# CPU build: a local wheel cache (pip's find-links) answers first; otherwise PyTorch's CPU index.
	$(BIN)/python -m pip install --quiet --no-index --no-deps torch==$(TORCH_VERSION) 2>/dev/null \
	  || $(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION) --index-url $(TORCH_CPU_INDEX)
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION) triton==$(TRITON_VERSION)
endif
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $@

tutorial: setup demo
	@mkdir -p $(BUILD)/notebooks $(BUILD)/html
	@for nb in $(NOTEBOOKS); do \
	  echo "== executing $$nb"; \
	  $(BIN)/jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=1800 \
	    --ExecutePreprocessor.kernel_name=python3 --output-dir $(BUILD)/notebooks "$$nb" || exit 1; \
	done
	$(BIN)/jupyter nbconvert --to html --output-dir $(BUILD)/html $(BUILD)/notebooks/*.ipynb
	@echo ""
	@echo "Executed notebooks (with plots): $(abspath $(BUILD)/notebooks)"
	@echo "HTML for browsing:               $(abspath $(BUILD)/html)"

# The decode engine end to end: a table of accuracy (and time, on a GPU) per budget, and a plot.
demo: setup
	$(BIN)/python -m sparse_ref.demo --out $(BUILD)/demo.png

test: setup
	$(BIN)/python -m pytest tests --nbmake notebooks --nbmake-timeout=900 -q

lint: setup
	$(BIN)/ruff check .

# Strip outputs and execution counts from the committed notebooks.
clean-notebooks: setup
	$(BIN)/jupyter nbconvert --clear-output --inplace $(NOTEBOOKS)

clean:
	rm -rf $(BUILD) .pytest_cache .ruff_cache
