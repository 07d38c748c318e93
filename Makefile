# headroom: `make run` sets up (once) and serves the embedded default; `make test` runs every test.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.headroom-setup

.PHONY: setup run test test-unit test-integration lint fmt bench-overhead bench-autoscale clean

# The set-up reruns only when what it installs changes.
$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/headroom serve --env local

test: $(STAMP)
	$(PY) -m pytest -q tests

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Side-by-side TTFT/TPOT/throughput of headroom and bare `vllm serve` (same engine flags).
bench-overhead: $(STAMP)
	$(PY) -m loadtests.bench_overhead --env local --out results/bench_overhead

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
