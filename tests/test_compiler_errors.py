"""Issue 2: malformed specs give one clear ``SpecError`` (file, key, problem) and never a traceback.

- a table of malformed specs (YAML syntax and types, unknown/missing keys, bad and reserved
  names, undeclared names, shape errors, derivation errors, code-injection attempts, huge
  numbers, deep nesting, long expressions), each loaded from a file: the error must be a
  ``SpecError`` whose text is one line, names the file, and whose ``key`` and problem are
  the expected ones; every case runs under a time limit (a hang is a failure);
- the ``ssmcraft derive`` command on a few of them: exit status 2, one line on stderr, no traceback;
- identifiers that are Python keywords or names the generated code uses either are refused
  with a ``SpecError`` or compile to a recurrence that computes the right thing;
- property tests (hypothesis): random spec text and random expressions never raise anything
  but ``SpecError``, and a spec that compiles also runs (well-typed random objectives, checked
  against the independent evaluator, are in test_compiler_derivation.py).

Tolerances: the one numerical comparison (hostile identifiers) uses rtol 1e-10 on float64
(same maths, different association).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ssmcraft
from ssmcraft.compiler import expr as E
from ssmcraft.errors import SpecError
from helpers import time_limit

ROOT = Path(__file__).resolve().parents[1]
CASE_SECONDS = 10          # a spec error is found in well under a second; more is a hang

BASE = {
    "name": "t",
    "summary": "a test spec",
    "state": {"S": ["d", "m"]},
    "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"]}, "q": {"shape": ["m"]},
               "beta": {"shape": ["d"], "positive": True}},
    "objective": "sq(S - S_prev)/2 + wsq(S*k - x, beta)/2",
    "update": "implicit",
    "approximation": "exact",
    "output": "S*q",
}
BASE_TEXT = yaml.safe_dump(BASE, sort_keys=False)


def spec(**changes) -> str:
    """BASE with top-level keys replaced (None deletes), as YAML text."""
    d = copy.deepcopy(BASE)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return yaml.safe_dump(d, sort_keys=False)


def inputs_with(**extra) -> dict:
    d = copy.deepcopy(BASE["inputs"])
    for k, v in extra.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def obj(text: str) -> str:
    return spec(objective=text)


MULTI_OBJ = {"D": "sq(D - D_prev/2)/2 + wsq((S_prev + D)*k - x, beta)/2", "S": "sq(S - S_prev - D)/2"}


def multi(**changes) -> str:
    """A two-state spec (D then S), with top-level keys replaced as in ``spec``."""
    return spec(**{"state": {"D": ["d", "m"], "S": ["d", "m"]}, "objective": MULTI_OBJ, **changes})


INJECTION_MARKER = Path("/tmp/ssmcraft_pwned")

# (id, spec text, expected key, regex the problem must match)
CASES = [
    # --- YAML itself -----------------------------------------------------------------------
    ("yaml_unclosed_flow", "name: t\nstate: {S: [d, m]\ninputs: {}\n", "", r"invalid YAML"),
    ("yaml_bad_indent", "name: t\n  state: x\n bad: [\n", "", r"invalid YAML"),
    ("yaml_tab_indent", "name: t\ninputs:\n\tx: {shape: [d]}\n", "", r"invalid YAML"),
    ("yaml_python_tag", f"name: !!python/object/apply:os.system ['touch {INJECTION_MARKER}']\n", "", r"invalid YAML"),
    ("yaml_duplicate_key", BASE_TEXT + "objective: \"sq(S)\"\n", "", r"duplicate key 'objective'"),
    ("yaml_top_list", "- name\n- t\n", "", r"mapping at the top level"),
    ("yaml_empty_file", "", "", r"mapping at the top level"),
    ("yaml_unhashable_key", "? [a, b]\n: 1\n" + BASE_TEXT, "", r"(invalid YAML|key)"),
    ("yaml_unhashable_flow_key", "{[a]: 1, name: t}\n", "", r"(invalid YAML|key)"),
    ("yaml_deeply_nested", "name: " + "[" * 5000 + "]" * 5000 + "\n", "", r"(nested|invalid YAML)"),
    # --- schema: keys and types --------------------------------------------------------------
    ("unknown_top_key", BASE_TEXT + "objectve: \"sq(S)\"\n", "objectve", r"unknown key"),
    ("unknown_input_key", spec(inputs=inputs_with(x={"shape": ["d"], "shap": ["d"]})), "inputs.x.shap", r"unknown key"),
    ("unknown_param_key", spec(params={"A": {"shape": ["d", "m"], "sign": "negative"}}), "params.A.sign", r"unknown key"),
    ("missing_objective", spec(objective=None), "objective", r"missing"),
    ("missing_update", spec(update=None), "update", r"missing"),
    ("missing_input_shape", spec(inputs=inputs_with(x={"positive": True})), "inputs.x.shape", r"missing"),
    ("inputs_is_list", spec(inputs=["x", "k"]), "inputs", r"mapping"),
    ("state_is_string", spec(state="S"), "state", r"one entry"),
    ("state_one_dim", spec(state={"S": ["d"]}), "state.S", r"two dimension names"),
    ("state_same_dims", spec(state={"S": ["d", "d"]}), "state.S", r"different names"),
    ("shape_is_string", spec(inputs=inputs_with(x={"shape": "d"})), "inputs.x.shape", r"list"),
    ("shape_unknown_dim", spec(inputs=inputs_with(x={"shape": ["n"]})), "inputs.x.shape", r"unknown dimension 'n'"),
    ("input_matrix", spec(inputs=inputs_with(x={"shape": ["d", "m"]})), "inputs.x.shape", r"vectors or scalars"),
    ("param_transposed", spec(params={"A": {"shape": ["m", "d"]}}), "params.A.shape", r"state's shape"),
    ("positive_not_bool", spec(inputs=inputs_with(beta={"shape": ["d"], "positive": 1})), "inputs.beta.positive", r"true or false"),
    ("objective_not_string", spec(objective=5), "objective", r"non-empty string"),
    ("objective_empty", obj(""), "objective", r"non-empty string|empty"),
    ("objective_blank", obj("   "), "objective", r"non-empty string|empty"),
    ("update_typo", spec(update="implict"), "update", r"implicit, explicit or newton"),
    ("update_bool", spec(update=True), "update", r"implicit, explicit or newton"),
    ("approximation_typo", spec(approximation="diag"), "approximation", r"expected exact, diagonal or \{minibatch: C\}"),
    ("param_init_unknown", spec(params={"A": {"shape": ["d", "m"], "init": "glorot"}}), "params.A.init", r"unknown initialiser"),
    ("param_init_bad_range", spec(params={"A": {"shape": ["m"], "init": {"uniform": [1, 0]}}}), "params.A.init", r"low < high"),
    ("param_pos_and_neg", spec(params={"A": {"shape": ["m"], "positive": True, "negative": True}}), "params.A", r"both"),
    ("activation_unknown", spec(inputs=inputs_with(k={"shape": ["m"], "activation": "gelu"})), "inputs.k.activation", r"unknown activation"),
    ("normalize_scalar", spec(inputs=inputs_with(beta={"shape": [], "normalize": True})), "inputs.beta.normalize", r"vector"),
    ("summary_list", spec(summary=["a", "b"]), "summary", r"string"),
    # --- names ------------------------------------------------------------------------------
    ("bad_spec_name", spec(name="1abc"), "name", r"not a valid name"),
    ("bad_input_name", spec(inputs=inputs_with(**{"x-y": {"shape": ["d"]}})), "inputs.x-y", r"not a valid name"),
    ("name_too_long", spec(inputs=inputs_with(**{"a" * 33: {"shape": ["d"]}})), "inputs." + "a" * 33, r"not a valid name"),
    ("reserved_S_prev", spec(inputs=inputs_with(S_prev={"shape": ["d"]})), "inputs.S_prev", r"reserved"),
    ("reserved_function", spec(inputs=inputs_with(exp={"shape": ["d"]})), "inputs.exp", r"reserved"),
    ("input_named_like_dim", spec(inputs=inputs_with(d={"shape": ["d"]})), "inputs.d", r"already used"),
    ("input_named_like_state", spec(inputs=inputs_with(S={"shape": ["d"]})), "inputs.S", r"already used"),
    ("dim_named_like_state", spec(state={"S": ["S", "m"]}, inputs={"x": {"shape": ["S"]}, "k": {"shape": ["m"]}, "q": {"shape": ["m"]}},
                                  objective="sq(S - S_prev)/2 - dot(S*k, x)"), "state.S", r"already used|reserved|differ|state"),
    ("undeclared_in_objective", obj("sq(S - S_prev)/2 + wsq(S*kk - x, beta)/2"), "objective", r"unknown name 'kk'; declared: S, S_prev"),
    ("undeclared_in_output", spec(output="S*qq"), "output", r"unknown name 'qq'"),
    ("undeclared_in_let", spec(let={"r": "S*k - xx"}), "let.r", r"unknown name 'xx'"),
    ("let_cycle", spec(let={"a": "b + x", "b": "a + x"}, objective="sq(S - S_prev)/2 + sq(a)"), "let.a", r"unknown name 'b'|cycle"),
    ("let_self", spec(let={"a": "a + x"}), "let.a", r"unknown name 'a'|cycle"),
    ("let_shadows_input", spec(let={"x": "S*k"}), "let.x", r"already used"),
    # --- expressions: syntax and shapes ------------------------------------------------------------
    ("unknown_function", obj("sq(S - S_prev)/2 + foo(x)"), "objective", r"unknown function 'foo'"),
    ("wrong_arity", obj("sq(S - S_prev)/2 + dot(x)"), "objective", r"takes 2 argument"),
    ("function_without_call", obj("sq(S - S_prev)/2 + sq"), "objective", r"without arguments"),
    ("unbalanced_paren", obj("sq(S - S_prev/2"), "objective", r"syntax error.*expected '\)'"),
    ("trailing_operator", obj("sq(S - S_prev)/2 +"), "objective", r"syntax error"),
    ("shape_mismatch_Sx", obj("sq(S - S_prev)/2 + sq(S*x)"), "objective", r"cannot multiply \[d, m\] by \[d\]"),
    ("shape_mismatch_had", obj("sq(S - S_prev)/2 + dot(S*k, had(x, k))"), "objective", r"do not match"),
    ("outer_of_matrix", obj("sq(S - S_prev)/2 + sq(outer(S, k))"), "objective", r"outer\(\) takes two vectors"),
    ("diag_of_matrix", obj("sq(S - S_prev)/2 + sq(diag(S))"), "objective", r"diag\(\) takes a vector"),
    ("ones_of_input", obj("sq(S - S_prev)/2 + dot(S*ones(x), x)"), "objective", r"ones\(\) takes a dimension"),
    ("square_product", obj("sq(S - S_prev)/2 + sq(S*(outer(k, k)*outer(k, k))*q)"), "objective", r"square matri"),
    ("non_scalar_objective", obj("S - S_prev"), "objective", r"must be a scalar"),
    ("vector_objective", obj("S*k - x"), "objective", r"must be a scalar"),
    ("objective_without_state", obj("sq(x) + sq(k)"), "objective", r"does not depend on the state"),
    ("output_wrong_shape", spec(output="T(S)*x"), "output", r"vector over d"),
    ("output_matrix", spec(output="S"), "output", r"vector over d"),
    ("output_scalar", spec(output="dot(S*q, x)"), "output", r"vector over d"),
    ("output_reads_S_prev", spec(output="S_prev*q"), "output", r"S_prev"),
    ("output_without_state", spec(output="x"), "output", r"does not read the state"),
    ("output_reads_S_prev_via_let", spec(let={"r": "S*q + S_prev*q"}, output="r"), "output", r"S_prev"),
    ("let_shape_error", spec(let={"r": "S*x"}), "let.r", r"cannot multiply"),
    ("exponent_not_number", obj("sq(S - S_prev)/2 + sq(x)**sq(k)"), "objective", r"exponent"),
    # --- derivation -----------------------------------------------------------------------
    ("implicit_not_quadratic", obj("sq(S - S_prev)/2 + sq(S*k - x)**2"), "objective", r"not quadratic.*explicit"),
    ("implicit_exp", obj("sq(S - S_prev)/2 + sq(exp(S*k) - x)"), "objective", r"not quadratic.*explicit"),
    ("implicit_rank5", obj("sq(S - S_prev)/2 + sq(S*k - x)/2 + sq(S*q - x)/2 + sq(S*exp(k))/2 + sq(S*exp(q))/2 + sq(S*sigmoid(k))/2"),
     "objective", r"rank-5.*rank <= 4.*Woodbury.*explicit"),
    ("implicit_rank2_indefinite", obj("sq(S - S_prev)/2 + dot(S*k, S*q)"), "objective", r"convex.*minor.*rank-2.*-1, is negative"),
    ("newton_cauchy", spec(update="newton", objective="sq(S - S_prev)/2 + dot(beta, log(1 + had(S*k - x, S*k - x)))"),
     "objective", r"Hessian.*Newton.*convex.*rank-1"),
    ("newton_couples_rows", spec(update="newton", objective="sq(S - S_prev)/2 + sqrt(1 + sq(S*k - x))"),
     "objective", r"Hessian.*couples the rows.*explicit"),
    ("implicit_nonconvex", obj("-sq(S - S_prev)/2 + wsq(S*k - x, beta)/2"), "objective", r"convex"),
    ("implicit_linear_only", obj("dot(S*k, x)"), "objective", r"linear"),
    ("implicit_couples_rows", obj("sq(S - S_prev)/2 + sq(T(x)*S)"), "objective", r"rows|explicit"),
    ("diagonal_of_nonlinear", spec(update="explicit", approximation="diagonal", objective="log(1 + sq(S*k - x))"), "approximation", r"nonlinear"),
    # --- hostile input ----------------------------------------------------------------------------
    ("inject_import", obj("__import__('os').system('touch /tmp/ssmcraft_pwned')"), "objective", r"syntax error"),
    ("inject_class", obj("().__class__.__bases__[0]"), "objective", r"syntax error"),
    ("inject_lambda", obj("(lambda: 0)()"), "objective", r"syntax error"),
    ("inject_attribute", obj("sq(S - S_prev)/2 + sq(x.real)"), "objective", r"syntax error"),
    ("inject_subscript", obj("sq(S - S_prev)/2 + sq(x[0])"), "objective", r"syntax error"),
    ("inject_string", obj("sq(S - S_prev)/2 + 'a'"), "objective", r"syntax error"),
    ("inject_sympy_eval", obj("sq(S - S_prev)/2 + Symbol('x')"), "objective", r"syntax error|unknown function"),
    ("inject_sympy_name", obj("sq(S - S_prev)/2 + Symbol(x)"), "objective", r"unknown function 'Symbol'"),
    ("inject_semicolon", obj("sq(S - S_prev)/2; import os"), "objective", r"syntax error"),
    ("huge_exponent", obj("sq(S - S_prev)/2 + sq(x)**99999"), "objective", r"exponent"),
    ("huge_float_exponent", obj("sq(S - S_prev)/2 + sq(x)**1e9"), "objective", r"exponent"),
    ("long_literal", obj("sq(S - S_prev)/2 + " + "9" * 30 + "*dot(S*k, x)"), "objective", r"number literal longer"),
    ("deep_parens_5000", obj("(" * 5000 + "sq(S - S_prev)" + ")" * 5000), "objective", r"longer than|nested deeper"),
    ("deep_parens_100", obj("(" * 100 + "sq(S - S_prev)" + ")" * 100), "objective", r"nested deeper"),
    ("deep_unary_200", obj("-" * 200 + "sq(S - S_prev)"), "objective", r"nested deeper"),
    ("deep_calls_60", obj("exp(" * 60 + "dot(S*k, x)" + ")" * 60), "objective", r"nested deeper"),
    ("long_expression", obj(" + ".join(["dot(S*k, x)"] * 400)), "objective", r"longer than"),
    ("too_many_nodes", obj("+".join(["x"] * 1999)), "objective", r"more than .* nodes"),
    ("division_by_zero", obj("sq(S - S_prev)/0"), "objective", r"zero|infinite|undefined|not finite|zoo"),
    ("zero_to_negative_power", obj("sq(S - S_prev)/2 + 0**-1*dot(S*k, x)"), "objective", r"zero|infinite|undefined|not finite|zoo"),
    ("log_of_zero", obj("sq(S - S_prev)/2 + log(0)*dot(S*k, x)"), "objective", r"zero|infinite|undefined|not finite|zoo"),
    # several states (objectives/momentum_longhorn.yaml's form)
    ("multi_objective_string", multi(objective="sq(S - S_prev)"), "objective", r"mapping state -> loss"),
    ("multi_objective_unknown_state", multi(objective={**MULTI_OBJ, "V": "sq(S)"}), "objective.V", r"unknown key; allowed: D, S"),
    ("multi_objective_missing_state", multi(objective={"D": MULTI_OBJ["D"]}), "objective.S", r"missing"),
    ("multi_reads_later_state", multi(objective={**MULTI_OBJ, "D": "sq(D - D_prev)/2 + dot(S*k, x)"}), "objective.D",
     r"'S' is the new value of a state updated after D.*use S_prev"),
    ("multi_reads_later_via_let", multi(let={"z": "S*k"}, objective={**MULTI_OBJ, "D": "sq(D - D_prev)/2 + dot(z, x)"}),
     "objective.D", r"reads 'S' \(through a let\)"),
    ("multi_loss_ignores_state", multi(objective={**MULTI_OBJ, "S": "sq(D - S_prev)"}), "objective.S", r"does not depend on the state S"),
    ("multi_loss_not_scalar", multi(objective={**MULTI_OBJ, "S": "S - S_prev"}), "objective.S", r"must be a scalar"),
    ("multi_shapes_differ", multi(state={"D": ["d", "m"], "S": ["m", "d"]}), "state.S", r"first state's shape \[d, m\]"),
    ("multi_state_named_prev", multi(state={"D": ["d", "m"], "D_prev": ["d", "m"]}), "state.D_prev", r"previous value"),
    ("multi_input_clashes_prev", multi(inputs=inputs_with(D_prev={"shape": ["d"]})), "inputs.D_prev", r"already used"),
    ("multi_update_bad", multi(update="newton2"), "update", r"implicit or explicit"),
    ("multi_update_unknown_state", multi(update={"D": "implicit", "X": "implicit"}), "update.X", r"unknown key"),
    ("multi_update_missing_state", multi(update={"D": "implicit"}), "update.S", r"missing"),
    ("multi_update_bad_value", multi(update={"D": "implicit", "S": 3}), "update.S", r"implicit or explicit"),
    ("multi_approximation_list", multi(approximation=["exact"]), "approximation", r"mapping state -> value"),
    ("multi_approximation_diagonal", multi(approximation={"D": "diagonal"}), "approximation.D", r"not supported with several states"),
    ("multi_output_reads_prev", multi(output="S_prev*q"), "output", r"new states, not S_prev"),
    ("multi_output_reads_prev_via_let", multi(let={"w": "S_prev*q", "r": "S*q + w"}, output="r"), "output",
     r"reads S_prev \(through a let\).*let\.r"),
    ("multi_reads_later_via_two_lets", multi(let={"z": "S*k", "zz": "2*z"}, objective={**MULTI_OBJ, "D": "sq(D - D_prev)/2 + dot(zz, x)"}),
     "objective.D", r"reads 'S' \(through a let\).*use S_prev \(let\.zz\)"),
    ("multi_approximation_diagonal_all", multi(approximation="diagonal"), "approximation", r"not supported with several states"),
    ("multi_output_reads_none", multi(output="x"), "output", r"reads none of the states"),
    ("multi_implicit_not_quadratic", multi(objective={**MULTI_OBJ, "D": "sq(D - D_prev)/2 + exp(dot(D*k, x))"}),
     "objective.D", r"not quadratic in D, so it has no closed-form minimiser; use update\.D: explicit$"),  # no newton here
    # --- constants the generated code cannot hold: not real, or folded out of range --------------
    ("const_not_real_sqrt", obj("sqrt(-1)*wsq(S*k - x, beta)/2"), "objective", r"not real"),
    ("const_not_real_log", obj("sq(S - S_prev)/2 + log(-1)*dot(S*k, x)"), "objective", r"not real"),
    ("const_folds_huge_power", obj("sq(S - S_prev)/2 + (1e30)**16*wsq(S*k - x, beta)/2"), "objective",
     r"folds to .* out of the range"),
    ("const_folds_huge_product", obj("sq(S - S_prev)/2 + 1e30*1e30*1e30*wsq(S*k - x, beta)/2"), "objective",
     r"out of the range"),
    ("const_folds_tiny", obj("sq(S - S_prev)/2 + (1e-20)**2*wsq(S*k - x, beta)/2"), "objective", r"out of the range"),
    ("const_folds_huge_function", obj("sq(S - S_prev)/2 + exp(1000)*wsq(S*k - x, beta)/2"), "objective",
     r"folds to 1\.97E\+434, out of the range"),
    # a refusal shows sums as sums, not as the compiler's internal reduction symbols (_r8)
    ("newton_silu_not_convex", spec(objective="sq(S - S_prev)/2 + dot(beta, silu(S*k - x))", update="newton"),
     "objective", r"^(?!.*\b_r\d).*weight of its rank-1 part, .*Sum\(S_prev\[i, j\]\*k\[j\]"),
    # --- param initialisers that torch could not follow ------------------------------------------
    ("init_normal_negative_std", spec(params={"A": {"shape": ["m"], "init": {"normal": [-1, -0.5]}}}),
     "params.A.init", r"std >= 0"),
    ("init_uniform_inf", spec(params={"A": {"shape": ["m"], "init": {"uniform": [0, float("inf")]}}}),
     "params.A.init", r"finite numbers"),
    ("init_constant_nan", spec(params={"A": {"shape": ["m"], "init": float("nan")}}), "params.A.init", r"finite number"),
    # the quadratic part's coefficient, refused, shows its sums as sums (as the rank-1 weight's below)
    ("quadratic_part_shows_sums", obj("sq(S - S_prev)/2*dot(S_prev*k, x) + wsq(S*k - x, beta)/2"), "objective",
     r"^(?!.*\b_r\d).*quadratic part, Sum\(x\[i\]\*Sum\(S_prev"),
    ("multi_unknown_name", multi(objective={**MULTI_OBJ, "S": "sq(S - S_prev - E)/2"}), "objective.S", r"unknown name 'E'"),
]


def _write(tmp_path, case_id, text) -> Path:
    p = tmp_path / f"{case_id}.yaml"
    p.write_text(text, encoding="utf-8")
    return p


def test_table_is_large_and_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) >= 30 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case_id, text, key, pattern", CASES, ids=[c[0] for c in CASES])
def test_malformed_spec(case_id, text, key, pattern, tmp_path):
    path = _write(tmp_path, case_id, text)
    INJECTION_MARKER.unlink(missing_ok=True)
    with time_limit(CASE_SECONDS):
        with pytest.raises(SpecError) as ei:
            ssmcraft.compile(str(path))
    e = ei.value
    msg = str(e)
    assert "\n" not in msg, f"error is not one line: {msg!r}"
    assert msg.startswith(str(path) + ":"), f"error does not name the file first: {msg!r}"
    assert e.source == str(path)
    assert e.key == key, f"key {e.key!r}, expected {key!r} ({msg})"
    import re
    assert re.search(pattern, e.problem, re.I | re.S), f"problem {e.problem!r} does not match {pattern!r}"
    assert len(msg) < 2000, "the message should be short"
    assert not INJECTION_MARKER.exists(), "spec text ran code"


@pytest.mark.parametrize("case_id", ["multi_reads_later_state", "multi_reads_later_via_let", "multi_approximation_diagonal",
                                     "multi_approximation_diagonal_all", "multi_output_reads_prev",
                                     "multi_output_reads_prev_via_let", "output_reads_S_prev_via_let"])
def test_what_a_state_may_read_is_checked_at_the_spec_stage(case_id):
    """These problems are the spec stage's (``load_spec``: no sympy), named with their key."""
    from ssmcraft.compiler.spec import load_spec

    text, key, pattern = next(c[1:] for c in CASES if c[0] == case_id)
    with pytest.raises(SpecError) as ei:
        load_spec(text)
    import re
    assert ei.value.key == key and re.search(pattern, ei.value.problem, re.I | re.S), str(ei.value)


@pytest.mark.parametrize("bad", [
    "a" * 300,                       # a library name that cannot be a file name
    "a" * 300 + ".yaml",             # a path whose name is too long
    "objectives/no_such_objective.yaml",
    "no/such/dir/x.yaml",
    "no/such/dir/deltanet.yaml",     # a library file's name in a folder that is not there: not the library's
    "nosuch.txt",                    # neither a file nor a library name
])
def test_bad_spec_arguments(bad):
    with time_limit(CASE_SECONDS):
        with pytest.raises(SpecError) as ei:
            ssmcraft.compile(bad)
    assert "\n" not in str(ei.value) and str(ei.value).startswith(bad + ": ")


def test_a_folder_is_not_a_spec_file():
    with pytest.raises(SpecError) as ei:
        ssmcraft.compile(str(ROOT / "objectives"))
    assert ei.value.problem == "a folder, not a spec file", str(ei.value)


def test_a_spec_file_is_read_whatever_its_name_ends_with(tmp_path, monkeypatch):
    text = (ROOT / "objectives" / "longhorn.yaml").read_text()
    monkeypatch.chdir(tmp_path)
    for name in ("lh.spec", "LH.YAML", "lh"):                          # bare names: not the '/' rule
        (tmp_path / name).write_text(text)
        assert ssmcraft.compile(name).spec.source == name
    (tmp_path / "mamba").write_text(text)                               # a file here named like a library objective
    assert ssmcraft.compile("mamba").spec.source == str(ROOT / "objectives" / "mamba.yaml")
    with pytest.raises(SpecError) as ei:                                # any-case suffix: a path, not YAML text
        ssmcraft.compile("NOSUCH.YAML")
    assert ei.value.problem == "no such file"
    assert ssmcraft.compile("deltanet.yaml").spec.source == str(ROOT / "objectives" / "deltanet.yaml")
    one_line = yaml.safe_dump(BASE, default_flow_style=True, width=10_000).strip()      # YAML text holding '/'
    assert "\n" not in one_line and "/" in one_line and ssmcraft.compile(one_line).spec.source == "<text>"


def test_an_unwritable_cache_folder_is_one_error(tmp_path, monkeypatch):
    from ssmcraft.compiler import cache
    from ssmcraft.errors import SsmcraftError

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("SSMCRAFT_CACHE", str(tmp_path / "afile"))
    with pytest.raises(SsmcraftError, match="cache folder .*afile/generated: Not a directory \\(set SSMCRAFT_CACHE"):
        cache.cache_dir()


@pytest.mark.parametrize("bad", [42, 3.5, None, ["name: t"], b"name: t"])
def test_bad_spec_argument_types(bad):
    with pytest.raises(SpecError):
        ssmcraft.compile(bad)


# Number literals that are short to write but huge as exact rationals. Each runs in its own
# subprocess with a CPU-time limit (5 s; loading + deriving a spec takes < 1 s) and a 2 GB
# address-space limit, because a C-level big-integer computation cannot be interrupted
# in-process and an interrupted sympy can leave corrupted caches behind.
# Literals outside float64's range cannot be honoured by generated code: SpecError. A large
# but representable one (1e300) may be accepted, but the derivation must stay fast.
LITERAL_CASES = {
    "huge_literal_1e300": ("1e300", False),
    "huge_literal_1e999999": ("1e999999", True),
    "tiny_literal_1e-999999": ("1e-999999", True),
    "huge_literal_1e99999999999": ("1e99999999999", True),
}
_LITERAL_SCRIPT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
resource.setrlimit(resource.RLIMIT_CPU, (5, 5))
from ssmcraft.compiler.spec import load_spec
from ssmcraft.compiler.symbolic import symbolic_objective
from ssmcraft.compiler.structure import build_ir
from ssmcraft.errors import SpecError
try:
    build_ir(symbolic_objective(load_spec(sys.argv[1])))
    print('COMPILED')
except SpecError as e:
    print('SPECERROR|' + e.key + '|' + e.problem)
"""


def test_huge_number_literals_are_rejected_quickly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {}
    for cid, (lit, _) in LITERAL_CASES.items():
        path = _write(tmp_path, cid, obj(f"sq(S - S_prev)/2 + {lit}*dot(S*k, x)"))
        procs[cid] = subprocess.Popen([sys.executable, "-c", _LITERAL_SCRIPT, str(path)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    failures = []
    for cid, p in procs.items():
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            failures.append(f"{cid}: no answer in 120 s")
            continue
        ok = out.startswith("SPECERROR|objective|") or (not LITERAL_CASES[cid][1] and out.startswith("COMPILED"))
        if not ok:
            why = "killed at the 5 s CPU limit" if p.returncode in (-24, 152) else f"rc={p.returncode}"
            failures.append(f"{cid}: {why}; stdout={out.strip()[:200]!r} stderr={err.strip()[-300:]!r}")
    assert not failures, "\n".join(failures)


CLI_CASES = ["yaml_unclosed_flow", "inject_import", "implicit_rank5"]   # each subprocess imports torch: ~4 s CPU


def test_cli_prints_one_line_and_exits_2(tmp_path):
    table = {c[0]: c for c in CASES}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {}
    for cid in CLI_CASES:
        path = _write(tmp_path, cid, table[cid][1])
        procs[cid] = (path, subprocess.Popen([sys.executable, "-m", "ssmcraft.cli", "derive", str(path)],
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT))
    failures = []
    for cid, (path, p) in procs.items():
        try:
            out, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            failures.append(f"{cid}: timed out")
            continue
        lines = err.strip().splitlines()
        if p.returncode != 2 or len(lines) != 1 or "Traceback" in err or str(path) not in err or out.strip():
            failures.append(f"{cid}: rc={p.returncode}, stderr={err[-600:]!r}, stdout={out[-200:]!r}")
        elif not lines[0].startswith("ssmcraft derive: error: "):
            failures.append(f"{cid}: unexpected prefix {lines[0]!r}")
    assert not failures, "\n".join(failures)


# ======================================================================================
# Identifiers that collide with Python or the generated code
# ======================================================================================
HOSTILE_TEMPLATE = {
    "name": "hostile",
    "state": {"S": ["d", "m"]},
    "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"]}, "q": {"shape": ["m"]},
               "delta": {"shape": ["d"], "positive": True}},
    "params": {"A": {"shape": ["d", "m"], "negative": True, "init": {"constant": -1.0}}},
    "objective": "sq(S - had(exp(had(delta, A)), S_prev))/2 - dot(S*k, had(delta, softplus(x)))",
    "update": "implicit",
    "output": "S*q",
}
HOSTILE = ["lambda", "None", "torch", "F", "env", "co"]   # Python keywords; names the generated code uses


def _rename(where: str, new: str) -> dict:
    import re
    d = copy.deepcopy(HOSTILE_TEMPLATE)
    old = {"input": "delta", "dim": "d", "state": "S"}[where]
    sub = lambda s: re.sub(rf"\b{old}\b(?!_prev)", new, s)            # noqa: E731
    for key in ("objective", "output"):
        d[key] = sub(d[key])
    if where == "input":
        d["inputs"] = {new if n == old else n: v for n, v in d["inputs"].items()}
    elif where == "dim":
        d["state"] = {"S": [new, "m"]}
        for decl in [*d["inputs"].values(), *d["params"].values()]:
            decl["shape"] = [new if s == old else s for s in decl["shape"]]
    else:
        d["state"] = {new: ["d", "m"]}
    return d


@pytest.mark.parametrize("where", ["input", "dim", "state"])
@pytest.mark.parametrize("ident", HOSTILE)
def test_hostile_identifiers(ident, where):
    """Either a SpecError naming the declaration, or a recurrence that computes the right thing:
    S_t = exp(delta A) . S_prev + (delta softplus(x)) k^T, y = S_t q."""
    raw = _rename(where, ident)
    try:
        with time_limit(CASE_SECONDS):
            o = ssmcraft.compile(raw)
    except SpecError as e:
        assert "\n" not in str(e) and ident in str(e), str(e)
        return
    g = torch.Generator().manual_seed(0)
    Bn, Tn, Hn, d, m = 1, 3, 1, 3, 4
    delta_name = ident if where == "input" else "delta"
    inputs = {"x": torch.randn(Bn, Tn, Hn, d, generator=g, dtype=torch.float64),
              "k": torch.randn(Bn, Tn, Hn, m, generator=g, dtype=torch.float64),
              "q": torch.randn(Bn, Tn, Hn, m, generator=g, dtype=torch.float64),
              delta_name: torch.rand(Bn, Tn, Hn, d, generator=g, dtype=torch.float64) + 0.1}
    A = -torch.rand(d, m, generator=g, dtype=torch.float64) - 0.1
    S0 = torch.randn(Bn, Hn, d, m, generator=g, dtype=torch.float64)
    y, S = o.reference(inputs, {"A": A}, initial_state=S0)
    Sx, ys = S0.clone(), []
    for t in range(Tn):
        dl, x, k, q = (inputs[n][:, t] for n in (delta_name, "x", "k", "q"))
        Sx = torch.exp(dl[..., :, None] * A) * Sx + (dl * torch.nn.functional.softplus(x))[..., :, None] * k[..., None, :]
        ys.append((Sx @ q[..., None])[..., 0])
    torch.testing.assert_close(y, torch.stack(ys, 1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, Sx, rtol=1e-10, atol=1e-10)


# ======================================================================================
# Property tests
# ======================================================================================
NAMES = ["S", "S_prev", "x", "k", "q", "beta", "d", "m", "kk", "S_t", "_x", "__import__", "lambda", "os", "A"]
FUNCS = sorted(E.FUNCTIONS) + ["eval", "exec", "getattr", "Symbol"]
# (literals above ~1e100 are covered by test_huge_number_literals_are_rejected_quickly, in subprocesses)
NUMBERS = ["0", "1", "2", "0.5", ".5", "1.", "3e-2", "1e3", "1e30", "16", "17", "0.25", "-1", "99999", "1e-9", "0.333"]
TOKENS = ["+", "-", "*", "/", "**", "(", ")", ",", " "] + NAMES + FUNCS + [f" {n} " for n in NUMBERS]
JUNK = ["'", '"', ".", ":", "[", "]", "{", "}", "#", "\\", "\n", "\t", "λ", "٣", "()", "lambda:", ";", "=", "@", "%",
        "__class__", "!", "&", "|", "`", "\x00", "\u2028", "_"]

atoms = st.one_of(st.sampled_from(NAMES), st.sampled_from(NUMBERS))


def _extend(children):
    return st.one_of(
        st.tuples(children, st.sampled_from(["+", "-", "*", "/", "**"]), children).map(lambda t: f"{t[0]} {t[1]} {t[2]}"),
        st.tuples(st.sampled_from(FUNCS), st.lists(children, min_size=0, max_size=3)).map(lambda t: f"{t[0]}({', '.join(t[1])})"),
        children.map(lambda c: f"({c})"),
        children.map(lambda c: f"-{c}"),
    )


grammar_exprs = st.recursive(atoms, _extend, max_leaves=10)
token_soup = st.lists(st.sampled_from(TOKENS + JUNK), max_size=25).map("".join)
expressions = st.one_of(grammar_exprs, grammar_exprs.map(lambda e: f"sq(S - S_prev)/2 + {e}"), token_soup,
                        st.text(max_size=40))


PROPERTY_SETTINGS = dict(max_examples=120, deadline=None, derandomize=True, database=None,
                         phases=[Phase.explicit, Phase.generate],
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                HealthCheck.filter_too_much])


def _compile_and_run(text):
    """compile(text) raises only SpecError; when it compiles, the reference runs."""
    with time_limit(5):
        try:
            o = ssmcraft.compile(text)
        except SpecError as e:
            assert "\n" not in str(e)
            return
        sizes = {o.spec.dims[0]: 2, o.spec.dims[1]: 3}
        g = torch.Generator().manual_seed(0)
        inputs = {n: torch.rand(1, 2, 1, *[sizes[s] for s in decl.shape], generator=g, dtype=torch.float64) + 0.1
                  for n, decl in o.spec.inputs.items()}
        params = {n: -torch.rand(*[sizes[s] for s in decl.shape], generator=g, dtype=torch.float64) - 0.1
                  for n, decl in o.spec.params.items()}
        y, S = o.reference(inputs, params)
        assert y.shape == (1, 2, 1, 2) and S.shape == (1, 1, 2, 3)


@settings(**PROPERTY_SETTINGS)
@given(objective=expressions, output=st.one_of(st.just("S*q"), expressions),
       update=st.sampled_from(["implicit", "explicit"]), approximation=st.sampled_from(["exact", "diagonal"]))
def test_random_expressions_only_raise_spec_error(objective, output, update, approximation):
    d = copy.deepcopy(BASE)
    d.update(objective=objective, output=output, update=update, approximation=approximation)
    _compile_and_run(yaml.safe_dump(d))


KEYS = ["name", "state", "inputs", "objective", "update", "output", "params", "let", "approximation", "summary",
        "foo", "S", "x", "shape", "positive", "init", "- ", "? ", "!!python/name:os.system", "<<", "&a", "*a"]
VALUES = ["t", "{S: [d, m]}", "[d]", "[d, m]", "{x: {shape: [d]}}", "implicit", "explicit", "exact", "diagonal",
          "true", "1", "null", "[", "{", "&a x", "*a", "!!binary aGk=", "'", '"', "|", ">", "2020-01-01", "-.inf",
          "{uniform: [0, 1]}", "{A: {shape: [d, m], init: s4d_real}}", "~", "0x1F", "[[[[]]]]"]


@st.composite
def yamlish(draw):
    lines = []
    for _ in range(draw(st.integers(0, 10))):
        indent = " " * draw(st.sampled_from([0, 0, 0, 2, 4, 1]))
        key = draw(st.sampled_from(KEYS))
        value = draw(st.one_of(st.sampled_from(VALUES), expressions.map(lambda e: '"' + e.replace('"', "'") + '"'),
                               st.text(max_size=10)))
        lines.append(f"{indent}{key}: {value}")
    return "\n".join(lines) + draw(st.sampled_from(["", "\n"]))


@st.composite
def mutated_base(draw):
    """The valid BASE text with a few random edits (deletions, insertions, duplicated lines)."""
    text = BASE_TEXT
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["delete", "insert", "dup", "swap"]))
        i = draw(st.integers(0, len(text)))
        if op == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 8)):]
        elif op == "insert":
            text = text[:i] + draw(st.sampled_from(TOKENS + JUNK + VALUES)) + text[i:]
        elif op == "dup":
            lines = text.splitlines(keepends=True)
            j = draw(st.integers(0, len(lines) - 1))
            text = "".join(lines[:j + 1] + [lines[j]] + lines[j + 1:])
        else:
            lines = text.splitlines(keepends=True)
            j = draw(st.integers(0, len(lines) - 2))
            lines[j], lines[j + 1] = lines[j + 1], lines[j]
            text = "".join(lines)
    return text


@settings(**PROPERTY_SETTINGS)
@given(text=st.one_of(yamlish(), mutated_base(), st.text(max_size=200)))
def test_random_spec_text_only_raises_spec_error(text):
    with time_limit(5):
        try:
            ssmcraft.load_spec(text)
        except SpecError as e:
            assert "\n" not in str(e)
    _compile_and_run(text)
