# The two commands of the README:
#   make study   creates .venv, installs, runs the default study, prints where the report is
#   make test    creates .venv, installs, runs the tests
# On a GPU machine: make install GPU=1 (faiss with GPU indexes; see pyproject.toml's [gpu]).
VENV     ?= .venv
PYTHON   ?= python3
CORES    ?= 2
CONFIG   ?= config.yaml
TORCH    ?= torch==2.14.1 torchvision==0.29.1
# GPU=1: faiss with GPU indexes (pyproject.toml's [gpu] extra) instead of faiss-cpu ([cpu]).
# Both wheels install the module `faiss`, so a venv holds exactly one of them; once installed
# with GPU=1 the venv stays GPU until `make install GPU=0`.
GPU      ?= $(if $(wildcard $(VENV)/.installed-gpu),1,0)
FAISS    := $(if $(filter 1,$(GPU)),gpu,cpu)
SNAKE_ARGS ?=
# one line per finished cell with an ETA (smallbatch.local.console); Snakemake's full log stays in
# .snakemake/log/. CONSOLE= (empty) prints Snakemake's own output instead.
CONSOLE  ?= --logger smallbatch
BIN      := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)

.PHONY: install study smoke test test-fast lint report data clean-results

install: $(VENV)/.installed-$(FAISS)

$(VENV)/.installed-$(FAISS): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	@# another faiss wheel (even one installed over this one) shares files with faiss-$(FAISS): remove every faiss wheel first
	others=$$($(BIN)/python -m pip list --format=freeze 2>/dev/null | sed -n 's/^\(faiss[-_a-z0-9]*\)==.*/\1/ip' \
		| tr 'A-Z_' 'a-z-' | grep -vx 'faiss-$(FAISS)'); \
	if [ -n "$$others" ]; then $(BIN)/python -m pip uninstall -q -y faiss-cpu faiss-gpu $$others; fi
	$(BIN)/python -m pip install -q -e '.[test,dev,slurm,$(FAISS)]'
	rm -f $(VENV)/.installed $(VENV)/.installed-cpu $(VENV)/.installed-gpu
	touch $@

# Fashion-MNIST from Debian's package when we can install it (root + apt);
# otherwise the study is run with data.download=true and torchvision fetches it.
data:
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null; fi

study: install data
	@# Snakemake reads --configfile files itself (its YAML errors name no line): check it first
	@$(BIN)/smallbatch cells --config $(CONFIG) > /dev/null
	@dl=""; if [ ! -d /usr/share/datasets/fashion-mnist ] && [ ! -d results/data/FashionMNIST/raw ]; then \
		echo "Debian's dataset-fashion-mnist is not installed: torchvision will download Fashion-MNIST"; \
		dl="workflow/configs/download.yaml"; fi; \
	$(BIN)/python -m snakemake --snakefile Snakefile --configfile $(CONFIG) $$dl --workflow-profile workflow/profiles/default \
		--cores $(CORES) $(CONSOLE) $(SNAKE_ARGS)
	@echo "report: $$(pwd)/results/report/index.md   (browse runs and artifacts: cd results && mlflow ui --backend-store-uri sqlite:///mlflow.db)"

smoke: install
	$(BIN)/python -m snakemake --snakefile Snakefile --configfile workflow/configs/smoke.yaml \
		--workflow-profile workflow/profiles/default --cores $(CORES) $(CONSOLE) $(SNAKE_ARGS)

report: install
	$(BIN)/smallbatch report --config $(CONFIG) --out results/report

# the tests run in TEST_WORKERS pytest-xdist workers, a module (and every module that drives the
# local SLURM) whole in one worker (tests/conftest.py); TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= $(CORES)

test: install  # the 25 slowest tests listed at the end: where the suite spends its time
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=25

# the fast tier for the edit-test loop: everything but the end-to-end (workflow) tests
test-fast: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow"

# what .ci/run checks before the tests: formatting, lint and types (ruff, mypy: pinned in pyproject.toml's [dev])
lint: install
	$(BIN)/ruff format --check src tests benchmarks tools
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/mypy

clean-results:
	rm -rf results/runs results/baselines results/logs results/report results/mlflow.db results/mlartifacts results/mlflow.ready results/smoke
