"""Verdict logic on constructed numbers: agree, disagree and inconclusive are all reachable."""
from __future__ import annotations

from ssmcraft.study import verdict as V


def test_confidence_levels():
    assert V.confidence(0.5, 0.1, 3)[0] == "high"
    assert V.confidence(0.15, 0.1, 2)[0] == "medium"
    assert V.confidence(0.05, 0.1, 3)[0] == "low"
    assert V.confidence(0.5, 0.0, 1)[0] == "low"


def test_mqar_state_size_agree_and_disagree():
    good = {"longhorn": {16: [0.6, 0.62, 0.61], 32: [0.9, 0.92, 0.91]},
            "mamba": {16: [0.4, 0.41, 0.42], 32: [0.7, 0.71, 0.69]}}
    claim1, claim2 = V.mqar_state_size(good, tol=0.02)
    assert claim1["verdict"] == "agrees" and claim1["confidence"] == "high"
    assert claim2["verdict"] == "agrees"
    bad = {"longhorn_diag": {16: [0.3], 32: [0.2]}, "mamba": {16: [0.6], 32: [0.5]}}
    claim1, claim2 = V.mqar_state_size(bad, tol=0.02)
    assert claim1["verdict"] == "disagrees" and claim1["confidence"] == "low"
    assert claim2["verdict"] == "disagrees"
    assert V.mqar_state_size({"gla": {16: [0.5]}}, 0.02)[0]["verdict"] == "inconclusive"


def test_exact_vs_diagonal_all_three_outcomes():
    acc = {"longhorn": [0.9, 0.91, 0.92], "longhorn_diag": [0.7, 0.72, 0.71]}
    loss = {"longhorn": [2.0, 2.01, 2.02], "longhorn_diag": [1.8, 1.81, 1.79]}
    a, l = V.exact_vs_diagonal(acc, loss, "longhorn", "longhorn_diag", 0.01, 0.01)
    assert a["verdict"] == "agrees" and a["confidence"] == "high"
    assert l["verdict"] == "disagrees"
    same = {"longhorn": [0.5], "longhorn_diag": [0.505]}
    a, _ = V.exact_vs_diagonal(same, loss, "longhorn", "longhorn_diag", 0.01, 0.01)
    assert a["verdict"] == "inconclusive"


def _row(obj, setting, within, beyond, exploded, refused=None):
    return {"objective": obj, "setting": setting, "within": within, "beyond": beyond, "exploded": exploded,
            "refused": refused}


def test_extrapolation_verdicts():
    rows = [_row("longhorn", "plain", 2.0, 2.05, False), _row("mamba", "plain", 2.0, 3.5, True),
            _row("mamba", "window=256", 2.0, 2.2, None), _row("longhorn", "window=256", None, None, None, "refused")]
    v = {x["claim"].split()[0]: x for x in V.extrapolation(rows, 1.1, 0.01, 1)}
    assert v["Longhorn"]["verdict"] == "agrees"
    assert v["Mamba"]["verdict"] == "agrees"
    assert v["a"]["verdict"] == "agrees"
    rows = [_row("longhorn", "plain", 2.0, 3.0, True), _row("mamba", "plain", 2.0, 2.0, False),
            _row("mamba", "window=256", 2.0, 2.5, None), _row("longhorn", "retention=0.9,insertion=1", 2.0, 3.0, True)]
    v = {x["claim"].split()[0]: x for x in V.extrapolation(rows, 1.1, 0.01, 1)}
    assert v["Longhorn"]["verdict"] == "disagrees"
    assert v["Mamba"]["verdict"] == "disagrees"
    assert v["a"]["verdict"] == "disagrees"


def test_state_capacity_fit_and_verdicts():
    assert V.min_safe_length({64: True, 128: False, 256: False}) == 128
    assert V.min_safe_length({64: False, 128: True, 256: False}) == 256
    assert V.min_safe_length({64: True, 128: True}) is None
    fit = V.linear_fit([4, 8, 16], [40, 80, 160])
    assert abs(fit["slope"] - 10) < 1e-9 and abs(fit["r2"] - 1) < 1e-9
    v, _ = V.state_capacity({4: 64, 8: 128, 16: 256, 32: None}, 3, 0.8, 1)
    assert v["verdict"] == "agrees"
    v, fit = V.state_capacity({4: 256, 8: 128, 16: 64}, 3, 0.8, 1)
    assert v["verdict"] == "disagrees" and fit["slope"] < 0
    v, _ = V.state_capacity({4: 64, 8: None}, 3, 0.8, 1)
    assert v["verdict"] == "inconclusive"


def test_composed_search_verdict():
    new = {"objective": "c_ddec_regr", "same_as": None}
    same = {"objective": "c_sdec_regr_cstep_impl_exact", "same_as": "gated_longhorn"}
    lib = {"objective": "mamba", "same_as": "mamba"}
    assert V.composed_search([lib, new])["verdict"] == "agrees"
    v = V.composed_search([lib, same])           # a composed twin of a library layer is not new
    assert v["verdict"] == "disagrees" and "(= gated_longhorn)" in v["evidence"]
    assert V.composed_search([lib])["verdict"] == "disagrees"
    assert V.composed_search([])["verdict"] == "inconclusive"


def test_library_match_by_derived_update():
    """The composed scalar-decay regression with a per-channel step derives exactly gated_longhorn."""
    import json

    import ssmcraft
    from ssmcraft.search.compose import compose_objective
    from ssmcraft.study.runners import library_match

    twin = compose_objective({"proximity": "scalar_decay", "data": "regression", "step": "per_channel",
                              "update": "implicit"})
    other = compose_objective({"proximity": "diagonal_decay", "data": "regression", "step": "per_channel",
                               "update": "implicit"})
    lib = {"gated_longhorn", "longhorn", "mamba"}
    cache: dict = {}
    assert library_match({"objective": twin["name"], "objective_spec": json.dumps(twin)}, lib, ssmcraft.compile,
                         cache) == "gated_longhorn"
    assert library_match({"objective": other["name"], "objective_spec": json.dumps(other)}, lib, ssmcraft.compile,
                         cache) is None
    assert library_match({"objective": "mamba"}, lib, ssmcraft.compile, cache) == "mamba"


def test_a_difference_within_the_seed_spread_is_inconclusive():
    """Bimodal MQAR runs (solved or stuck at chance): a mean gap smaller than the spread is no evidence."""
    acc = {"longhorn": [0.13, 0.98, 0.99], "longhorn_diag": [0.98, 0.14, 0.15]}
    loss = {"longhorn": [1.0, 1.0, 1.0], "longhorn_diag": [1.0, 1.0, 1.0]}
    a, _ = V.exact_vs_diagonal(acc, loss, "longhorn", "longhorn_diag", 0.01, 0.01)
    assert a["verdict"] == "inconclusive" and "within the seed spread" in a["evidence"]
    one_seed = {"longhorn": [0.9], "longhorn_diag": [0.5]}
    assert V.exact_vs_diagonal(one_seed, loss, "longhorn", "longhorn_diag", 0.01, 0.01)[0]["verdict"] == "agrees"
