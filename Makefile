# Keel's front door. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.keel-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test lint format bench clean install

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/keel demo

test: $(STAMP)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

format: $(STAMP)
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.run
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.exporter
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.reliability
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.ray_overhead

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
