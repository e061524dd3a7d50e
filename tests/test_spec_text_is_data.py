"""Spec text is data: nothing in an objective spec runs code, on any path that imports generated code.

- the spec of the report (a ``source:`` label whose newline used to end the comment it was pasted
  into, so that the next line, ``open(...)``, ran on import) on compile (mapping, YAML text and
  file), ``ssmcraft search --check``, a search trial, ``ssmcraft eval`` of a run trained from it and
  ``ssmcraft export``: the file the payload would create is absent after each;
- ``safe_source``: the escaping reads back exactly and never yields a statement; the AST allowlist
  refuses what generated code never needs; the cache never imports a refused module and never runs
  a cached file whose text is not the checked one;
- multi-line and newline-ended spec text works through derive, train and export (a folded
  ``objective: >``, an ``output`` ending in a newline, a run folder whose path holds quotes);
- the objective-spec refusals of the report: a billion-laughs spec, deep nesting, a huge ``init``,
  digits of other scripts, a name ending in a newline; a constant >= 2**64 compiles and runs.
"""
from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

import pytest
import torch
import yaml

import ssmcraft
from helpers import random_inputs, time_limit
from ssmcraft import cli
from ssmcraft.compiler import cache, safe_source
from ssmcraft.errors import SpecError, SsmcraftError

HOSTILE_TEXT = [
    "x\nopen('/tmp/x', 'w')\n#", 'a"""b', "a'''b", "ends with a backslash \\", "\\n literal", "\r\nimport os",
    "nul\x00byte", "line\u2028sep", "form\x0cfeed", "# -*- coding: utf-7 -*-", "coding=rot13", "٥ Ω ℌ ﬁ",
    "\"; __import__('os').system('true'); \"", "tab\there", "emoji \U0001F600", "", "\x85next", "a\\\nb",
]


def pwn_spec(target: Path) -> str:
    """The objective spec of the report, its payload aimed at ``target``."""
    return (
        "name: e\n"
        f'source: "x\\nopen(\\"{target}\\", \\"w\\")\\n#"\n'
        "state: {S: [d, m]}\n"
        "inputs: {x: {shape: [d]}, k: {shape: [m]}}\n"
        'objective: "sq(S - S_prev)/2 - dot(S*k, x)"\n'
        "update: implicit\n"
        'output: "S*k"\n'
    )


def hostile_folder(root: Path, target: Path) -> Path:
    """A folder whose path ends a comment line and runs ``open(target)`` if pasted raw: a spec file's
    path is its label (a mapping's label is its ``source:``)."""
    return root / f"x\nopen({str(target)!r}, 'w')\n#"


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty generated-code cache and no generated module in ``sys.modules``, so that the next
    compile writes and imports its modules again."""
    monkeypatch.setenv("SSMCRAFT_CACHE", str(tmp_path / "cache"))
    for name in [n for n in sys.modules if n.startswith("ssmcraft_generated_")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path / "cache" / "generated"


def only_escaped(source: str, marker: str) -> bool:
    """Whether ``marker`` occurs in ``source`` only inside comments and string literals."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING) and marker in tok.string:
            return False
    return True


# -- safe_source ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text", HOSTILE_TEXT)
def test_escaped_text_reads_back_and_is_never_code(text):
    assert ast.literal_eval(safe_source.string(text)) == text
    assert ast.literal_eval(safe_source.docstring(text)) == text
    module = safe_source.comment(text) + "\nX = 1\n"
    assert [type(n).__name__ for n in ast.parse(module).body] == ["Assign"]
    assert all(ch.isprintable() for ch in safe_source.escape(text))
    # a comment on a module's first lines must not pick its encoding (PEP 263)
    compile(safe_source.comment(text).encode("utf-8") + b"\nX = 1\n", "<t>", "exec")


@pytest.mark.parametrize("source, problem", [
    ("open('/tmp/x', 'w')\n", "reads 'open'"),
    ("import os\n", "imports os"),
    ("from os import system\n", "imports system from os"),
    ("x = (1).__class__\n", "attribute '__class__'"),
    ("y = __import__('os')\n", "'__import__'"),
    ("f = lambda: 0\n", "Lambda is not allowed"),
    ("class A:\n    pass\n", "ClassDef is not allowed"),
    ("import torch\n@torch.no_grad()\ndef f():\n    pass\n", "decorator 'torch.no_grad()'"),
    ("def f():\n    global g\n", "Global is not allowed"),
    ("with x:\n    pass\n", "With is not allowed"),
    ("x = [i for i in range(3)]\n", "ListComp is not allowed"),
    ("def f(:\n", "does not parse"),
])
def test_the_allowlist_refuses_what_generated_code_never_needs(source, problem):
    with pytest.raises(safe_source.GeneratedCodeError) as e:
        safe_source.check(source, "generated module t")
    assert problem in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_allowlist_passes_every_generated_library_module(compiled):
    from ssmcraft.compiler.library import library_names
    from ssmcraft.compiler.printing import TorchPrinter

    for name in library_names():
        assert safe_source.problem(compiled(name).source) is None, name
    printed = {f.split(".", 1)[1] for f in TorchPrinter._torch_functions.values() if f.startswith("torch.")}
    assert printed <= dict(safe_source.GENERATED.module_attributes)["torch"]


@pytest.mark.parametrize("source, problem", [
    ("import torch\nx = torch.load('f')\n", "torch.load is not allowed"),
    ("import torch\nx = torch.hub.load('a', 'b')\n", "torch.hub is not allowed"),
    ("import torch\nt = torch\nx = t.load('f')\n", "the module 'torch' used other than as"),
    ("import torch as t\n", "imports torch as t;"),
    ("import triton\nx = triton.runtime\n", "triton.runtime is not allowed"),
    ("import torch\ndef f(x):\n    return torch.exp(x) + torch.sqrt(x)\n", None),
])
def test_modules_that_reach_files_are_held_to_what_generated_code_calls(source, problem):
    found = safe_source.problem(source)
    assert (found is None) if problem is None else (problem in found), found


def test_a_refused_module_is_neither_written_nor_imported(fresh_cache, tmp_path):
    target = tmp_path / "PWNED"
    text = f"open({str(target)!r}, 'w')\n"
    with pytest.raises(safe_source.GeneratedCodeError, match="refused to import generated code: line 1: reads 'open'"):
        cache.load_generated("ref_t", cache.key_for("t", text), text)
    assert not target.exists() and not any(fresh_cache.glob("ref_t_*"))


def test_a_tampered_cache_file_is_rewritten_and_never_run(fresh_cache, tmp_path):
    target = tmp_path / "PWNED"
    obj = ssmcraft.compile("longhorn")
    (path,) = fresh_cache.glob("ref_longhorn_*.py")
    assert path.read_text() == obj.source
    path.write_text(obj.source + f"\nopen({str(target)!r}, 'w')\n")
    sys.modules.pop(obj.module.__name__)
    again = ssmcraft.compile("longhorn")
    assert not target.exists()
    assert path.read_text() == obj.source                        # rewritten from the checked text
    assert again.module is not obj.module and again.module.__file__ == str(path)


def test_the_module_run_is_the_checked_text_not_the_file(fresh_cache, tmp_path, monkeypatch):
    """A file changed between the check and the import is not what runs."""
    target = tmp_path / "PWNED"
    text = "X = 1\n"
    real = cache.write_text

    def write_then_tamper(path, source):
        real(path, source + f"open({str(target)!r}, 'w')\n")
    monkeypatch.setattr(cache, "write_text", write_then_tamper)
    module = cache.load_generated("ref_t", cache.key_for("tamper", text), text)
    assert module.X == 1 and not target.exists()


# -- the report's spec on every path ---------------------------------------------------------------
def test_the_reported_spec_runs_nothing_on_compile(fresh_cache, tmp_path):
    target = tmp_path / "PWNED"
    text = pwn_spec(target)
    folder = hostile_folder(tmp_path, target)
    folder.mkdir(parents=True)
    (folder / "e.yaml").write_text(text)
    for spec in (yaml.safe_load(text), text, folder / "e.yaml"):
        for name in [n for n in sys.modules if n.startswith("ssmcraft_generated_")]:
            del sys.modules[name]
        obj = ssmcraft.compile(spec)
        y, _ = obj.reference(*random_inputs(obj.spec, B=1, T=2, H=1))
        assert torch.isfinite(y).all()
        assert not target.exists()
        assert safe_source.problem(obj.source) is None and only_escaped(obj.source, "open(")


def _search_spec(tmp_path: Path, objective_file: str, trials: int = 1) -> Path:
    from ssmcraft.search.testing import tiny_spec

    raw = tiny_spec(budget={"trials": trials, "tokens_per_trial": 256, "seconds_per_trial": 60, "timeout_grace": 30},
                    space={"objective": {"choice": [objective_file]}, "lr": {"float": [1e-3, 1e-2], "log": True}},
                    sampler={"name": "random"}, task={"name": "mqar", "seq_len": 16}, model={"d_model": 16, "n_layers": 1})
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_reported_spec_runs_nothing_in_search_check(fresh_cache, tmp_path, capsys):
    target = tmp_path / "PWNED"
    (tmp_path / "e.yaml").write_text(pwn_spec(target))
    spec = _search_spec(tmp_path, "e.yaml")
    assert cli.main(["search", str(spec), "--out", str(tmp_path / "run"), "--check"]) == 0
    assert "valid; all 1 variants of the space derive" in capsys.readouterr().out
    assert not target.exists()


def test_the_reported_spec_runs_nothing_in_a_trial_eval_or_export(fresh_cache, tmp_path, capsys, monkeypatch):
    """One search trial trains the objective, ``ssmcraft eval`` evaluates a run trained from it and
    ``ssmcraft export`` exports the trial (each with an empty cache: each writes and imports its
    generated code again)."""
    from ssmcraft.search import InlineExecutor, find_trial, load_search_spec, run_search

    target = tmp_path / "PWNED"
    (tmp_path / "e.yaml").write_text(pwn_spec(target))
    result = run_search(load_search_spec(_search_spec(tmp_path, "e.yaml")), tmp_path / "run",
                        executor=InlineExecutor(), plots=False, log=lambda line: None)
    assert result.counts.get("complete") == 1, result.counts
    assert not target.exists()

    for fresh in (fresh_cache.parent / "eval", fresh_cache.parent / "export"):
        for name in [n for n in sys.modules if n.startswith("ssmcraft_generated_")]:
            del sys.modules[name]
        monkeypatch.setenv("SSMCRAFT_CACHE", str(fresh))
        if fresh.name == "eval":
            assert cli.main(["eval", str(find_trial(tmp_path / "run")), "--extrapolate", "2", "--batches", "1", "--batch-size", "2"]) == 0
        else:
            assert cli.main(["export", str(tmp_path / "run"), "--trial", "best", "--out", str(tmp_path / "exp")]) == 0
            text = next((tmp_path / "exp").glob("*.py")).read_text()
            assert only_escaped(text, "open(\\\"") and "verified" in capsys.readouterr().out
        assert not target.exists() and any(fresh.glob("generated/ref_e_*.py"))   # this step imported its own


# -- multi-line and newline-ended spec text works through derive, train and export ----------------
MULTILINE = """\
name: folded
summary: |
  two lines of summary, with "quotes", \'\'\'triple\'\'\' and \"\"\"triple\"\"\" quotes
  and a backslash \\ at the end \\
state: {S: [d, m]}
inputs: {x: {shape: [d]}, k: {shape: [m]}, q: {shape: [m]}, beta: {shape: [d], positive: true}}
objective: STYLE
  sq(S - S_prev)/2
  + wsq(S*k - x, beta)/2
update: implicit
output: "S*q\\n"
"""


@pytest.mark.parametrize("style, loss", [
    (">", "#   loss L(S) = sq(S - S_prev)/2 + wsq(S*k - x, beta)/2\n#       (update"),     # folded: one line + "\n"
    ("|", "#   loss L(S) = sq(S - S_prev)/2\n#   + wsq(S*k - x, beta)/2\n#       (update"),  # literal: two lines
])
def test_multiline_spec_text_derives_trains_and_exports(fresh_cache, tmp_path, capsys, style, loss):
    from ssmcraft.export.exporter import export
    from ssmcraft.train import train_run

    spec = tmp_path / "folded.yaml"
    spec.write_text(MULTILINE.replace("STYLE", style))
    assert cli.main(["derive", str(spec)]) == 0
    assert "rank1" in capsys.readouterr().out
    raw = yaml.safe_load(spec.read_text())
    assert "\n" in raw["objective"] and raw["output"].endswith("\n")
    run = tmp_path / 'run """quoted\'\'\' \\ folder'
    config = {"name": "t", "seed": 0, "task": {"name": "mqar", "seq_len": 16},
              "model": {"d_model": 16, "n_layers": 1,
                        "mixer": {"kind": "objective", "objective": raw, "state_size": 4}},
              "train": {"batch_size": 4, "tokens": 256, "eval_every": 0, "eval_batches": 1, "eval_batch_size": 4}}
    assert train_run(config, run)["status"] == "ok"
    result = export(run, tmp_path / "exp")
    assert result.verified["max_abs_diff"] < 1e-5
    text = result.module.read_text()
    assert loss in text
    assert only_escaped(text, "quoted" + "'" * 3) and only_escaped(text, "triple" + "'" * 3)


# -- objective-spec refusals ---------------------------------------------------------------------
BASE = {"name": "e", "state": {"S": ["d", "m"]}, "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"]}},
        "objective": "sq(S - S_prev)/2 - dot(S*k, x)", "update": "implicit", "output": "S*k"}


def laughs(levels: int = 9) -> str:
    """The billion-laughs spec: each level an alias list of nine of the level before (~1 kB)."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + f"\nname: *a{levels - 1}\n"


@pytest.mark.parametrize("text, key, problem", [
    (laughs(), "", "expands to more than 100,000 values"),
    ("name: &a [*a]\n", "", "an alias refers to a node that contains it"),
    ("name: " + "[" * 70 + "]" * 70 + "\n", "", "nested more than 64 levels deep"),
    (yaml.safe_dump({**BASE, "params": {"A": {"shape": [], "init": 10 ** 400}}}), "params.A.init",
     "finite numbers of magnitude at most 1e+31"),
    (yaml.safe_dump({**BASE, "params": {"A": {"shape": [], "init": {"normal": [0, 10 ** 400]}}}}), "params.A.init",
     "normal takes finite numbers"),
    (yaml.safe_dump({**BASE, "objective": "sq(S - S_prev)/2 - \u0665*dot(S*k, x)"}), "objective",
     "unexpected character '\u0665'"),
    (yaml.safe_dump({**BASE, "name": "e\n"}), "name", "is not a valid name"),
    (yaml.safe_dump({**BASE, "inputs": {"x\n": {"shape": ["d"]}, "k": {"shape": ["m"]}}}), "inputs.x\n",
     "is not a valid name"),
])
def test_hostile_yaml_is_one_short_line_fast(text, key, problem):
    assert len(text) < 2000
    with time_limit(2):
        with pytest.raises(SpecError) as e:
            ssmcraft.compile(text)
    msg = str(e.value)
    assert e.value.key == key and problem in e.value.problem and "\n" not in msg and len(msg) < 400, msg


def test_a_huge_value_is_quoted_short():
    with pytest.raises(SpecError) as e:
        ssmcraft.compile({**BASE, "update": "x" * 100_000})
    assert len(str(e.value)) < 200 and "(100,002 characters)" in str(e.value)


def test_a_constant_beyond_int64_compiles_and_runs(fresh_cache):
    big = ssmcraft.compile({**BASE, "objective": "sq(S - S_prev)/2 - 18446744073709551616*dot(S*k, x)"})
    one = ssmcraft.compile(BASE)
    inputs, _ = random_inputs(one.spec, B=1, T=3, H=1)
    y_big, _ = big.reference(inputs)
    y_one, _ = one.reference(inputs)
    torch.testing.assert_close(y_big, 2.0 ** 64 * y_one, rtol=1e-12, atol=0)
    y_fast, _ = big(inputs)
    torch.testing.assert_close(y_fast, y_big, rtol=1e-12, atol=0)


def test_errors_never_carry_a_line_break_from_the_label():
    with pytest.raises(SsmcraftError) as e:
        ssmcraft.compile({**BASE, "source": "a\nb" * 1000, "update": "nope"})
    assert "\n" not in str(e.value) and len(str(e.value)) < 700


@pytest.mark.parametrize("name, family", [("wd_longhorn", "rank1_row_chunk"), ("longhorn_diag", "diagonal"),
                                          ("huber_longhorn", "general")])
def test_generated_triton_sources_hold_the_label_only_escaped(fresh_cache, tmp_path, name, family):
    """The prologue, diagonal and general generators (``ssmcraft derive --kernel``'s text, imported by
    the families on CUDA; the prologue and general ones are imported here too, through the cache)."""
    from ssmcraft.compiler.library import find_objective
    from ssmcraft.runtime import select as triton_backend

    target = tmp_path / "PWNED"
    raw = yaml.safe_load(find_objective(name).read_text())
    raw["source"] = f"x\nopen({str(target)!r}, 'w')\n#\"\"\"\\"
    fam, parts = triton_backend.kernel_source(ssmcraft.compile(raw))
    assert fam == family and parts and not target.exists()
    for _, text in parts:
        assert safe_source.problem(text) is None and only_escaped(text, "open(")


def test_a_generator_that_pastes_raw_text_is_caught_by_the_allowlist(fresh_cache, tmp_path, capsys, monkeypatch):
    """Defence in depth: were a generator to paste a label unescaped (simulated here), the module is
    refused before import, with one line and exit status 2, and the payload never runs."""
    from ssmcraft.compiler import codegen

    target = tmp_path / "PWNED"
    (tmp_path / "e.yaml").write_text(pwn_spec(target))
    monkeypatch.setattr(codegen.safe_source, "comment", lambda text, prefix="# ": prefix + text)
    spec = _search_spec(tmp_path, "e.yaml")
    assert cli.main(["search", str(spec), "--out", str(tmp_path / "run"), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refused to import generated code: line 2: reads 'open'" in err, err
    assert not target.exists() and not any(fresh_cache.glob("ref_e_*"))


def test_an_alias_bomb_in_a_searched_objective_file_is_one_line(fresh_cache, tmp_path, capsys):
    (tmp_path / "e.yaml").write_text(laughs())
    spec = _search_spec(tmp_path, "e.yaml")
    with time_limit(5):
        assert cli.main(["search", str(spec), "--out", str(tmp_path / "run"), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "e.yaml: invalid YAML: the document expands to more than 100,000 values" in err, err
    assert not (tmp_path / "run").exists()


def test_an_alias_bomb_in_an_experiment_file_is_one_line(tmp_path, capsys):
    """An experiment file (which may carry an objective spec) is read by the same bounded loader."""
    (tmp_path / "exp.yaml").write_text(laughs().replace("name: *a8", "model: {mixer: {objective: *a8}}"))
    with time_limit(5):
        assert cli.main(["train", str(tmp_path / "exp.yaml"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exp.yaml: invalid YAML: the document expands to more than" in err, err
    assert not (tmp_path / "run").exists()


def test_small_aliases_and_merge_keys_still_load():
    from ssmcraft import yamlsafe

    assert yamlsafe.load("a: &b {x: 1}\nc: {<<: *b, y: 2}\nd: {<<: *b, x: 3}\ne: [*b, *b]\n", "t") == \
        {"a": {"x": 1}, "c": {"x": 1, "y": 2}, "d": {"x": 3}, "e": [{"x": 1}, {"x": 1}]}
    with pytest.raises(SpecError, match=r"t: invalid YAML \(line 2, column 19\): duplicate key 'y'"):
        yamlsafe.load("a: &b {x: 1}\nc: {<<: *b, y: 2, y: 3}\n", "t")
