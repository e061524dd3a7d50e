"""The ``ssmcraft search`` command in a process of its own: killed with SIGKILL mid-trial
and started again with the same command, it resumes (no finished trial lost or repeated,
the trial it was running re-queued); with the Ray executor it starts its own local Ray
instance on loopback."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from optuna.trial import TrialState

from ssmcraft.search.rundir import open_study
from ssmcraft.search.testing import tiny_spec

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def search_command(spec: Path, out: Path, executor: str, trial_function: str) -> list[str]:
    return [sys.executable, "-m", "ssmcraft.cli", "search", str(spec), "--out", str(out),
            "--executor", executor, "--no-objective-check", "--no-plots", "--trial-function", trial_function]


def _trials(out: Path) -> list:
    if not (out / "run.json").exists() or not (out / "journal.log").exists():
        return []
    try:
        return open_study(out).trials
    except Exception:  # the study is being created
        return []


def kill_driver_when(tmp_path: Path, raw: dict, trial_function: str, ready, timeout: float = 120):
    """Start ``ssmcraft search`` (inline) on ``raw`` in a process of its own and SIGKILL it
    once ``ready(trials)`` holds; returns the command (to start it again), the run folder
    and the trials as they were."""
    spec = tmp_path / "search.yaml"
    spec.write_text(yaml.safe_dump(raw))
    out = tmp_path / "run"
    command = search_command(spec, out, "inline", trial_function)
    driver = subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not ready(trials := _trials(out)):
        assert driver.poll() is None, driver.stdout.read().decode()
        assert time.monotonic() < deadline, [t.state for t in trials]
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    return command, out, trials


def test_a_killed_driver_resumes_with_the_same_command(tmp_path):
    raw = tiny_spec(budget={"trials": 6, "tokens_per_trial": 1000, "seconds_per_trial": 30},
                    train={"sleep_s": 0.6}, sampler={"name": "random"})

    def ready(trials):  # a trial runs (handed to the executor), after two have finished
        states = [t.state for t in trials]
        return (states.count(TrialState.COMPLETE) >= 2 and states[-1] == TrialState.RUNNING
                and "trial_dir" in trials[-1].user_attrs)

    command, out, _ = kill_driver_when(tmp_path, raw, "ssmcraft.search.testing:sleepy", ready)
    before = {t.number: t for t in open_study(out).trials}
    finished = {n: t.values for n, t in before.items() if t.state == TrialState.COMPLETE}
    (running,) = [t for t in before.values() if t.state == TrialState.RUNNING]

    again = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"re-queued: [{running.number}]" in again.stdout

    trials = open_study(out).trials
    after = {t.number: t for t in trials}
    for n, values in finished.items():  # kept, not re-run
        assert after[n].state == TrialState.COMPLETE and after[n].values == values
        assert len((out / "trials" / f"{n:04d}" / "attempts.log").read_text().splitlines()) == 1
    stale = after[running.number]
    assert stale.state == TrialState.FAIL and stale.user_attrs["stale"] is True
    (requeued,) = [t for t in trials if t.user_attrs.get("requeue_of") == running.number]
    assert requeued.params == running.params and requeued.state == TrialState.COMPLETE
    assert requeued.user_attrs["seed"] == running.user_attrs["seed"]
    counted = [t for t in trials if not t.user_attrs.get("stale")]
    assert len(counted) == 6 and all(t.state == TrialState.COMPLETE for t in counted)
    assert len(trials) == 7
    # the re-queued trial runs its point again; no other trial repeats one (a sampler seeded as
    # in the first run would replay its sequence: trials 4 and 5 would be trials 0 and 1)
    fresh = [t.params for t in trials if t is not requeued]
    assert all(a != b for i, a in enumerate(fresh) for b in fresh[:i]), fresh
    rows = (out / "leaderboard.csv").read_text().splitlines()
    assert len(rows) == 1 + 7


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
@pytest.mark.xdist_group("ray")
def test_the_ray_executor_starts_its_own_loopback_instance(tmp_path):
    spec = tmp_path / "search.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(budget={"trials": 2, "tokens_per_trial": 1000,
                                                       "seconds_per_trial": 60})))
    env = {k: v for k, v in ENV.items() if not k.startswith("RAY_")}
    done = subprocess.run(search_command(spec, tmp_path / "run", "ray", "ssmcraft.search.testing:quadratic"),
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ray: started a local Ray instance at 127.0.0.1:" in done.stdout
    assert "2 complete, 0 pruned, 0 failed (executor: ray (" in done.stdout
