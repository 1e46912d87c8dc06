#!/usr/bin/env bash
# Keel's GPU checks in one command, on any Linux machine with an NVIDIA GPU (one is enough).
#
#   bash bench/gpu_check.sh [all|tests|step|chunk|smoke] [--out DIR] [--dry-run]
#
# The machine needs an NVIDIA driver, Python ≥ 3.11, a CUDA build of torch 2.11–2.13 and
# transformers 5.17, and Keel's other dependencies, in one of two ways:
#   - with a package index: `pip install -e '.[dev,bench]'` from the repository root. It
#     installs the pinned torch 2.13.0 (PyPI's Linux x86-64 wheels are CUDA builds); for
#     another CUDA install that torch from PyTorch's index first and pip keeps it, e.g.
#     `pip install --index-url https://download.pytorch.org/whl/cu128 torch==2.13.0`
#     (deploy/Dockerfile does the same). `bench` adds TRL, for the comparison in `step`;
#   - without one, on a machine that already has torch, transformers, pytest and Keel's other
#     compiled dependencies (peft, accelerate, psutil, pyarrow, rich, prometheus-client, …):
#     `make gpu-wheels` on a machine with an index puts wheels of the rest into
#     bench/wheels/ (pydantic and its parts; TRL, datasets, dill, multiprocess for TRL's half;
#     more with `make gpu-wheels GPU_EXTRA_WHEELS="name==version"`); copy the checkout with that
#     folder, and this script installs them into a folder of its own (no dependencies
#     resolved, nothing else touched) and puts it on PYTHONPATH.
# The checkout itself is used from its folder (PYTHONPATH=src), installed or not.
#
# Parts (`all`: tests, then step; each under a timeout, KEEL_GPU_CHECK_TIMEOUT_S, 1200 s):
#   tests: pytest -m gpu tests/gpu: every role's model and a separate rollout copy on the GPU,
#          mixed precision's small updates, exact resume in mixed precision, the example YAML
#          through `keel train` (a few minutes);
#   step:  python -m bench.gpu_step: one GRPO step of a 0.5B model, Keel then TRL when trl is
#          importable (a few minutes on an H100-class GPU);
#   chunk: bench.gpu_step, Keel only, with train.logits_chunk_tokens 8192 (peak memory);
#   decode: bench.gpu_step, Keel only, once per rollout.decode (generate, keel, keel-static:
#          the CUDA-graph decode step), for their rollout tokens/s;
#   smoke: the same checks' logic on the CPU (KEEL_GPU_TEST_DEVICE=cpu, gpu_step --smoke), for a
#          machine without a GPU (under a minute).
# Logs go to DIR: --out DIR, else $KEEL_GPU_CHECK_OUT, else runs/gpu-check/ under the repository
# (git-ignored): machine.txt (GPU, torch, transformers), tests.log, gpu_step*.log (the JSON
# lines of bench/gpu_step.py are its stdout). The exit status is non-zero when a part failed.
set -uo pipefail

usage() { sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; }

what=all out=${KEEL_GPU_CHECK_OUT:-} dry=0
while (($#)); do
    case $1 in
        all | tests | step | chunk | decode | smoke) what=$1 ;;
        --out) out=${2:?--out needs a folder}; shift ;;
        --out=*) out=${1#--out=} ;;
        --dry-run) dry=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
    shift
done

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ -n $out ]] || out=$repo/runs/gpu-check
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$repo" || exit 2
python=${PYTHON:-python3}
limit=${KEEL_GPU_CHECK_TIMEOUT_S:-1200}

run() {  # run LOG COMMAND...: the command under the timeout, its output shown and kept in LOG
    local log=$1; shift
    echo "+ $* > $out/$log"
    ((dry)) && return 0
    timeout "$limit" "$@" 2>&1 | tee "$out/$log"
    return "${PIPESTATUS[0]}"
}

if compgen -G "bench/wheels/*.whl" >/dev/null; then
    site=${TMPDIR:-/tmp}/keel-gpu-check-site
    echo "+ pip install bench/wheels/*.whl into $site (no index, no dependencies)"
    if ((!dry)); then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" bench/wheels/*.whl || exit 1
    fi
    export PYTHONPATH=$site
fi
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
echo "logs: $out"

if ((!dry)); then
    {
        command -v nvidia-smi >/dev/null && nvidia-smi -L
        "$python" -c "import torch, transformers as t; print('torch', torch.__version__, \
'transformers', t.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() \
else 'no CUDA device')"
    } 2>&1 | tee "$out/machine.txt"
fi

status=0
pytest=("$python" -m pytest -q -m gpu tests/gpu -p no:cacheprovider)
if [[ $what == all || $what == tests ]]; then
    run tests.log "${pytest[@]}" || status=1
fi
if [[ $what == all || $what == step ]]; then
    run gpu_step.log "$python" -m bench.gpu_step || status=1
fi
if [[ $what == chunk ]]; then
    run gpu_step_chunk.log "$python" -m bench.gpu_step --no-trl --logits-chunk 8192 || status=1
fi
if [[ $what == decode ]]; then
    for loop in generate keel keel-static; do
        run "gpu_step_$loop.log" "$python" -m bench.gpu_step --no-trl --decode "$loop" \
            || status=1
    done
fi
if [[ $what == smoke ]]; then
    run tests_cpu.log env KEEL_GPU_TEST_DEVICE=cpu OMP_NUM_THREADS=1 "${pytest[@]}" || status=1
    run gpu_step_smoke.log env OMP_NUM_THREADS=1 "$python" -m bench.gpu_step --smoke || status=1
fi
exit $status
