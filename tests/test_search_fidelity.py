"""Multi-fidelity search (``fidelity:``): asynchronous successive halving and Hyperband
brackets decided by the coordinator on a multi-objective study (where Optuna forbids
pruners), the rule checked against an independent replay of the records, determinism,
and a killed driver resuming with no rung decision lost or repeated."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess

import pytest
from optuna.trial import TrialState

from ssmcraft.errors import SpecError
from ssmcraft.search import InlineExecutor, load_search_spec, run_search
from ssmcraft.search.fidelity import Fidelity, decide, plan
from ssmcraft.search.rundir import open_study
from ssmcraft.search.testing import curve, tiny_spec
from tests.test_search_subprocess import ENV, REPO, kill_driver_when

# 32 tokens a step (batch 1 x seq_len 32); min_tokens 96 (3 steps): rungs at 96 and 288
# tokens; the full budget 864 tokens (27 steps)
FIDELITY = {"kind": "successive_halving", "min_tokens": 96, "eta": 3}


def fidelity_spec(**overrides) -> dict:
    return tiny_spec(**{
        "train": {"batch_size": 1},
        "budget": {"trials": 12, "tokens_per_trial": 864, "seconds_per_trial": 30},
        "rank": {"val_loss": "minimize", "tokens_per_s": "maximize"},
        "sampler": {"name": "random"},
        "fidelity": FIDELITY, **overrides})


def search(out, raw=None, trial_fn=curve):
    return run_search(load_search_spec(raw or fidelity_spec()), out, executor=InlineExecutor(),
                      trial_fn=trial_fn, compile_fn=None, plots=False, log=lambda line: None)


def replay(trials, eta: int) -> dict[int, list[bool]]:
    """The ASHA rule applied afresh to the recorded rung values, in the order they were
    decided (trial order; a replayed record is its candidate's earlier decision, not a new
    one): candidate -> go on? at each rung it reached. Asserts that no candidate has two
    values at one rung."""
    seen: dict[tuple[int, int], dict[int, float]] = {}
    verdicts: dict[int, list[bool]] = {}
    for t in sorted(trials, key=lambda t: t.number):
        c = t.user_attrs["candidate"]
        for r in t.user_attrs.get("rungs", []):
            if r.get("replayed"):
                continue
            table = seen.setdefault((t.user_attrs["fidelity"]["bracket"], r["rung"]), {})
            assert c not in table, f"rung {r['rung']} decided twice for candidate {c}"
            table[c] = r["value"]
            ranked = sorted(table, key=lambda x: (table[x], x))
            verdicts.setdefault(c, []).append(ranked.index(c) < max(1, len(table) // eta))
    return verdicts


def test_the_rule_and_the_schedule():
    f = Fidelity("successive_halving", 100, 3, "val_loss", "minimize")
    assert f.rung_tokens(2700) == [100, 300, 900] and f.rung_tokens(901) == [100, 300, 900]
    first = decide(f, 0, 100, 7, 2.0, {})
    assert first.go_on and (first.place, first.of) == (1, 1)  # alone at a rung: goes on
    d = decide(f, 1, 300, 9, 2.31, {c: 1.0 + c / 10 for c in range(8)})  # 9 values, keep 3
    assert not d.go_on and (d.place, d.of) == (9, 9)
    assert d.reason == "rung 1 (300 tokens): val_loss 2.31 not in the top 1/3 of 9 (place 9; cutoff 1.2)"
    assert decide(f, 1, 300, 9, 1.1, {c: 1.0 + c / 10 for c in range(8)}).go_on  # ties: the older first
    assert not decide(f, 1, 300, 9, 1.2, {c: 1.0 + c / 10 for c in range(8)}).go_on
    assert not decide(f, 0, 100, 1, math.nan, {}).go_on
    up = Fidelity("successive_halving", 100, 3, "accuracy", "maximize")
    assert decide(up, 0, 100, 3, 0.9, {0: 0.1, 1: 0.2}).go_on
    hb = Fidelity("hyperband", 100, 3, "val_loss", "minimize")
    assert hb.brackets(2700) == [27, 12, 6, 4]  # Hyperband's n_s for R = 3 rungs
    assert [sum(hb.bracket_of(i, 2700) == b for i in range(49)) for b in range(4)] == [27, 12, 6, 4]
    assert len({hb.bracket_of(i, 2700) for i in range(4)}) > 1  # interleaved, not in blocks

    config = {"task": {"name": "mqar", "seq_len": 32}, "train": {"batch_size": 2, "tokens": 2700}}
    p = plan(f, config, 0)  # 64 tokens a step, 42 steps: rungs at 100 -> 2 steps, 6, 18
    assert config["train"]["eval_every"] == 2 and p.tokens == (128, 384, 1152)
    short = {"task": {"name": "mqar", "seq_len": 32}, "train": {"batch_size": 2, "tokens": 1100}}
    assert plan(f, short, 0).tokens == (128, 384)  # 17 steps: the 18-step rung is past the end
    assert plan(hb, dict(config, train={"tokens": 2700}), 3).bracket == hb.bracket_of(3, 2700)


@pytest.mark.parametrize("change, key, message", [
    ({"pruner": {"name": "median"}, "rank": {"val_loss": "minimize"}}, "fidelity", "keep one"),
    ({"train": {"eval_every": 5}}, "train.eval_every", "set by the search from fidelity.min_tokens"),
    ({"fidelity": {**FIDELITY, "min_tokens": 864}}, "fidelity.min_tokens", "leaves no rung"),
    ({"fidelity": {**FIDELITY, "kind": "bohb"}}, "fidelity.kind", "expected successive_halving or hyperband, got 'bohb'"),
    ({"fidelity": {**FIDELITY, "eta": 1}}, "fidelity.eta", "must be >= 2"),
    ({"fidelity": {**FIDELITY, "direction": "maximize"}}, "fidelity.direction", "rank says val_loss: minimize"),
    ({"fidelity": {"kind": "hyperband"}}, "fidelity.min_tokens", "missing"),
])
def test_bad_fidelity_blocks_are_one_line_errors(change, key, message):
    with pytest.raises(SpecError) as e:
        load_search_spec(fidelity_spec(**change), source="s.yaml")
    assert f"s.yaml: {key}:" in str(e.value) and message in str(e.value)


def test_successive_halving_on_a_multi_objective_study(tmp_path):
    result = search(tmp_path / "a")
    trials = result.study.get_trials(deepcopy=False)
    assert len(trials) == 12
    verdicts = replay(trials, 3)
    for t in trials:
        rungs = t.user_attrs["rungs"]
        assert [r["go_on"] for r in rungs] == verdicts[t.number]
        assert [r["tokens"] for r in rungs] == [96, 288][:len(rungs)]
        if t.state == TrialState.COMPLETE:  # reached the full budget through every rung
            assert len(rungs) == 2 and all(r["go_on"] for r in rungs)
        else:  # stopped at its rung, with the reason, after no token past it
            assert t.state == TrialState.PRUNED and not rungs[-1]["go_on"]
            assert t.user_attrs["reason"] == f"stopped at {rungs[-1]['reason']}"
            assert t.user_attrs["metrics"]["tokens"] == rungs[-1]["tokens"]
    states = [t.state for t in trials]
    assert 0 < states.count(TrialState.COMPLETE) < states.count(TrialState.PRUNED)
    assert all(t.state == TrialState.COMPLETE for t in result.study.best_trials)
    assert result.counts == {"complete": states.count(TrialState.COMPLETE),
                             "pruned": states.count(TrialState.PRUNED), "failed": 0}
    again = search(tmp_path / "b").study.get_trials(deepcopy=False)  # deterministic
    assert [(t.state, t.user_attrs["rungs"]) for t in again] == [(t.state, t.user_attrs["rungs"]) for t in trials]


def test_a_report_without_tokens_fails_its_trial_and_the_search_goes_on(tmp_path):
    """Rungs are measured in tokens: a report that has none is the trial function's bug, not a
    token count read from the step; the trial fails with the reason, the others run on."""
    def no_tokens_in_odd_trials(config, out_dir, report):
        if config["seed"] % 2:
            return curve(config, out_dir, lambda step, metrics: report(step, {k: v for k, v in metrics.items()
                                                                              if k != "tokens"}))
        return curve(config, out_dir, report)

    result = search(tmp_path, fidelity_spec(budget={"trials": 6, "tokens_per_trial": 864, "seconds_per_trial": 30}),
                    trial_fn=no_tokens_in_odd_trials)
    trials = result.study.get_trials(deepcopy=False)
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(trials) == 6 and failed and len(failed) < 6
    for t in failed:
        assert t.user_attrs["reason"].startswith("error: its report at step 3 has no number 'tokens' (it sent val_loss)")
        assert "fidelity rungs are measured in tokens" in t.user_attrs["reason"] and "rungs" not in t.user_attrs
    assert all(t.user_attrs["rungs"] for t in trials if t.state != TrialState.FAIL)


def test_hyperband_brackets(tmp_path):
    raw = fidelity_spec(fidelity={**FIDELITY, "kind": "hyperband"}, budget={
        "trials": 14, "tokens_per_trial": 864, "seconds_per_trial": 30})
    trials = search(tmp_path, raw).study.get_trials(deepcopy=False)
    f = load_search_spec(raw).fidelity
    for t in trials:
        bracket = t.user_attrs["fidelity"]["bracket"]
        assert bracket == f.bracket_of(t.number, 864)
        assert [r["rung"] for r in t.user_attrs.get("rungs", [])][:1] == ([bracket] if bracket < 2 else [])
        if bracket == 2:  # no rung: straight to the full budget
            assert t.state == TrialState.COMPLETE and t.user_attrs["fidelity"]["eval_every"] is None
        else:  # validations on the bracket's first rung (3 steps, 9 steps) and its multiples
            assert t.user_attrs["fidelity"]["eval_every"] == 3 * 3 ** bracket
    assert {t.user_attrs["fidelity"]["bracket"] for t in trials} == {0, 1, 2}
    verdicts = replay(trials, 3)
    assert all([r["go_on"] for r in t.user_attrs.get("rungs", [])] == verdicts.get(t.number, []) for t in trials)


def test_a_killed_driver_resumes_with_no_rung_decision_lost_or_repeated(tmp_path):
    raw = fidelity_spec(train={"batch_size": 1, "sleep_s": 1.5})

    def ready(trials):  # a running trial has passed a rung and goes on, after one finished
        rungs = trials[-1].user_attrs.get("rungs") if trials else None
        return len(trials) >= 2 and trials[-1].state == TrialState.RUNNING and rungs and rungs[-1]["go_on"]

    command, out, trials = kill_driver_when(tmp_path, raw, "ssmcraft.search.testing:curve", ready, timeout=90)
    killed = trials[-1]
    done = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

    trials = open_study(out).trials
    stale = trials[killed.number]
    assert stale.state == TrialState.FAIL and stale.user_attrs["stale"]
    (rerun,) = [t for t in trials if t.user_attrs.get("requeue_of") == killed.number]
    assert rerun.user_attrs["candidate"] == killed.number
    before = stale.user_attrs["rungs"]
    assert before and len(before) >= len(killed.user_attrs["rungs"])
    assert rerun.user_attrs["rungs"][:len(before)] == [{**r, "replayed": True} for r in before]
    # every decision the ASHA rule's, each rung decided once per candidate (the re-run's
    # first rungs replayed, not re-counted), every candidate finished once
    counted = [t for t in trials if not t.user_attrs.get("stale")]
    assert len(counted) == 12 and len({t.user_attrs["candidate"] for t in counted}) == 12
    verdicts = replay(trials, 3)
    for t in counted:
        assert [r["go_on"] for r in t.user_attrs["rungs"]] == verdicts[t.user_attrs["candidate"]]
        assert t.state == (TrialState.COMPLETE if all(verdicts[t.user_attrs["candidate"]]) else TrialState.PRUNED)


def test_the_fidelity_comparison_at_tiny_scale(tmp_path, capsys):
    """benchmarks/search_fidelity.py on the composed-search study's smoke space, real
    training, a few seconds per arm."""
    loader = importlib.util.spec_from_file_location("search_fidelity", REPO / "benchmarks" / "search_fidelity.py")
    script = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(script)
    assert script.main(["--scale", "smoke", "--seconds", "3", "--trials", "5", "--min-tokens", "128",
                        "--executor", "inline", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "compare.json").read_text())
    full, multi = result["rows"]
    assert (full["arm"], multi["arm"]) == ("full_budget", "fidelity")
    assert full["stopped_at_a_rung"] == 0 and full["candidates"] == full["full_budget"] >= 1
    assert multi["candidates"] == multi["full_budget"] + multi["stopped_at_a_rung"] + multi["failed"] >= 1
    for row in (full, multi):
        assert row["candidates_per_gpu_hour"] == pytest.approx(row["candidates"] / (row["wall_s"] / 3600), rel=0.05)  # wall_s: to the ms
    assert result["ratio"] == pytest.approx(multi["candidates_per_gpu_hour"] / full["candidates_per_gpu_hour"])
    study = open_study(tmp_path / "fidelity")
    assert study.user_attrs["spec"]["fidelity"] == {"kind": "successive_halving", "min_tokens": 128, "eta": 3}
    for t in study.trials:  # real training reports on every rung (train.eval_every set by the search)
        assert t.user_attrs["rungs"][0]["tokens"] == 128
        if t.state == TrialState.PRUNED:
            assert t.user_attrs["reason"].startswith("stopped at rung")
            assert t.user_attrs["metrics"]["tokens"] == t.user_attrs["rungs"][-1]["tokens"]
    assert "candidates per GPU-hour, successive_halving / full budget: " in capsys.readouterr().out


def test_trials_wait_for_answers_only_when_one_can_stop_them():
    """A Ray trial waits for a report's answer only when it can be "stop": a rung or a pruner."""
    from ssmcraft.search.coordinator import answers_matter
    assert not answers_matter(load_search_spec(tiny_spec()))                 # one metric, no pruner
    assert answers_matter(load_search_spec(tiny_spec(pruner={"name": "median"})))
    assert answers_matter(load_search_spec(fidelity_spec()))                 # rungs, two metrics
    several = load_search_spec(tiny_spec(rank={"val_loss": "minimize", "tokens_per_s": "maximize"}))
    assert not answers_matter(several)
