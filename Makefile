# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test check lint format unit integration fuzz proto bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# What ruff and mypy look at (the generated iop_pb2.py is excluded in pyproject.toml).
SOURCES := iop tests bench scripts twisted

$(STAMP): $(BIN)/python setup.py
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python scripts/demo.py

# Every test, after the quality gate: what CI runs.
test: check integration

# The quality gate: lint, format, types, unit tests.
check: install
	$(BIN)/ruff check $(SOURCES)
	$(BIN)/ruff format --check $(SOURCES)
	$(BIN)/mypy
	$(BIN)/trial iop

# Rewrite the sources the way `make check` wants them.
format: install
	$(BIN)/ruff check --fix $(SOURCES)
	$(BIN)/ruff format $(SOURCES)

unit: install
	$(BIN)/trial iop

integration: install
	$(BIN)/pytest -q tests

# The long fuzz mode (the short one runs in `make check`): per test, up to
# FUZZ_FRAMES wire frames (or HTTP requests) or FUZZ_SECONDS, whichever
# comes first.
FUZZ_FRAMES ?= 1000000
FUZZ_SECONDS ?= 600
fuzz: install
	IOP_FUZZ=long IOP_FUZZ_FRAMES=$(FUZZ_FRAMES) IOP_FUZZ_SECONDS=$(FUZZ_SECONDS) \
		$(BIN)/trial iop.test.test_fuzz_wire iop.test.test_fuzz_http

proto: install
	cd iop/protocols && ../../$(BIN)/python -m grpc_tools.protoc -I. --python_out=. iop.proto

# Every benchmark in its short form (a minute or two) and issue 11's table
# (bench/README.md); `make bench BENCH_FLAGS=--full` for the reference sizes.
BENCH_FLAGS ?=
bench: install
	$(BIN)/python bench/report.py $(BENCH_FLAGS)

clean:
	rm -rf $(VENV) build *.egg-info _trial_temp .pytest_cache
