# Fresh machine: `make run` sets up .venv and starts the app; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The pinned CPU build; on a GPU box override, e.g. `make run TORCH=torch==2.13.0 TORCH_INDEX=...`.
TORCH ?= torch==2.13.0
export GRADIO_ANALYTICS_ENABLED := False

.PHONY: setup setup-dev run test test-fast test-reliability lint bench clean

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

run: setup
	$(PY) app.py

test: setup-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q --durations=15

# The unit tests: no child processes, browser or GPU (markers in tests/conftest.py).
test-fast: setup-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -m "not slow and not browser and not gpu"

# Hostile traces and load replayed (issue 22): about 15 s, the served app's latency check included.
test-reliability: setup-dev
	$(PY) -m pytest -q -m reliability

lint: setup-dev
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

bench: setup
	$(PY) bench/estimator_speed.py

clean:
	rm -rf $(VENV)
