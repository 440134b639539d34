# Two commands set up and use the platform on a fresh machine (see README.md):
#   make run    virtualenv, install, fetch the default model, migrate, demo data, start every process
#   make test   virtualenv, install (with dev extras), start PostgreSQL/Redis if needed, run the suite
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

# The test command talks to real services; these defaults match a local install.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/loraplex
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
# The suite runs in this many processes (pytest-xdist, a module's tests in one process; 0 = in
# pytest's own); tests/xdist_isolation.py gives each its own test database and Redis database.
# Each process (and each server a test starts) runs torch on every core, so its OpenMP threads
# wait for work asleep (OMP_WAIT_POLICY=passive), not spinning on a core another process needs:
# two copies of tests/inference/engine/test_engine.py side by side on 2 cores took 142 s
# spinning, 54 s asleep (49 s with one thread each, which would leave the kernels' threaded
# paths untested). For the tests only: an engine alone on its cores decodes ~27% slower asleep
# (bench/serve_vs_offline.py --quick offline: 227 and 219 tok/s spinning, 166 and 154 asleep),
# so `make run` and the deployment files leave OpenMP's default.
TEST_PROCESSES ?= 2

.PHONY: run test lint model install install-dev clean bench-peers

$(PY):
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (Python 3.11 is required)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install --quiet -e .
	@touch $@

$(VENV)/.installed-dev: pyproject.toml | $(PY)
	$(PIP) install --quiet -e ".[dev]"
	@touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

model: $(VENV)/.installed
	$(PY) -m inference.models fetch

run: $(VENV)/.installed
	@$(PY) -m kernels.cpu_fused
	$(PY) deploy/local/run.py

test: $(VENV)/.installed-dev
	@bash deploy/local/ensure-services.sh "$${DATABASE_URL:-$(TEST_DATABASE_URL)}" "$${REDIS_URL:-$(TEST_REDIS_URL)}"
	@bash deploy/local/ensure-browser.sh $(VENV)
	$(PY) -m inference.models fetch
	$(PY) -m kernels.cpu_fused
	$(VENV)/bin/ruff check .
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
		$(VENV)/bin/lint-imports --no-cache
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
		OMP_WAIT_POLICY="$${OMP_WAIT_POLICY:-passive}" PYTHONPATH="$(CURDIR)" $(VENV)/bin/pytest -p tests.xdist_isolation -n $(TEST_PROCESSES) --dist loadfile \
		$(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# The peers that bench/ measures beside the engine and that `make install` does not bring:
# llama.cpp through llama-cpp-python for bench/single_stream.py. It builds from source (about
# 7 minutes on 2 cores). A native build (-march=native) dies with "Illegal instruction" at the
# first token on CPUs that advertise AMX, so it is built for AVX2/FMA/F16C, which every x86-64
# CPU the project meets runs.
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF

bench-peers: $(VENV)/.installed
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PIP) install --no-cache-dir "$(LLAMA_CPP_PYTHON)"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
