"""checkov over deploy/ (docs/deploy.md, "Checking the manifests"): every manifest as written
(the kubernetes framework), every kustomization as rendered (the kustomize framework, through
.venv-checkov's kubectl) and the Dockerfile, with deploy/.checkov.yaml; no check may fail, and
every check skipped for one object names its reason. checkov lives in .venv-checkov
(scripts/install-test-tools): its pins conflict with Keel's. One checkov run, shared by the tests,
scans deploy/ beside a Deployment that breaks the rules, which must be reported (so a checkov
that checks nothing cannot pass)."""

import json
import os
import subprocess

import pytest
import yaml

from tests.deploy.tools import CHECKOV_VENV, REPO_DEPLOY

CONFIG = REPO_DEPLOY / ".checkov.yaml"
FRAMEWORKS = {"kubernetes", "kustomize", "dockerfile"}
BROKEN = "keel-broken"  # the control Deployment's name


def checkov_binary() -> str:
    path = CHECKOV_VENV / "bin" / "checkov"
    if not path.is_file():
        pytest.fail("checkov is not installed: run scripts/install-test-tools", pytrace=False)
    return str(path)


def control_deployment() -> dict:
    """The serving Deployment with root, a writable root filesystem, privilege escalation and
    its token mounted: what the checks exist to catch."""
    (deployment,) = yaml.safe_load_all((REPO_DEPLOY / "serve/base/deployment.yaml").read_text())
    deployment["metadata"] = {"name": BROKEN}
    spec = deployment["spec"]["template"]["spec"]
    spec["securityContext"] = {"runAsUser": 0}
    spec["automountServiceAccountToken"] = True
    spec["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": True}
    return deployment


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict[str, dict]:
    """checkov's JSON report by framework, for deploy/ and the control folder."""
    control = tmp_path_factory.mktemp("control")
    (control / f"{BROKEN}.yaml").write_text(yaml.safe_dump(control_deployment()))
    env = {**os.environ, "PATH": f"{CHECKOV_VENV / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        [checkov_binary(), "--config-file", str(CONFIG), "-d", str(REPO_DEPLOY), "-d", str(control),
         "-o", "json"],
        capture_output=True, text=True, env=env, timeout=300, cwd=REPO_DEPLOY.parent,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: failed checks (the control's)
    return merged(proc.stdout)


def merged(output: str) -> dict[str, dict]:
    """checkov's JSON output (one document per scanned folder, each a framework's report or a
    list of them) as one report per framework: the check lists joined, the counts summed."""
    out: dict[str, dict] = {}
    decoder, at = json.JSONDecoder(), 0
    while output[at:].strip():
        at += len(output[at:]) - len(output[at:].lstrip())
        doc, at = decoder.raw_decode(output, at)
        for part in doc if isinstance(doc, list) else [doc]:
            report = out.setdefault(part["check_type"], {"results": {}, "summary": {}})
            for key, checks in part["results"].items():
                report["results"].setdefault(key, []).extend(checks)
            for key, value in part["summary"].items():
                if isinstance(value, int):
                    report["summary"][key] = report["summary"].get(key, 0) + value
    return out


def failed(report: dict[str, dict]) -> list[dict]:
    return [f for r in report.values() for f in r["results"]["failed_checks"]]


def test_no_check_fails_on_deploy(report):
    """Every failed check belongs to the control Deployment; deploy/ has none."""
    ours = [
        (f["check_id"], f["check_name"], f["resource"], f["file_path"])
        for f in failed(report)
        if BROKEN not in f["resource"]
    ]
    assert not ours, "\n".join(map(str, ours))


def test_the_control_deployment_fails_the_checks_it_breaks(report):
    ids = {f["check_id"] for f in failed(report) if BROKEN in f["resource"]}
    # root (CKV_K8S_23, _40), writable root filesystem (_22), privilege escalation (_20),
    # capabilities not dropped (_28, _37), the API token mounted (_38)
    assert {"CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_23", "CKV_K8S_28", "CKV_K8S_37",
            "CKV_K8S_38", "CKV_K8S_40"} <= ids  # fmt: skip


def test_every_framework_ran_and_every_kustomization_was_rendered(report):
    assert set(report) >= FRAMEWORKS
    for framework in FRAMEWORKS:
        summary = report[framework]["summary"]
        assert summary["parsing_errors"] == 0, framework
        assert summary["passed"] > 0, framework
    rendered = {
        f["file_path"].split("/deploy/")[-1].lstrip("/")
        for f in report["kustomize"]["results"]["passed_checks"]
    }
    kustomizations = {
        str(p.relative_to(REPO_DEPLOY)) for p in REPO_DEPLOY.rglob("kustomization.yaml")
    }
    assert {r for r in rendered if r.endswith("kustomization.yaml")} == kustomizations


def test_every_skipped_check_names_its_reason(report):
    skipped = [s for r in report.values() for s in r["results"].get("skipped_checks", [])]
    assert skipped  # the Deployment's and the Dockerfile's skips are seen
    for check in skipped:
        reason = (check.get("check_result") or {}).get("suppress_comment", "")
        assert len(reason.split()) >= 4, (check["check_id"], check["resource"], reason)
