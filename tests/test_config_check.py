"""ssmcraft.config_check: a declared section refuses unknown and missing keys and bad values in one
line naming the source and the dotted key, and fills defaults with copies."""
from __future__ import annotations

import pytest

from ssmcraft.config_check import ABSENT, Checker, Field
from ssmcraft.errors import SpecError

FIELDS = {
    "trials": Field(lambda c, k, v: c.number(k, v, integer=True, min=1)),
    "lrs": Field(lambda c, k, v: c.seq(k, v, c.positive), default=[1e-3]),
    "executor": Field(default="inline", choices=("inline", "ray")),
    "note": Field(lambda c, k, v: c.string(k, v), default=ABSENT),
}


def _problem(given) -> SpecError:
    with pytest.raises(SpecError) as e:
        Checker("run.yaml", "budget").section("", given, FIELDS)
    assert "\n" not in str(e.value)
    return e.value


def test_a_section_fills_defaults_with_copies_and_leaves_absent_keys_out():
    c = Checker("run.yaml", "budget")
    one, two = c.section("", {"trials": 3}, FIELDS), c.section("", {"trials": 4, "note": "x"}, FIELDS)
    assert one == {"trials": 3, "lrs": [1e-3], "executor": "inline"}
    assert two == {"trials": 4, "lrs": [1e-3], "executor": "inline", "note": "x"}
    one["lrs"].append(1.0)
    assert FIELDS["lrs"].default == [1e-3] and two["lrs"] == [1e-3]


@pytest.mark.parametrize("given, key, words", [
    ({"trials": 1, "trails": 2}, "budget.trails", "unknown key; allowed: trials, lrs, executor, note"),
    ({}, "budget.trials", "missing (required)"),
    ({"trials": 0}, "budget.trials", "must be >= 1, got 0"),
    ({"trials": True}, "budget.trials", "expected an integer"),
    ({"trials": 1, "lrs": [1e-3, -1]}, "budget.lrs[1]", "expected a positive number, got -1"),
    ({"trials": 1, "executor": "threads"}, "budget.executor", "expected inline or ray, got 'threads'"),
    ({"trials": 1, "executor": ["ray"]}, "budget.executor", "expected inline or ray"),
    ({"trials": 1, "note": ""}, "budget.note", "expected a non-empty string"),
    ([1, 2], "budget", "expected a mapping, got list"),
])
def test_each_problem_is_one_line_naming_the_source_and_key(given, key, words):
    e = _problem(given)
    assert e.source == "run.yaml" and e.key == key and words in e.problem, str(e)


def test_a_nested_checker_names_the_full_key():
    c = Checker("s.yaml").under("smoke").under("eval")
    with pytest.raises(SpecError, match=r"^s\.yaml: smoke\.eval\.batches: expected a positive integer, got 0$"):
        c.positive("batches", 0, integer=True)
