"""The Ray executor, on one local Ray instance shared by the module (started through the
executor's own ``connect``): killed workers retried, hard timeouts, the same records and
leaderboard schema as in-process, pruning through the report broker, loopback only."""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from optuna.trial import TrialState

from ssmcraft.errors import SsmcraftError
from ssmcraft.search import InlineExecutor, load_search_spec, run_search
from ssmcraft.search.executor_ray import RayExecutor, connect, run_on_worker
from ssmcraft.search.reports import columns
from ssmcraft.search.testing import Scripted, curve, quadratic, tiny_spec
from tests.test_search_fidelity import fidelity_spec

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
              pytest.mark.xdist_group("ray")]   # conftest: one Ray instance on the machine at a time


@pytest.fixture(scope="module")
def ray():
    """One local Ray instance for the module, started as the search starts it (Ray is
    imported only here: ``connect`` must set its environment first)."""
    assert connect("local", num_cpus=2, log=lambda line: None)
    import ray

    yield ray
    ray.shutdown()


def search(out, trial_fn=quadratic, executor=None, **overrides):
    spec = load_search_spec(tiny_spec(**overrides))
    return run_search(spec, out, executor=executor or RayExecutor(), trial_fn=trial_fn, compile_fn=None,
                      plots=False, log=lambda line: None)


def budget(**changes):
    return {**tiny_spec()["budget"], **changes}


def by_number(study):
    return {t.number: t for t in study.get_trials(deepcopy=False)}


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def _listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets the processes listen on, from /proc."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]  # per-word little endian
                ip = b"".join(words)
                text = ".".join(map(str, ip)) if width == 8 else (
                    ".".join(map(str, ip[12:])) if ip[:12] == b"\0" * 10 + b"\xff\xff" else ip.hex())
                out.append((text, int(port, 16)))
    return out


def test_ray_listens_on_loopback_only(ray):
    sockets = _listening(_descendants(os.getpid()) | {os.getpid()})
    assert len(sockets) >= 2, sockets  # the GCS and the raylet at least
    loopback = {"127.0.0.1", "00000000000000000000000000000001"}
    assert all(ip in loopback for ip, _ in sockets), sockets
    assert 8265 not in {port for _, port in sockets}  # no dashboard
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


def test_a_killed_worker_is_retried_a_bounded_number_of_times(ray, tmp_path):
    result = search(tmp_path / "run", Scripted({0: "exit_once", 1: "exit"}),
                    budget=budget(trials=3, timeout_grace=30), resources={"max_retries": 1})
    trials = by_number(result.study)
    assert trials[0].state == TrialState.COMPLETE and trials[0].user_attrs["attempts"] == 2
    assert trials[1].state == TrialState.FAIL
    assert trials[1].user_attrs["reason"].startswith("worker died (2 attempts): WorkerCrashedError")
    assert trials[2].state == TrialState.COMPLETE


def test_a_trial_past_its_hard_limit_is_killed(ray, tmp_path):
    start = time.monotonic()
    result = search(tmp_path / "run", Scripted({0: "sleep"}, sleep_s=120),
                    budget=budget(trials=3, seconds_per_trial=1, timeout_grace=1))
    assert time.monotonic() - start < 60
    trials = by_number(result.study)
    assert trials[0].state == TrialState.FAIL
    assert trials[0].user_attrs["reason"] == "timeout: no result within 2 s (hard limit); its worker was killed"
    assert trials[1].state == trials[2].state == TrialState.COMPLETE


def test_ray_records_failures_and_the_leaderboard_like_inline(ray, tmp_path):
    fn = Scripted({1: "raise", 2: "nan", 3: "oom", 4: "diverged"})
    runs = {name: search(tmp_path / name, fn, executor=executor, budget=budget(trials=6))
            for name, executor in (("ray", RayExecutor()), ("inline", InlineExecutor()))}
    reasons = {name: {t.number: t.user_attrs["reason"] for t in r.study.trials} for name, r in runs.items()}
    assert reasons["ray"] == reasons["inline"]
    assert reasons["ray"][3].startswith("out of memory")
    assert columns(runs["ray"].study) == columns(runs["inline"].study)
    header = {name: (tmp_path / name / "leaderboard.csv").read_text().splitlines()[0] for name in runs}
    assert header["ray"] == header["inline"]
    assert runs["ray"].executor.startswith("ray (2 CPUs, 0 GPUs; 2 trials at a time")
    host = runs["ray"].study.trials[0].user_attrs["host"]
    assert host["pid"] != os.getpid() and "node_id" in host


def test_reports_sent_without_waiting_all_reach_the_study(ray, tmp_path):
    # one metric and no pruner: trials do not wait for answers (answers_matter is False), and
    # quadratic returns right after its 4th report (loss * (1 + 1/i), i = 1..4); every report
    # still reaches Optuna
    result = search(tmp_path / "run", quadratic, budget=budget(trials=4))
    trials = result.study.trials
    assert len(trials) == 4
    for t in trials:
        assert t.state == TrialState.COMPLETE and len(t.intermediate_values) == 4, (t.number, t.intermediate_values)
        last = t.intermediate_values[max(t.intermediate_values)]
        assert last == pytest.approx(1.25 * t.value), (t.number, last, t.value)


def test_a_trial_not_awaiting_answers_returns_once_its_last_report_is_in(monkeypatch, tmp_path):
    # locally the broker always has the last report before the driver drains it, so the test
    # above passes without that wait; here a fake broker and ray.get show that it happens
    calls, awaited = [], []

    class Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *args):
            calls.append(self.name)
            return len(calls)   # the ref: the call's number

    def get(ref):
        assert calls[ref - 1] == "resend", calls
        awaited.append(ref)

    def trial(config, out_dir, report):
        assert not any(report(step, {"loss": 1.0}) for step in (1, 2, 3))
        return {"loss": 1.0}

    broker = SimpleNamespace(**{name: Method(name) for name in ("started", "report", "poll", "resend")})
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(
        get=get, get_gpu_ids=lambda: [], get_runtime_context=lambda: SimpleNamespace(get_node_id=lambda: "node")))
    outcome = run_on_worker(trial, {}, str(tmp_path), 0, broker, wants_gpu=False, await_answers=False)
    assert outcome.metrics == {"loss": 1.0}
    assert calls == ["started", "report", "report", "report", "resend"]
    assert awaited == [len(calls)]  # the reports sent again, and no answer asked for


@pytest.mark.parametrize("pruner", [{"name": "median", "n_startup_trials": 5}, {"name": "none"}],
                         ids=["awaiting_answers", "not_awaiting"])
def test_a_killed_report_broker_restarts_and_no_report_is_lost(ray, tmp_path, pruner):
    """Trial 1 SIGKILLs the broker's worker after its first report: Ray restarts the broker, the
    search goes on, and every report of every trial reaches the study (those the dead broker
    held are sent again)."""
    pid_file = tmp_path / "broker.pid"
    logs = []

    def log(line):
        logs.append(line)
        if line.startswith("search: study"):      # the executor has started its broker
            pid_file.write_text(str(ray.get(executor._broker.__ray_call__.remote(lambda self: os.getpid()))))

    executor = RayExecutor(log=log)
    fn = Scripted({1: "kill_pid"}, sleep_s=0.3, steps=6, pid_file=str(pid_file))
    result = run_search(load_search_spec(tiny_spec(budget=budget(trials=3), resources={"cpus_per_trial": 2},
                                                   pruner=pruner)),
                        tmp_path / "run", executor=executor, trial_fn=fn, compile_fn=None, plots=False, log=log)
    trials = by_number(result.study)
    assert [trials[n].state for n in range(3)] == [TrialState.COMPLETE] * 3
    assert sorted(trials[1].intermediate_values) == [i * 1000 for i in range(1, 7)]
    assert all(len(trials[n].intermediate_values) == 4 for n in (0, 2))
    assert any("report broker restarted" in line for line in logs), logs


def test_the_time_a_restarting_broker_takes_does_not_count_against_running_trials(monkeypatch, tmp_path):
    """A broker restart takes seconds, tens on a loaded machine, and a running trial may wait for
    it all along (its last resend, an answer): a fake Ray and clock show that the hard limit (7 s)
    pauses for that time, and still kills a trial that goes on past it."""
    import ray.exceptions as rex

    import ssmcraft.search.executor_ray as executor_ray

    clock = SimpleNamespace(t=0.0)
    drains = iter([(0.0, "old", [1, 2]),    # (seconds the drain takes, incarnation, trials started)
                   (0.0, "old", []),
                   (20.0, "new", []),       # the broker died meanwhile: 20 s until it is back
                   (0.0, "new", []), (0.0, "new", []), (0.0, "new", []), (0.0, "new", [])])
    finished, cancelled = set(), []

    def get(ref):
        if ref == "drain":
            seconds, incarnation, started = next(drains)
            clock.t += seconds
            return incarnation, started, []
        return executor_ray.Outcome(metrics={"loss": 1.0})

    broker = SimpleNamespace(drain=SimpleNamespace(remote=lambda: "drain"))
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(
        wait=lambda refs, num_returns, timeout: ([r for r in refs if r in finished], []), get=get,
        cancel=lambda ref, force: cancelled.append(ref), exceptions=rex))
    monkeypatch.setattr(executor_ray, "time", SimpleNamespace(monotonic=lambda: clock.t))
    logs = []
    executor = RayExecutor(log=logs.append)
    executor._broker = broker
    for n in (1, 2):
        job = SimpleNamespace(number=n, out_dir=tmp_path / str(n), time_limit_s=7.0, on_report=None)
        executor._running[f"task{n}"] = job

    def wait_at(t):
        clock.t = t
        return [(job.number, outcome.error) for job, outcome in executor.wait(0.2)]

    assert wait_at(1.0) == []       # both started at 1
    assert wait_at(5.8) == []       # the broker last answered at 5.8
    assert wait_at(6.0) == []       # seen running at 6; the drain returns at 26, the broker restarted
    assert logs == ["search: the report broker restarted (its worker died); running trials send their "
                    "reports again"]
    assert wait_at(27.0) == []      # 5.8 s of their own (1-5.8, 26-27): within the limit
    finished.add("task1")
    assert wait_at(28.0) == [(1, None)]
    assert wait_at(28.1) == []      # trial 2: 6.9 s of its own
    assert wait_at(28.3) == [(2, "timeout: no result within 7 s (hard limit); its worker was killed")]
    assert cancelled == ["task2"]


def test_pruning_decisions_reach_running_ray_trials(ray, tmp_path):
    fn = Scripted({2: "bad_curve"}, sleep_s=0.2, steps=40)
    result = search(tmp_path / "run", fn, budget=budget(trials=3), resources={"cpus_per_trial": 2},
                    pruner={"name": "median", "n_startup_trials": 2})
    trials = by_number(result.study)
    assert result.executor.startswith("ray (2 CPUs, 0 GPUs; 1 trials at a time")
    assert trials[2].state == TrialState.PRUNED
    assert trials[2].intermediate_values == {1000: 100.0}  # stopped at its first report: none late
    assert len(trials[0].intermediate_values) == 4


def test_ray_trials_stop_at_their_rung_as_inline_ones_do(ray, tmp_path):
    raw = fidelity_spec(budget={"trials": 8, "tokens_per_trial": 864, "seconds_per_trial": 30},
                        resources={"cpus_per_trial": 2})  # one at a time: the same order as inline
    runs = {name: run_search(load_search_spec(raw), tmp_path / name, executor=executor, trial_fn=curve,
                             compile_fn=None, plots=False, log=lambda line: None)
            for name, executor in (("ray", RayExecutor()), ("inline", InlineExecutor()))}
    ray_trials, inline_trials = (r.study.get_trials(deepcopy=False) for r in runs.values())
    assert [t.user_attrs["rungs"] for t in ray_trials] == [t.user_attrs["rungs"] for t in inline_trials]
    assert [t.state for t in ray_trials] == [t.state for t in inline_trials]
    for t in ray_trials:  # a stopped trial trained no token past its rung
        if t.state == TrialState.PRUNED:
            assert t.user_attrs["metrics"]["tokens"] == t.user_attrs["rungs"][-1]["tokens"]
    assert TrialState.PRUNED in {t.state for t in ray_trials}


def test_asking_for_a_gpu_the_cluster_lacks_is_an_error(ray, tmp_path):
    with pytest.raises(SsmcraftError, match="gpus_per_trial is 1 but the Ray cluster has no GPU"):
        search(tmp_path / "run", resources={"gpus_per_trial": 1})


def test_a_failed_memory_probe_records_the_workers_error(monkeypatch):
    """A probe task that raised on its worker reaches the packer as the worker's error, not as Ray's
    first line (which names only the task and its pid)."""
    import ray.exceptions as rex

    failed = rex.RayTaskError("probe_memory", "Traceback ...", ValueError("boom: no GPU memory measured"),
                              proctitle="ray::probe_memory()", pid=7)

    def get(ref, timeout=None):
        raise failed
    fake_ray = SimpleNamespace(remote=lambda **kw: (lambda fn: SimpleNamespace(remote=lambda config: "ref")),
                               get=get, cancel=lambda *a, **k: None, exceptions=rex)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    executor = RayExecutor.__new__(RayExecutor)
    executor._probe_cpus = 1.0
    with pytest.raises(RuntimeError) as info:
        executor._probe({})
    assert str(info.value) == "error: on the worker: ValueError: boom: no GPU memory measured"
    # (how the packer records a probe's RuntimeError: test_search_packing's test_a_failed_probe_packs_nothing_and_says_so)
