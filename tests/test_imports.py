"""The pure layers import without the heavy stacks (ray, transformers)."""

import subprocess
import sys

CODE = """
import sys
import keel.algo, keel.config
print(sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "transformers", "peft")))
"""


def test_algo_and_config_import_neither_ray_nor_transformers():
    out = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_the_runner_and_the_cli_import_ray_peft_and_the_serving_stack_only_when_used():
    """Ray and peft: only for the Ray backend or LoRA; FastAPI, uvicorn and grpc: only by
    keel.serve (`keel serve`). One interpreter for both checks (each costs seconds)."""
    code = CODE.replace(
        "keel.algo, keel.config", "keel.cli.main, keel.controller.runner, keel.workers"
    )
    heavy = '("ray", "peft", "fastapi", "uvicorn", "starlette", "grpc")'
    code = code.replace('("ray", "transformers", "peft")', heavy)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
