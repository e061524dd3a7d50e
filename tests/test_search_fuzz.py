"""Fuzzing the search's inputs: generated search specs through ``ssmcraft search SPEC --check``
(the spec loader, the experiment check and the objective compile), and damaged journals
through a resume. Seeded and deterministic. Every input either passes or is refused with
one line and exit status 2; none gives a traceback, hangs or writes anything (``--check``
writes nothing; a refused resume leaves the run folder as it was)."""
from __future__ import annotations

import copy
import random
import shutil

import pytest
import yaml

from ssmcraft import cli
from ssmcraft.errors import SsmcraftError
from ssmcraft.search.outcome import time_limit
from ssmcraft.search.testing import search_tiny, tiny_spec

SPECS_PER_BATCH = 50
BATCHES = 4             # 200 specs per run
SECONDS_PER_INPUT = 20  # a hang fails the test (SIGALRM) instead of stalling CI

WEIRD = [
    10 ** 400, -10 ** 400, 2 ** 63, 2 ** 32, 2 ** 32 - 1, -1, 0, 1, 3, 0.5, 1e308, -1e-308, float("nan"),
    float("inf"), "", "x" * 3000, "ünïcødé", "../../../tmp/escape", "a\nb", "/etc/passwd", "./missing.yaml", "a\x00b.yaml", "x" * 300 + ".yaml",
    "longhorn", "deltanet", "auto", "minimize", "maximize", "tpe", "random", "nsga2", "median", None, True,
    False, [], [1, 2], [8, 32], [1e-4, 1e-2], [[[[[]]]]], {}, {"a": 1}, {"choice": []}, {"choice": [1, 1]},
    {"int": [1, 10 ** 400]}, {"int": [8, 32], "step": 8}, {"float": [0, 1], "log": True},
    {"float": [1e-4, 1e-2], "log": True}, {"choice": ["exact", "diagonal"]}, {"compose": {}},
    {"compose": {"step": ["scalar", "per_channel"]}, "label": "c2"}, {"name": "none"},
]
KEYS = ["name", "seed", "task", "model", "train", "budget", "space", "rank", "sampler", "pruner", "resources",
        "fidelity", "objectives_dir", "trials", "seq_len", "d_model", "n_layers", "lr", "m", "choice", "int",
        "float", "log", "step", "compose", "label", "kind", "min_tokens", "eta", "metric", "max_retries",
        "gpus_per_trial", "cpus_per_trial", "n_startup_trials", "population_size", "model.n_layers",
        "train.batch_size", "task.seq_len", "approximation", "width", "bogus", "x" * 200]
TEXT_DAMAGE = [
    lambda r, t: t + f"{r.choice(KEYS[:13])}: {r.choice(['1', 'x', '[]', '{}'])}\n",   # a key given twice
    lambda r, t: t[:r.randrange(len(t))],                                               # cut short
    lambda r, t: _insert(r, t, r.choice([":", "[", "{", "&a ", "*a ", "\t", "!!python/name:os.system ",
                                         "? ", "- ", "%", "@", "\x00", "\ufeff", "'"])),
    lambda r, t: "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcdefgh", "bcdefghi")) + t,
    lambda r, t: t + "deep: " + "[" * r.choice([50, 70, 5000]) + "]" * 5000 + "\n",
    lambda r, t: t.replace("\n", "\n  ", r.randrange(1, 4)),
]


def _insert(r: random.Random, text: str, what: str) -> str:
    i = r.randrange(len(text) + 1)
    return text[:i] + what + text[i:]


def _paths(node, prefix=()):
    """Every path into a spec tree (dict keys and list indices), the root excluded."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield prefix + (k,)
        yield from _paths(v, prefix + (k,))


def _mutate(r: random.Random, spec: dict) -> dict:
    for _ in range(r.randint(1, 3)):
        paths = list(_paths(spec))
        *parent_path, last = r.choice(paths)
        parent = spec
        for part in parent_path:
            parent = parent[part]
        op = r.random()
        if op < 0.55:
            parent[last] = copy.deepcopy(r.choice(WEIRD))
        elif op < 0.7 and isinstance(parent, dict):
            del parent[last]
        elif op < 0.85 and isinstance(parent, dict):
            parent[r.choice(KEYS)] = copy.deepcopy(r.choice(WEIRD + [1, 2, "x"]))
        else:   # a subtree of the spec where another one was
            parent[last] = copy.deepcopy(parent_at(spec, r.choice(paths)))
    return spec


def parent_at(spec, path):
    node = spec
    for part in path:
        node = node[part]
    return node


def _spec_text(r: random.Random) -> str:
    spec = tiny_spec(budget={"trials": 4, "tokens_per_trial": 1000, "seconds_per_trial": 5})
    if r.random() < 0.85:
        spec = _mutate(r, spec)
    text = yaml.safe_dump(spec, sort_keys=r.random() < 0.5, allow_unicode=True)
    if r.random() < 0.3:
        text = r.choice(TEXT_DAMAGE)(r, text)
    return text


def _files(folder):
    return sorted(p.relative_to(folder) for p in folder.rglob("*"))


@pytest.mark.parametrize("batch", range(BATCHES))
def test_generated_search_specs_pass_or_are_refused_in_one_line(tmp_path, monkeypatch, capsys, batch):
    r = random.Random(1000 + batch)
    monkeypatch.chdir(tmp_path)
    outcomes = {0: 0, 2: 0}
    for i in range(SPECS_PER_BATCH):
        text = _spec_text(r)
        path = tmp_path / f"spec{i}.yaml"
        path.write_text(text, encoding="utf-8")
        before = _files(tmp_path)
        with time_limit(SECONDS_PER_INPUT):
            code = cli.main(["search", str(path), "--out", str(tmp_path / f"run{i}"), "--check"])
        out, err = capsys.readouterr()
        assert code in (0, 2), (i, text, out, err)
        outcomes[code] += 1
        if code == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("ssmcraft search: error: ") and len(lines[0]) < 1000, \
                (i, text, err)
        else:
            assert "valid;" in out, (i, text, out)
        assert _files(tmp_path) == before, (i, text)     # --check writes nothing, refused or not
    assert min(outcomes.values()) > 0, outcomes          # the batch holds valid specs and refused ones


JOURNAL_DAMAGE = ["cut", "flip", "insert_line", "drop_line", "duplicate_line", "garbage_tail", "empty_line"]


def _damage(r: random.Random, data: bytes, how: str) -> bytes:
    lines = data.splitlines(keepends=True)
    i = r.randrange(len(lines))
    if how == "cut":
        return data[:r.randrange(1, len(data))]
    if how == "flip":
        k = r.randrange(len(data))
        return data[:k] + bytes([data[k] ^ (1 << r.randrange(8))]) + data[k + 1:]
    if how == "insert_line":
        return b"".join(lines[:i] + [r.choice([b"garbage\n", b"{}\n", b"[1]\n", b'{"op_code": 99}\n'])] + lines[i:])
    if how == "drop_line":
        return b"".join(lines[:i] + lines[i + 1:])
    if how == "duplicate_line":
        return b"".join(lines[:i + 1] + lines[i:])
    if how == "garbage_tail":
        return data + bytes(r.randrange(256) for _ in range(r.randint(1, 40)))
    return b"".join(lines[:i] + [b"\n"] + lines[i:])


def test_damaged_journals_resume_or_are_refused_in_one_line(tmp_path):
    """A journal damaged at random resumes (a torn tail moved aside) or is refused with one
    ``SsmcraftError`` line that leaves the folder as it was; never a traceback. (A damage
    that Optuna reads as valid records of another meaning, e.g. a flipped digit in a value,
    cannot be told from a real record: such a run resumes.)"""
    r = random.Random(7)
    pristine = tmp_path / "pristine"
    search_tiny(pristine, budget={**tiny_spec()["budget"], "trials": 2})
    data = (pristine / "journal.log").read_bytes()

    outcomes = {"resumed": 0, "refused": 0}
    for i in range(16):
        out = tmp_path / f"run{i}"
        shutil.copytree(pristine, out)
        how = JOURNAL_DAMAGE[i % len(JOURNAL_DAMAGE)]
        (out / "journal.log").write_bytes(_damage(r, data, how))
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        try:
            with time_limit(SECONDS_PER_INPUT):
                search_tiny(out, budget={**tiny_spec()["budget"], "trials": 3})
            outcomes["resumed"] += 1
        except SsmcraftError as e:
            outcomes["refused"] += 1
            assert "\n" not in str(e) and len(str(e)) < 1000, (how, str(e))
            assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before, (how, str(e))
    assert min(outcomes.values()) > 0, outcomes
