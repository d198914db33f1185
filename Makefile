# Each target creates or refreshes .venv from pyproject.toml by itself: a fresh machine needs
# only Python 3.11 and make.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,tpu,demo]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m jax_tpu_embed.demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# Benchmarks against the peers (torch, FBGEMM, flax+optax), W0 and W1 of shared/WORKLOADS.md.
bench: $(STAMP)
	$(PY) -m pip install -q -r benchmarks/requirements-bench.txt
	$(PY) benchmarks/run.py --workload W0 --engines all --steps 20 --out bench_results/
	$(PY) benchmarks/run.py --workload W1 --engines all --steps 20 --max-seconds 40 --out bench_results/

clean:
	rm -rf $(VENV) .pytest_cache
