"""The ``mad`` study kind: MAD's protocol over objectives at smoke scale, its table and its checks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssmcraft.errors import SpecError
from ssmcraft.study.commands import run_study
from ssmcraft.study.spec import load_study_spec, mad_cells

SPEC = Path(__file__).resolve().parent.parent / "specs" / "studies" / "mad.yaml"


def test_mad_study_writes_its_score_table(tmp_path):
    done = run_study(SPEC, tmp_path, device="cpu", scale="smoke", say=lambda _m: None)
    results = json.loads(Path(done["results"]).read_text())
    scores = results["data"]["scores"]
    assert [r["objective"] for r in scores] == ["longhorn_diag", "attention"]
    for row in scores:
        parts = [row[t] for t in ("in_context_recall", "selective_copying", "memorization")]
        assert all(0.0 <= x <= 1.0 for x in parts)
        assert row["mad_score"] == pytest.approx(sum(parts) / 3)
    assert scores[0]["state_bytes"] == 4 * 16 * 4                      # fp32 H d m at state_size 4
    levels = results["data"]["levels"]
    assert {(r["task"], r["level"]) for r in levels} == {(t, "baseline") for t in
                                                         ("in_context_recall", "selective_copying", "memorization")}
    report = Path(done["report"]).read_text()
    assert "MAD score per objective" in report and "mad_scores.png" in report
    run = tmp_path / "runs" / "attention" / "memorization" / "baseline" / "lr0.01" / "s0"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["task"] == {"name": "memorization", "vocab": 32, "seq_len": 16, "num_train_examples": 32}


def test_iso_state_gives_each_objective_the_m_that_fits():
    from ssmcraft.errors import SsmcraftError
    from ssmcraft.study.runners import iso_state_size

    model = {"d_model": 16, "n_layers": 2, "mixer": {"kind": "objective", "heads": 1, "expand": 1}}
    assert iso_state_size(model, "longhorn_diag", 2 * 16 * 8) == 8          # one state: 2 layers x d 16 x m
    assert iso_state_size(model, "momentum_longhorn", 2 * 16 * 8) == 4      # two states
    assert iso_state_size(model, "longhorn_diag", 2 * 16 * 8 + 31) == 8     # the largest m that fits
    assert iso_state_size(model, "attention", 100) is None
    with pytest.raises(SsmcraftError, match="more than state_elements = 10"):
        iso_state_size(model, "longhorn_diag", 10)


def test_all_levels_expand_to_mads_configurations():
    spec = load_study_spec(SPEC)
    full = spec.params("full")
    assert len(mad_cells(full)) == 66 and full["levels"] == "all"


@pytest.mark.parametrize("change, key, problem", [
    ({"tasks": ["recall"]}, "smoke.tasks[0]", "not a MAD task"),
    ({"levels": "some"}, "smoke.levels", "expected all or baseline"),
    ({"task_overrides": {"compression": {"seq_len": 9}}}, "smoke.task_overrides.compression", "not among"),
    ({"task_overrides": {"memorization": {"seq_len": 9}}}, "smoke.task_overrides.memorization", "must be even"),
    ({"model": {"d_model": 16, "n_layer": 1}}, "smoke.experiment.model.n_layer", "unknown key"),
    ({"state_elements": 64}, "smoke.state_elements", "not both"),
])
def test_bad_mad_specs_name_the_key(change, key, problem):
    import yaml

    raw = yaml.safe_load(SPEC.read_text())
    raw["smoke"] = {**raw["smoke"], **change}
    with pytest.raises(SpecError) as e:
        load_study_spec(raw)
    assert e.value.key == key and problem in e.value.problem
