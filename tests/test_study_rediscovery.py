"""Leave-one-out rediscovery: the space census (which compositions derive a left-out layer, and
the odds of drawing one), the search-side count, the verdict, and the spec checks."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

import ssmcraft
from ssmcraft.errors import SpecError
from ssmcraft.search.compose import compose_objective
from ssmcraft.search.spec import load_search_spec
from ssmcraft.study import verdict as V
from ssmcraft.study.rediscovery import census_rows, fingerprint_of, rediscoveries, space_census
from ssmcraft.study.spec import load_study_spec

SPECS = Path(__file__).resolve().parent.parent / "specs" / "studies"

SEARCH = {
    "name": "loo", "task": {"name": "mqar"}, "model": {"d_model": 16, "n_layers": 1},
    "budget": {"trials": 4, "tokens_per_trial": 1000, "seconds_per_trial": 10},
    "space": {"objective": {"choice": [
        "mamba",
        {"compose": {"proximity": ["plain", "scalar_decay"], "data": "regression",
                     "step": ["scalar", "per_channel"], "update": "implicit"}},
    ]}},
    "rank": {"val_loss": "minimize"},
}


def _longhorn_twin() -> dict:
    return compose_objective({"proximity": "plain", "data": "regression", "step": "per_channel",
                              "update": "implicit"})


def test_census_counts_the_compositions_that_derive_a_left_out_layer():
    spec = load_search_spec(copy.deepcopy(SEARCH), source="t")
    cache: dict = {}
    targets = {"longhorn": fingerprint_of("longhorn", ssmcraft.compile, cache),
               "gated_longhorn": fingerprint_of("gated_longhorn", ssmcraft.compile, cache),
               "deltanet": fingerprint_of("deltanet", ssmcraft.compile, cache)}
    census = space_census(spec, targets, ssmcraft.compile, cache)
    assert census["variants"] == 5 and census["underivable"] == 0         # mamba + 2 x 2 compositions
    lh = census["targets"]["longhorn"]
    # one of the four compositions; P = 1/2 (option) x 1/2 (proximity) x 1/2 (step)
    assert lh["variants"] == 1 and lh["p_per_trial"] == pytest.approx(0.125) and lh["expected_trials"] == 8
    assert census["targets"]["gated_longhorn"]["variants"] == 1          # scalar decay + per-channel step
    assert census["targets"]["deltanet"]["variants"] == 0                 # explicit steps are not in this space
    assert census["targets"]["deltanet"]["expected_trials"] is None


def test_census_adds_the_chances_of_every_selection_of_one_objective():
    """Two options of the space select Longhorn's twin: its chance is the sum of both draws."""
    raw = copy.deepcopy(SEARCH)
    raw["space"]["objective"]["choice"] = [
        {"compose": {"proximity": ["plain", "scalar_decay"], "step": "per_channel"}, "label": "a"},
        {"compose": {"proximity": "plain", "step": ["per_channel", "scalar"]}, "label": "b"}]
    spec = load_search_spec(raw, source="t")
    cache: dict = {}
    census = space_census(spec, {"longhorn": fingerprint_of("longhorn", ssmcraft.compile, cache)},
                          ssmcraft.compile, cache)
    assert census["variants"] == 3                                  # 2 + 2 selections, one objective shared
    lh = census["targets"]["longhorn"]
    assert lh["variants"] == 1 and lh["p_per_trial"] == pytest.approx(0.5)    # 1/2 x 1/2, twice


def test_rediscoveries_reads_the_first_trial_in_order_and_the_best_rank():
    twin = json.dumps(_longhorn_twin(), sort_keys=True)
    other = json.dumps(compose_objective({"proximity": "scalar_decay", "data": "regression", "step": "scalar",
                                          "update": "implicit"}), sort_keys=True)
    table = [  # out of order on purpose; a failed twin still counts as drawn
        {"trial": 5, "objective": "c_plain", "objective_spec": twin, "rank": 1, "pareto": True},
        {"trial": 0, "objective": "mamba", "objective_spec": None, "rank": 3, "pareto": False},
        {"trial": 2, "objective": "c_plain", "objective_spec": twin, "rank": None, "pareto": False},
        {"trial": 1, "objective": "c_sdec", "objective_spec": other, "rank": 2, "pareto": False},
    ]
    cache: dict = {}
    targets = {"longhorn": fingerprint_of("longhorn", ssmcraft.compile, cache),
               "deltanet": fingerprint_of("deltanet", ssmcraft.compile, cache)}
    found = rediscoveries(table, targets, ssmcraft.compile, cache)
    assert found["longhorn"] == {"trials": [2, 5], "first_trial": 2, "trials_until_first": 3,
                                 "trials_until_trained": 4, "complete": 1, "best_rank": 1, "on_front": True}
    assert found["deltanet"]["trials"] == [] and found["deltanet"]["first_trial"] is None
    census = {"variants": 5, "underivable": 0,
              "targets": {"longhorn": {"variants": 1, "p_per_trial": 0.125, "expected_trials": 8.0, "examples": []},
                          "deltanet": {"variants": 0, "p_per_trial": 0.0, "expected_trials": None, "examples": []}}}
    rows = census_rows(census, found, n_trials=4, n_ranked=3)
    lh, dn = rows
    assert lh["rediscovered"] and (lh["first_drawn"], lh["first_trained"]) == (3, 4)
    assert (lh["times_drawn"], lh["times_trained"], lh["best_rank"]) == (2, 1, 1)
    assert lh["p_uniform_within_budget"] == pytest.approx(1 - 0.875 ** 4, abs=1e-3)
    assert not dn["rediscovered"] and dn["p_uniform_within_budget"] is None
    assert V.rediscovery(rows)["verdict"] == "inconclusive"       # deltanet is not expressible here
    assert V.rediscovery([lh])["verdict"] == "agrees"
    drawn_only = {**lh, "rediscovered": False, "first_trained": None, "times_trained": 0, "best_rank": None}
    v = V.rediscovery([drawn_only])
    assert v["verdict"] == "disagrees" and "no such trial finished" in v["evidence"]
    v = V.rediscovery([{**drawn_only, "first_drawn": None, "times_drawn": 0}])
    assert v["verdict"] == "disagrees" and "not drawn" in v["evidence"]
    assert V.rediscovery([])["verdict"] == "inconclusive"


def test_leave_out_is_checked_in_the_study_spec():
    raw = yaml.safe_load((SPECS / "composed_search.yaml").read_text())
    bad = copy.deepcopy(raw)
    bad["base"]["leave_out"] = ["not_a_layer"]
    with pytest.raises(SpecError, match="not a library objective") as e:
        load_study_spec(bad, source="s.yaml")
    assert e.value.key.endswith("leave_out")
    bad = copy.deepcopy(raw)
    bad["base"]["leave_out"] = ["mamba"]               # the smoke space offers mamba by name
    with pytest.raises(SpecError, match="left out of the library"):
        load_study_spec(bad, source="s.yaml")
    bad["base"]["leave_out"] = ["longhorn", "longhorn"]
    with pytest.raises(SpecError, match="twice"):
        load_study_spec(bad, source="s.yaml")
    ok = copy.deepcopy(raw)
    ok["base"]["leave_out"] = ["gla"]
    assert load_study_spec(ok, source="s.yaml").params("smoke")["leave_out"] == ["gla"]


def test_leave_one_out_study_runs_at_smoke_scale(tmp_path):
    """The shipped spec end to end on the CPU: both left-out layers are in the space (Longhorn as
    the per-channel implicit regression, Gated DeltaNet as the decay-then-explicit step on a scalar
    decay), one of its 8 compositions each; the report opens with the rediscovery table."""
    from ssmcraft.study.commands import run_study

    run_study(SPECS / "leave_one_out.yaml", tmp_path, device="cpu", scale="smoke", say=lambda s: None)
    results = json.loads((tmp_path / "results.json").read_text())
    table = results["tables"][0]
    assert table["title"].startswith("Leave-one-out rediscovery")
    rows = {r["left_out"]: r for r in table["rows"]}
    for name in ("longhorn", "gated_deltanet"):
        assert rows[name]["variants_in_space"] == 1 and rows[name]["p_per_uniform_trial"] == 0.125
        assert rows[name]["uniform_expected_trials"] == 8.0
        assert rows[name]["p_uniform_within_budget"] == pytest.approx(1 - 0.875 ** 3, abs=1e-3)
    claims = [v["claim"] for v in results["verdicts"]]
    assert any("rediscovers" in c for c in claims)
    drawn = results["data"]["rediscovery"]
    assert {r["left_out"] for r in drawn} == {"gated_deltanet", "longhorn"}
    # with Longhorn out of the library, its twin counts as not in the library
    lib = [r for r in results["tables"][-1]["rows"] if r.get("same_as") == "longhorn"]
    assert not lib


@pytest.mark.parametrize("name", ["composed_search", "composed_search_bytes", "leave_one_out"])
def test_the_gpu_scale_specs_start(name):
    """The full-scale spaces pass the check a search runs before its first trial: every library
    anchor derives, and a composition this compiler cannot derive is listed, not fatal."""
    from ssmcraft.search.objectives import check_objectives

    study = load_study_spec(SPECS / f"{name}.yaml")
    spec = load_search_spec(study.params("full")["search"], source=name, base=study.base)
    check = check_objectives(spec, ssmcraft.compile)
    assert check.derive >= 1 and check.total == check.derive + len(check.underivable)
    if name == "leave_one_out":     # the census the report opens with: each left-out layer is 1 of 48
        cache: dict = {}
        targets = {n: fingerprint_of(n, ssmcraft.compile, cache) for n in ("longhorn", "gated_deltanet")}
        census = space_census(spec, targets, ssmcraft.compile, cache)
        assert census["variants"] == 48 and census["underivable"] == 0
        for t in census["targets"].values():
            assert t["variants"] == 1 and t["expected_trials"] == pytest.approx(48)
