# `make demo` and `make test` set everything up from a fresh clone, then run.
# PYTHON is the interpreter to install into (a venv's python works too).
PYTHON ?= python3
# The local CPU wheel on this machine; set TORCH_SPEC= (empty) to keep the torch you already have.
TORCH_SPEC ?= torch==2.13.0
SETUP_STAMP := .setup.stamp

.PHONY: setup demo test test-fast clean

setup: $(SETUP_STAMP)

$(SETUP_STAMP): pyproject.toml
	$(if $(TORCH_SPEC),$(PYTHON) -m pip install --quiet "$(TORCH_SPEC)")
	$(PYTHON) -m pip install --quiet -e ".[dev]"
	# the benchmark's megatron-core contender (pure Python; --no-deps keeps torch as pinned)
	$(PYTHON) -m pip install --quiet --no-deps "megatron-core>=0.16.1,<0.17" || \
		echo "megatron-core did not install: tensorpar bench reports it as not installed"
	touch $@

# The main job: train the GPT at TP=2 on Python's help text (3.5 minutes on 2 CPU cores),
# then continue a prompt from the checkpoint it wrote.
DEMO_DIR ?= runs/demo
demo: setup
	rm -rf $(DEMO_DIR)
	$(PYTHON) -m tensorpar train --tp 2 --out $(DEMO_DIR)
	$(PYTHON) -m tensorpar generate --ckpt $(DEMO_DIR) --tp 2 --max-new-tokens 300 --temperature 0.7 \
		--prompt "The with statement"

# Everything (CI runs this; 12 min 36 s here), with the 25 slowest tests listed at the end.
test: setup
	$(PYTHON) -m pytest -q --durations=25

# The fast tier for development: every package's core behaviour, under 3 minutes on 2 cores
# (2 min 7 s here); the end-to-end runs and the larger sizes (tests/conftest.py's SLOW) left out.
test-fast: setup
	$(PYTHON) -m pytest -q -m "not slow"

clean:
	rm -f $(SETUP_STAMP)
