"""Resuming a search: a trial left running belongs to the study, not to a host or a path (a
moved folder, a new hostname), coordinators sharing an RDB re-queue only the trials of
those that are gone (leases), and a trial whose folder is deleted while it runs fails
with its reason while the search goes on; a damaged ``run.json`` is refused in one line."""
from __future__ import annotations

import shutil
import time

import optuna
import pytest
from optuna.trial import TrialState

from ssmcraft import cli
from ssmcraft.search import lease, load_search_spec
from ssmcraft.search.space import suggest
from ssmcraft.search.storage import open_storage
from ssmcraft.search.testing import quadratic, search_tiny, tiny_spec

BUDGET = tiny_spec()["budget"]


def _leave_running(study: optuna.Study, owner: str) -> tuple[int, dict]:
    """A trial as a coordinator that died while it ran leaves it: RUNNING, with its owner."""
    trial = study.ask()
    trial.set_user_attr("owner", owner)
    trial.set_user_attr("seed", 77)
    return trial.number, suggest(trial, load_search_spec(tiny_spec()))


def _requeued(study: optuna.Study, number: int) -> list:
    return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("requeue_of") == number]


def test_a_moved_folder_resumed_under_another_hostname_requeues_what_was_running(tmp_path):
    first = tmp_path / "first"
    search_tiny(first, budget={**BUDGET, "trials": 2})
    storage, _ = open_storage(first, None, writer=True)
    number, params = _leave_running(optuna.load_study(study_name="tiny", storage=storage),
                                    "node-a-container-1f3e:/mnt/scratch/run")   # how owners were once written
    moved = tmp_path / "elsewhere" / "run"
    shutil.move(first, moved)
    logs: list[str] = []
    result = search_tiny(moved, logs=logs, budget={**BUDGET, "trials": 3})
    assert result.requeued == [number]
    trials = {t.number: t for t in result.study.trials}
    assert trials[number].state == TrialState.FAIL and trials[number].user_attrs["stale"] is True
    (again,) = _requeued(result.study, number)
    assert again.params == params and again.user_attrs["seed"] == 77 and again.state == TrialState.COMPLETE
    assert result.counts == {"complete": 3, "pruned": 0, "failed": 0}
    assert not any("alive" in line for line in logs)


def _rdb_study(url: str) -> tuple[optuna.Study, object]:
    storage, _ = open_storage(None, url, writer=True)
    return optuna.load_study(study_name="tiny", storage=storage), storage


def _lease(study: optuna.Study, driver: str, **record) -> None:
    study.set_user_attr(lease.PREFIX + driver, {"host": "node-b", "pid": 4242, **record})


def test_coordinators_sharing_an_rdb_requeue_only_the_trials_of_those_that_are_gone(tmp_path):
    url = f"sqlite:///{tmp_path}/study.db"
    first = search_tiny(tmp_path / "a", storage_url=url, budget={**BUDGET, "trials": 1})
    (mine,) = [k for k in first.study.user_attrs if k.startswith(lease.PREFIX)]
    assert first.study.user_attrs[mine]["closed"] is True      # a coordinator that stopped says so
    study, _ = _rdb_study(url)
    now = time.time()
    _lease(study, "alive", heartbeat=now + 3600, closed=False)  # beats past this test's end
    _lease(study, "lapsed", heartbeat=now - 2 * lease.LEASE_S, closed=False)
    _lease(study, "closed", heartbeat=now, closed=True)
    running = {owner: _leave_running(study, owner)[0] for owner in ("alive", "lapsed", "closed", "never-leased")}

    logs: list[str] = []
    result = search_tiny(tmp_path / "b", storage_url=url, logs=logs, budget={**BUDGET, "trials": 4})
    assert sorted(result.requeued) == sorted(running[o] for o in ("lapsed", "closed", "never-leased"))
    trials = {t.number: t for t in result.study.trials}
    assert trials[running["alive"]].state == TrialState.RUNNING and not _requeued(result.study, running["alive"])
    assert any(f"[{running['alive']}] belong to coordinator alive on node-b (pid 4242" in line for line in logs)
    for owner in ("lapsed", "closed", "never-leased"):
        assert len(_requeued(result.study, running[owner])) == 1

    _lease(study, "alive", heartbeat=time.time() - 2 * lease.LEASE_S, closed=False)   # it died since
    result = search_tiny(tmp_path / "c", storage_url=url, budget={**BUDGET, "trials": 5})
    assert result.requeued == [running["alive"]]
    assert _requeued(result.study, running["alive"])[0].state == TrialState.COMPLETE


def test_a_running_coordinator_requeues_the_trials_of_one_whose_lease_lapses_meanwhile(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/study.db"
    search_tiny(tmp_path / "a", storage_url=url, budget={**BUDGET, "trials": 1})
    study, _ = _rdb_study(url)
    _lease(study, "other", heartbeat=time.time(), closed=False)      # alive now, and never beats again
    number, params = _leave_running(study, "other")
    monkeypatch.setattr(lease, "BEAT_S", 0.05)
    monkeypatch.setattr(lease, "LEASE_S", 1.0)
    logs: list[str] = []

    def slow(config, out_dir, report):
        time.sleep(0.4)
        return quadratic(config, out_dir, report)

    result = search_tiny(tmp_path / "b", slow, storage_url=url, logs=logs, budget={**BUDGET, "trials": 6})
    assert result.requeued == []                                      # alive when this one started
    assert any(f"[{number}] belong to coordinator other" in line for line in logs)
    assert any(f"re-queued: [{number}]" in line for line in logs)     # lapsed while this one ran
    (again,) = _requeued(result.study, number)
    assert again.params == params and again.state == TrialState.COMPLETE


def test_a_coordinator_on_an_rdb_renews_its_lease_while_it_runs(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/study.db"
    monkeypatch.setattr(lease, "BEAT_S", 0.05)
    seen: list[float] = []

    def watch(config, out_dir, report):
        study, _ = _rdb_study(url)
        (record,) = [v for k, v in study.user_attrs.items() if k.startswith(lease.PREFIX)]
        seen.append(record["heartbeat"])
        assert record["closed"] is False
        time.sleep(0.3)
        return quadratic(config, out_dir, report)

    search_tiny(tmp_path / "a", watch, storage_url=url, budget={**BUDGET, "trials": 2})
    assert seen[1] - seen[0] > 0.1          # renewed between the two trials' starts


def test_a_trial_whose_folder_is_deleted_while_it_runs_fails_with_the_reason(tmp_path):
    def delete_own_folder(config, out_dir, report):
        if out_dir.name == "0001":
            shutil.rmtree(out_dir)
        return quadratic(config, out_dir, report)

    logs: list[str] = []
    result = search_tiny(tmp_path / "run", delete_own_folder, logs=logs, budget={**BUDGET, "trials": 3})
    trials = {t.number: t for t in result.study.trials}
    assert trials[1].state == TrialState.FAIL
    assert trials[1].user_attrs["reason"].startswith("error: its folder trials/0001 was deleted while it ran")
    assert [trials[n].state for n in (0, 2)] == [TrialState.COMPLETE] * 2
    assert result.counts == {"complete": 2, "pruned": 0, "failed": 1}


@pytest.mark.parametrize("text", ["garbage{", "[1, 2]", '{"study": "tiny"}'], ids=["not_json", "a_list", "no_storage"])
def test_a_damaged_run_json_is_refused_in_one_line_by_resume_and_leaderboard(tmp_path, capsys, text):
    out = tmp_path / "run"
    search_tiny(out, budget={**BUDGET, "trials": 1})
    (out / "run.json").write_text(text)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for argv in (["leaderboard", str(out)],
                 ["search", "--resume", "--out", str(out), "--executor", "inline", "--no-objective-check"]):
        assert cli.main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert f"{out / 'run.json'}: " in line and "restore it from a copy" in line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
