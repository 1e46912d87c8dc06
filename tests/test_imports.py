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


def test_the_runner_imports_ray_and_peft_only_when_the_ray_backend_or_lora_is_used():
    code = CODE.replace("keel.algo, keel.config", "keel.controller.runner, keel.workers")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert "'ray'" not in out.stdout
    assert "'peft'" not in out.stdout


def test_fastapi_uvicorn_and_grpc_are_imported_by_keel_serve_only():
    code = CODE.replace("keel.algo, keel.config", "keel.cli.main, keel.controller.runner")
    served = '("fastapi", "uvicorn", "starlette", "grpc")'
    code = code.replace('("ray", "transformers", "peft")', served)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
