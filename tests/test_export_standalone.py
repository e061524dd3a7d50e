"""``ssmcraft export``: the written module works without ssmcraft and reproduces the model.

Trained models come from tiny real runs (``ssmcraft.train.train_run``) and a two-trial
search (one trial trains, one fails). The standalone checks run in one subprocess where
``ssmcraft`` (and yaml, sympy, optuna, triton) cannot be imported: torch and safetensors only.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ssmcraft.errors import SsmcraftError
from helpers import tiny_search

OBJECTIVES = ("longhorn", "mamba")   # rank-1 (exact Longhorn) and elementwise decay with a learned param


def experiment(objective, n_layers=2):
    return {"name": "export-test", "seed": 0,
            "task": {"name": "mqar", "vocab": 32, "seq_len": 16, "num_kv_pairs": 2},
            "model": {"d_model": 16, "n_layers": n_layers, "mlp_ratio": 2,
                      "mixer": {"kind": "objective", "objective": objective, "state_size": 8}},
            "train": {"batch_size": 8, "tokens": 8 * 16 * 4, "eval_every": 0, "eval_batches": 1,
                      "eval_batch_size": 8}}


def search_trial(config, out_dir, report):
    """Trial 1 fails; the others train a tiny model of the trial's objective."""
    from ssmcraft.train import train_run

    if json.loads((Path(out_dir) / "trial.json").read_text())["number"] == 1:
        raise ValueError("scripted failure")
    objective = config.get("objective") or config["model"]["mixer"]["objective"]
    return train_run(experiment(objective, n_layers=1), out_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ssmcraft.train import train_run

    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name in OBJECTIVES:
        metrics = train_run(experiment(name), root / name)
        assert metrics["status"] == "ok"
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def search_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("search") / "run"
    result = tiny_search(out, search_trial, trials=2)
    assert result.counts["complete"] == 1 and result.counts["failed"] == 1
    return out


@pytest.fixture(scope="module")
def exports(runs, search_dir, tmp_path_factory):
    from ssmcraft.cli import main
    from ssmcraft.export import export

    root = tmp_path_factory.mktemp("exports")
    out = {}
    for name, run in runs.items():
        assert main(["export", str(run), "--out", str(root / name)]) == 0
        out[name] = root / name
    out["layer"] = root / "layer"
    export(runs["longhorn"], out["layer"], layer_only=True)
    out["search"] = root / "search"
    assert main(["export", str(search_dir), "--trial", "best", "--out", str(out["search"])]) == 0
    return out


STANDALONE = textwrap.dedent(r'''
    import importlib.util, json, sys
    for blocked in ("ssmcraft", "yaml", "sympy", "optuna", "triton"):
        sys.modules[blocked] = None          # importing any of these now raises ImportError
    import torch
    import torch.nn as nn

    def load(folder):
        [path] = [p for p in __import__("glob").glob(folder + "/*.py")]
        name = path.rsplit("/", 1)[-1][:-3]
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    case = json.loads(sys.argv[1])
    results = {}
    for key, folder in case["models"].items():
        mod = load(folder)
        ref = mod.load_safetensors(case["refs"][key])   # the exported reader
        model = mod.from_pretrained(folder)
        ids = ref["ids"]
        logits = model(ids)
        r = {"diff": float((logits - ref["logits"]).abs().max()), "backend": model.backend,
             "dtype": str(logits.dtype)}
        state = model.init_state(ids.shape[0])
        sizes, steps = set(), []
        for t in range(ids.shape[1]):
            lt, state = model.step(ids[:, t], state)
            steps.append(lt)
            sizes.add(model.state_size(state))
        r["step_diff"] = float((torch.stack(steps, 1) - logits).abs().max())
        r["state_sizes"] = sorted(sizes)
        pre, diffs = {}, []
        for T in (1, 3, 8):                  # shorter than the conv kernel (4), odd, longer
            lp, pstate = model.prefill(ids[:, :T])
            more = [lp]
            for t in range(T, ids.shape[1]):
                lt, pstate = model.step(ids[:, t], pstate)
                more.append(lt[:, None])
            diffs.append(float((torch.cat(more, 1) - torch.stack(steps, 1)).abs().max()))
        r["prefill_diffs"] = diffs
        r["prefill_state_size"] = model.state_size(pstate)
        out = model.generate(ids[0, :5], max_new_tokens=6)
        full = model(out[None])[0]
        r["generate_len"] = int(out.shape[0])
        r["generate_greedy_consistent"] = bool((full[4:-1].argmax(-1) == out[5:]).all())
        mod.OBJECTIVE.prefer = "reference"
        r["reference_diff"] = float((model(ids) - logits).abs().max())
        r["reference_backend"] = model.backend
        mod.OBJECTIVE.prefer = "auto"
        fresh = mod.Model()
        r["fresh_shape"] = list(fresh(ids).shape)
        results[key] = r

    mod = load(case["layer"])
    ref = mod.load_safetensors(case["refs"]["layer"])
    lr = {"has_lm": hasattr(mod, "Model") or hasattr(mod, "from_pretrained")}
    diffs = []
    for i in range(int(ref["n_layers"])):
        mixer = mod.Mixer.from_pretrained(case["layer"], layer=i)
        diffs.append(float((mixer(ref["h"]) - ref[f"y{i}"]).abs().max()))
    lr["diffs"] = diffs
    trained = mod.Mixer.from_pretrained(case["layer"], layer=1).train()
    d = trained.d_model
    seq = nn.Sequential(nn.Embedding(32, d), trained, nn.Linear(d, 32))
    ids = torch.randint(0, 32, (3, 11))
    loss = nn.functional.cross_entropy(seq(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    lr["loss_finite"] = bool(torch.isfinite(loss))
    lr["grads"] = all(p.grad is not None and bool(torch.isfinite(p.grad).all())
                      for p in trained.parameters() if p.requires_grad)
    fresh = mod.Mixer(d_model=24, state_size=4)
    lr["fresh_shape"] = list(nn.Sequential(nn.Linear(5, 24), fresh)(torch.randn(2, 7, 5)).shape)
    lr["fresh_m"] = fresh.m
    h = torch.randn(2, 9, 24)
    cache = fresh.init_cache(2)
    ys = []
    for t in range(9):
        y, cache = fresh.step(h[:, t], cache)
        ys.append(y)
    lr["step_diff"] = float((torch.stack(ys, 1) - fresh(h)).abs().max())
    y_pre, pcache = fresh.prefill(h[:, :5])
    y_pre2, pcache = fresh.prefill(h[:, 5:], pcache)
    lr["prefill_diff"] = float((torch.cat([y_pre, y_pre2], 1) - torch.stack(ys, 1)).abs().max())
    lr["prefill_cache_diff"] = max(float((pcache.conv - cache.conv).abs().max()),
                                   float((pcache.state - cache.state).abs().max()))
    lr["backend"] = fresh.last_backend
    results["layer"] = lr
    results["ssmcraft_loaded"] = sorted(n for n, m in sys.modules.items() if n.startswith("ssmcraft") and m is not None)
    print("RESULT " + json.dumps(results))
''')


@torch.no_grad()
def _reference_files(runs, search_dir, tmp_path):
    """Logits of ssmcraft's own loaded models (load_run / load_trial) on fixed ids."""
    from safetensors.torch import save_file

    from ssmcraft.search import load_trial
    from ssmcraft.train import load_run

    refs = {}
    gen = torch.Generator().manual_seed(1)
    models = {name: load_run(run) for name, run in runs.items()}
    models["search"] = load_trial(search_dir, "best")
    for key, model in models.items():
        ids = torch.randint(0, model.cfg.vocab_size, (2, 20), generator=gen)
        refs[key] = tmp_path / f"{key}.safetensors"
        save_file({"ids": ids, "logits": model(ids).contiguous()}, str(refs[key]))
    lm = models["longhorn"]
    h = torch.randn(2, 13, lm.cfg.d_model, generator=gen)
    layer = {"h": h, "n_layers": torch.tensor(len(lm.blocks))}
    for i, block in enumerate(lm.blocks):
        layer[f"y{i}"] = block.mixer(h).contiguous()
    refs["layer"] = tmp_path / "layer.safetensors"
    save_file(layer, str(refs["layer"]))
    return refs


def test_exported_module_runs_without_ssmcraft(runs, search_dir, exports, tmp_path):
    refs = _reference_files(runs, search_dir, tmp_path)
    case = {"models": {k: str(exports[k]) for k in (*OBJECTIVES, "search")}, "layer": str(exports["layer"]),
            "refs": {k: str(v) for k, v in refs.items()}}
    proc = subprocess.run([sys.executable, "-c", STANDALONE, json.dumps(case)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT "):])
    assert res["ssmcraft_loaded"] == []
    for key in (*OBJECTIVES, "search"):
        r = res[key]
        assert r["diff"] < 1e-5, (key, r)                  # same logits as ssmcraft's loaded model
        assert r["step_diff"] < 1e-5, (key, r)             # recurrent decoding == parallel forward
        assert max(r["prefill_diffs"]) < 1e-5, (key, r)    # prefill + steps == steps alone
        assert r["prefill_state_size"] == r["state_sizes"][0], (key, r)
        assert len(r["state_sizes"]) == 1, (key, r)        # constant-size state
        assert r["backend"] == "torch-vectorised" and r["dtype"] == "torch.float32"
        assert r["reference_diff"] < 1e-5 and r["reference_backend"] == "reference-loop"
        assert r["generate_len"] == 11 and r["generate_greedy_consistent"], (key, r)
        assert r["fresh_shape"] == [2, 20, 32]
    lr = res["layer"]
    assert not lr["has_lm"]
    assert len(lr["diffs"]) == 2 and max(lr["diffs"]) < 1e-5, lr
    assert lr["loss_finite"] and lr["grads"]
    assert lr["fresh_shape"] == [2, 7, 24] and lr["fresh_m"] == 4
    assert lr["step_diff"] < 1e-5 and lr["backend"] == "torch-vectorised"
    assert lr["prefill_diff"] < 1e-5 and lr["prefill_cache_diff"] < 1e-5, lr


def test_export_folder_contents(exports):
    for key in (*OBJECTIVES, "search", "layer"):
        folder = exports[key]
        names = sorted(p.name for p in folder.iterdir())
        config = json.loads((folder / "config.json").read_text())
        assert names == sorted(["README.md", "config.json", "model.safetensors", config["module"]])
        assert config["format"] == "ssmcraft-export" and config["layer_only"] == (key == "layer")
        assert config["objective"]["spec"]["name"] == config["objective"]["name"]
        assert "objective" in config["model"]["mixer"] and config["objective"]["update"]
        text = (folder / config["module"]).read_text()
        assert config["objective"]["update"].splitlines()[0] in text.split('"""')[0]   # header shows the update
        assert "Trained in: " in text
        imported = {a.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom)}
        assert {m.split(".")[0] for m in imported} <= set(sys.stdlib_module_names) | {"torch", "safetensors", "triton", "__future__"}
        readme = (folder / "README.md").read_text()
        usage = readme.split("```python\n")[1].split("```")[0].strip().splitlines()
        assert len(usage) == 3
        assert (folder / "model.safetensors").read_bytes()[8:9] == b"{"          # safetensors, not a pickle
    search = json.loads((exports["search"] / "config.json").read_text())
    assert search["source"]["kind"] == "search" and search["source"]["trial"] == 0
    assert "trial 0 of search 'tiny'" in (exports["search"] / search["module"]).read_text()
    layer = json.loads((exports["layer"] / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(exports["layer"] / "model.safetensors"), "pt") as f:
        assert all(".mixer." in k for k in f.keys())


def test_failed_unknown_and_bad_sources(search_dir, runs, tmp_path, capsys):
    from ssmcraft.cli import main
    from ssmcraft.export import export

    with pytest.raises(SsmcraftError, match="trial 1 did not complete.*scripted failure"):
        export(search_dir, tmp_path / "a", trial=1)
    with pytest.raises(SsmcraftError, match="no finished trial 7"):
        export(search_dir, tmp_path / "a", trial="7")
    with pytest.raises(SsmcraftError, match="'best' or a trial number"):
        export(search_dir, tmp_path / "a", trial="last")
    with pytest.raises(SsmcraftError, match="training run folder.*drop --trial"):
        export(runs["longhorn"], tmp_path / "a", trial="0")
    with pytest.raises(SsmcraftError, match="neither a search folder"):
        export(tmp_path, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    capsys.readouterr()
    assert main(["export", str(search_dir), "--trial", "1", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did not complete" in err and "Traceback" not in err
    assert main(["export", str(search_dir), "--trial", "12", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no finished trial 12" in err


def test_refuses_non_empty_out_and_diverged_run(runs, tmp_path):
    from ssmcraft.export import export

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(SsmcraftError, match="not empty"):
        export(runs["longhorn"], tmp_path / "full")
    diverged = tmp_path / "diverged"
    diverged.mkdir()
    for f in ("config.json", "model.safetensors"):
        (diverged / f).write_bytes((runs["longhorn"] / f).read_bytes())
    (diverged / "metrics.json").write_text(json.dumps({"status": "diverged", "reason": "loss is nan at step 3"}))
    with pytest.raises(SsmcraftError, match="diverged.*nan at step 3"):
        export(diverged, tmp_path / "x")
