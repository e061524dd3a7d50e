"""A two-node Ray cluster simulated on this machine: a head (``ray start --head``) and a
worker node (``ray start --address``), each its own raylet with one CPU (so two trials
run at once, one of them on the worker node), and ``ssmcraft search SPEC --address HEAD``
as a separate driver process. The worker node's raylet is killed (SIGKILL) while a trial
runs there: the trial is re-run on the surviving node (``resources.max_retries``) and
recorded as retried, with its two attempts, and the search finishes with every trial
complete.

Only the processes this test starts are stopped (the nodes' process groups; Ray's worker
processes leave the group but exit with their raylet), in a fixture's teardown; never
``ray stop``, which would stop every Ray process on the machine.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from optuna.trial import TrialState

from ssmcraft.search.rundir import open_study
from ssmcraft.search.testing import tiny_spec

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
              pytest.mark.xdist_group("ray")]   # conftest: one Ray instance on the machine at a time

REPO = Path(__file__).resolve().parent.parent
# Ray on loopback (ENV.md), no usage stats, no token auth; a lost raylet noticed in ~1.5 s
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "disabled", "RAY_health_check_period_ms": "500",
           "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "3",
           "RAY_health_check_initial_delay_ms": "0"}
# `ray start --address` for a second node on loopback. With RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# (what keeps Ray on loopback here) `ray start` refuses to add a node ("multi-node clusters are
# not supported"); with =1 it swaps 127.0.0.1 for this machine's public address, where the
# loopback-bound head does not listen. So the worker node runs Ray's own CLI with that one swap
# turned off; on a real cluster each node is started with plain `ray start --address`.
WORKER_NODE = """import sys
from ray._private import services
services.resolve_ip_for_localhost = lambda host: host
from ray.scripts.scripts import main
sys.argv[0] = "ray"
main()
"""
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, **RAY_ENV,
       "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``: pid -> command name."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            children.setdefault(int(rest.split()[1]), []).append((int(entry.name), name))
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child, name in children.get(todo.pop(), []):
            if child not in found:
                found[child] = name
                todo.append(child)
    return found


class LocalCluster:
    """A head and worker nodes started with ``ray start --block`` in process groups of
    their own, so that stopping them stops exactly what this test started."""

    def __init__(self, root: Path) -> None:
        self.temp_dir = root
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, head: bool = False) -> None:
        log = open(self.temp_dir / f"{name}.out", "w")
        common = ["--block", "--num-gpus=0", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
                  "--object-store-memory=100000000", f"--temp-dir={self.temp_dir / 'ray'}"]
        command = [sys.executable, "-m", "ray.scripts.scripts"] if head else [sys.executable, "-c", WORKER_NODE]
        self.nodes[name] = subprocess.Popen(
            [*command, "start", *common, *args], env=ENV if head else {**ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for_nodes(self, n: int, timeout: float = 60) -> None:
        probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='error'); "
                 "print(sum(x['Alive'] for x in ray.nodes()))")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, node in self.nodes.items():
                assert node.poll() is None, f"ray node {name} exited: {(self.temp_dir / f'{name}.out').read_text()}"
            done = subprocess.run([sys.executable, "-c", probe, self.address], env=ENV,
                                  capture_output=True, text=True, timeout=30)
            if done.returncode == 0 and done.stdout.strip() == str(n):
                return
            time.sleep(0.5)
        raise AssertionError(f"the cluster did not reach {n} nodes: {done.stdout} {done.stderr}")

    def raylet(self, name: str) -> int:
        (pid,) = [p for p, comm in descendants(self.nodes[name].pid).items() if comm == "raylet"]
        return pid

    def processes(self, name: str) -> set[int]:
        return set(descendants(self.nodes[name].pid))

    def stop(self) -> None:
        for node in self.nodes.values():  # workers first (reverse), then the head
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.wait(timeout=30)


@pytest.fixture
def cluster():
    root = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's socket paths have a length limit
    c = LocalCluster(root)
    try:
        c.start("head", "--head", f"--port={c.port}", "--num-cpus=1", "--include-dashboard=false", head=True)
        c.start("worker", f"--address={c.address}", "--num-cpus=1")
        c.wait_for_nodes(2)
        yield c
    finally:
        c.stop()
        subprocess.run(["rm", "-rf", str(root)], check=False)


def attempt_pids(out: Path) -> dict[int, list[int]]:
    """trial number -> the pid of each attempt (``attempts.log``)."""
    found = {}
    for log in (out / "trials").glob("*/attempts.log"):
        found[int(log.parent.name)] = [int(line.split()[2]) for line in log.read_text().splitlines()]
    return found


def test_a_lost_worker_node_mid_search_is_recorded_and_its_trial_retried(cluster, tmp_path):
    raw = tiny_spec(budget={"trials": 4, "tokens_per_trial": 1000, "seconds_per_trial": 60},
                    train={"sleep_s": 3.0}, resources={"cpus_per_trial": 1, "max_retries": 2})
    (tmp_path / "search.yaml").write_text(yaml.safe_dump(raw))
    out = tmp_path / "run"
    driver = subprocess.Popen(
        [sys.executable, "-m", "ssmcraft.cli", "search", "search.yaml", "--out", str(out), "--address",
         cluster.address, "--no-objective-check", "--no-plots", "--trial-function", "ssmcraft.search.testing:sleepy"],
        cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        victim = None
        while victim is None:  # a trial running on the worker node
            assert driver.poll() is None, driver.stdout.read()
            assert time.monotonic() < deadline, "no trial ran on the worker node"
            on_worker = cluster.processes("worker")
            victim = next((n for n, pids in attempt_pids(out).items() if pids[-1] in on_worker), None)
            time.sleep(0.1)
        os.kill(cluster.raylet("worker"), signal.SIGKILL)
        stdout, _ = driver.communicate(timeout=75)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    assert driver.returncode == 0, stdout
    assert f"connected to the Ray cluster at {cluster.address}" in stdout
    assert "4 complete, 0 pruned, 0 failed" in stdout, stdout

    trials = {t.number: t for t in open_study(out).trials}
    assert len(trials) == 4 and all(t.state == TrialState.COMPLETE for t in trials.values())
    lost = trials[victim]
    assert lost.user_attrs["attempts"] == 2, lost.user_attrs
    assert "retried" in lost.user_attrs["reason"], lost.user_attrs
    first, retry = attempt_pids(out)[victim]
    assert first in on_worker and retry not in on_worker  # the retry ran on the surviving head
    info = json.loads((out / "trials" / f"{victim:04d}" / "trial.json").read_text())
    assert info["outcome"]["attempts"] == 2
