"""deploy/serve: the `keel serve` Deployment, its Services and PodDisruptionBudget, offline.

Built-in kinds validate strictly against Kubernetes 1.33's schemas (kubernetes-validate); the
kustomizations (CPU: deploy/serve, GPU: deploy/serve/gpu) list files that exist and render with
`kubectl kustomize` when kubectl is installed; and the manifests agree with the code they run:
the container's arguments parse with keel's own argparse parser and its config with the serve
config's loader, the probes and the scrape path are routes of the real FastAPI app (and answer
as the probes expect), the ports agree, the grace period covers the drain. The operator overlay
(deploy/serve/operator: ServiceMonitor, PrometheusRule, KEDA ScaledObject) validates against the
vendored CRD schemas, its rules are alerts.yml's serving group, and it scrapes and scales on the
series and job the server and the alerts use."""

import copy
import gzip
import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient

from keel.cli.main import build_parser
from keel.serve.app import build_app
from keel.serve.config import ServeConfig, load_serve_config
from keel.serve.metrics import ServeMetrics
from tests.deploy.test_kuberay import SCHEMAS, closed
from tests.deploy.tools import REPO_DEPLOY, binary, kubectl, kustomize

SERVE = REPO_DEPLOY / "serve"
BASE = SERVE / "base"
K8S_VERSION = "1.33"
LABELS = {"app.kubernetes.io/name": "keel", "app.kubernetes.io/component": "serve"}
# the kinds `kubectl kustomize deploy/serve` renders (the base), sorted
BASE_KINDS = sorted(
    ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "Service", "ServiceAccount"]
    + ["NetworkPolicy"] * 3
)


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base_resources() -> dict[str, dict]:
    """The base's resources by kind (the two Services as Service and Service/headless, the
    NetworkPolicies as NetworkPolicy/NAME)."""
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    out = {}
    for name in kust["resources"]:
        for doc in docs(BASE / name):
            headless = doc["kind"] == "Service" and doc["spec"].get("clusterIP") == "None"
            policy = doc["kind"] == "NetworkPolicy"
            suffix = "/headless" if headless else f"/{doc['metadata']['name']}" if policy else ""
            out[doc["kind"] + suffix] = doc
    return out


def rendered(folder: Path) -> list[dict]:
    return kustomize(folder)


needs_kubectl = pytest.mark.skipif(
    kubectl() is None, reason="rendering the kustomizations needs kubectl"
)


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


class StubPolicy(SimpleNamespace):
    """What build_app's routes read of a ServedPolicy, with real metrics: no model needed."""

    def __init__(self, ready: bool, draining: bool = False, kind: str = "policy"):
        super().__init__(kind=kind, name=kind, step=7, ready=ready, draining=draining,
                         metrics=ServeMetrics(kind, f"/data/models/{kind}"))  # fmt: skip

    def close(self, timeout=None) -> None:
        pass


def app_routes() -> set[str]:
    app = build_app(StubPolicy(ready=True), ServeConfig())
    return {route.path for route in app.routes}


# ---------------------------------------------------------------- schemas and kustomizations
def test_built_in_kinds_validate_strictly():
    resources = base_resources()
    assert set(resources) == {"Deployment", "Service", "Service/headless", "PodDisruptionBudget",
                              "ServiceAccount", "NetworkPolicy/keel-serve-deny",
                              "NetworkPolicy/keel-serve-ingress",
                              "NetworkPolicy/keel-serve-egress"}  # fmt: skip
    for doc in resources.values():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    "path, value",
    [
        (["spec", "template", "spec", "containers", 0, "readinesProbe"], {}),  # misspelled
        (["spec", "template", "spec", "terminationGracePeriodSecond"], 90),  # misspelled
        (["spec", "replicas"], "two"),  # wrong type
    ],
)
def test_a_misspelled_or_mistyped_field_fails(path, value):
    deployment = copy.deepcopy(base_resources()["Deployment"])
    node = deployment
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_the_kustomizations_list_files_that_exist():
    base = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert all((BASE / name).is_file() for name in base["resources"])
    (generated,) = base["configMapGenerator"]
    assert all((BASE / f.split("=")[-1]).is_file() for f in generated["files"])
    assert base["labels"][0]["pairs"] == LABELS and base["labels"][0]["includeTemplates"]
    for overlay in (SERVE, SERVE / "gpu"):
        kust = yaml.safe_load((overlay / "kustomization.yaml").read_text())
        assert [(overlay / r).resolve() for r in kust["resources"]] == [BASE.resolve()]
        for patch in kust.get("patches", []):
            assert (overlay / patch["path"]).is_file()


@needs_kubectl
@pytest.mark.parametrize("overlay", ["", "gpu"])
def test_the_kustomizations_render_valid_resources(overlay):
    out = rendered(SERVE / overlay)
    kinds = sorted(d["kind"] for d in out)
    assert kinds == BASE_KINDS
    for doc in out:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert LABELS.items() <= doc["metadata"]["labels"].items(), doc["kind"]
    config_map = next(d for d in out if d["kind"] == "ConfigMap")
    deployment = next(d for d in out if d["kind"] == "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    # the generated name carries a content hash; the Deployment follows it (a new serve.yaml
    # rolls the pods)
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_map["metadata"]["name"].startswith("keel-serve-config-")
    assert yaml.safe_load(config_map["data"]["serve.yaml"]) == yaml.safe_load(
        (BASE / "serve.yaml").read_text()
    )
    limits = container(deployment)["resources"]["limits"]
    assert ("nvidia.com/gpu" in limits) == (overlay == "gpu")
    if overlay == "gpu":
        tolerations = deployment["spec"]["template"]["spec"]["tolerations"]
        assert {
            "key": "nvidia.com/gpu",
            "operator": "Exists",
            "effect": "NoSchedule",
        } in tolerations


# ------------------------------------------------------------------ agreement with the code
def deployments() -> list[tuple[str, dict]]:
    """The CPU Deployment as written, and the GPU one as rendered (when kubectl is here)."""
    out = [("cpu", base_resources()["Deployment"])]
    if kubectl() is not None:
        out.append(("gpu", next(d for d in rendered(SERVE / "gpu") if d["kind"] == "Deployment")))
    return out


def test_the_container_runs_keel_serve_as_keels_parser_reads_it():
    for variant, deployment in deployments():
        c = container(deployment)
        assert "command" not in c  # the image's entrypoint is `keel` (deploy/Dockerfile)
        args = build_parser().parse_args(c["args"])
        assert args.command == "serve" and args.host == "0.0.0.0", variant
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert args.port == ports["http"] == 8000, variant
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert args.model.startswith(mounts["data"]["mountPath"] + "/"), variant
        assert mounts["data"]["readOnly"] and mounts["config"]["readOnly"]
        assert args.config.parent == Path(mounts["config"]["mountPath"])
        # the mounted file is base/serve.yaml (the ConfigMap's key), valid with the --set's
        cfg = load_serve_config(BASE / args.config.name, args.set)
        limits = c["resources"]["limits"]
        assert cfg.serve.torch_threads <= int(limits["cpu"]), variant
        env = {e["name"]: e for e in c["env"]}
        assert env["OMP_NUM_THREADS"]["value"] == limits["cpu"], variant
        if variant == "gpu":
            assert cfg.resources.device == "cuda" and cfg.models.dtype == "bfloat16"
        else:
            assert cfg.resources.device == "auto"


def test_the_api_key_comes_from_the_secret_through_the_variable_keel_serve_reads():
    c = container(base_resources()["Deployment"])
    cfg = load_serve_config(BASE / "serve.yaml")
    assert cfg.serve.api_key is None  # never in the ConfigMap
    env = {e["name"]: e for e in c["env"]}
    ref = env[cfg.serve.api_key_env]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "keel-serve", "key": "api-key"}  # docs/deploy.md creates it
    assert not ref.get("optional")  # no secret: the pod waits, it never serves without auth


def test_the_model_volume_is_the_kuberay_pvc():
    spec = base_resources()["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    (pvc,) = docs(REPO_DEPLOY / "kuberay" / "pvc.yaml")
    claim = volumes["data"]["persistentVolumeClaim"]
    assert claim == {"claimName": pvc["metadata"]["name"], "readOnly": True}
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]  # replicas on several nodes


def test_probes_hit_routes_of_the_real_app_on_the_served_port():
    routes = app_routes()
    c = container(base_resources()["Deployment"])
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe",
                                                    "readinessProbe")}  # fmt: skip
    for kind, probe in probes.items():
        assert probe["path"] in routes, (kind, probe["path"], routes)
        assert probe["port"] == "http", kind
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/healthz"
    annotations = base_resources()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in routes
    assert int(annotations["prometheus.io/port"]) == c["ports"][0]["containerPort"]


@pytest.mark.parametrize("ready, draining, status", [(True, False, 200), (False, False, 503),
                                                     (False, True, 503)])  # fmt: skip
def test_the_probed_routes_answer_as_the_probes_expect(ready, draining, status):
    """/healthz: 200 whenever the server answers; /readyz: 200 only while the batching queue
    accepts work (503 while draining: the pod leaves the Service's endpoints). Neither needs
    the API key the Deployment sets (kubelet sends none), while /v1 does."""
    c = container(base_resources()["Deployment"])
    policy = StubPolicy(ready=ready, draining=draining)
    client = TestClient(build_app(policy, ServeConfig(api_key="from-the-secret")))
    assert client.get(c["livenessProbe"]["httpGet"]["path"]).status_code == 200
    answer = client.get(c["readinessProbe"]["httpGet"]["path"])
    assert answer.status_code == status
    assert answer.json()["status"] == (
        "draining" if draining else "ready" if ready else "not ready"
    )
    annotations = base_resources()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    scraped = client.get(annotations["prometheus.io/path"])
    assert scraped.status_code == 200 and "keel_serve_requests_total" in scraped.text
    assert client.get("/v1/models").status_code == 401


def test_probe_timings():
    """Loading a model may take minutes: the startup probe allows 10; liveness then restarts a
    pod only after a minute of silence, while readiness takes it out of the Service in 10 s."""
    c = container(base_resources()["Deployment"])

    def window(probe: dict) -> int:
        return probe["periodSeconds"] * probe["failureThreshold"]

    assert window(c["startupProbe"]) >= 600
    assert window(c["livenessProbe"]) >= 60 > window(c["readinessProbe"])
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[kind]["timeoutSeconds"] >= 3, kind  # the default 1 s is too tight under load


def test_the_grace_period_covers_the_endpoint_removal_and_the_drain():
    """SIGTERM comes after preStop; keel serve then waits up to serve.drain_timeout_s for the
    open requests (uvicorn) and again for the batching queue: both fit before SIGKILL."""
    spec = base_resources()["Deployment"]["spec"]["template"]["spec"]
    c = container(base_resources()["Deployment"])
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = int(command[1])
    assert pre_stop >= 5
    drain = load_serve_config(BASE / "serve.yaml").serve.drain_timeout_s
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + 2 * drain


def test_services_and_budget_select_the_pods_and_agree_on_ports():
    resources = base_resources()
    deployment = resources["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert deployment["spec"]["replicas"] >= 2  # the budget below lets one go at a time
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0
    port_names = {p["name"] for p in container(deployment)["ports"]}
    service = resources["Service"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("http", 80, "http")
    assert port["targetPort"] in port_names
    headless = resources["Service/headless"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["ports"][0]["targetPort"] in port_names
    budget = resources["PodDisruptionBudget"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert budget["spec"]["maxUnavailable"] == 1


# ------------------------------------------- deploy/serve/operator: Prometheus operator, KEDA
OPERATOR = SERVE / "operator"
CRD_SCHEMAS = {  # kind → the vendored CRD schema (tests/deploy/schemas/README.md)
    "ServiceMonitor": "servicemonitor-v1",
    "PrometheusRule": "prometheusrule-v1",
    "ScaledObject": "scaledobject-v1alpha1",
}


def operator_objects() -> dict[str, dict]:
    """The overlay's own objects by kind (its resources other than the base)."""
    kust = yaml.safe_load((OPERATOR / "kustomization.yaml").read_text())
    out = {}
    for name in kust["resources"]:
        if (OPERATOR / name).is_file():
            for doc in docs(OPERATOR / name):
                out[doc["kind"]] = doc
    return out


def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    path = SCHEMAS / f"{CRD_SCHEMAS[kind]}.schema.json.gz"
    return jsonschema.Draft7Validator(closed(json.loads(gzip.decompress(path.read_bytes()))))


def serving_group() -> dict:
    groups = yaml.safe_load((REPO_DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    return next(g for g in groups if g["name"] == "keel-serve")


def test_the_operator_overlay_adds_its_objects_to_the_base():
    kust = yaml.safe_load((OPERATOR / "kustomization.yaml").read_text())
    assert (OPERATOR / kust["resources"][0]).resolve() == BASE.resolve()
    assert all((OPERATOR / r).exists() for r in kust["resources"])
    assert set(operator_objects()) == set(CRD_SCHEMAS)
    base = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert not {kind for name in base["resources"] for kind in
                (d["kind"] for d in docs(BASE / name))} & set(CRD_SCHEMAS)  # fmt: skip


@pytest.mark.parametrize("kind, path, value", [
    ("ServiceMonitor", ["spec", "endpoint"], []),  # misspelled (endpoints)
    ("ServiceMonitor", ["spec", "endpoints", 0, "interval"], "15 seconds"),  # not a duration
    ("PrometheusRule", ["spec", "groups", 0, "rule"], []),  # misspelled (rules)
    ("ScaledObject", ["spec", "minReplicas"], 2),  # misspelled (minReplicaCount)
    ("ScaledObject", ["spec", "triggers", 0, "metadata", "threshold"], 32),  # not a string
])  # fmt: skip
def test_the_operator_objects_validate_against_their_crds(kind, path, value):
    validator = crd_validator(kind)
    obj = operator_objects()[kind]
    assert not [e.message for e in validator.iter_errors(obj)], kind
    broken = copy.deepcopy(obj)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert list(validator.iter_errors(broken)), (kind, path)


@needs_kubectl
def test_the_operator_overlay_renders():
    out = rendered(OPERATOR)
    kinds = sorted(d["kind"] for d in out)
    assert kinds == sorted([*BASE_KINDS, *CRD_SCHEMAS])
    for doc in out:
        assert LABELS.items() <= doc["metadata"]["labels"].items(), doc["kind"]
        if doc["kind"] in CRD_SCHEMAS:
            assert not [e.message for e in crd_validator(doc["kind"]).iter_errors(doc)]
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_prometheusrule_holds_the_serving_alerts(tmp_path):
    """Its one group is alerts.yml's keel-serve group, equal rule for rule, and promtool
    accepts it as a rule file."""
    rule = operator_objects()["PrometheusRule"]
    assert rule["spec"]["groups"] == [serving_group()]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    proc = subprocess.run([binary("promtool"), "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(serving_group()['rules'])} rules found" in proc.stdout


def scrape_job() -> str:
    """The job the ServiceMonitor's relabeling gives the serving pods."""
    (endpoint,) = operator_objects()["ServiceMonitor"]["spec"]["endpoints"]
    (relabel,) = [r for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    return relabel["replacement"]


def test_the_servicemonitor_scrapes_each_pod_once_as_the_alerts_job():
    """It selects the headless Service (every pod, ready or not), not the ClusterIP one (the
    same pods again), on a port of it, at the app's /metrics; the pods' job is the one the
    serving alerts and deploy/prometheus/kubernetes.yml use."""
    monitor = operator_objects()["ServiceMonitor"]
    resources = base_resources()
    selector = monitor["spec"]["selector"]["matchLabels"]
    headless, service = resources["Service/headless"], resources["Service"]
    assert selector.items() <= headless["metadata"]["labels"].items()
    assert not selector.items() <= {**service["metadata"].get("labels", {}), **LABELS}.items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in headless["spec"]["ports"]}
    assert endpoint["path"] in app_routes()
    job = scrape_job()
    for rule in serving_group()["rules"]:
        assert set(re.findall(r'job="([^"]+)"', rule["expr"])) <= {job}, rule["alert"]
    kubernetes = yaml.safe_load((REPO_DEPLOY / "prometheus" / "kubernetes.yml").read_text())
    assert kubernetes["scrape_configs"][0]["job_name"] == job


def seconds(duration: str) -> int:
    assert duration.endswith("s"), duration
    return int(duration[:-1])


def test_the_scaledobject_scales_the_deployment_by_its_queue_depth():
    """KEDA scales the base Deployment (never under the budget's two replicas) on the summed
    keel_serve_queue_depth of the ServiceMonitor's job, at a backlog per replica no larger
    than one batch, polling no faster than the scrapes."""
    from tests.deploy.tools import METRIC, serving_series

    scaled = operator_objects()["ScaledObject"]["spec"]
    deployment = base_resources()["Deployment"]
    target = scaled["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"],
        deployment["kind"],
        deployment["metadata"]["name"],
    )
    budget = base_resources()["PodDisruptionBudget"]["spec"]["maxUnavailable"]
    assert scaled["minReplicaCount"] >= max(deployment["spec"]["replicas"], budget + 1)
    assert scaled["maxReplicaCount"] > scaled["minReplicaCount"]
    triggers = {tr["name"]: tr for tr in scaled["triggers"]}
    assert set(triggers) == {"queue-depth", "gpu-idle"}
    trigger = triggers["queue-depth"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    query = trigger["metadata"]["query"]
    assert set(METRIC.findall(query)) == {"keel_serve_queue_depth"}
    assert "keel_serve_queue_depth" in serving_series()
    assert query.startswith("sum(") and f'job="{scrape_job()}"' in query
    batch = load_serve_config(BASE / "serve.yaml").serve.max_batch_size
    assert 0 < int(trigger["metadata"]["threshold"]) <= batch
    (endpoint,) = operator_objects()["ServiceMonitor"]["spec"]["endpoints"]
    assert scaled["pollingInterval"] >= seconds(endpoint["interval"])


# --------------------------------------------- deploy/serve/vllm: vLLM's own server on GPUs
VLLM_OVERLAY = SERVE / "vllm"


def vllm_flags(args: list[str]) -> dict[str, str]:
    """`--name=value` arguments by name (vLLM's CLI; every flag here is written so)."""
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--"))


def test_the_vllm_overlay_patches_the_gpu_overlay():
    kust = yaml.safe_load((VLLM_OVERLAY / "kustomization.yaml").read_text())
    assert [(VLLM_OVERLAY / r).resolve() for r in kust["resources"]] == [(SERVE / "gpu").resolve()]
    assert all((VLLM_OVERLAY / p["path"]).is_file() for p in kust["patches"])


@needs_kubectl
def test_the_vllm_overlay_runs_vllm_serve_on_the_bases_model_behind_the_same_services():
    """The rendered resources validate strictly; the container runs `vllm serve` on the
    model the base serves (the kuberay PVC, read only), on the port the Services target, under
    serve.yaml's model name, with the Secret's key as VLLM_API_KEY (never Keel's variable, never
    without it), probed at /health; SIGTERM's drain (vLLM's --shutdown-timeout) fits the grace
    period after preStop; the GPU stays. (vLLM's own parser and routes read the arguments in
    tests/serve/test_vllm_serve.py, in the vLLM environment.)"""
    out = rendered(VLLM_OVERLAY)
    assert sorted(d["kind"] for d in out) == BASE_KINDS
    for doc in out:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert LABELS.items() <= doc["metadata"]["labels"].items(), doc["kind"]
    deployment = next(d for d in out if d["kind"] == "Deployment")
    c = container(deployment)
    assert c["command"] == ["vllm"] and c["args"][0] == "serve"
    base = container(base_resources()["Deployment"])
    keel_args = build_parser().parse_args(base["args"])
    assert c["args"][1] == keel_args.model  # the same exported model folder
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert set(volumes) == {"data", "tmp", "home"}  # Keel's serve config is not mounted
    assert volumes["data"] == base_resources()["Deployment"]["spec"]["template"]["spec"][
        "volumes"][0]  # fmt: skip
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert set(mounts) == set(volumes)
    mount = mounts["data"]
    assert mount["readOnly"] and c["args"][1].startswith(mount["mountPath"] + "/")
    assert all("emptyDir" in volumes[name] for name in ("tmp", "home"))  # vLLM's caches
    flags = vllm_flags(c["args"][2:])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(flags["port"]) == ports["http"] == keel_args.port and flags["host"] == "0.0.0.0"
    services = [d for d in out if d["kind"] == "Service"]
    assert all(s["spec"]["ports"][0]["targetPort"] == "http" for s in services)
    serve_cfg = load_serve_config(BASE / "serve.yaml")
    assert flags["served-model-name"] == serve_cfg.serve.model_name
    env = {e["name"]: e for e in c["env"]}
    assert serve_cfg.serve.api_key_env not in env
    ref = env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "keel-serve", "key": "api-key"} and not ref.get("optional")
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[kind]["httpGet"] == {"path": "/health", "port": "http"}, kind
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + int(flags["shutdown-timeout"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert flags["dtype"] == "bfloat16"


# ------------------------------------- the scale-down rule: GPU utilisation under 30% for an hour
def gpu_trigger() -> dict:
    (trigger,) = [t for t in operator_objects()["ScaledObject"]["spec"]["triggers"]
                  if t["name"] == "gpu-idle"]  # fmt: skip
    return trigger


def desired_replicas(value: float, target: float, replicas: int) -> int:
    """What the HPA asks of a metricType Value trigger: ceil(replicas × value / target), or the
    replicas there are while the ratio is within its 10% tolerance (Kubernetes' documented
    algorithm)."""
    ratio = value / target
    return replicas if abs(ratio - 1) <= 0.1 else -(-replicas * value // target)


def test_the_gpu_trigger_reads_the_serving_pods_gpu_utilisation_in_the_queues_namespace():
    """The second trigger is a Prometheus query on DCGM's GPU utilisation of this Deployment's
    pods (their names: keel-serve-<replicaset hash>-<suffix>), in the namespace the queue
    trigger reads, against a target of 30 (%), as a Value (the HPA scales the replicas there
    are by value / target); an empty result (no DCGM: the CPU base) reads as 0."""
    trigger = gpu_trigger()
    meta = trigger["metadata"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert float(meta["threshold"]) == 30 and meta["ignoreNullValues"] == "true"
    query = meta["query"]
    assert "DCGM_FI_DEV_GPU_UTIL" in query and "[1h:1m]" in query
    queue = next(t for t in operator_objects()["ScaledObject"]["spec"]["triggers"]
                 if t["name"] == "queue-depth")  # fmt: skip
    (namespace,) = re.findall(r'\bnamespace="([^"]+)"', queue["metadata"]["query"])
    assert f'exported_namespace="{namespace}"' in query
    assert meta["serverAddress"] == queue["metadata"]["serverAddress"]
    pod = re.search(r'exported_pod=~"([^"]+)"', query).group(1)
    name = base_resources()["Deployment"]["metadata"]["name"]
    assert re.fullmatch(pod, f"{name}-7d9f8b6c5-x2x4q")  # a pod of the Deployment
    assert not re.fullmatch(pod, f"{name}-reward-7d9f8b6c5-x2x4q")  # another Deployment's
    assert not re.fullmatch(pod, "other-7d9f8b6c5-x2x4q")


GPU_SERIES = 'DCGM_FI_DEV_GPU_UTIL{{exported_namespace="{ns}", exported_pod="{pod}"}}'


@pytest.mark.parametrize("busy_minute, value", [
    (None, 20),  # 20% for two hours: the trigger reads 20 (< 30): scale down
    (90, 30),  # one minute at 50%, 30 minutes ago: capped at 30, hold
    (50, 20),  # the same minute 70 minutes ago, out of the hour: scale down
])  # fmt: skip
def test_the_gpu_trigger_holds_the_replicas_unless_the_gpus_idled_for_an_hour(
    tmp_path, busy_minute, value
):
    """promtool evaluates the trigger's own query on two hours of samples, one a minute, of two
    serving pods at 20% (and, where given, both at 50% for one minute), plus a busy pod of
    another Deployment and one of another namespace, which must not count. The value is the
    highest per-minute mean of the last hour, capped at 30: at 30 the HPA keeps the 4 replicas
    there are, below it asks for fewer."""
    query = gpu_trigger()["metadata"]["query"]
    ns = re.search(r'exported_namespace="([^"]+)"', query).group(1)

    def values(minute_value) -> str:
        return " ".join(str(minute_value(m)) for m in range(121))

    def serving(m: int) -> int:
        return 50 if m == busy_minute else 20

    series = [
        {"series": GPU_SERIES.format(ns=ns, pod=f"keel-serve-5f7c9d8b4-{s}"),
         "values": values(serving)} for s in ("abcde", "fghij")
    ] + [
        {"series": GPU_SERIES.format(ns=ns, pod="keel-serve-reward-5f7c9d8b4-zzzzz"),
         "values": values(lambda m: 95)},
        {"series": GPU_SERIES.format(ns="elsewhere", pod="keel-serve-5f7c9d8b4-zzzzz"),
         "values": values(lambda m: 95)},
    ]  # fmt: skip
    suite = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": [{"expr": query, "eval_time": "120m",
                                  "exp_samples": [{"labels": "{}", "value": value}]}],
        }],
    }  # fmt: skip
    path = tmp_path / "gpu_trigger_test.yml"
    path.write_text(yaml.safe_dump(suite))
    proc = subprocess.run([binary("promtool"), "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    target = float(gpu_trigger()["metadata"]["threshold"])
    assert (desired_replicas(value, target, 4) < 4) == (busy_minute != 90)
    # a wrong expectation fails: promtool really compared the value
    suite["tests"][0]["promql_expr_test"][0]["exp_samples"][0]["value"] = value + 1
    path.write_text(yaml.safe_dump(suite))
    proc = subprocess.run([binary("promtool"), "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode != 0


# ----------------------------------------- deploy/serve/reward: `keel serve --reward` (reward.url)
REWARD = SERVE / "reward"


def test_the_reward_server_runs_keel_serve_reward_as_keels_parser_and_app_read_it():
    """The container's arguments parse as `keel serve MODEL --reward` with the mounted config
    (reward.yaml, valid for the serve loader); the probes and the scrape path are routes of the
    reward app, which serves /v1/score; the key comes from the Secret keel-reward through the
    variable keel serve reads; the Service targets the pods' port; the model is on the PVC."""
    resources = {d["kind"]: d for name in yaml.safe_load((REWARD / "kustomization.yaml")
                 .read_text())["resources"] for d in docs(REWARD / name)}  # fmt: skip
    deployment = resources["Deployment"]
    c = container(deployment)
    args = build_parser().parse_args(c["args"])
    assert args.command == "serve" and args.reward and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.port == ports["http"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert args.model.startswith(mounts["data"]["mountPath"] + "/") and mounts["data"]["readOnly"]
    assert args.config.parent == Path(mounts["config"]["mountPath"])
    kust = yaml.safe_load((REWARD / "kustomization.yaml").read_text())
    (generated,) = kust["configMapGenerator"]
    (entry,) = generated["files"]
    key, source = entry.split("=")
    assert key == args.config.name
    cfg = load_serve_config(REWARD / source, args.set)
    assert cfg.serve.torch_threads <= int(c["resources"]["limits"]["cpu"])
    env = {e["name"]: e for e in c["env"]}
    assert env[cfg.serve.api_key_env]["valueFrom"]["secretKeyRef"] == {
        "name": "keel-reward", "key": "api-key"}  # fmt: skip
    app = build_app(StubPolicy(ready=True, kind="reward"), ServeConfig())
    routes = {route.path for route in app.routes}
    assert "/v1/score" in routes and "/v1/completions" not in routes
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[kind]["httpGet"]["path"] in routes, kind
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in routes
    service = resources["Service"]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"][
        "labels"].items()  # fmt: skip
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    (pvc,) = docs(REPO_DEPLOY / "kuberay" / "pvc.yaml")
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    drain = cfg.serve.drain_timeout_s
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= (
        pre_stop + 2 * drain)  # fmt: skip
    for doc in resources.values():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
