"""The ``equal_state`` study kind (specs/studies/second_order.yaml): iso-state sizing with square and
MLP states, the paired verdict over seeds, the spec's checks, and a smoke-scale run."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.study import verdict as V
from ssmcraft.study.commands import run_study
from ssmcraft.study.runners import iso_state_size
from ssmcraft.study.spec import load_study_spec

SPEC = Path(__file__).resolve().parent.parent / "specs" / "studies" / "second_order.yaml"
MODEL = {"d_model": 16, "n_layers": 2, "mixer": {"kind": "objective", "heads": 1, "expand": 1}}


def _largest(count, elements):
    return max(m for m in range(1, 200) if count(m) <= elements)


@pytest.mark.parametrize("objective, per_layer", [
    ("deltanet", lambda m: 16 * m),                        # S [d, m]
    ("rls", lambda m: 16 * m + m * m),                     # S [d, m] and the covariance R [m, m]
    ("precond_delta", lambda m: 16 * m + m * m),
    ("ttt_mlp", lambda m: 2 * m * m + 16 * 2 * m),         # W1 [2m, m], W2 [d, 2m]
])
@pytest.mark.parametrize("elements", [2 * 16 * 8, 2 * 16 * 8 + 31, 2 * 16 * 40])
def test_iso_state_counts_every_state_square_and_mlp_ones_included(objective, per_layer, elements):
    m = iso_state_size(MODEL, objective, elements)
    assert m == _largest(lambda m: 2 * per_layer(m), elements)


def test_iso_state_of_a_composition_and_too_small_a_budget():
    from ssmcraft.search.compose import compose_objective

    metric = compose_objective({"proximity": "metric", "data": "regression", "step": "scalar", "update": "implicit"})
    assert iso_state_size(MODEL, metric, 2 * 16 * 8) == _largest(lambda m: 2 * (16 * m + m * m), 2 * 16 * 8)
    with pytest.raises(SsmcraftError, match="rls carries 34 numbers of state at m = 1"):
        iso_state_size(MODEL, "rls", 33)


def test_sign_test_and_bootstrap():
    assert V.sign_test_p(5, 5) == pytest.approx(1 / 32)
    assert V.sign_test_p(3, 3) == pytest.approx(1 / 8)
    assert V.sign_test_p(2, 3) == pytest.approx(4 / 8)
    assert V.sign_test_p(0, 0) == 1.0
    lo, hi = V.bootstrap_ci([1.0, 2.0, 3.0, 4.0])
    assert 1.0 <= lo < 2.5 < hi <= 4.0
    assert V.bootstrap_ci([0.5, 0.5]) == (0.5, 0.5)
    assert V.bootstrap_ci([]) is None


def test_paired_pairs_by_seed_and_drops_missing_runs():
    a = {0: 0.9, 1: 0.8, 2: 0.85, 3: None}
    b = {0: 0.5, 1: 0.6, 2: 0.55, 3: 0.99}
    r = V.paired(a, b, tol=0.01, higher_is_better=True)
    assert r["n"] == 3 and r["wins"] == 3 and r["outcome"] == "better"
    assert r["mean_diff"] == pytest.approx((0.4 + 0.2 + 0.3) / 3)
    assert r["p_better"] == pytest.approx(1 / 8)
    loss = V.paired({0: 2.0, 1: 2.1}, {0: 1.9, 1: 2.0}, tol=0.005, higher_is_better=False)
    assert loss["outcome"] == "worse" and loss["losses"] == 2 and loss["mean_diff"] == pytest.approx(-0.1)
    one = V.paired({0: 0.9, 1: None}, {0: 0.1, 1: 0.2}, tol=0.01, higher_is_better=True)
    assert one["n"] == 1 and one["mean_diff"] == pytest.approx(0.8) and one["outcome"] == "tie"
    mixed = V.paired({0: 0.9, 1: 0.1}, {0: 0.5, 1: 0.5}, tol=0.01, higher_is_better=True)
    assert mixed["outcome"] == "tie" and mixed["wins"] == 1 and mixed["losses"] == 1


def _pairs(**by):
    return {c: {b: V.paired(dict(enumerate(x)), dict(enumerate(y)), 0.01, True) for b, (x, y) in bs.items()}
            for c, bs in by.items()}


def test_beats_all_agrees_disagrees_and_is_inconclusive():
    hi5, lo5, mid5 = [0.9, 0.92, 0.91, 0.93, 0.9], [0.5, 0.52, 0.51, 0.5, 0.49], [0.7, 0.71, 0.7, 0.72, 0.69]
    v = V.beats_all("claim", _pairs(rls={"longhorn": (hi5, mid5), "deltanet": (hi5, lo5)},
                                    ttt={"longhorn": (lo5, mid5), "deltanet": (lo5, lo5)}), "accuracy")
    assert v["verdict"] == "agrees" and v["confidence"] == "high"          # 5 of 5 seeds: p = 1/32
    v = V.beats_all("claim", _pairs(rls={"longhorn": (hi5[:3], mid5[:3]), "deltanet": (hi5[:3], mid5[:3])}), "accuracy")
    assert v["verdict"] == "agrees" and v["confidence"] == "medium"        # 3 of 3: p = 1/8
    v = V.beats_all("claim", _pairs(rls={"longhorn": (lo5, hi5), "deltanet": (hi5, lo5)},
                                    ttt={"longhorn": (mid5, mid5), "deltanet": (mid5, hi5)}), "accuracy")
    assert v["verdict"] == "disagrees" and v["confidence"] == "high"
    none = [None] * 5                                                      # every run diverged
    v = V.beats_all("claim", _pairs(rls={"longhorn": (lo5, hi5), "deltanet": (hi5, lo5)},
                                    ttt={"longhorn": (none, mid5), "deltanet": (none, lo5)}), "accuracy")
    assert v["verdict"] == "disagrees" and "ttt: no finished run to pair, left out" in v["evidence"]
    v = V.beats_all("claim", _pairs(ttt={"longhorn": (none, mid5)}), "accuracy")
    assert v["verdict"] == "inconclusive"
    v = V.beats_all("claim", _pairs(rls={"longhorn": (hi5, lo5), "deltanet": (mid5, mid5)}), "accuracy")
    assert v["verdict"] == "inconclusive" and v["confidence"] == "low"
    assert "rls vs longhorn: accuracy advantage +0.4" in v["evidence"]


def _expect(raw: dict, key: str, problem: str):
    with pytest.raises(SpecError) as e:
        load_study_spec(raw)
    assert e.value.key == key and problem in e.value.problem, (e.value.key, e.value.problem)


@pytest.mark.parametrize("where, change, key, problem", [
    ("smoke", {"challengers": [{"compose": {"proximity": "metrik"}}]}, "smoke.challengers[0].compose.proximity",
     "is not one of"),
    ("smoke", {"challengers": [{"objective": "rls"}]}, "smoke.challengers[0].objective", "unknown key"),
    ("smoke", {"challengers": ["rls", "rls"]}, "smoke.challengers", "lists an objective twice"),
    ("smoke", {"challengers": ["deltanet"]}, "smoke.baselines[1]", "also a challenger"),
    ("smoke", {"baselines": ["attention"]}, "smoke.baselines[0]", "attention has no fixed state"),
    ("full", {"state_elements": {"mqar": 512}}, "full.state_elements.text", "missing"),
    ("smoke", {"overrides": {"mamba": {}}}, "smoke.overrides.mamba", "not one of this study's objectives"),
    ("smoke", {"overrides": {"rls": {"model": {"mixer": {"input_bias": {"beta": 1.0}}}}}},
     "smoke.overrides.rls.model.mixer.input_bias", "unknown input(s) ['beta']"),
    ("full", {"state_elements": {"mqar": 40, "text": 2048}}, "full.state_elements.mqar", "more than state_elements = 40"),
])
def test_bad_second_order_specs_name_the_key(where, change, key, problem):
    raw = yaml.safe_load(SPEC.read_text())
    raw[where] = {**raw[where], **change}
    _expect(raw, key, problem)


def test_second_order_study_runs_at_smoke_scale(tmp_path):
    done = run_study(SPEC, tmp_path, device="cpu", scale="smoke", say=lambda _m: None)
    results = json.loads(Path(done["results"]).read_text())
    rows = results["tables"][0]["rows"]
    by = {(r["task"], r["objective"]): r for r in rows}
    # d 16 and 64 numbers of state: DeltaNet and Longhorn m 4; RLS 16m + m^2 -> 3; the MLP memory 2m^2 + 32m -> 1
    assert by["mqar", "deltanet"]["m"] == 4 and by["mqar", "rls"]["m"] == 3 and by["mqar", "ttt_mlp"]["m"] == 1
    assert by["mqar", "c_plain_regr_sstep_expl_mb16_n"]["m"] == 4
    assert all(r["state_bytes"] <= 4 * 64 for r in rows) and by["text", "rls"]["state_bytes"] == 4 * (16 * 3 + 9)
    assert all(r["seeds"] == 2 for r in rows), [r for r in rows if r["seeds"] != 2]
    pairs = results["data"]["pairs"]
    assert len(pairs) == 2 * 4 * 2 and all(p["n"] == 2 for p in pairs)
    assert [v["claim"].split(" at ")[0] for v in results["verdicts"]] == \
        ["on MQAR accuracy", "on byte-level validation loss (nats/byte)"]
    assert all(v["verdict"] in ("agrees", "disagrees", "inconclusive") for v in results["verdicts"])
    assert (tmp_path / "equal_state.png").stat().st_size > 1000
    for task in ("mqar", "text"):                   # the spec's per-objective override reaches that objective only
        mixer = lambda o: json.loads((tmp_path / "runs" / task / o / "s0" / "config.json").read_text())["model"]["mixer"]
        assert mixer("rls")["input_bias"] == {"lam": 4.0} and "input_bias" not in mixer("deltanet")
