PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench-quick clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[dev]'
	# torch only as this exact CPU wheel (on local disk here); any other spec downloads GBs
	$(BIN)/pip install -q $(if $(wildcard /opt/wheels),--find-links /opt/wheels) torch==2.13.0
	# torchdata's StatefulDataLoader, without its deps (they would pull another torch)
	$(BIN)/pip install -q --no-deps torchdata==0.11.0
	# Hugging Face Trainer (epochal[hf]): transformers and accelerate without their deps (accelerate's
	# would pull another torch), then their small deps by name
	$(BIN)/pip install -q --no-deps transformers==5.24.0 accelerate==1.15.0
	$(BIN)/pip install -q huggingface-hub==2.4.0 tokenizers==0.23.3 tqdm typer regex pyyaml filelock packaging psutil safetensors
	# Lightning (epochal.integrations.lightning), without its deps (they would pull another
	# torch), then its small pure-Python deps by name (fsspec, packaging, PyYAML and
	# typing-extensions come with the dev extra)
	$(BIN)/pip install -q --no-deps lightning==2.6.6 lightning-utilities==0.15.3 torchmetrics==1.9.0 tqdm==4.70.1
	# JAX on CPU (epochal.jax, epochal[jax]) and Orbax, for the JAX door's tests
	$(BIN)/pip install -q jax==0.10.2 orbax-checkpoint==0.12.8
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/epochal demo --dir ./checkpoints --more 5

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --durations=10 tests
	$(BIN)/ruff check src
	$(BIN)/mypy src/epochal
	$(BIN)/lint-imports

# the inner loop: unit and conformance tiers, under a minute (make test still runs all)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "not system" tests

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy src/epochal
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) checkpoints
