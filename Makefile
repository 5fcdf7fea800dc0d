# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test unit integration proto bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python setup.py
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python scripts/demo.py

test: install
	$(BIN)/trial iop
	$(BIN)/pytest -q tests

unit: install
	$(BIN)/trial iop

integration: install
	$(BIN)/pytest -q tests

proto: install
	cd iop/protocols && ../../$(BIN)/python -m grpc_tools.protoc -I. --python_out=. iop.proto

bench: install
	$(BIN)/python bench/relay.py

clean:
	rm -rf $(VENV) build *.egg-info _trial_temp .pytest_cache
