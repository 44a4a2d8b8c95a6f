# Development tasks. Each target installs the package into $(VENV) first.
#   make demo   - run the motivating pipeline with 2 workers, checkpoint and resume
#   make test   - run the test suite

PY ?= python3
VENV ?= .venv

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo demo-distributed test lint bench soak clean

install: $(STAMP)

# Reinstalls whenever the dependencies or their pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/pip install -c constraints.txt -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(BIN)/python examples/token_buckets.py --workers 2

demo-distributed: $(STAMP)
	$(BIN)/python -m torch.distributed.run --nproc_per_node=2 \
		--master_addr=127.0.0.1 --master_port=$${PORT:-29533} \
		examples/token_buckets.py --workers 2 --distributed

# One pytest worker per core (at most 4); each module stays on one worker, so a
# module's fixtures (a torchrun launch, a built corpus) run once.
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --maxprocesses=4 --dist loadscope

lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m mypy

bench: $(STAMP)
	$(BIN)/python -m centralpipe bench

soak: $(STAMP)
	$(BIN)/python -m centralpipe soak --minutes $${MINUTES:-5}

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -not -path "./$(VENV)/*" -prune -exec rm -rf {} +
