"""The coordinator with the in-process executor and fake trials: failures recorded with
their reason, reproducibility (and no point sampled twice across resumes), pruning, the
journal checked on resume (torn, damaged, truncated or lost), stale trials, reports, and the
CLI. (Ray: test_search_ray.py; a killed driver: test_search_subprocess.py; trial ownership
and leases: test_search_resume.py; fuzzing: test_search_fuzz.py.)"""
from __future__ import annotations

import copy
import csv
import os
import sys
import time
import types

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from ssmcraft import cli
from ssmcraft.errors import DerivationError, SpecError, SsmcraftError
from ssmcraft.search import InlineExecutor, compose_objective, find_trial, load_search_spec, load_trial, run_search
from ssmcraft.search.coordinator import recover_stale
from ssmcraft.search.reports import pareto_fronts
from ssmcraft.search.rundir import open_study
from ssmcraft.search.space import suggest
from ssmcraft.search.storage import RunLock, open_storage
from ssmcraft.search.testing import Scripted, quadratic, search_tiny, tiny_spec


search = search_tiny


def by_number(study):
    return {t.number: t for t in study.get_trials(deepcopy=False)}


def budget(**changes):
    return {**tiny_spec()["budget"], **changes}


def test_failures_are_recorded_with_their_reason_and_the_search_goes_on(tmp_path):
    fn = Scripted({1: "raise", 2: "nan", 3: "oom", 4: "sleep", 5: "diverged", 7: "time_limit"}, sleep_s=30)
    start = time.monotonic()
    result = search(tmp_path / "run", fn, budget=budget(trials=8, seconds_per_trial=0.5, timeout_grace=0.5))
    assert time.monotonic() - start < 15  # the sleeping trial was stopped at its limit
    trials = by_number(result.study)
    expected = {
        0: (TrialState.COMPLETE, None),
        1: (TrialState.FAIL, "error: ValueError: scripted failure"),
        2: (TrialState.FAIL, "diverged: val_loss is nan"),
        3: (TrialState.FAIL, "out of memory: MemoryError: scripted: CUDA out of memory"),
        4: (TrialState.FAIL, "timeout: no result within 1 s (hard limit)"),
        5: (TrialState.FAIL, "diverged: loss became inf at step 3"),
        6: (TrialState.COMPLETE, None),
        7: (TrialState.COMPLETE, "timeout: stopped after 7 tokens (train.max_seconds)"),
    }
    for n, (state, reason) in expected.items():
        assert trials[n].state == state, (n, trials[n].user_attrs.get("reason"))
        if reason is None:
            assert trials[n].user_attrs["reason"] is None
        else:
            assert trials[n].user_attrs["reason"].startswith(reason)
    assert result.counts == {"complete": 3, "pruned": 0, "failed": 5}
    assert "ValueError: scripted failure" in (tmp_path / "run/trials/0001/error.txt").read_text()
    with open(tmp_path / "run/leaderboard.csv") as f:
        rows = list(csv.DictReader(f))
    ranked = [float(r["metric.val_loss"]) for r in rows if r["rank"]]
    assert len(ranked) == 3 and ranked == sorted(ranked)
    assert {r["trial"]: r["reason"] for r in rows}["3"].startswith("out of memory")
    assert [r["status"] for r in rows][3:] == ["failed"] * 5 and len(rows) == 8


def test_a_trial_whose_objective_does_not_derive_fails_with_the_compilers_message(tmp_path):
    def fn(config, out_dir, report):
        raise DerivationError("<dict>", "objective", "not quadratic in S; use update: explicit")

    result = search(tmp_path / "run", fn, budget=budget(trials=1))
    (trial,) = result.study.trials
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["reason"] == ("objective does not derive: <dict>: objective: "
                                          "not quadratic in S; use update: explicit")


def test_an_underivable_composition_fails_its_trials_and_the_search_goes_on(tmp_path):
    """The compose space multiplies terms: a variant the compiler refuses is listed before the
    search, and each trial that draws it fails with the compiler's reason; the others run."""
    from ssmcraft.search.space import objective_of

    def compile_fn(objective):
        if objective["inputs"]["beta"]["shape"] == []:
            raise SpecError("<dict>", "inputs.beta", "scalar step not supported")

    def trial_fn(config, out_dir, report):
        compile_fn(objective_of(config))
        return quadratic(config, out_dir, report)

    logs: list = []
    result = search(tmp_path / "run", trial_fn, compile_fn=compile_fn, logs=logs, budget=budget(trials=6))
    assert any("2 of 4 variants of the space derive" in line for line in logs)
    trials = result.study.trials
    scalar = [t for t in trials if t.params["composed.step"] == "scalar"]
    assert len(trials) == 6 and scalar and len(scalar) < 6
    for t in trials:
        if t in scalar:
            assert t.state == TrialState.FAIL
            assert t.user_attrs["reason"] == "objective invalid: <dict>: inputs.beta: scalar step not supported"
        else:
            assert t.state == TrialState.COMPLETE


def test_a_rejected_library_objective_is_reported_before_any_trial(tmp_path):
    def compile_fn(objective):
        if objective["name"] == "mamba":
            raise SpecError("<dict>", "objective", "mamba refused")

    choice = tiny_spec()["space"]["objective"]["choice"] + ["mamba"]
    space = {**tiny_spec()["space"], "objective": {"choice": choice}}
    with pytest.raises(SpecError, match="mamba refused"):
        search(tmp_path / "run", compile_fn=compile_fn, space=space)
    assert not (tmp_path / "run" / "journal.log").exists()
    result = search(tmp_path / "ok", compile_fn=lambda objective: None, budget=budget(trials=1))
    assert result.counts["complete"] == 1


def test_a_fixed_seed_reproduces_the_parameter_sequence(tmp_path):
    def params(name, seed):
        result = search(tmp_path / name, seed=seed, budget=budget(trials=6))
        return [t.params for t in result.study.trials]

    first = params("a", 3)
    assert params("b", 3) == first
    assert params("c", 4) != first
    assert len({str(p) for p in first}) == 6


@pytest.mark.parametrize("sampler", [{"name": "random"}, {"name": "tpe", "n_startup_trials": 10}, {"name": "nsga2"}],
                         ids=["random", "tpe", "nsga2"])
def test_a_resumed_search_never_samples_a_point_again(tmp_path, sampler):
    """Stopped after 3 trials and resumed twice: no trial repeats an earlier one's point (the
    sampler, seeded again, would replay its sequence); resuming from the same state samples
    the same points (the reseed is a function of the study, not of the clock)."""
    def resumed(out):
        search(out, sampler=sampler, budget=budget(trials=3))
        search(out, sampler=sampler, budget=budget(trials=6))
        logs: list[str] = []
        result = search(out, sampler=sampler, budget=budget(trials=9), logs=logs)
        assert any("sampler reseeded" in line and "the 6 trials in the study" in line for line in logs)
        return [t.params for t in result.study.trials]

    params = resumed(tmp_path / "a")
    assert len(params) == 9
    for n in range(3, 9):
        assert all(params[n] != params[earlier] for earlier in range(n)), (n, params)
    if sampler["name"] == "random":
        assert resumed(tmp_path / "b") == params


def test_pruning_stops_a_bad_trial(tmp_path):
    fn = Scripted({3: "bad_curve"}, sleep_s=0, steps=5)
    result = search(tmp_path / "run", fn, budget=budget(trials=5),
                    pruner={"name": "median", "n_startup_trials": 2})
    trials = by_number(result.study)
    assert trials[3].state == TrialState.PRUNED
    assert trials[3].intermediate_values == {1000: 100.0}
    assert trials[3].user_attrs["reason"] == "pruned"
    assert len(trials[0].intermediate_values) == 4  # every trial's reports are recorded


def test_a_pruner_needs_a_trial_function_that_reports(tmp_path):
    def fn(config, out_dir, report):
        return quadratic(config, out_dir, report)

    fn.can_report = lambda: False
    with pytest.raises(SpecError, match="cannot report intermediate values"):
        search(tmp_path / "run", fn, pruner={"name": "median"})


def test_resume_moves_a_torn_journal_record_aside_and_removes_a_stale_lock(tmp_path):
    out = tmp_path / "run"
    first = search(out, budget=budget(trials=3))
    values = {t.number: t.values for t in first.study.trials}
    torn = b'{"op_code": 5, "worker_id": "x", "trial_id": 3, "us'
    with open(out / "journal.log", "ab") as f:
        f.write(torn)                                                       # killed mid-write
    os.symlink(out / "journal.log", out / "journal.log.lock")              # killed holding the lock
    logs: list[str] = []
    start = time.monotonic()
    second = search(out, logs=logs, budget=budget(trials=5))
    assert time.monotonic() - start < 10  # did not wait for Optuna's 30 s lock grace period
    assert any(f"moved a torn last record ({len(torn)} bytes" in line and "journal.log.torn-1" in line for line in logs)
    assert (out / "journal.log.torn-1").read_bytes() == torn               # kept aside, not lost
    assert any("stale journal lock" in line for line in logs)
    trials = second.study.trials
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]
    assert {t.number: t.values for t in trials[:3]} == values
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert (out / "journal.log").read_bytes().endswith(b"\n")


def test_a_last_journal_record_without_its_newline_is_kept(tmp_path):
    out = tmp_path / "run"
    search(out, budget=budget(trials=3))
    journal = out / "journal.log"
    data = journal.read_bytes()
    journal.write_bytes(data[:-1])                 # killed between the record and its newline
    logs: list[str] = []
    result = search(out, logs=logs, budget=budget(trials=4))
    assert any("lacked its newline" in line for line in logs)
    assert journal.read_bytes().startswith(data)   # every record kept, the newline put back
    assert [(t.number, t.state) for t in result.study.trials] == [(n, TrialState.COMPLETE) for n in range(4)]
    for n in range(3):                             # none re-ran
        assert len((out / "trials" / f"{n:04d}" / "attempts.log").read_text().splitlines()) == 1


def _tree(folder):
    return {p.relative_to(folder): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("damage, message", [
    ("garbage", r"journal\.log: line 4 \(byte \d+\) is not a journal record \(not JSON"),
    ("not_a_record", r"line 4 \(byte \d+\) is not a journal record \(JSON, but not a record"),
    ("truncated", r"trials/0002 \(1 folder\(s\) in all\) belongs to no trial of the study, which holds trials 0-1"),
    ("emptied", r"trials/0000 \(3 folder\(s\) in all\) belongs to no trial of the study, which holds no trial"),
    ("deleted", r"trials/0000 \(3 folder\(s\) in all\) belongs to no trial"),
])
def test_a_damaged_or_lost_journal_is_refused_and_nothing_is_changed(tmp_path, capsys, damage, message):
    out = tmp_path / "run"
    search(out, budget=budget(trials=3))
    journal = out / "journal.log"
    lines = journal.read_bytes().splitlines(keepends=True)
    if damage == "garbage":
        lines.insert(3, b"\x00\x00 not a record\n")
    elif damage == "not_a_record":
        lines.insert(3, b'{"trial_id": 1}\n')
    elif damage == "truncated":     # cut just before trial 2 was created
        first = next(i for i, line in enumerate(lines) if b'"op_code":4' in line.replace(b" ", b"")
                     and sum(b'"op_code":4' in x.replace(b" ", b"") for x in lines[:i + 1]) == 3)
        lines = lines[:first]
    journal.write_bytes(b"".join(lines))
    if damage == "emptied":
        journal.write_bytes(b"")
    if damage == "deleted":
        journal.unlink()
    before = _tree(out)
    with pytest.raises(SsmcraftError, match=message) as e:
        search(out, budget=budget(trials=5))
    assert "\n" not in str(e.value) and ("Restore" in str(e.value))
    assert _tree(out) == before                     # nothing written, no trial folder reused
    spec = out.parent / "s.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(budget=budget(trials=5))))
    assert cli.main(["search", str(spec), "--out", str(out), "--executor", "inline", "--no-objective-check",
                     "--trial-function", "ssmcraft.search.testing:quadratic"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Restore" in err
    assert _tree(out) == before


def test_stale_running_trials_are_failed_and_requeued_once(tmp_path):
    out = tmp_path / "run"
    search(out, budget=budget(trials=2))
    # a coordinator that died while trial 2 ran
    storage, _ = open_storage(out, None, writer=True)
    study = optuna.load_study(study_name="tiny", storage=storage)
    dead = study.ask()
    dead.set_user_attr("seed", 1234)
    params = suggest(dead, load_search_spec(tiny_spec()))

    logs: list[str] = []
    result = search(out, logs=logs, budget=budget(trials=3))
    trials = by_number(result.study)
    assert trials[2].state == TrialState.FAIL and trials[2].user_attrs["stale"] is True
    assert trials[2].user_attrs["reason"].startswith("stale:")
    assert trials[3].params == params and trials[3].user_attrs["requeue_of"] == 2
    assert trials[3].user_attrs["seed"] == 1234 and trials[3].state == TrialState.COMPLETE
    assert result.requeued == [2] and len(trials) == 4
    assert result.counts == {"complete": 3, "pruned": 0, "failed": 0}  # the stale one does not count

    # killed between re-queueing and failing: the next start must not re-queue again
    again = study.ask()
    study.enqueue_trial(again.params, user_attrs={"requeue_of": again.number})
    n_before = len(study.trials)
    assert recover_stale(study, storage, own_all=True, log=lambda s: None) == [again.number]
    assert len(study.trials) == n_before
    assert study.trials[again.number].state == TrialState.FAIL


def test_a_different_spec_in_the_same_folder_is_refused(tmp_path):
    search(tmp_path / "run", budget=budget(trials=1))
    with pytest.raises(SsmcraftError, match="different spec"):
        search(tmp_path / "run", model={"d_model": 32, "n_layers": 1})


def test_a_folder_of_another_study_is_refused_and_left_as_it_was(tmp_path):
    search(tmp_path / "run", budget=budget(trials=1))
    before = {f: f.read_bytes() for f in (tmp_path / "run").rglob("*") if f.is_file() and f.suffix != ".lock"}
    logs = []
    with pytest.raises(SsmcraftError, match="holds study 'tiny', and the spec names 'other'; use another --out"):
        search(tmp_path / "run", name="other", budget=budget(trials=1), logs=logs)
    assert logs == []           # refused first: before the objectives are checked or anything is said
    after = {f: f.read_bytes() for f in (tmp_path / "run").rglob("*") if f.is_file() and f.suffix != ".lock"}
    assert after == before
    assert [s.study_name for s in optuna.get_all_study_summaries(open_storage(tmp_path / "run", None, writer=False)[0])] == ["tiny"]


def test_a_ranking_metric_no_trial_returns_stops_the_search_after_one_trial(tmp_path):
    logs = []
    with pytest.raises(SsmcraftError, match="rank.tokens_per_sec: trial 0 trained to its end and returned no such metric"):
        search(tmp_path / "run", logs=logs, rank={"val_loss": "minimize", "tokens_per_sec": "maximize"},
               sampler={"name": "nsga2"}, budget=budget(trials=4))
    trials = open_study(tmp_path / "run").trials
    assert len(trials) == 1 and trials[0].state == TrialState.FAIL
    assert "metric 'tokens_per_sec' missing" in trials[0].user_attrs["reason"]


def test_a_ranking_metric_that_is_not_a_number_stops_the_search_after_a_timed_out_trial(tmp_path):
    def stopped_by_the_clock(config, out_dir, report=None):
        return {"status": "timeout", "val_loss": 1.0, "objective": "longhorn", "tokens": 7}
    with pytest.raises(SsmcraftError, match="rank.objective: trial 0 trained to its end and returned 'longhorn', not a number"):
        search(tmp_path / "run", stopped_by_the_clock, rank={"objective": "minimize"}, budget=budget(trials=3))
    assert len(open_study(tmp_path / "run").trials) == 1


def test_ssmcrafts_own_trials_check_the_experiment_sections_before_anything_is_written(tmp_path):
    from ssmcraft.search.trial import train_trial

    model = {"d_model": 16, "n_layers": 1, "d_modle": 3}
    with pytest.raises(SpecError, match="model.d_modle: unknown key"):
        search(tmp_path / "run", train_trial, model=model)
    assert not (tmp_path / "run").exists()
    search(tmp_path / "own", model=model)          # a trial function of its own may read other keys


def test_a_cpu_allocation_failure_is_out_of_memory():
    from ssmcraft.search.outcome import classify_exception

    e = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                     "you tried to allocate 35184372088832 bytes.")
    assert classify_exception(e).startswith("out of memory: RuntimeError: ")
    assert classify_exception(RuntimeError("shape mismatch")).startswith("error: RuntimeError: ")


def test_an_unreachable_ray_address_is_refused_at_once():
    import socket

    from ssmcraft.search.executor_ray import check_reachable

    with socket.socket() as s:          # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(SsmcraftError, match=f"Ray address {address}: nothing answers there"):
            check_reachable(address, timeout=2)
    assert time.monotonic() - start < 5
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        for address in (f"127.0.0.1:{s.getsockname()[1]}", f"ray://127.0.0.1:{s.getsockname()[1]}"):
            check_reachable(address, timeout=2)                               # something listens: passes
    check_reachable("auto")                                               # left to Ray


def test_one_coordinator_per_folder(tmp_path):
    (tmp_path / "run").mkdir()
    with RunLock(tmp_path / "run"):
        with pytest.raises(SsmcraftError, match=f"another ssmcraft search is running here \\(pid {os.getpid()}\\)"):
            search(tmp_path / "run")


def test_pareto_fronts():
    points = [(1, 5), (2, 2), (5, 1), (3, 3), (4, 4), (2, 2)]
    assert pareto_fronts(points, ["minimize", "minimize"]) == [0, 0, 0, 1, 2, 0]
    assert pareto_fronts(points, ["minimize", "maximize"]) == [0, 1, 2, 1, 1, 1]


def test_multi_metric_study_ranks_by_pareto_front_and_writes_every_plot(tmp_path):
    result = search(tmp_path / "run", plots=True, budget=budget(trials=6),
                    rank={"val_loss": "minimize", "tokens_per_s": "maximize"},
                    sampler={"name": "nsga2", "population_size": 4})
    for name in ("pareto.png", "state_size.png", "importances.png", "leaderboard.csv"):
        assert (tmp_path / "run" / name).stat().st_size > 1000, result.reports
    with open(tmp_path / "run/leaderboard.csv") as f:
        rows = list(csv.DictReader(f))
    front = [(float(r["metric.val_loss"]), float(r["metric.tokens_per_s"])) for r in rows if r["pareto"] == "True"]
    others = [(float(r["metric.val_loss"]), float(r["metric.tokens_per_s"])) for r in rows if r["pareto"] == "False"]
    assert front and [r["rank"] for r in rows] == [str(i) for i in range(1, 7)]
    for v, s in others:  # everything off the front is dominated by a point on it
        assert any(fv <= v and fs >= s and (fv, fs) != (v, s) for fv, fs in front)


def test_single_metric_reports_history_and_importances(tmp_path):
    result = search(tmp_path / "run", plots=True, budget=budget(trials=4))
    assert any(line.endswith("history.png") for line in result.reports)
    assert (tmp_path / "run/importances.png").exists() and (tmp_path / "run/state_size.png").exists()


def test_find_and_load_trial(tmp_path, monkeypatch):
    out = tmp_path / "run"
    result = search(out, Scripted({1: "raise"}), budget=budget(trials=4))
    best = min((t for t in result.study.trials if t.state == TrialState.COMPLETE), key=lambda t: t.values[0])
    assert find_trial(out, "best") == out / "trials" / f"{best.number:04d}"
    assert find_trial(out, 2) == out / "trials" / "0002"
    with pytest.raises(SsmcraftError, match="trial 1 did not complete \\(error: ValueError"):
        find_trial(out, 1)
    with pytest.raises(SsmcraftError, match="no finished trial 9; finished: 0, 1, 2, 3"):
        find_trial(out, "9")
    fake_train = types.ModuleType("ssmcraft.train")  # the real one imports torch: slow here
    fake_train.load_run = lambda path: ("model", path)
    monkeypatch.setitem(sys.modules, "ssmcraft.train", fake_train)
    assert load_trial(out, "best") == ("model", find_trial(out, "best"))


def test_cli_search_resume_and_leaderboard(tmp_path, capsys):
    import yaml

    (tmp_path / "lib").mkdir()  # a relative objectives_dir: --resume must still find it
    (tmp_path / "lib" / "custom.yaml").write_text(yaml.safe_dump(compose_objective({}) | {"name": "custom"}))
    raw = tiny_spec(budget=budget(trials=2), objectives_dir="lib")
    raw["space"]["objective"]["choice"].append("custom")
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(raw))
    out = tmp_path / "run"
    common = ["--out", str(out), "--executor", "inline", "--no-objective-check", "--no-plots",
              "--trial-function", "ssmcraft.search.testing:quadratic"]
    assert cli.main(["search", str(spec), *common]) == 0
    printed = capsys.readouterr().out
    assert "2 complete, 0 pruned, 0 failed (executor: inline" in printed and "journal file" in printed
    assert printed.count("  complete  ") == 2  # the leaderboard table
    assert cli.main(["search", "--resume", "--trials", "3", *common]) == 0
    assert "resuming study 'tiny': 2 of 3 trials finished" in capsys.readouterr().out
    assert len(open_study(out).trials) == 3
    assert cli.main(["leaderboard", str(out), "--top", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["rank", "trial", "status", "objective"] and len(table) == 2


def test_cli_search_check_lists_the_compositions_that_do_not_derive(tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    import yaml

    from ssmcraft.runtime import objective as runtime_objective

    def compile_fn(objective):
        if objective["inputs"]["beta"]["shape"] == []:
            raise DerivationError("<dict>", "objective", "no closed form here")
        return SimpleNamespace(spec=SimpleNamespace(name=objective["name"]))

    monkeypatch.setattr(runtime_objective, "compile", compile_fn)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec()))
    assert cli.main(["search", str(spec), "--out", str(tmp_path / "run"), "--check"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "valid; 2 of 4 variants of the space derive" in printed[0]
    listed = [line for line in printed if line.startswith("  does not derive: ")]
    assert len(listed) == 2 and all("_sstep_" in line and "no closed form here" in line for line in listed)


@pytest.mark.parametrize("argv, message", [
    (["search", "missing.yaml", "--out", "{tmp}/x", "--executor", "inline"], "missing.yaml: search spec not found"),
    (["search", "--resume", "--out", "{tmp}/none", "--executor", "inline"], "holds no search to resume"),
    (["search", "{tmp}/bad.yaml", "--out", "{tmp}/x", "--executor", "inline"], "bad.yaml: budget.trials: must be >= 1"),
    (["leaderboard", "{tmp}"], "not a search folder"),
    (["search", "{tmp}/bad.yaml", "--out", "{tmp}/x", "--trial-function", "nope"], "expected MODULE:NAME"),
    (["search", "{tmp}/bad.yaml", "--out", "{tmp}/x", "--executor", "inline", "--no-objective-check", "--storage", "foo",
      "--trial-function", "ssmcraft.search.testing:quadratic"], "--storage (not a URL): ArgumentError: Could not parse"),
    (["search", "{tmp}/bad.yaml", "--out", "{tmp}/x", "--executor", "inline", "--no-objective-check", "--storage",
      "sqlite:////no/such/dir/x.db", "--trial-function", "ssmcraft.search.testing:quadratic"],
     "--storage sqlite:////no/such/dir/x.db: OperationalError: (sqlite3.OperationalError) unable to open database file"),
    (["search", "{tmp}/bad.yaml", "--out", "{tmp}/bad.yaml", "--executor", "inline", "--no-objective-check",
      "--trial-function", "ssmcraft.search.testing:quadratic"], "bad.yaml: cannot be the run folder (File exists)"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, message):
    import yaml

    raw = copy.deepcopy(tiny_spec())
    raw["budget"]["trials"] = 0
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    if "--trial-function" in argv:
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(tiny_spec()))
    assert cli.main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_an_rdb_storage_holds_the_study_and_run_json_keeps_no_password(tmp_path):
    from ssmcraft.search.rundir import read_run_info
    from ssmcraft.search.storage import mask_url

    url = f"sqlite:///{tmp_path}/study.db"
    spec = load_search_spec(tiny_spec(budget=budget(trials=2)))
    result = run_search(spec, tmp_path / "run", executor=InlineExecutor(), trial_fn=quadratic,
                        storage_url=url, compile_fn=None, plots=False, log=lambda line: None)
    assert result.storage == f"RDB {url}" and not (tmp_path / "run" / "journal.log").exists()
    assert len(open_study(tmp_path / "run").trials) == 2  # found through run.json
    assert read_run_info(tmp_path / "run")["storage"] == {"kind": "rdb", "url": url, "password_hidden": False}
    assert mask_url("postgresql://me:secret@db.example/ssm") == "postgresql://me:***@db.example/ssm"
