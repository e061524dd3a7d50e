"""Fuzzing the objective-spec compiler: 1,000 generated specs per run (4 seeded batches of 250).

Each case starts from a library objective that derives quickly and takes one to three mutations:
hostile text (newlines of every kind, quotes, triple quotes, backslashes, NUL, encoding
declarations, digits and letters of other scripts, ``__import__`` and ``open`` payloads aimed at a
canary file) in ``name``, ``summary`` and ``source``; names renamed to hostile or odd identifiers
(everywhere they are used, so some still compile); expressions made near-valid (a token inserted
or cut, deep parentheses, huge or tiny constants, line breaks); huge, negative and non-finite
initialisers; wrong types, unknown keys and missing keys. A case is given as a mapping, as YAML
text, or as hostile YAML (alias bombs, deep nesting, duplicate keys, Python tags, broken syntax).

Every case must, under a time limit, either compile (and then run its reference loop and pass the
AST allowlist, with the hostile text only inside comments and string literals) or raise an
``SsmcraftError`` whose message is one short line. After each batch: the canary file does not
exist, the working folder is empty, and the cache holds only generated ``.py`` files. Seeded, so a
failure names a case that reproduces: ``case(seed, i)``.
"""
from __future__ import annotations

import copy
import io
import random
import re
import reprlib
import sys
import tokenize
from pathlib import Path

import pytest
import yaml

import ssmcraft
from helpers import random_inputs, time_limit
from ssmcraft.compiler import safe_source
from ssmcraft.compiler.library import find_objective
from ssmcraft.errors import SsmcraftError

BATCHES, CASES = 4, 250
CASE_SECONDS = 10
TEMPLATES = ("linear_attention", "retnet", "gla", "hgrn", "mamba", "deltanet", "longhorn_diag", "gated_deltanet")
CANARY = "FUZZ_CANARY"       # the file every payload tries to create, in the batch's working folder

HOSTILE = [
    "x\nopen('{c}', 'w')\n#", 'x"""\nopen("{c}", "w")\n"""', "x'''\nopen('{c}', 'w')\n'''",
    "\\", "ends in a backslash\\", "a\\\nopen('{c}', 'w')", "\r__import__('os').system('touch {c}')",
    "\r\nopen('{c}','w')", "line\u2028open('{c}','w')", "para\u2029sep", "nul\x00byte", "\x85next line",
    "\x0cform feed", "\x0bvertical", "lone \ud800 surrogate", "\x1c\x1d\x1e", "# -*- coding: utf-7 -*-", "coding=rot13 +AAo-open('{c}')",
    "\"; __import__('os').system('touch {c}'); \"", "'; open('{c}', 'w'); '", "{{}} {0} %s $x `id`",
    "\u0665\u0666\u0667 \u0661e9", "\u03a9\u210c\ufb01", "\U0001F600", "", " ", "\t", "x" * 5000, "\ud7ff",
    "\"\"\"", "'''", "r'''", "f'{{open(\"{c}\")}}'", "#!/bin/sh", "</script>", "\n" * 5,
]
IDENTS = ["lambda", "class", "open", "exec", "eval", "__import__", "__class__", "_x", "x_", "env", "co",
          "erase", "torch", "tl", "F", "math", "triton", "S_prev", "T", "sq", "exp", "e\n", "x\n", "\u03c0",
          "\u0665", "a" * 32, "a" * 33, "x y", "x-y", "1x", "", "None", "True", "print", "sum", "phi0", "co2",
          "env_", "oq", "oc", "a", "p", "q", "u", "v", "c", "B", "y", "d2", "m2", "KIND", "DIMS", "INPUTS",
          "coefficients", "step", "readout", "STATES", "F1", "tl_", "self", "cls", "nan", "inf"]
TOKENS = ["(", ")", "+", "-", "*", "/", "**", ",", "sq(", "exp(", "log(", "dot(", "T(", "ones(", "diag(",
          "__import__('os')", "x.__class__", "lambda: 0", "[", "]", "'", '"', "\\", "\n", "\u0665", "1e999",
          "1e31", "1e-31", "1e32", "2**64", "18446744073709551616", "999999999999999999999999", "0", "1/0",
          "S_prev", "S", "#", ";", "\x00", "\u2028", "@", ".", "e", "E", "0x10", "1_000", "\t", "\r"]
CONSTANTS = ["18446744073709551616", "99999999999999999999999", "1e30", "1e-30", "0", "-1", "1e31", "1e32",
             "0.0", "1.5e-3", "2**64", "10**30", "(-2)**0.5"]
VALUES = [None, 0, -1, 1.5, True, [], {}, "x", [1, [2]], {"a": 1}, 10 ** 100, -10 ** 400, float("inf"),
          float("nan"), "\n", ["d", "m", "d"], {"shape": "d"}]
INITS = [10 ** 400, -10 ** 400, float("inf"), float("nan"), 1e308, 1e31, -5, 0, "zeros", "ones", "bogus",
         {"uniform": [0, 10 ** 400]}, {"uniform": [1, 0]}, {"normal": [0, -1]}, {"log_uniform": [-1, 1]},
         {"constant": "x"}, [1, 2], None, True, "s4d_real", "retnet_decay", {"uniform": [0, 1], "x": 1}]


def hostile(rng: random.Random, canary: str) -> str:
    text = rng.choice(HOSTILE)
    if rng.random() < 0.3:
        text += rng.choice(HOSTILE)
    return text.replace("{c}", canary)


def _rename(spec: dict, old: str, new: str) -> None:
    """Rename ``old`` to ``new`` in every expression of ``spec`` (so the renamed spec may still compile)."""
    pattern = re.compile(rf"\b{re.escape(old)}\b")
    for key in ("objective", "output"):
        if isinstance(spec.get(key), str):
            spec[key] = pattern.sub(lambda m: new, spec[key])
    if isinstance(spec.get("let"), dict):
        spec["let"] = {k: pattern.sub(lambda m: new, v) if isinstance(v, str) else v for k, v in spec["let"].items()}


def _expression(rng: random.Random, text: str) -> str:
    how = rng.randrange(6)
    if how == 0:
        i = rng.randrange(len(text) + 1)
        return text[:i] + rng.choice(TOKENS) + text[i:]
    if how == 1 and text:
        i = rng.randrange(len(text))
        return text[:i] + text[i + rng.randint(1, 4):]
    if how == 2:
        n = rng.choice([1, 5, 40, 47, 49, 60, 500])
        return "(" * n + text + ")" * n
    if how == 3:
        return f"{rng.choice(CONSTANTS)}*({text})"
    if how == 4:
        return text.replace(" ", rng.choice(["\n ", "\n", "\t", "\r\n "]))
    return text + " " + rng.choice(["+", "-", "*"]) + " " + rng.choice(["sq(S)", "dot(S*k, x)", "0", "1e31", "S_prev"])


def mutate(rng: random.Random, spec: dict, canary: str) -> None:
    what = rng.choices(range(10), weights=[4, 1, 2, 2, 1, 1, 1, 1, 1, 1])[0]   # hostile text most often
    if what == 0:
        spec[rng.choice(["name", "summary", "source", "summary"])] = hostile(rng, canary)
    elif what == 1:
        spec["name"] = rng.choice(IDENTS)
    elif what == 2:
        table = rng.choice([k for k in ("inputs", "params", "let") if isinstance(spec.get(k), dict) and spec[k]]
                           or ["inputs"])
        if isinstance(spec.get(table), dict) and spec[table]:
            old = rng.choice(sorted(spec[table], key=str))
            new = rng.choice(IDENTS) if rng.random() < 0.6 else f"{old}_{rng.randrange(100)}"
            spec[table] = {(new if k == old else k): v for k, v in spec[table].items()}
            if isinstance(old, str):
                _rename(spec, old, new)
    elif what == 3:
        key = rng.choice(["objective", "output", "objective"])
        if isinstance(spec.get(key), str):
            spec[key] = _expression(rng, spec[key])
    elif what == 4:
        spec.setdefault("params", {})
        if isinstance(spec["params"], dict):
            spec["params"]["w_" + str(rng.randrange(9))] = {"shape": rng.choice([[], ["d"], ["m"], ["d", "m"]]),
                                                             "init": copy.deepcopy(rng.choice(INITS))}
    elif what == 5:
        spec[rng.choice(sorted(spec, key=str))] = copy.deepcopy(rng.choice(VALUES)) if rng.random() < 0.9 else \
            nested(rng.choice([100, 5000]), rng.random() < 0.5)
    elif what == 6:
        spec[rng.choice([hostile(rng, canary), "objectiv", "Name", "__class__", 1, None])] = rng.choice(VALUES)
    elif what == 7:
        spec.pop(rng.choice(sorted(spec, key=str)), None)
    elif what == 8:
        inputs = spec.get("inputs")
        if isinstance(inputs, dict) and inputs:
            decl = inputs[rng.choice(sorted(inputs, key=str))]
            if isinstance(decl, dict):
                decl[rng.choice(["shape", "positive", "activation", "normalize", "bogus"])] = \
                    copy.deepcopy(rng.choice([["d"], ["m"], [], ["d", "m"], ["x"], "d", [1], None, True, "silu",
                                              "\n", 10 ** 400]))
    else:
        spec[rng.choice(["update", "approximation"])] = rng.choice(
            ["implicit", "explicit", "newton", "exact", "diagonal", "bogus", None, 1, "implicit\n"])


def nested(depth: int, self_containing: bool):
    """A list ``depth`` levels deep, or a mapping that contains itself (only a mapping, not YAML, can)."""
    if self_containing:
        loop: dict = {}
        loop["a"] = loop
        return loop
    root = cur = []
    for _ in range(depth):
        cur.append([])
        cur = cur[0]
    return root


def hostile_yaml(rng: random.Random, canary: str) -> str:
    how = rng.randrange(7)
    if how == 0:   # billion laughs, 3 to 9 levels
        levels, width = rng.randint(3, 9), rng.randint(2, 10)
        lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
        return "\n".join(lines) + f"\n{rng.choice(['name', 'objective', 'inputs'])}: *a{levels - 1}\n"
    if how == 1:
        n = rng.choice([10, 63, 65, 1000, 50_000])
        return "name: " + rng.choice(["[", "{a: "]) * n + "1" + rng.choice(["]", "}"]) * n + "\n"
    if how == 2:
        return f"!!python/object/apply:os.system ['touch {canary}']\n"
    if how == 3:
        return f"name: e\nname: f\nsource: {hostile(rng, canary)!r}\n"
    if how == 4:
        return "name: &n e\nsource: *n\nstate: {S: [d, m]}\ninputs: &i {x: {shape: [d]}, k: {shape: [m]}}\n" \
               "objective: \"sq(S - S_prev)/2 - dot(S*k, x)\"\nupdate: implicit\noutput: S*k\nlet: *i\n"
    if how == 5:
        return "".join(rng.choice(":-[]{}&*!|>'\"#%@`\t\n ab\u0665\x00") for _ in range(rng.randint(1, 80)))
    return f"name: e\nobjective: !!python/name:os.system\nsource: {canary}\n"


def case(seed: int, i: int, canary: str, templates: dict) -> object:
    """The ``i``-th case of batch ``seed``: a mapping, YAML text or hostile YAML."""
    rng = random.Random(seed * 100_003 + i)
    if rng.random() < 0.08:
        return hostile_yaml(rng, canary)
    spec = copy.deepcopy(templates[rng.choice(TEMPLATES)])
    for _ in range(rng.choice([1, 1, 2, 3])):
        mutate(rng, spec, canary)
    if rng.random() < 0.4:
        try:
            return yaml.safe_dump(spec, sort_keys=False, allow_unicode=rng.random() < 0.5)
        except (yaml.YAMLError, RecursionError):
            return spec
    return spec


def only_escaped(source: str, markers) -> bool:
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING) and any(m in tok.string for m in markers):
            return False
    return True


@pytest.fixture(scope="module")
def templates():
    return {name: yaml.safe_load(find_objective(name).read_text()) for name in TEMPLATES}


@pytest.mark.parametrize("seed", range(BATCHES))
def test_generated_specs_compile_or_fail_cleanly(seed, templates, tmp_path, monkeypatch):
    work, cache_root = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("SSMCRAFT_CACHE", str(cache_root))
    canary = work / CANARY
    compiled = refused = 0
    for i in range(CASES):
        spec = case(seed, i, str(canary), templates)
        where = f"case({seed}, {i}): {reprlib.repr(spec)}"
        try:
            with time_limit(CASE_SECONDS):
                obj = ssmcraft.compile(spec)
                inputs, params = random_inputs(obj.spec, B=1, T=2, H=1)
                y, _ = obj.reference(inputs, params)
        except SsmcraftError as e:
            msg = str(e)
            assert "\n" not in msg and len(msg) < 2000, f"{where}: a message of {len(msg)} characters / lines"
            refused += 1
            continue
        except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
            raise AssertionError(f"{where}: {type(e).__name__}: {str(e)[:300]}") from e
        compiled += 1
        assert y.shape[:3] == (1, 2, 1), where
        assert safe_source.problem(obj.source) is None, where
        assert only_escaped(obj.source, ["__import__", "open(", "system(", CANARY, "+AAo-"]), where
        assert Path(obj.module.__file__).parent == cache_root / "generated", where
        for name in [n for n in sys.modules if n.startswith("ssmcraft_generated_")]:
            del sys.modules[name]      # the next case imports its module again
    assert not canary.exists()
    assert list(work.iterdir()) == []
    written = [p for p in cache_root.rglob("*") if p.is_file()]
    assert all(p.parent == cache_root / "generated" and p.suffix == ".py" for p in written), written
    # the mix stays meaningful: both outcomes are common
    assert compiled >= CASES // 10 and refused >= CASES // 4, (compiled, refused)
