# Each target creates or refreshes .venv from pyproject.toml by itself: a fresh machine needs
# only Python 3.11 and make.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-all lint format bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,tpu,demo,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m jax_tpu_embed.demo

# The suite in two tiers. `make test` (what a change is checked with) runs the fast tier:
# every test not marked slow. `make test-slow` runs the slow tier, `-m slow`: the full libtpu
# AOT matrix, multi-process and subprocess tests, the demo, the full optimizer rotation, the
# fuzzer's kept cases (campaigns: `.venv/bin/python tests/fuzz.py --help`).
# A test may leave the fast tier for the slow one only when other fast tests run every line
# of the package that it runs (`tests/tier_coverage.py` lists such tests); CI still runs it.
# `make test-all` runs both in one session. --dist loadgroup spreads tests over both workers
# one by one, except those of a file marked xdist_group (module state), kept on one worker.
# ARGS= passes more pytest options, e.g. ARGS="-k routing --durations=20". pytest exits 5
# when it selects no test: an error here (a tier that runs nothing checks nothing).
# --max-worker-restart=0: a worker that crashes (or that pytest-timeout ends) fails the run
# at once. pytest-xdist 3.8 under --dist loadgroup hangs after it replaces a crashed worker
# (pytest-dev/pytest-xdist#1323, #1327, #1378), which held CI until its limit twice.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadgroup --max-worker-restart=0
define run_tier
	$(PYTEST) $(1) $(ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make $@: pytest selected no test (exit 5)" >&2; fi; \
	exit $$rc
endef

test: $(STAMP)
	$(call run_tier,-m "not slow")

test-slow: $(STAMP)
	$(call run_tier,-m slow)

test-all: $(STAMP)
	$(call run_tier,)

# ruff's linter, ruff's formatter (check only) and pyright (settings in pyproject.toml) over
# the package, tests/ and benchmarks/, imports resolved in this venv. pyright runs even when
# ruff fails, so that one run lists every finding; any failing fails the target.
lint: $(STAMP)
	$(PY) -m ruff check jax_tpu_embed tests benchmarks; ruff=$$?; \
	$(PY) -m ruff format --check jax_tpu_embed tests benchmarks || ruff=1; \
	$(PY) -m pyright --pythonpath $(PY) && exit $$ruff

# Rewrites the code: ruff's formatter, then the lint fixes ruff can make by itself.
format: $(STAMP)
	$(PY) -m ruff format jax_tpu_embed tests benchmarks
	$(PY) -m ruff check --fix jax_tpu_embed tests benchmarks

# Benchmarks against the peers (torch, FBGEMM, flax+optax): workloads W0 and W1 (docs/design.md).
bench: $(STAMP)
	$(PY) -m pip install -q -r benchmarks/requirements-bench.txt
	$(PY) benchmarks/run.py --workload W0 --engines all --steps 20 --out bench_results/
	$(PY) benchmarks/run.py --workload W1 --engines all --steps 20 --max-seconds 40 --out bench_results/

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
