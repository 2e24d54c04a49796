# Two commands set everything up on a fresh machine:
#   make lab    create .venv, install hvdnb + the "Python 3 (hvdnb)" kernel, open JupyterLab
#   make test   create .venv, install with test extras, run the whole suite
# and one keeps the house tidy:
#   make lint   ruff check, ruff format --check, mypy (strict on all of hvdnb and kernels_ext)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned to the CPU build through constraints.txt: a fresh resolve of an open
# range would pull the newest torch with several GB of CUDA wheels. On a GPU node:
#   make lab TORCH=torch CONSTRAINTS=      (pip's default torch, with CUDA)
TORCH       ?= torch==2.13.0
CONSTRAINTS ?= -c constraints.txt
PIP    := $(BIN)/python -m pip install -q $(CONSTRAINTS)
# two lanes (pytest-xdist workers; tests/conftest.py says how tests are shared out, and why)
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder
# more pip options for the install step (the suite passes --no-compile when it builds a fresh
# copy of this environment: byte-compiling is an install-time cost, not what it checks)
PIP_OPTS ?=

.PHONY: lab test lint docs demo bench install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# hvdnb with the `durable` extra (the server runs each cell and keeps its output, so a reload or
# a closed browser loses none of it: docs/reference/panel.md) and the `lessons` extra: everything the ten teaching notebooks import (scikit-learn,
# TensorFlow with tf-keras, Accelerate, transformers, Lightning), so that every lesson runs with
# no install step left for run time. A TensorFlow already in the environment (a GPU build the
# user installed, or one of another release) is kept: then the lessons' other packages go in
# beside it, with the tf-keras release that matches it (--no-deps: tf-keras names the
# `tensorflow` distribution, which would go in over a tensorflow-gpu or tf-nightly).
OWN_TF := import importlib.metadata as m; d = m.packages_distributions().get("tensorflow"); \
	print(".".join(m.version(d[0]).split(".")[:2]) if d else "")

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) "$(TORCH)"
	@tf="$$($(BIN)/python -c '$(OWN_TF)')"; set -ex; \
	if [ -n "$$tf" ]; then \
		echo "make: keeping the TensorFlow $$tf in $(VENV); the lessons' other packages go in beside it"; \
		$(PIP) $(PIP_OPTS) -e ".[lessons-torch,durable]"; \
		$(PIP) $(PIP_OPTS) --no-deps "tf-keras==$$tf.*"; \
	else \
		$(PIP) $(PIP_OPTS) -e ".[lessons,durable]"; \
	fi
	@# an editable install skips the wheel's data files, among them the one that turns
	@# hvdnb's server extension on; put it where the wheel would (`jupyter server extension
	@# enable` refuses an extension that no config file names yet)
	install -D -m 644 jupyter-config/hvdnb-server.json \
		$(VENV)/etc/jupyter/jupyter_server_config.d/hvdnb-server.json
	@# the page runs cells itself (its outputs trusted: widgets draw); the server writes
	@# only a running cell whose page left (hvdnb.server.takeover), not nbmodel's page executor
	$(BIN)/jupyter labextension disable --level=sys_prefix @datalayer/jupyter-server-nbmodel
	touch $@

# the test tools; the docs extra too: tests/docs reads the reference through Sphinx's own
# source analyser
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e ".[test,docs]"
	touch $@

$(VENV)/.installed-lint: $(VENV)/.installed
	$(PIP) -e ".[lint]"
	touch $@

LINT_PATHS := hvdnb kernels_ext tests bench examples docs/_ext docs/conf.py

# mypy reads the libraries the project runs with (the test, tf and frameworks extras): a
# class built on transformers' TrainerCallback is typed only where transformers is installed,
# so lint on a clean clone and on a developer's tree must see the same environment
lint: $(VENV)/.installed-lint $(VENV)/.installed-test
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy hvdnb kernels_ext

# The documentation site (docs/, Sphinx + myst-nb) into build/docs/html; warnings are errors.
# The tutorials are the notebooks' executed copies in $(EXECUTED) (the notebook tests write
# them there; a missing or stale one is run first, on 2 local CPU ranks). Nothing is fetched.
EXECUTED ?= $(CURDIR)/build/executed-notebooks
$(VENV)/.installed-docs: $(VENV)/.installed
	$(PIP) -e ".[docs]"
	touch $@

docs: $(VENV)/.installed-docs
	HVDNB_EXECUTED_DIR=$(EXECUTED) $(BIN)/python -m sphinx -W --keep-going -n -q -b html docs build/docs/html
	@echo "docs: build/docs/html/index.html"

install: $(VENV)/.installed
	$(BIN)/hvdnb install-kernel

# JupyterLab refuses to start as root (containers, CI boxes) unless told it is intended
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: install
	$(BIN)/jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1 $(ALLOW_ROOT)

demo: $(VENV)/.installed
	$(BIN)/hvdnb demo -n 2

test: $(VENV)/.installed-test
	HVDNB_EXECUTED_DIR=$(EXECUTED) $(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.installed-test
	$(BIN)/python bench/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info
