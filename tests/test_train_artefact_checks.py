"""What eval, export and ``load_trial`` read from a run folder is checked against what the run
recorded (``ssmcraft.train.record``), and hostile or corrupt artefacts are one line and exit code 2
with nothing on disk changed.

One tiny run (and a one-trial search) is trained per module on CPU; every case works on a copy.
The fuzz cases are seeded byte flips and truncations of model.safetensors, config.json,
metrics.json, run.json and trial.json.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
from pathlib import Path

import pytest

from ssmcraft.cli import main
from ssmcraft.errors import SsmcraftError
from ssmcraft.train import load_run, train_run
from ssmcraft.train.record import update_hash, value_sha256
from helpers import tiny_search

EVAL = ["--extrapolate", "2", "--batches", "1", "--batch-size", "2", "--state-points", "4", "--quiet"]


def experiment(seed=0):
    return {"name": "checks", "seed": seed,
            "task": {"name": "mqar", "vocab": 32, "seq_len": 16, "num_kv_pairs": 2},
            "model": {"d_model": 16, "n_layers": 1, "mlp_ratio": 2,
                      "mixer": {"kind": "objective", "objective": "longhorn", "state_size": 8}},
            "train": {"batch_size": 8, "tokens": 8 * 16 * 2, "eval_every": 0, "eval_batches": 1,
                      "eval_batch_size": 8}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two trained runs of the same shapes (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("runs")
    for seed in (0, 1):
        assert train_run(experiment(seed), root / f"seed{seed}")["status"] == "ok"
    return root


def search_trial(config, out_dir, report):
    return train_run(experiment(), out_dir)


@pytest.fixture(scope="module")
def search_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("search") / "run"
    assert tiny_search(out, search_trial, trials=1).counts["complete"] == 1
    return out


def copy_of(folder: Path, tmp_path: Path, name: str = "run") -> Path:
    dest = tmp_path / name
    shutil.copytree(folder, dest)
    return dest


def snapshot(folder: Path) -> dict:
    """Relative path -> sha256 of every file (and every folder, as None) under ``folder``."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


UNRECORDED = "records no artefact hashes"


def refused(capsys, argv: list[str], *texts: str, unrecorded: bool = False) -> str:
    """``ssmcraft ARGV`` exits 2 with one stderr line holding every text, no traceback (after the
    one warning line of a run that recorded no hashes, with ``unrecorded``); the line."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 + unrecorded and err.endswith("\n"), err
    assert not unrecorded or UNRECORDED in lines[0]
    for text in texts:
        assert text in lines[-1], err
    return lines[-1]


def refused_everywhere(capsys, run: Path, tmp_path: Path, *texts: str, unrecorded: bool = False) -> None:
    """eval and export refuse ``run`` (one line each), write nothing, and ``load_run`` raises."""
    before = snapshot(run.parent)
    refused(capsys, ["eval", str(run), *EVAL], *texts, unrecorded=unrecorded)
    refused(capsys, ["export", str(run), "--out", str(tmp_path / "exp")], *texts, unrecorded=unrecorded)
    with pytest.raises(SsmcraftError):
        load_run(run)
    assert snapshot(run.parent) == before and not (tmp_path / "exp").exists()


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2))


# -- what a run records --------------------------------------------------------------------------
def test_a_run_records_the_hashes_of_what_it_wrote(runs):
    import ssmcraft

    run = runs / "seed0"
    config = json.loads((run / "config.json").read_text())
    rec = json.loads((run / "metrics.json").read_text())["artefacts"]
    assert rec["weights_sha256"] == hashlib.sha256((run / "model.safetensors").read_bytes()).hexdigest()
    assert rec["objective_sha256"] == value_sha256(config["model"]["mixer"]["objective"])
    assert rec["model_sha256"] == value_sha256(config["model"])
    # the update's hash is the same whether the objective is compiled from the library or from config.json
    assert rec["update_hash"] == update_hash(ssmcraft.compile(config["model"]["mixer"]["objective"]))
    assert rec["update_hash"] == update_hash(ssmcraft.compile("longhorn"))
    assert rec["update_hash"] != update_hash(ssmcraft.compile("longhorn_diag"))
    other = json.loads((runs / "seed1" / "metrics.json").read_text())["artefacts"]
    assert other["weights_sha256"] != rec["weights_sha256"] and other["model_sha256"] == rec["model_sha256"]


# -- edits and swaps are refused -----------------------------------------------------------------
def test_an_edited_objective_is_refused(runs, tmp_path, capsys):
    run = copy_of(runs / "seed0", tmp_path)
    text = (run / "config.json").read_text()
    assert text.count('"update": "implicit"') == 1
    (run / "config.json").write_text(text.replace('"update": "implicit"', '"update": "explicit"'))
    refused_everywhere(capsys, run, tmp_path, "config.json: model.mixer.objective: the objective is not the one "
                       "this run trained")


def test_weights_of_another_run_of_the_same_shapes_are_refused(runs, tmp_path, capsys):
    run = copy_of(runs / "seed0", tmp_path)
    shutil.copy(runs / "seed1" / "model.safetensors", run / "model.safetensors")
    refused_everywhere(capsys, run, tmp_path, "model.safetensors: sha256 ", "is not the weights this run recorded")


def test_an_edited_model_setting_is_refused(runs, tmp_path, capsys):
    run = copy_of(runs / "seed0", tmp_path)
    edit_json(run / "config.json", lambda c: c["model"].update(norm_eps=1e-3))   # same shapes, other outputs
    refused_everywhere(capsys, run, tmp_path, "config.json: model: the model section is not the one this run trained")


def test_a_trial_of_a_search_is_checked_on_export_and_load_trial(search_dir, runs, tmp_path, capsys):
    from ssmcraft.search import find_trial, load_trial

    search = copy_of(search_dir, tmp_path, "search")
    trial = find_trial(search, "best")
    shutil.copy(runs / "seed1" / "model.safetensors", trial / "model.safetensors")
    before = snapshot(search)
    refused(capsys, ["export", str(search), "--out", str(tmp_path / "exp")], "is not the weights this run recorded")
    with pytest.raises(SsmcraftError, match="is not the weights this run recorded"):
        load_trial(search, "best")
    assert snapshot(search) == before and not (tmp_path / "exp").exists()


def test_weights_without_metrics_are_refused(runs, tmp_path, capsys):
    run = copy_of(runs / "seed0", tmp_path)
    (run / "metrics.json").unlink()
    refused_everywhere(capsys, run, tmp_path, "no metrics.json beside model.safetensors")


def test_a_malformed_record_is_refused(runs, tmp_path, capsys):
    run = copy_of(runs / "seed0", tmp_path)
    edit_json(run / "metrics.json", lambda m: m.update(artefacts="sha"))
    refused_everywhere(capsys, run, tmp_path, "metrics.json: artefacts: expected a mapping of sha256 strings")


# -- runs that recorded nothing; another derivation ----------------------------------------------
def test_a_run_without_hashes_loads_with_a_warning(runs, tmp_path, capsys):
    run = copy_of(runs / "seed0", tmp_path)
    edit_json(run / "metrics.json", lambda m: m.pop("artefacts"))
    capsys.readouterr()
    assert main(["eval", str(run), *EVAL, "--out", str(tmp_path / "ev")]) == 0
    assert UNRECORDED in capsys.readouterr().err
    assert main(["export", str(run), "--out", str(tmp_path / "exp")]) == 0
    assert (tmp_path / "exp" / "model.safetensors").is_file()
    # unchecked, but a corrupt file is still one line
    data = (run / "model.safetensors").read_bytes()
    (run / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused_everywhere(capsys, run, tmp_path / "second", "model.safetensors: not a readable safetensors file",
                       unrecorded=True)


def test_another_derivation_of_the_same_spec_warns(runs, tmp_path, caplog):
    run = copy_of(runs / "seed0", tmp_path)
    with caplog.at_level(logging.WARNING, logger="ssmcraft"):
        load_run(run)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]     # the recorded derivation
    edit_json(run / "metrics.json", lambda m: m["artefacts"].update(update_hash="0123456789abcdef"))
    with caplog.at_level(logging.WARNING, logger="ssmcraft"):
        load_run(run)
    assert any("trained with IR 0123456789abcdef" in r.getMessage() for r in caplog.records)


# -- corrupt and hostile artefacts: one line, exit 2, nothing changed ----------------------------------
HOSTILE_VALUES = [None, -1, 0, 2 ** 70, 1e308, -0.5, float("nan"), "", "x", "../../etc", [], {}, True,
                  [[[[]]]], {"name": "x"}]


def mutate_json(data: bytes, rng: random.Random) -> bytes:
    """Valid JSON with one value (anywhere in the tree) replaced by a hostile one, or one key dropped."""
    doc = json.loads(data)
    paths = []

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                paths.append(path + [k])
                walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                paths.append(path + [i])
                walk(v, path + [i])
    walk(doc, [])
    *parent, last = rng.choice(paths)
    node = doc
    for k in parent:
        node = node[k]
    if isinstance(node, dict) and rng.random() < 0.2:
        del node[last]
    else:
        node[last] = rng.choice(HOSTILE_VALUES)
    return json.dumps(doc).encode()


def mutate(data: bytes, rng: random.Random) -> bytes:
    """A seeded hostile variant: bytes flipped, a truncation, the file emptied or grown; for JSON
    also a valid document with a hostile value."""
    kinds = ["flip", "flip", "truncate", "empty", "append"] + (["json"] * 4 if data[:1] == b"{" else [])
    kind = rng.choice(kinds)
    if kind == "json":
        return mutate_json(data, rng)
    if kind == "empty" or not data:
        return b""
    if kind == "truncate":
        return data[:rng.randrange(len(data))]
    if kind == "append":
        return data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(out))
        out[i] = (out[i] + rng.randint(1, 255)) % 256
    return bytes(out)


def fuzz_case(capsys, folder: Path, argv_of, target: Path, rng: random.Random, tmp_path: Path, must_refuse: bool,
              mutation=mutate):
    original = target.read_bytes()
    hostile = mutation(original, rng)
    if hostile == original:
        return
    target.write_bytes(hostile)
    try:
        before = snapshot(folder)
        for argv in argv_of(tmp_path / "out"):
            capsys.readouterr()
            rc = main(argv)
            err = capsys.readouterr().err
            assert "Traceback" not in err, (target.name, err)
            if rc == 0:        # a change that leaves what the command reads intact (a metric's digit)
                assert not must_refuse, (target.name, hostile[:80])
                shutil.rmtree(tmp_path / "out", ignore_errors=True)
                continue
            assert rc == 2 and err.splitlines()[-1].startswith(f"ssmcraft {argv[0]}: error: "), (target.name, rc, err)
            assert len(err.splitlines()) == 1 + (UNRECORDED in err), (target.name, err)
            assert snapshot(folder) == before and not (tmp_path / "out").exists(), target.name
    finally:
        target.write_bytes(original)


def eval_and_export(run: Path):
    """``out -> [eval argv, export argv]`` of ``run`` (the export unverified: loading is what is fuzzed)."""
    return lambda out: [["eval", str(run), *EVAL, "--out", str(out)],
                        ["export", str(run), "--out", str(out), "--no-verify"]]


def test_fuzzed_run_artefacts_are_one_line_and_change_nothing(runs, tmp_path, capsys):
    run = copy_of(runs / "seed0", tmp_path)
    rng = random.Random(0)
    argv_of = eval_and_export(run)
    for name, cases, must_refuse in (("model.safetensors", 8, True), ("config.json", 8, False),
                                     ("metrics.json", 4, False)):
        for _ in range(cases):
            fuzz_case(capsys, run, argv_of, run / name, rng, tmp_path, must_refuse)


def test_fuzzed_artefacts_of_a_run_without_hashes_are_one_line_and_change_nothing(runs, tmp_path, capsys):
    """Nothing recorded to compare with: the readers themselves must refuse (safetensors, the config's checks)."""
    run = copy_of(runs / "seed0", tmp_path)
    edit_json(run / "metrics.json", lambda m: m.pop("artefacts"))
    rng = random.Random(2)
    argv_of = eval_and_export(run)

    def weights(data: bytes, rng: random.Random) -> bytes:      # a truncation, or flips inside the header
        header = 8 + int.from_bytes(data[:8], "little")
        if rng.random() < 0.5:
            return data[:rng.randrange(len(data))]
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(header)
            out[i] = (out[i] + rng.randint(1, 255)) % 256
        return bytes(out)
    for _ in range(6):
        fuzz_case(capsys, run, argv_of, run / "model.safetensors", rng, tmp_path, False, weights)
    for _ in range(8):
        fuzz_case(capsys, run, argv_of, run / "config.json", rng, tmp_path, False, mutate_json)


def test_fuzzed_search_artefacts_are_one_line_and_change_nothing(search_dir, tmp_path, capsys):
    from ssmcraft.search import find_trial

    search = copy_of(search_dir, tmp_path, "search")
    trial = find_trial(search, "best")
    rng = random.Random(1)
    argv_of = lambda out: [["export", str(search), "--out", str(out), "--no-verify"]]  # noqa: E731
    for target, cases, must_refuse in ((search / "run.json", 6, False), (trial / "trial.json", 4, False),
                                       (trial / "model.safetensors", 3, True)):
        for _ in range(cases):
            fuzz_case(capsys, search, argv_of, target, rng, tmp_path, must_refuse)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_missing_file_is_one_line(runs, tmp_path, capsys, name):
    run = copy_of(runs / "seed0", tmp_path)
    (run / name).unlink()
    refused_everywhere(capsys, run, tmp_path, str(run))


def test_garbage_experiment_and_unwritable_out_are_one_line(tmp_path, capsys):
    (tmp_path / "x.yaml").write_bytes(b"\xff\xfe\x00garbage")
    refused(capsys, ["train", str(tmp_path / "x.yaml"), "--out", str(tmp_path / "o")], "x.yaml: not UTF-8 text")
    (tmp_path / "file").write_text("")
    (tmp_path / "ok.yaml").write_text(json.dumps(experiment()))
    refused(capsys, ["train", str(tmp_path / "ok.yaml"), "--out", str(tmp_path / "file"), "--quiet"],
            "cannot be created as the run folder")
    assert not (tmp_path / "o").exists() and (tmp_path / "file").read_text() == ""
