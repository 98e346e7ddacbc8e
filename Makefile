# Capture & Replay. The README's two commands are `make course` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0: a CUDA build from PyPI on Linux x86_64, the CPU build where a local wheel is served.
# If torch already imports in the venv it is left alone. Override: make setup TORCH='torch==2.11.0'
TORCH ?= torch==2.13.0
TEST_PATHS := tests notebooks labs solutions
NBVAL := --nbval-lax --nbval-cell-timeout=900

.PHONY: setup course test lab gpu-test doctor clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed  ## create .venv and install the course

course: setup  ## set up, check the environment, execute every notebook into build/
	$(PY) -m course doctor
	$(PY) -m course run

test: setup  ## set up, then run the unit tests and every notebook under nbval
	$(PY) -m pytest -p no:cacheprovider $(TEST_PATHS) $(NBVAL)

doctor: setup
	$(PY) -m course doctor

lab: setup  ## open JupyterLab on the course
	$(PY) -m pip install -q "jupyterlab>=4"
	$(PY) -m jupyter lab --notebook-dir=.

# The GPU lane: the same suite with live GPU measurements, on a machine whose python
# already has the course's dependencies (no venv). COURSE_PATH=cuda makes it fail at
# once instead of silently falling back to the simulator.
gpu-test:
	COURSE_PATH=cuda $(PYTHON) -m pytest -p no:cacheprovider $(TEST_PATHS) $(NBVAL)

clean:
	rm -rf build $(VENV)
