"""Study spec validation: every shipped spec loads; malformed ones fail with a SpecError
naming the key."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from ssmcraft.errors import SpecError
from ssmcraft.study.spec import KINDS, load_study_spec

SPECS = Path(__file__).resolve().parent.parent / "specs" / "studies"


def _raw(name: str) -> dict:
    return yaml.safe_load((SPECS / f"{name}.yaml").read_text())


def test_every_kind_has_a_shipped_spec_and_it_loads():
    kinds = set()
    for path in sorted(SPECS.glob("*.yaml")):
        spec = load_study_spec(path)
        kinds.add(spec.kind)
        assert spec.params("smoke") and spec.params("full")
    assert kinds == set(KINDS)


def test_base_is_merged_under_each_scale():
    spec = load_study_spec(_raw("mqar_state_size"))
    smoke, full = spec.params("smoke"), spec.params("full")
    assert smoke["experiment"]["task"]["name"] == full["experiment"]["task"]["name"] == "mqar"
    assert smoke["experiment"]["model"]["mixer"]["heads"] == 1 and smoke["experiment"]["model"]["d_model"] == 16


def _expect(raw: dict, key: str, words: str):
    with pytest.raises(SpecError) as e:
        load_study_spec(raw, source="t.yaml")
    assert e.value.key == key, str(e.value)
    assert words in e.value.problem, str(e.value)
    assert str(e.value).startswith("t.yaml: ")


def test_missing_and_unknown_top_level_keys():
    raw = _raw("mqar_state_size")
    _expect({k: v for k, v in raw.items() if k != "kind"}, "kind", "missing")
    _expect({**raw, "kind": "nope"}, "kind", "unknown study kind 'nope'")
    _expect({**raw, "extra": 1}, "extra", "unknown key")
    _expect({k: v for k, v in raw.items() if k != "full"}, "full", "missing")
    _expect({**raw, "name": "has space"}, "name", "expected letters")


def test_kind_parameters_are_checked_in_both_scales():
    raw = _raw("mqar_state_size")
    bad = copy.deepcopy(raw)
    bad["full"]["state_sizes"] = [16, 0]
    _expect(bad, "full.state_sizes[1]", "positive integer")
    bad = copy.deepcopy(raw)
    bad["smoke"]["lrs"] = []
    _expect(bad, "smoke.lrs", "at least 1")
    bad = copy.deepcopy(raw)
    bad["smoke"]["bogus"] = 1
    _expect(bad, "smoke.bogus", "unknown key for a mqar_state_size study")
    bad = copy.deepcopy(raw)
    del bad["base"]["experiment"]["task"]
    bad["smoke"]["experiment"].pop("task")
    bad["full"]["experiment"].pop("task")
    _expect(bad, "smoke.experiment.task", "missing")
    bad = copy.deepcopy(raw)
    bad["base"]["experiment"]["task"]["name"] = "text"
    _expect(bad, "smoke.experiment.task.name", "needs the 'mqar' task")
    bad = copy.deepcopy(raw)
    bad["smoke"]["seeds"] = [0, 0]
    _expect(bad, "smoke.seeds", "repeat")


def test_experiments_and_objectives_are_checked_as_a_training_would_in_both_scales():
    raw = _raw("extrapolation")
    for part, key in (("train", "batch_sizee"), ("task", "corpsu")):
        bad = copy.deepcopy(raw)
        bad["full"].setdefault("experiment", {}).setdefault(part, {})[key] = 1
        _expect(bad, f"full.experiment.{part}.{key}", "unknown key")
    bad = copy.deepcopy(raw)
    bad["full"].setdefault("experiment", {}).setdefault("model", {})["d_model"] = "wide"
    _expect(bad, "full.experiment.model.d_model", "expected an integer >= 1")
    bad = copy.deepcopy(raw)
    bad["full"]["objectives"] = ["longhorn", "mambaa"]
    _expect(bad, "full.objectives[1]", "unknown objective 'mambaa'")
    bad = _raw("mqar_state_size")
    bad["smoke"]["overrides"] = {"mamba": {"train": {"lrr": 0.1}}}          # one objective's own experiment
    _expect(bad, "smoke.overrides.mamba.train.lrr", "unknown key")
    bad = _raw("state_capacity")
    bad["base"]["objective"] = "mambaa"
    _expect(bad, "smoke.objective", "unknown objective 'mambaa'")


def test_thresholds_mitigations_and_nested_search_errors():
    raw = _raw("extrapolation")
    _expect({**raw, "thresholds": {"nope": 1}}, "thresholds.nope", "unknown threshold")
    _expect({**raw, "thresholds": {"max_ratio": "x"}}, "thresholds.max_ratio", "expected a number")
    bad = copy.deepcopy(raw)
    bad["smoke"]["mitigations"] = ["retention=-1"]
    _expect(bad, "smoke.mitigations[0]", "positive")
    bad = copy.deepcopy(raw)
    bad["full"]["eval"] = {"batchez": 2}
    _expect(bad, "full.eval.batchez", "unknown key")
    raw = _raw("composed_search")
    bad = copy.deepcopy(raw)
    del bad["smoke"]["search"]["budget"]
    _expect(bad, "smoke.search.budget", "missing")
    bad = copy.deepcopy(raw)
    bad["smoke"]["executor"] = "threads"
    _expect(bad, "smoke.executor", "inline or ray")
    raw = _raw("exact_vs_diagonal")
    _expect({**raw, "base": {**raw["base"], "objectives": ["longhorn"]}}, "smoke.objectives", "[exact, diagonal]")


def test_not_found_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError, match="study spec not found"):
        load_study_spec(tmp_path / "nope.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="invalid YAML"):
        load_study_spec(p)
