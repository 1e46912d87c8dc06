"""deploy/'s security model (docs/deploy.md, "Security"): each component's ServiceAccount and the
only Role (the KubeRay autoscaler's), the containers' confinement (non-root as the image's user,
read-only root filesystem with emptyDirs where Ray and Keel write, no capabilities, no privilege
escalation, seccomp RuntimeDefault, no API token but the autoscaler's), who may connect to whom
under the NetworkPolicies (tests/deploy/netpol.py evaluates them), and the namespace per
training version."""

import copy
import ipaddress
import re

import kubernetes_validate
import pytest
import yaml

from keel.config import validate
from tests.deploy.netpol import Endpoint, can_connect
from tests.deploy.tools import REPO_DEPLOY, kustomize

KUBERAY = REPO_DEPLOY / "kuberay"
SERVE = REPO_DEPLOY / "serve"
VERSION = REPO_DEPLOY / "kuberay-version"
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def docs(path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def image_user() -> tuple[int, int, str]:
    """(uid, gid, home) of the image's user: deploy/Dockerfile's USER and useradd."""
    text = (REPO_DEPLOY / "Dockerfile").read_text()
    uid, gid = map(int, re.search(r"^USER (\d+):(\d+)$", text, re.M).groups())
    home = re.search(r"useradd .*--home-dir (\S+)", text).group(1)
    assert re.search(rf"useradd .*--uid {uid} --gid {gid}", text)
    return uid, gid, home


def rayjob() -> dict:
    (job,) = docs(KUBERAY / "rayjob.yaml")
    return job


def pod_templates() -> dict[str, dict]:
    """Every pod template of deploy/ by a name: the RayJob's head, worker groups and submitter,
    and the serving and reward-server Deployments (as written)."""
    spec = rayjob()["spec"]
    out = {"head": spec["rayClusterSpec"]["headGroupSpec"]["template"],
           "submitter": spec["submitterPodTemplate"]}  # fmt: skip
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        out[f"worker/{group['groupName']}"] = group["template"]
    for name, path in (("serve", SERVE / "base"), ("reward", SERVE / "reward")):
        (deployment,) = docs(path / "deployment.yaml")
        out[name] = deployment["spec"]["template"]
    return out


# ------------------------------------------------------------------- identities and the Role
def service_accounts() -> dict[str, dict]:
    found = docs(KUBERAY / "rbac.yaml") + docs(SERVE / "base" / "serviceaccount.yaml")
    found += docs(SERVE / "reward" / "serviceaccount.yaml")
    return {d["metadata"]["name"]: d for d in found if d["kind"] == "ServiceAccount"}


def test_each_component_has_its_own_service_account_and_no_token_by_default():
    accounts = service_accounts()
    used = {name: t["spec"]["serviceAccountName"] for name, t in pod_templates().items()}
    assert used["head"] == "keel-ray-head" and used["submitter"] == "keel-ray-submitter"
    assert used["serve"] == "keel-serve" and used["reward"] == "keel-reward"
    assert {v for k, v in used.items() if k.startswith("worker/")} == {"keel-ray-worker"}
    assert set(used.values()) == set(accounts)  # each account is used, none is `default`
    for name, account in accounts.items():
        assert account["automountServiceAccountToken"] is False, name
    for name, template in pod_templates().items():
        assert template["spec"]["automountServiceAccountToken"] is False, name


def all_deploy_docs() -> list[dict]:
    out = []
    for path in REPO_DEPLOY.rglob("*.yaml"):
        for doc in docs(path):
            if isinstance(doc, dict) and "kind" in doc:
                out.append(doc)
    return out


def test_only_the_autoscaler_has_a_role_and_it_is_the_least_it_needs():
    """One Role in deploy/, bound to keel-ray-head only: read pods, read and patch the
    RayCluster (the Ray autoscaler patches replicas and workersToDelete; KubeRay creates and
    deletes the pods). No wildcard, no secrets, no create or delete, no cluster-wide grant."""
    found = all_deploy_docs()
    kinds = [d["kind"] for d in found]
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    (role,) = [d for d in found if d["kind"] == "Role"]
    (binding,) = [d for d in found if d["kind"] == "RoleBinding"]
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}  # fmt: skip
    assert rules == {("", "pods"): {"get", "list", "watch"},
                     ("ray.io", "rayclusters"): {"get", "patch"}}  # fmt: skip
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}  # fmt: skip
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [
        ("ServiceAccount", "keel-ray-head")
    ]


def test_the_api_token_reaches_the_autoscaler_container_only():
    """The head pod mounts no token; its projected volume (token, CA, namespace: what the kubelet
    would mount) is mounted, read only, into the autoscaler container at the path the Ray
    autoscaler reads, and into no Ray container."""
    head = rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    volumes = {v["name"]: v for v in head["volumes"]}
    (token,) = [n for n, v in volumes.items()
                if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))]  # fmt: skip # noqa: E501
    sources = volumes[token]["projected"]["sources"]
    assert {k for s in sources for k in s} == {"serviceAccountToken", "configMap", "downwardAPI"}
    options = rayjob()["spec"]["rayClusterSpec"]["autoscalerOptions"]
    mounts = {m["name"]: m for m in options["volumeMounts"]}
    assert mounts[token]["mountPath"] == TOKEN_PATH and mounts[token]["readOnly"] is True
    for name, template in pod_templates().items():
        for c in template["spec"]["containers"]:
            assert all(m["name"] != token and m["mountPath"] != TOKEN_PATH
                       for m in c.get("volumeMounts", [])), (name, c["name"])  # fmt: skip


# --------------------------------------------------------------------- the containers' confinement
def check_container(security: dict, where: str) -> None:
    assert security["allowPrivilegeEscalation"] is False, where
    assert security["readOnlyRootFilesystem"] is True, where
    assert security["capabilities"] == {"drop": ["ALL"]}, where
    assert not security.get("privileged"), where


def check_pod(template: dict, where: str) -> None:
    uid, gid, home = image_user()
    spec = template["spec"]
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert (pod["runAsUser"], pod["runAsGroup"]) == (uid, gid), where
    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in spec["containers"]:
        check_container(c["securityContext"], f"{where}/{c['name']}")
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        for path in ("/tmp", home):  # where Ray, torch, Triton, vLLM and HF write
            assert "emptyDir" in volumes[mounts[path]["name"]], (where, path)
        for path, mount in mounts.items():
            writable = not mount.get("readOnly")
            kind = next(k for k in volumes[mount["name"]] if k != "name")
            assert not writable or kind in {"emptyDir", "persistentVolumeClaim"}, (where, path)


def test_every_pod_runs_as_the_images_unprivileged_user_read_only_and_without_capabilities():
    uid, _, _ = image_user()
    assert uid >= 10000  # not a host user's uid (checkov CKV_K8S_40)
    for name, template in pod_templates().items():
        check_pod(template, name)
    options = rayjob()["spec"]["rayClusterSpec"]["autoscalerOptions"]
    check_container(options["securityContext"], "autoscaler")
    assert options["securityContext"]["runAsNonRoot"] is True


def test_a_container_left_writable_or_root_fails_the_check():
    template = copy.deepcopy(pod_templates()["serve"])
    template["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
    with pytest.raises(AssertionError):
        check_pod(template, "serve")
    template = copy.deepcopy(pod_templates()["serve"])
    template["spec"]["securityContext"]["runAsUser"] = 0
    with pytest.raises(AssertionError):
        check_pod(template, "serve")


def test_the_training_run_writes_only_where_the_pods_may():
    """The run directory and Keel's cache are on the PVC, which the head and the workers mount
    writable; the config is read from a read-only mount."""
    cfg = validate(yaml.safe_load((KUBERAY / "grpo.yaml").read_text()))
    env = yaml.safe_load(rayjob()["spec"]["runtimeEnvYAML"])["env_vars"]
    for name, template in pod_templates().items():
        if name in {"serve", "reward", "submitter"}:
            continue
        (c,) = template["spec"]["containers"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert not mounts["/data"].get("readOnly"), name
        for path in (cfg.run_dir, env["KEEL_CACHE"]):
            assert path.startswith("/data/"), path


def test_the_rendered_serving_variants_keep_the_confinement():
    """The GPU, vLLM, load-balancer and operator overlays patch the base; their Deployments
    keep its account and confinement (vLLM's too: it writes its caches to the emptyDirs).
    Their built-in kinds, and the reward server's, validate strictly against Kubernetes 1.33."""
    for doc in kustomize(SERVE / "lb") + kustomize(SERVE / "reward"):
        kubernetes_validate.validate(doc, "1.33", strict=True)
    for overlay in ("gpu", "vllm", "lb", "operator"):
        (deployment,) = [d for d in kustomize(SERVE / overlay) if d["kind"] == "Deployment"]
        template = deployment["spec"]["template"]
        check_pod(template, overlay)
        assert template["spec"]["serviceAccountName"] == "keel-serve"
        assert template["spec"]["automountServiceAccountToken"] is False


# ------------------------------------------------------------------------- who talks to whom
def policies(paths, namespace: str) -> list[dict]:
    out = []
    for path in paths:
        for doc in docs(path):
            assert doc["kind"] == "NetworkPolicy"
            out.append({**doc, "metadata": {**doc["metadata"], "namespace": namespace}})
    return out


def labels(template: dict) -> dict[str, str]:
    return template["metadata"]["labels"]


def ip_in(policy_docs: list[dict], name: str) -> str:
    """An address inside the ipBlock of the policy `name` (the user's CIDR)."""
    (policy,) = [p for p in policy_docs if p["metadata"]["name"] == name]
    rules = policy["spec"].get("egress", []) + policy["spec"].get("ingress", [])
    (cidr,) = [peer["ipBlock"]["cidr"] for r in rules for peer in r.get("to", r.get("from", []))
               if "ipBlock" in peer]  # fmt: skip
    return str(next(iter(ipaddress.ip_network(cidr))))


def container_port(template: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    return ports[name]


TRAIN_NS, SERVE_NS = "keel-train-v1", "keel-serve"
PROMETHEUS = Endpoint("monitoring", {"app.kubernetes.io/name": "prometheus"})
OPERATOR = Endpoint("kuberay-system", {"app.kubernetes.io/name": "kuberay-operator"})
DNS = Endpoint("kube-system", {"k8s-app": "kube-dns"})
GATEWAY = Endpoint("ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"})


def test_the_training_job_is_reachable_only_from_itself_prometheus_and_the_operator():
    """The job's pods talk to each other on any port (Ray's and NCCL's ports are picked at run
    time) and to nothing else of the namespace; Prometheus reaches the head's metrics port and
    nothing else, the KubeRay operator the dashboard; another pod, in the namespace or not (a
    serving pod), reaches none of them. Out of the job: DNS, the object store on 443, and, for
    the head alone, the API server."""
    pols = policies([KUBERAY / "networkpolicy.yaml"], TRAIN_NS)
    templates = pod_templates()
    head = Endpoint(TRAIN_NS, labels(templates["head"]))
    worker = Endpoint(TRAIN_NS, labels(templates["worker/trainer"]))
    reward = Endpoint(TRAIN_NS, labels(templates["worker/reward"]))
    submitter = Endpoint(TRAIN_NS, labels(templates["submitter"]))
    neighbour = Endpoint(TRAIN_NS, {"app": "something-else"})
    serving = Endpoint(SERVE_NS, labels(templates["serve"]))
    store = Endpoint(None, ip=ip_in(pols, "keel-train-egress"))
    api = Endpoint(None, ip=ip_in(pols, "keel-train-head"))
    internet = Endpoint(None, ip="8.8.8.8")
    metrics = container_port(templates["head"], "metrics")
    dashboard = container_port(templates["head"], "dashboard")
    gcs = container_port(templates["head"], "gcs")

    assert can_connect(pols, worker, head, gcs) and can_connect(pols, head, worker, 41000)
    assert can_connect(pols, worker, reward, 29500)  # NCCL/gloo between worker pods
    assert can_connect(pols, submitter, head, dashboard)
    assert can_connect(pols, PROMETHEUS, head, metrics)
    assert not can_connect(pols, PROMETHEUS, head, gcs)
    assert not can_connect(pols, PROMETHEUS, worker, metrics)  # workers report through the head
    assert can_connect(pols, OPERATOR, head, dashboard)
    assert not can_connect(pols, OPERATOR, worker, dashboard)
    for outsider in (neighbour, serving, GATEWAY):
        for pod, port in ((head, dashboard), (head, gcs), (worker, 41000)):
            assert not can_connect(pols, outsider, pod, port), (outsider, pod, port)
    assert not can_connect(pols, head, neighbour, 80)
    for pod in (head, worker, submitter):
        assert can_connect(pols, pod, DNS, 53, "UDP") and can_connect(pols, pod, DNS, 53)
        assert can_connect(pols, pod, store, 443)
        assert not can_connect(pols, pod, store, 80) and not can_connect(pols, pod, internet, 443)
    assert can_connect(pols, head, api, 443)
    assert not can_connect(pols, worker, api, 443)
    # without the policies every connection above is open: the denials are theirs
    assert can_connect([], neighbour, head, gcs) and can_connect([], worker, internet, 443)


def test_the_serving_pods_take_the_gateway_prometheus_and_labelled_clients_only():
    """The API port from the ingress controller's namespace, Prometheus and pods of the
    namespace labelled keel-serve-client: "true"; not from other pods or namespaces (a training
    pod included), not on another port; out of the pods, DNS only. With deploy/serve/lb, the
    load balancer's clients (their addresses kept: externalTrafficPolicy Local) too."""
    base = policies([SERVE / "base" / "networkpolicy.yaml"], SERVE_NS)
    templates = pod_templates()
    pod = Endpoint(SERVE_NS, labels(templates["serve"]))
    (port,) = [p["containerPort"] for p in templates["serve"]["spec"]["containers"][0]["ports"]]
    client = Endpoint(SERVE_NS, {"keel-serve-client": "true"})
    stranger = Endpoint(SERVE_NS, {"app": "something-else"})
    foreign_client = Endpoint("elsewhere", {"keel-serve-client": "true"})
    trainer = Endpoint(TRAIN_NS, labels(templates["worker/trainer"]))
    for allowed in (GATEWAY, PROMETHEUS, client):
        assert can_connect(base, allowed, pod, port), allowed
        assert not can_connect(base, allowed, pod, port + 1), allowed
    for denied in (stranger, foreign_client, trainer, OPERATOR):
        assert not can_connect(base, denied, pod, port), denied
    assert can_connect(base, pod, DNS, 53, "UDP")
    assert not can_connect(base, pod, Endpoint(None, ip="8.8.8.8"), 443)
    assert not can_connect(base, pod, Endpoint(TRAIN_NS, labels(templates["head"])), 8265)

    with_lb = base + policies([SERVE / "lb" / "networkpolicy-lb.yaml"], SERVE_NS)
    lb_client = Endpoint(None, ip=ip_in(with_lb, "keel-serve-lb"))
    assert not can_connect(base, lb_client, pod, port)
    assert can_connect(with_lb, lb_client, pod, port)
    assert not can_connect(with_lb, Endpoint(None, ip="8.8.8.8"), pod, port)
    (service,) = docs(SERVE / "lb" / "service-lb.yaml")
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["externalTrafficPolicy"] == "Local"  # the client address survives
    sources = {ipaddress.ip_network(r) for r in service["spec"]["loadBalancerSourceRanges"]}
    assert ipaddress.ip_address(lb_client.ip) in next(iter(sources))
    assert service["spec"]["selector"].items() <= labels(templates["serve"]).items()


def test_the_policies_select_the_pods_the_manifests_make():
    """Every pod of the job carries the labels the training policies select, and no serving
    pod does; the serving policies select the Deployment's pods and no training pod."""
    training = policies([KUBERAY / "networkpolicy.yaml"], TRAIN_NS)
    serving = policies([SERVE / "base" / "networkpolicy.yaml"], SERVE_NS)
    deny_train = next(p for p in training if p["metadata"]["name"] == "keel-train-deny")
    deny_serve = next(p for p in serving if p["metadata"]["name"] == "keel-serve-deny")
    selector_t = deny_train["spec"]["podSelector"]["matchLabels"]
    selector_s = deny_serve["spec"]["podSelector"]["matchLabels"]
    for name, template in pod_templates().items():
        is_job = name not in {"serve", "reward"}
        assert (selector_t.items() <= labels(template).items()) == is_job, name
        assert (selector_s.items() <= labels(template).items()) == (name == "serve"), name
    assert set(deny_train["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny_train["spec"] and "egress" not in deny_train["spec"]


# ------------------------------------------------------------- a namespace per training version
def test_the_version_overlay_puts_the_whole_run_in_its_own_namespace():
    """deploy/kuberay-version renders deploy/kuberay into keel-train-<version>: every object in
    that namespace (the RoleBinding's subject too), the Namespace itself with Pod Security
    labels, and a namespace-wide deny beside the job's policies."""
    kust = yaml.safe_load((VERSION / "kustomization.yaml").read_text())
    namespace = kust["namespace"]
    assert re.fullmatch(r"keel-train-[a-z0-9]([a-z0-9.-]*[a-z0-9])?", namespace)
    out = kustomize(VERSION)
    base = kustomize(KUBERAY)
    kinds = sorted(d["kind"] for d in out)
    assert kinds == sorted([d["kind"] for d in base] + ["Namespace", "NetworkPolicy"])
    (ns,) = [d for d in out if d["kind"] == "Namespace"]
    assert ns["metadata"]["name"] == namespace
    ns_labels = ns["metadata"]["labels"]
    assert ns_labels["pod-security.kubernetes.io/enforce"] in {"baseline", "restricted"}
    assert ns_labels["pod-security.kubernetes.io/warn"] == "restricted"
    for doc in out:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, doc["kind"]
        if doc["kind"] != "RayJob":  # the CRD's schema: tests/deploy/test_kuberay.py
            kubernetes_validate.validate(doc, "1.33", strict=True)
    (binding,) = [d for d in out if d["kind"] == "RoleBinding"]
    assert {s["namespace"] for s in binding["subjects"]} == {namespace}
    (deny_all,) = [d for d in out if d["metadata"]["name"] == "default-deny-all"]
    assert deny_all["spec"]["podSelector"] == {}
    assert set(deny_all["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    version = kust["labels"][0]["pairs"]["app.kubernetes.io/version"]
    assert namespace == f"keel-train-{version}"


def version_namespace_labels() -> dict[str, str]:
    (namespace,) = docs(VERSION / "namespace.yaml")
    return namespace["metadata"]["labels"]


def test_the_reward_server_takes_the_training_jobs_calls_only():
    """A training pod in a version's namespace (labelled as deploy/kuberay-version labels it)
    reaches the reward server's API port; a training pod in an unlabelled namespace, a serving
    pod, the gateway, do not; the reward server opens nothing but DNS."""
    pols = policies([KUBERAY / "networkpolicy.yaml"], TRAIN_NS)
    pols += policies([SERVE / "reward" / "networkpolicy.yaml"], SERVE_NS)
    pols += policies([SERVE / "base" / "networkpolicy.yaml"], SERVE_NS)
    namespaces = {TRAIN_NS: version_namespace_labels()}
    templates = pod_templates()
    reward = Endpoint(SERVE_NS, labels(templates["reward"]))
    (port,) = [p["containerPort"] for p in templates["reward"]["spec"]["containers"][0]["ports"]]
    worker = Endpoint(TRAIN_NS, labels(templates["worker/reward"]))
    head = Endpoint(TRAIN_NS, labels(templates["head"]))
    unlabelled = Endpoint("default", labels(templates["worker/reward"]))
    serving = Endpoint(SERVE_NS, labels(templates["serve"]))
    for caller in (worker, head):  # the reward role runs in a worker group or in the driver
        assert can_connect(pols, caller, reward, port, namespaces=namespaces)
        assert not can_connect(pols, caller, reward, port + 1, namespaces=namespaces)
    assert not can_connect(pols, unlabelled, reward, port, namespaces=namespaces)
    for stranger in (serving, GATEWAY, OPERATOR):
        assert not can_connect(pols, stranger, reward, port, namespaces=namespaces), stranger
    assert can_connect(pols, PROMETHEUS, reward, port, namespaces=namespaces)
    assert can_connect(pols, reward, DNS, 53, "UDP", namespaces=namespaces)
    assert not can_connect(pols, reward, head, 8265, namespaces=namespaces)
    assert not can_connect(pols, reward, Endpoint(None, ip="8.8.8.8"), 443, namespaces=namespaces)
