# Keel's front door. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.keel-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test test-tools lint format bench bench-trl clean install mutants golden learning

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/keel demo

# The programs the tests run besides Python (Prometheus): installed here when missing, never
# skipped (scripts/install-test-tools; apt-get, as root or with sudo).
test-tools:
	@scripts/install-test-tools

# One torch thread per test process, one process per core (pytest-xdist; a test file stays on
# one worker, so module fixtures such as the Ray cluster are started once).
TEST_WORKERS ?= 2
test: $(STAMP) test-tools
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

# The mutation check: every wrong-math mutation must make the learning tests fail
# (tests/learning/mutants.py; the suite runs a subset). A few minutes.
mutants: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m tests.learning.mutants

# Regenerate the golden curves (tests/learning/golden/); commit the diff saying why.
golden: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m tests.learning.golden --write

# Every learning case on three seeds, each change printed against its margin.
learning: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m tests.learning.cases --seeds 0,1,2

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
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.micro_batching

# Keel against TRL's GRPOTrainer at equal work, step by step (bench/compare_trl.py; TRL from
# the bench extra). About 10 minutes on 2 cores; docs/performance.md has the figures.
bench-trl: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.compare_trl

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
