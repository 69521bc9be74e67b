# `make demo` and `make test` set everything up from a fresh clone, then run.
# PYTHON is the interpreter to install into (a venv's python works too).
PYTHON ?= python3
# The local CPU wheel on this machine; set TORCH_SPEC= (empty) to keep the torch you already have.
TORCH_SPEC ?= torch==2.13.0
SETUP_STAMP := .setup.stamp

.PHONY: setup demo test clean

setup: $(SETUP_STAMP)

$(SETUP_STAMP): pyproject.toml
	$(if $(TORCH_SPEC),$(PYTHON) -m pip install --quiet "$(TORCH_SPEC)")
	$(PYTHON) -m pip install --quiet -e ".[dev]"
	touch $@

demo: setup
	$(PYTHON) -m tensorpar verify --tp 2

test: setup
	$(PYTHON) -m pytest -q

clean:
	rm -f $(SETUP_STAMP)
