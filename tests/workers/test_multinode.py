"""A real two-node Ray cluster, started with the CLI as on two machines: `ray start --head` (node
A, with the dashboard, custom resource `node_a`) and `ray start --address …` (node B, `node_b`),
both on 127.0.0.1 with their own ports and a short temp dir (Ray's socket paths are limited to
107 characters). Groups are placed on a node by `resources.groups[].resources`.

One cluster serves the module (a node takes a few seconds to start): a Keel run submitted as a
Ray job through the dashboard, as the KubeRay RayJob submits it; then a GRPO run whose reward
group is on node B loses node B (its raylet SIGKILLed, then the rest of the node's processes, as
when a pod dies), a replacement node B joins (as KubeRay restarts the pod) and the run recovers
by itself from its latest checkpoint. Every node is stopped at the end, by its own process group
(never `ray stop`, which would stop every Ray on the machine).

The runs' drivers are `keel train` processes (the job's, on the head; the other from the test):
this process only reads the dashboard. (A pytest worker that ran a local `ray.init` before, as
test_ray_group does, could not create actors on this cluster: Ray 2.60 cancels them, "all
references to the actor were removed", after a `ray.shutdown` and a `ray.init(address=…)`.)"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from ray.job_submission import JobStatus, JobSubmissionClient
from ray.util.state import list_actors, list_nodes

from keel.config.loading import ConfigError, dump_config
from keel.controller.runner import run_training
from keel.guard.events import read_events
from tests.workers.test_ray_group import TOLERANCE, metrics, tiny_grpo, weights

pytestmark = pytest.mark.ray

BIN = Path(sys.executable).parent
REWARD = f"{Path(__file__).resolve().parents[1] / 'cli/format_reward.py'}:digit_fraction"
START_TIMEOUT_S = 90
# The GCS declares a node dead after this many failed health checks, this far apart (Ray's
# defaults, 5 × 3 s, would make the test wait 15 s for the lost node).
HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4"}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Node:
    """One `ray start --block` process in a process group of its own: the node's processes are
    its children, and `stop` ends them all by that group."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path):
        node_manager, object_manager, metrics_port, agent_grpc, agent_http, runtime_env = (
            free_ports(6)
        )
        self.name, self.node_manager_port = name, node_manager
        self.log = log_dir / f"ray-start-{name}-{node_manager}.log"
        cmd = [
            str(BIN / "ray"), "start", "--block",
            "--node-manager-port", str(node_manager), "--object-manager-port", str(object_manager),
            "--metrics-export-port", str(metrics_port), "--dashboard-agent-grpc-port",
            str(agent_grpc), "--dashboard-agent-listen-port", str(agent_http),
            "--runtime-env-agent-port", str(runtime_env), "--disable-usage-stats", *args,
        ]  # fmt: skip
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_started(self) -> None:
        deadline = time.time() + START_TIMEOUT_S
        while b"Ray runtime started" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"ray start ({self.name}) failed:\n{self.log.read_text()}")
            time.sleep(0.01)

    def raylet(self) -> psutil.Process:
        return next(
            p for p in psutil.Process(self.proc.pid).children(recursive=True)
            if p.name() == "raylet"
        )  # fmt: skip

    def lose(self) -> list[int]:
        """The node dies as a pod does: its raylet SIGKILLed first (the loss Ray must detect),
        then every other process of the node (its workers included). The pids killed."""
        raylet = self.raylet()
        rest = [p for p in psutil.Process(self.proc.pid).children(recursive=True) if p != raylet]
        raylet.kill()
        killed = [raylet.pid]
        for p in [*rest, psutil.Process(self.proc.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
                killed.append(p.pid)
        self.stop()
        return killed

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # `ray start --block` stops the node's processes on SIGTERM
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # whatever of the node is left
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class Cluster:
    """The head (node A, with the dashboard) and node B, joined to it."""

    def __init__(self, root: Path):
        self.root = root
        self.temp_dir = Path(tempfile.mkdtemp(prefix="kr-", dir="/tmp"))  # short socket paths
        self.port, self.dashboard_port, client_port = free_ports(3)
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        # A cluster on 127.0.0.1 is a trusted network: no token authentication (the head would
        # turn it on when ~/.ray/auth_token exists, the other nodes only when told). A job's
        # entrypoint needs `keel` on the PATH, no network, one torch thread.
        self.env = {
            **os.environ, **HEALTH, "RAY_AUTH_MODE": "disabled",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        self.head = Node("a", [
            "--head", "--port", str(self.port), "--num-cpus", "2",
            "--resources", json.dumps({"node_a": 2}), "--temp-dir", str(self.temp_dir),
            "--ray-client-server-port", str(client_port), "--include-dashboard=true",
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
        ], self.env, root)  # fmt: skip
        self.nodes = [self.head]
        self.head.wait_started()

    def add_node_b(self) -> Node:
        node = Node("b", [
            "--address", self.address, "--num-cpus", "1", "--resources", json.dumps({"node_b": 1}),
        ], self.env, self.root)  # fmt: skip
        self.nodes.append(node)
        node.wait_started()
        return node

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def wait_for(predicate, what: str, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def alive(cluster: Cluster, resource: str = "CPU") -> set[str]:
    """The ids of the cluster's live nodes that have `resource` (from the dashboard)."""
    nodes = list_nodes(cluster.dashboard, limit=1000)  # all: a filter counts as missing output
    return {n.node_id for n in nodes if n.state == "ALIVE" and resource in n.resources_total}


def hosts_by_role(cluster: Cluster) -> dict[str, set[str]]:
    """{"actor" | "reward": the ids of the nodes that ran Keel's hosts of that group}, from the
    dashboard's actor table (dead actors included)."""
    hosts = list_actors(cluster.dashboard, filters=[("class_name", "=", "RoleHost")], limit=1000)
    return {
        role: {a.node_id for a in hosts if a.name.startswith(f"keel-{role}")}
        for role in ("actor", "reward")
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Node A (head, dashboard) and node B. This process is no driver of it (the runs' drivers
    are `keel train` processes, as on a real cluster): it only reads the dashboard."""
    root = tmp_path_factory.mktemp("cluster")
    cluster = Cluster(root)
    env = pytest.MonkeyPatch()
    env.setenv("RAY_AUTH_MODE", "disabled")  # for the dashboard clients in this process
    try:
        cluster.add_node_b()
        wait_for(lambda: alive(cluster, "node_b"), "node B never joined the cluster")
        yield cluster
    finally:
        cluster.stop()
        env.undo()


def two_nodes(**extra):
    """The actor (with the reference) on node A, the reward on node B, the rollout in the
    driver (its random stream is checkpointed, so a resumed run samples what an uninterrupted
    one samples)."""
    return {"backend": "ray", "groups": [
        {"roles": ["actor", "reference"], "cpus_per_worker": 0.5, "resources": {"node_a": 1}},
        {"roles": ["reward"], "cpus_per_worker": 0.5, "resources": {"node_b": 1}},
    ], **extra}  # fmt: skip


@pytest.fixture(scope="module")
def local_run(tiny_dir, tmp_path_factory):
    """The uninterrupted run, in one process."""
    run_dir = tmp_path_factory.mktemp("local") / "run"
    cfg = tiny_grpo(tiny_dir, run_dir)
    cfg.reward.fn = REWARD
    run_training(cfg)
    return run_dir


def test_ray_job_submit_runs_keel_train_on_the_cluster(cluster, tiny_dir, tmp_path):
    """`ray job submit` through the dashboard's HTTP API, the KubeRay RayJob's way: the job's
    driver (`keel train`, resources.ray.address: auto) runs on the head and places the reward
    group on node B."""
    run_dir = tmp_path / "run"
    cfg = tiny_grpo(tiny_dir, run_dir, **two_nodes(ray={"address": "auto"}))
    cfg.reward.fn = REWARD
    cfg.train.steps = 2
    cfg.checkpoint.save_steps = 1
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(cfg))
    job = f"keel-test-{os.getpid()}-{time.time_ns()}"
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", cluster.dashboard, "--submission-id",
         job, "--no-wait", "--", "keel", "train", str(path)],
        env=cluster.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout + submit.stderr
    client = JobSubmissionClient(cluster.dashboard)
    wait_for(
        lambda: client.get_job_status(job).is_terminal(), f"job {job} did not end", timeout=300
    )
    logs = client.get_job_logs(job)
    assert client.get_job_status(job) == JobStatus.SUCCEEDED, logs
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2]  # step 0: the first evaluation
    assert (run_dir / "checkpoints/step_000002").is_dir()
    assert weights(run_dir)  # the exported policy
    assert client.get_job_info(job).entrypoint == f"keel train {path}"
    assert hosts_by_role(cluster) == {
        "actor": alive(cluster, "node_a"), "reward": alive(cluster, "node_b")
    }  # fmt: skip


# The run's reward (digit_fraction's scores), holding its call while the file `hold` exists: the
# test holds step 2's call on node B, so that the node is lost while it has work in flight.
HELD_REWARD = """
import time
from pathlib import Path

HOLD = Path(__file__).with_name("hold")


def digit_fraction(prompt, response, answer, **kwargs):
    while HOLD.exists():
        HOLD.with_name("held").touch()
        time.sleep(0.02)
    return sum(c.isdigit() for c in response) / max(len(response), 1)
"""


def test_a_lost_node_is_replaced_and_the_run_resumes_from_its_checkpoint(
    cluster, local_run, tiny_dir, tmp_path
):
    """Node B dies while its reward worker scores step 2; a replacement node B joins; the run
    rebuilds its groups (the reward group waits for a node with `node_b`), resumes from step
    1's checkpoint and ends where the uninterrupted run ends. The driver is `keel train` (on
    this machine, as on node A)."""
    run_dir, reward = tmp_path / "run", tmp_path / "reward.py"
    reward.write_text(HELD_REWARD)
    resources = two_nodes(max_restarts=1, ray={"address": cluster.address})
    cfg = tiny_grpo(tiny_dir, run_dir, **resources)
    cfg.reward.fn = f"{reward}:digit_fraction"
    cfg.checkpoint.save_steps = 1
    node_b = cluster.nodes[-1]
    hold, held = tmp_path / "hold", tmp_path / "held"
    lost: dict = {}

    def logged(step):
        path = run_dir / "metrics.jsonl"
        return path.is_file() and any(r["step"] >= step for r in metrics(run_dir))

    def lose_node_b_during_step_2():
        try:
            wait_for(lambda: logged(1), "step 1 was not logged", timeout=180)
            hold.touch()  # step 2 is generating; its reward call will wait on node B
            wait_for(held.exists, "step 2's reward call did not start", timeout=60)
            (lost["node_id"],) = alive(cluster, "node_b")
            lost["pids"] = node_b.lose()
            hold.unlink()
            cluster.add_node_b()  # as KubeRay restarts the pod
        except Exception as exc:  # the test fails on it below
            lost["error"] = exc

    thread = threading.Thread(target=lose_node_b_during_step_2, daemon=True)
    thread.start()
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(cfg))
    train = subprocess.run(
        [str(BIN / "keel"), "train", str(path)],
        env=cluster.env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    thread.join()
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "error" not in lost and lost["pids"], lost.get("error")
    events = read_events(run_dir / "events.jsonl")
    restart = [e for e in events if e["event"] == "restart"]
    # the reward group ran on node B, then on its replacement; the actor's group on node A
    (replacement,) = alive(cluster, "node_b")
    assert lost["node_id"] not in alive(cluster)
    assert hosts_by_role(cluster) == {
        "actor": alive(cluster, "node_a"), "reward": {lost["node_id"], replacement}
    }  # fmt: skip
    assert len(restart) == 1 and restart[0]["reason"] == "worker_lost" and restart[0]["step"] == 2
    assert "reward" in restart[0]["message"]
    resumed = [e for e in events if e["event"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] == 1
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2, 3]
    # resumed from a full-state checkpoint, the run ends where the uninterrupted one does
    local, dist = weights(local_run), weights(run_dir)
    assert max((local[k] - dist[k]).abs().max().item() for k in local) <= TOLERANCE


@pytest.mark.parametrize(
    "resources, says",
    [
        ({"node_b": 0}, "resources.groups.1.resources.node_b: Input should be greater than 0"),
        ({"node_b": float("inf")}, "resources.groups.1.resources.node_b: Input should be a finite"),
        ({"CPU": 1}, "resources.groups.1: resources.CPU: set cpus_per_worker instead"),
    ],
)
def test_a_groups_resources_are_checked_naming_the_field(tiny_dir, tmp_path, resources, says):
    groups = two_nodes()["groups"]
    groups[1]["resources"] = resources
    with pytest.raises(ConfigError, match=re.escape(says)):
        tiny_grpo(tiny_dir, tmp_path, backend="ray", groups=groups)
