# headroom: `make run` sets up (once) and serves the embedded default; `make test` runs every test.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.headroom-setup

.PHONY: setup run test test-unit test-integration lint fmt plan loadtest ladder bench bench-overhead bench-stat-logger bench-serve-request bench-autoscale tune-autoscale bench-vllm-agreement clean

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

# ruff (lint + format), mypy (strict on the pure packages) and import-linter (the layers in docs/architecture.md).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# What fits where: TP size, replicas, KV tokens, safe concurrency (no GPU needed).
plan: $(STAMP)
	$(VENV)/bin/headroom plan configs/prod.yaml --gpus 8 --nodes 2

# A short headless Locust run against the embedded default: CSVs + per-request raw file in results/loadtest.
loadtest: $(STAMP)
	HEADROOM_VENV=$(VENV) bash scripts/loadtest.sh

# The seeds' tuning procedure on the embedded default: 4 settings x 3 fresh engines (results/ladder-cpu).
ladder: $(STAMP)
	$(VENV)/bin/headroom ladder configs/base.yaml configs/local.yaml --profile structured \
	  --steps 4:6,16:6 --max-steps 3 --max-tokens 64 --ttft-slo-ms 100 --repeats 3 --out results/ladder-cpu

bench: bench-overhead bench-autoscale

# Side-by-side TTFT/TPOT/throughput of headroom and bare `vllm serve` (same engine flags), `vllm bench serve`
# as the client; the GPU run of the same benchmark is `loadtests/gpu/run.sh overhead`.
bench-overhead: $(STAMP)
	$(PY) -m loadtests.bench_overhead --env local --workloads random-1024 short shared-prefix --concurrency 1 8 \
	  --num-prompts 1:10,8:24 --output-len 32 --rounds 3 --ours-at 1 --out results/bench_overhead

# One histogram observation through Ray's metrics (headroom replicas' vLLM stat logger) against prometheus_client
# (`vllm serve`'s), per generated token in the engine client's event loop.
bench-stat-logger: $(STAMP)
	$(PY) -m loadtests.bench_stat_logger --out results/stat_logger

# Ray Serve's request path against uvicorn alone: the serving process's CPU per request, with no engine,
# and a py-spy profile of where it goes.
bench-serve-request: $(STAMP)
	$(PY) -m loadtests.bench_serve_request --profile-requests 20000 --out results/serve_request

# The shipped autoscaling policy against Ray's tuned default and static fleets, in the request-level
# simulator (26 min on 2 cores; results/autoscale). The deployment's numbers come from the config
# and its plan; Ray's knobs from results/autoscale/tuning.json (make tune-autoscale, 61 min).
AUTOSCALE_INPUTS := $(PY) -m loadtests.autoscale_inputs configs/base.yaml configs/prod.yaml --gpus 8 --nodes 2 --out results/autoscale/deployment.json

bench-autoscale: $(STAMP)
	$(AUTOSCALE_INPUTS)
	$(PY) -m autoscale.bench --out results/autoscale

tune-autoscale: $(STAMP)
	$(AUTOSCALE_INPUTS)
	$(PY) -m autoscale.tune --out results/autoscale

# Our TTFT/TPOT against `vllm bench serve` on the same server (start one first: make run).
bench-vllm-agreement: $(STAMP)
	$(PY) -m loadtests.vllm_bench_agreement --url http://127.0.0.1:8000 --model tiny-qwen3

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
