"""deploy/: the KubeRay RayJob against the CRD's schema, built-in kinds against Kubernetes'
schemas (kubernetes-validate, offline), the kustomization, the Dockerfile and the job's config."""

import copy
import gzip
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from keel.config import validate
from tests.deploy.tools import REPO_DEPLOY

KUBERAY = REPO_DEPLOY / "kuberay"
SCHEMA = Path(__file__).parent / "schemas" / "rayjob-v1.schema.json.gz"
K8S_VERSION = "1.33"


def closed(schema):
    """The schema with every object that lists `properties` closed to other keys (as the API
    server's strict field validation does), unless it preserves unknown fields."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        keeps = schema.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in schema and "additionalProperties" not in schema and not keeps:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def rayjob_validator():
    schema = closed(json.loads(gzip.decompress(SCHEMA.read_bytes())))
    return jsonschema.Draft7Validator(schema)


def rayjob():
    return yaml.safe_load((KUBERAY / "rayjob.yaml").read_text())


def test_the_rayjob_validates_against_the_kuberay_crd(rayjob_validator):
    job = rayjob()
    errors = [e.message for e in rayjob_validator.iter_errors(job)]
    assert not errors
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["backoffLimit"] >= 1
    workers = spec["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert int(workers["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    volumes = {v["name"]: v for v in workers["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "keel-data"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["mountPath"] for m in workers["containers"][0]["volumeMounts"]}
    assert {"/data", "/dev/shm"} <= mounts


@pytest.mark.parametrize(
    "path, value",
    [
        (["spec", "shutdownAfterJobFinish"], True),  # misspelled field
        (["spec", "rayClusterSpec", "headGroupSpec", "rayStartParam"], {}),  # misspelled
        (["spec", "backoffLimit"], "two"),  # wrong type
    ],
)
def test_a_misspelled_or_mistyped_field_fails(rayjob_validator, path, value):
    job = copy.deepcopy(rayjob())
    node = job
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert list(rayjob_validator.iter_errors(job))


def test_built_in_kinds_validate_with_kubernetes_validate():
    for doc in yaml.safe_load_all((KUBERAY / "pvc.yaml").read_text()):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    bad = {**yaml.safe_load((KUBERAY / "pvc.yaml").read_text()), "specs": {}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_kustomization_renders_every_resource():
    kust = yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())
    for name in kust["resources"]:
        assert (KUBERAY / name).is_file(), name
    generated = kust["configMapGenerator"][0]
    assert generated["name"] == "keel-config"  # the name the RayJob's head mounts
    assert all((KUBERAY / f.split("=")[-1]).is_file() for f in generated["files"])
    if shutil.which("kubectl") is None:
        return  # rendering needs kubectl; the structure above is checked regardless
    out = subprocess.run(
        ["kubectl", "kustomize", str(KUBERAY)], capture_output=True, text=True, check=True
    ).stdout
    kinds = {d["kind"]: d for d in yaml.safe_load_all(out)}
    assert set(kinds) == {"ConfigMap", "PersistentVolumeClaim", "RayJob"}
    kubernetes_validate.validate(kinds["ConfigMap"], K8S_VERSION, strict=True)
    assert kinds["RayJob"]["metadata"]["labels"]["app.kubernetes.io/name"] == "keel"


def test_the_jobs_training_config_is_a_valid_ray_config():
    cfg = validate(yaml.safe_load((KUBERAY / "grpo.yaml").read_text()))
    assert cfg.resources.backend == "ray" and cfg.resources.ray.address == "auto"
    assert cfg.resources.max_restarts >= 1
    job = rayjob()
    assert "/etc/keel/config.yaml" in job["spec"]["entrypoint"]


def test_the_dockerfile_pins_the_projects_torch_and_runs_keel():
    text = (REPO_DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+", text, re.M)
    assert 'ENTRYPOINT ["keel"]' in text
    deps = tomllib.loads((REPO_DEPLOY.parent / "pyproject.toml").read_text())["project"]
    torch_pin = next(d for d in deps["dependencies"] if d.startswith("torch=="))
    assert torch_pin in text  # the CUDA wheel of the same torch the package pins
