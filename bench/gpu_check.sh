#!/usr/bin/env bash
# The GPU checks of Keel in one command, for a machine with one NVIDIA GPU that has torch and
# transformers but not Keel's pure-Python dependencies (the lent H200: docs/performance.md).
#
#   here:   make gpu-wheels            # 4.5 MB of wheels into bench/wheels/ (git-ignored)
#   there:  bash bench/gpu_check.sh [all|tests|step|chunk]   (carry bench/wheels; all ≈ 9 min)
#
# tests: pytest -m gpu tests/gpu (devices of every role and a separate rollout copy, mixed
#        precision's small updates, exact resume in mixed precision, the example YAML through
#        `keel train`), ≤ 240 s;
# step:  bench/gpu_step.py (Keel, then TRL when its wheels are there), ≤ 330 s;
# chunk: bench/gpu_step.py, Keel only, with train.logits_chunk_tokens 8192 (peak memory), ≤ 240 s.
# Logs and the JSON lines go to $OUT (the device tool's folder) or /tmp/keel-gpu-check.
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/keel-gpu-check}
mkdir -p "$out"
if compgen -G "bench/wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/keel-site bench/wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/keel-site
fi
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
{
    nvidia-smi -L
    python3 -c "import torch, transformers as t; print('torch', torch.__version__, \
'transformers', t.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
} 2>&1 | tee "$out/machine.txt"
status=0
if [[ $what == all || $what == tests ]]; then
    timeout 240 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$out/tests.log"
    status=$((status | PIPESTATUS[0]))
fi
if [[ $what == all || $what == step ]]; then
    timeout 330 python3 -m bench.gpu_step 2>&1 | tee "$out/gpu_step.log"
    status=$((status | PIPESTATUS[0]))
fi
if [[ $what == chunk ]]; then
    timeout 240 python3 -m bench.gpu_step --no-trl --logits-chunk 8192 2>&1 |
        tee "$out/gpu_step_chunk.log"
    status=$((status | PIPESTATUS[0]))
fi
exit $status
