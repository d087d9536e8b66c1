# crossdc — the two set-up commands of the README are `make demo` and `make test`.
# Both build everything they need from the registries: a venv with the Python deps,
# the Kafka jars (Maven) and the Consul binary (Go), cached under ~/.cache/crossdc.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test test-more chaos setup lint unit integration down clean engine images docker-up

$(STAMP): pyproject.toml client/pyproject.toml client/setup.py
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ./client -e ".[dev]"
	$(BIN)/python -m crossdc_client.build_protos
	@touch $@

setup: $(STAMP)
	@bash compose/local/system-deps.sh
	$(BIN)/dr setup

## The main job: the whole DR story (two regions, proxies, mirrors, controllers, Prometheus;
## traffic; a primary-outage drill with automatic failover and failback; Spark reconciliation).
demo: setup
	$(BIN)/dr demo

## The whole suite: lint, types, import contracts, unit and integration tests.
test: setup lint
	$(BIN)/pytest -n 2  # the unit tests beside the server tests (tests/conftest.py)

## Beyond the 10 minutes of `make test` (CI runs it after the demo): the Spark standalone cluster,
## the SCRAM/TLS stack, a three-broker region, Ctrl-C in the demo, spark-submit's exit codes,
## and the reduced chaos set.
test-more: setup
	$(BIN)/pytest -m "slow or chaos"

## The full chaos suite under load (3 brokers per region; regenerates docs/reliability.md), and
## the long runs of the slow tests.
chaos: setup
	CROSSDC_CHAOS=full $(BIN)/pytest -m "chaos or slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

unit: $(STAMP)
	$(BIN)/pytest -m unit

integration: setup
	$(BIN)/pytest -m integration

## Containers: a Docker engine (Debian's docker.io, started with --iptables=false so the
## partition suite keeps working; idempotent), the images built here (cached by their inputs),
## and the whole deployment in containers (docs/docker.md). `make down` removes it.
engine:
	@bash compose/docker/engine.sh

images: setup engine
	$(BIN)/dr images build

docker-up: images
	$(BIN)/dr up --docker

down:
	$(BIN)/dr down

clean: down
	rm -rf .crossdc
