"""The search space chooses a hybrid layout: a labelled choice samples a label and puts its
value (a list of placement rules) at ``model.layers``; every layout is checked when the spec loads."""
from __future__ import annotations

import pytest

from ssmcraft.errors import SpecError
from ssmcraft.search import load_search_spec
from ssmcraft.search.space import build_config, check_experiment, suggest
from ssmcraft.search.testing import tiny_spec

LAYOUTS = {"pure": [], "swa_every_2": [{"every": 2, "mixer": {"kind": "attention", "heads": 2, "window": 8}}]}


class _Pick:
    """An Optuna-like trial that picks a fixed label for one param, the first value elsewhere."""

    def __init__(self, name, label):
        self.name, self.label = name, label

    def suggest_categorical(self, name, choices):
        return self.label if name == self.name else choices[0]

    def suggest_int(self, name, low, high, step=1, log=False):
        return low

    def suggest_float(self, name, low, high, step=None, log=False):
        return low


def _spec(layouts):
    raw = tiny_spec(model={"d_model": 16, "n_layers": 2})
    raw["space"]["model.layers"] = {"choice": layouts}
    return load_search_spec(raw)


def test_layout_choice_samples_a_label_and_places_its_rules():
    spec = _spec(LAYOUTS)
    params = suggest(_Pick("model.layers", "swa_every_2"), spec)
    assert params["model.layers"] == "swa_every_2"            # what Optuna stores: the label
    config = build_config(spec, params, seed=0, device="cpu")
    assert config["model"]["layers"] == LAYOUTS["swa_every_2"]
    config["model"]["layers"][0]["every"] = 5                  # a trial's config is its own copy
    assert build_config(spec, params, seed=0, device="cpu")["model"]["layers"][0]["every"] == 2
    check_experiment(spec)


def test_a_bad_layout_in_any_label_is_refused_when_the_spec_loads():
    spec = _spec({**LAYOUTS, "broken": [{"at": [7], "mixer": {"kind": "attention"}}]})
    with pytest.raises(SpecError) as e:
        check_experiment(spec)
    assert e.value.key == "model.layers[0].at" and "out of range" in e.value.problem


def test_labels_must_be_strings():
    raw = tiny_spec()
    raw["space"]["model.layers"] = {"choice": {1: []}}
    with pytest.raises(SpecError, match="labels of a labelled choice must be strings"):
        load_search_spec(raw)
