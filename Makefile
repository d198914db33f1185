# Each target creates or refreshes .venv from pyproject.toml by itself: a fresh machine needs
# only Python 3.11 and make.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,tpu,demo,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m jax_tpu_embed.demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

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
