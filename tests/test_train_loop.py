"""One training run: loss goes down, outputs are written, divergence is reported, configs
are checked, and a saved run loads back to the same model."""
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from ssmcraft.cli import main
from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.train import load_config, load_run, train_run
from ssmcraft.train.config import apply_overrides, resolve
from ssmcraft.train.schedule import lr_at, warmup_steps
from helpers import poison_step

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))
    (folder / "code.py").write_text(text)
    return str(folder)


def text_config(corpus, objective="longhorn", **train):
    return {
        "name": "tiny", "seed": 0,
        "task": {"name": "text", "corpus": corpus, "seq_len": 32, "val_fraction": 0.1, "block_size": 512},
        "model": {"d_model": 32, "n_layers": 1, "mlp_ratio": 2,
                  "mixer": {"kind": "objective", "objective": objective, "state_size": 8}},
        "train": {"batch_size": 8, "tokens": 8 * 32 * 40, "lr": 1e-2, "eval_every": 20, "eval_batches": 2,
                  "eval_batch_size": 8, **train},
    }


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return out, train_run(text_config(corpus), out)


def test_tiny_training_lowers_the_loss_and_writes_its_files(trained):
    out, m = trained
    assert m["status"] == "ok" and m["reason"] is None
    assert m["val_loss"] < 0.8 * m["train_loss_first"]
    assert m["train_loss_first"] > math.log(256) * 0.8           # starts near uniform over bytes
    assert m["tokens"] == 40 * 8 * 32 and m["steps"] == 40
    assert m["tokens_per_s"] > 0 and m["peak_memory_bytes"] > 0 and m["wall_s"] > 0
    # the steady rate leaves out the first step: 39 steps' tokens over the time after it
    assert m["steady_tokens_per_s"] == pytest.approx(39 * 8 * 32 / (m["train_s"] - m["first_step_s"]))
    assert m["objective"] == "longhorn" and m["backend"] and m["backend"] != ["None"]
    assert m["task"]["corpus"]["sha256"] and m["task"]["corpus"]["n_bytes"] > 0
    for name in ("config.json", "metrics.json", "history.json", "model.safetensors", "loss.png", "train.log"):
        assert (out / name).is_file(), name
    assert json.loads((out / "metrics.json").read_text())["val_loss"] == pytest.approx(m["val_loss"])
    history = json.loads((out / "history.json").read_text())
    assert len(history["train"]) == 40 and len(history["val"]) == 2          # after step 20, and the final one


def test_saved_run_loads_back_to_the_same_model(trained):
    out, m = trained
    config = load_config(out)
    assert isinstance(config["model"]["mixer"]["objective"], dict)           # the spec travels with the run
    assert config["model"]["mixer"]["objective"]["name"] == "longhorn"
    model = load_run(out)
    x = torch.randint(0, 256, (2, 16))
    again = load_run(out)
    torch.testing.assert_close(model(x), again(x))
    assert not model.training


def test_divergence_stops_the_run_with_a_status(corpus, tmp_path, monkeypatch):
    poison_step(monkeypatch, 4)
    m = train_run(text_config(corpus, tokens=8 * 32 * 10), tmp_path)
    assert m["status"] == "diverged" and "step 3" in m["reason"]
    assert m["val_loss"] is None and m["steps"] == 3
    on_disk = json.loads((tmp_path / "metrics.json").read_text())          # strict JSON, NaN-free
    assert on_disk["status"] == "diverged" and on_disk["val_loss"] is None
    model = load_run(tmp_path)                                             # last finite weights
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_time_limit_gives_timeout_status(corpus, tmp_path):
    m = train_run(text_config(corpus, tokens=8 * 32 * 10_000, max_seconds=0.5, save_model=False), tmp_path)
    assert m["status"] == "timeout" and m["steps"] < 10_000 and m["val_loss"] is not None
    assert not (tmp_path / "model.safetensors").exists()


def test_attention_baseline_trains(corpus, tmp_path):
    cfg = text_config(corpus, tokens=8 * 32 * 5)
    cfg["model"]["mixer"] = {"kind": "attention", "heads": 2}
    m = train_run(cfg, tmp_path)
    assert m["status"] == "ok" and m["objective"] == "attention" and m["backend"] == ["sdpa"]


def test_overrides_and_config_errors():
    cfg = apply_overrides({"task": {"name": "mqar"}}, ["train.lr=3e-3", "model.mixer.objective=mamba",
                                                       "train.betas=[0.9, 0.99]"])
    r = resolve(cfg)
    assert r["train"]["lr"] == 0.003 and r["model"]["mixer"]["objective"] == "mamba"
    assert r["train"]["betas"] == [0.9, 0.99] and r["train"]["batch_size"] == 32
    with pytest.raises(SpecError) as e:
        resolve({"task": {"name": "mqar"}, "train": {"lrr": 1}})
    assert e.value.key == "train.lrr"
    with pytest.raises(SpecError, match="missing"):
        resolve({"model": {}})
    with pytest.raises(SpecError) as e:
        resolve({"task": {"name": "mqar"}, "train": {"batch_size": 0}})
    assert e.value.key == "train.batch_size"


@pytest.mark.parametrize("section, value, key, problem", [
    ("model", {"d_model": "abc"}, "model.d_model", "expected an integer >= 1, got 'abc'"),
    ("model", {"d_model": -4}, "model.d_model", "expected an integer >= 1"),
    ("model", {"n_layers": 0}, "model.n_layers", "expected an integer >= 1, got 0"),
    ("model", {"mlp_ratio": "abc"}, "model.mlp_ratio", "expected a finite number >= 0"),
    ("model", {"mixer": {"state_size": "abc"}}, "model.mixer.state_size", "expected an integer >= 1"),
    ("model", {"mixer": {"gate": "yes"}}, "model.mixer.gate", "expected a bool"),
    ("model", {"vocab_size": "abc"}, "model.vocab_size", "expected an integer >= 1"),
    ("train", {"betas": [0.9, "abc"]}, "train.betas", "each in [0, 1)"),
    ("train", {"threads": "abc"}, "train.threads", "expected a positive integer"),
    ("train", {"device": 3}, "train.device", "expected auto, cpu, cuda or cuda:N"),
    ("train", {"device": "tpu"}, "train.device", "expected auto, cpu, cuda or cuda:N, got 'tpu'"),
])
def test_ill_typed_values_are_spec_errors(section, value, key, problem):
    with pytest.raises(SpecError) as e:
        resolve({"task": {"name": "mqar"}, section: value}, "x.yaml")
    assert e.value.key == key and problem in e.value.problem and str(e.value).startswith("x.yaml: "), str(e.value)


def test_zeros_that_mean_none_and_yaml_float_text_are_accepted():
    resolve({"task": {"name": "mqar"}, "model": {"mlp_ratio": 0, "mixer": {"conv_kernel": 0}}})
    assert resolve({"task": {"name": "mqar"}, "model": {"mixer": {"dt_min": "1e-3"}}})  # YAML's reading of 1e-3


@pytest.mark.parametrize("mixer, key, problem", [
    ({"objective": "nosuch"}, "model.mixer.objective", "unknown objective 'nosuch'"),
    ({"objective": "longhorn", "heads": 3}, "model.mixer.heads", "not divisible by heads = 3"),
    ({"objective": {**yaml.safe_load((ROOT / "objectives" / "longhorn.yaml").read_text()), "update": "bogus"}},
     "model.mixer.objective.update", "bogus"),
])
def test_a_mixer_its_objective_or_sizes_refuse_names_the_file_and_key(corpus, tmp_path, mixer, key, problem):
    cfg = text_config(corpus)
    cfg["model"]["mixer"].update(mixer)
    with pytest.raises(SpecError) as e:
        train_run(cfg, tmp_path, source="x.yaml")
    assert e.value.key == key and problem in e.value.problem and str(e.value).startswith("x.yaml: "), str(e.value)


def test_a_rerun_in_a_folder_removes_the_earlier_runs_results_first(corpus, trained, tmp_path, monkeypatch):
    """A run stopped early must not leave its config beside an earlier run's weights and metrics (eval
    and export would pair them); weights that do not fit a config are one error."""
    import shutil

    from ssmcraft.train import loop

    out, _ = trained
    folder = tmp_path / "again"
    shutil.copytree(out, folder)
    assert (folder / "model.safetensors").is_file() and (folder / "metrics.json").is_file()

    def stop(*args, **kwargs):
        raise KeyboardInterrupt          # the run is killed once its config is written
    monkeypatch.setattr(loop, "compile_model", stop)
    cfg = text_config(corpus)
    cfg["model"]["d_model"] = 48
    with pytest.raises(KeyboardInterrupt):
        train_run(cfg, folder)
    assert load_config(folder)["model"]["d_model"] == 48
    assert not any((folder / f).exists() for f in ("model.safetensors", "metrics.json", "history.json"))
    with pytest.raises(SsmcraftError, match="no model.safetensors"):
        load_run(folder)
    shutil.copy(out / "model.safetensors", folder / "model.safetensors")   # someone's weights of another size
    with pytest.raises(SsmcraftError, match="no metrics.json beside model.safetensors"):
        load_run(folder)
    (folder / "metrics.json").write_text(json.dumps({"status": "ok"}))   # as a run that recorded no hashes
    with pytest.raises(SsmcraftError, match="model.safetensors does not fit config.json"):
        load_run(folder)


def test_threads_apply_to_the_run_only(corpus, tmp_path):
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2           # a count the run must change, whatever this machine's default
    train_run(text_config(corpus, threads=other, tokens=8 * 32), tmp_path)
    assert torch.get_num_threads() == before


def test_schedule_warms_up_then_decays():
    total, lr = 100, 1.0
    w = warmup_steps(0.1, total)
    lrs = [lr_at(s, total, lr, w, 0.1) for s in range(total)]
    assert w == 10 and lrs[0] < lrs[5] < lrs[9] <= lr
    assert max(lrs) == pytest.approx(lr, rel=0.02)
    assert lrs[-1] == pytest.approx(0.1, abs=0.01) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_cli_train_writes_a_run_and_reports_errors_in_one_line(corpus, tmp_path, capsys):
    spec = tmp_path / "exp.yaml"
    spec.write_text(json.dumps(text_config(corpus, tokens=8 * 32 * 3)))          # JSON is YAML
    assert main(["train", str(spec), "--out", str(tmp_path / "r"), "--quiet", "--set", "train.eval_every=0"]) == 0
    assert "status=ok" in capsys.readouterr().out
    assert (tmp_path / "r" / "metrics.json").is_file()
    assert main(["train", str(spec), "--out", str(tmp_path / "r2"), "--set", "model.mixer.objective=nope"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"ssmcraft train: error: {spec}: model.mixer.objective: unknown objective 'nope'" in err and "longhorn" in err


def test_report_callback_sees_validations_and_can_prune(corpus, tmp_path):
    seen = []

    def report(step, values):
        seen.append((step, values))
        return step >= 20                                        # prune at the second validation

    m = train_run(text_config(corpus, tokens=8 * 32 * 40, eval_every=10), tmp_path, report=report)
    assert [s for s, _ in seen] == [10, 20]
    assert set(seen[0][1]) >= {"val_loss", "tokens"} and seen[0][1]["tokens"] == 10 * 8 * 32
    assert m["status"] == "pruned" and m["steps"] == 20 and m["val_loss"] == seen[-1][1]["val_loss"]
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "pruned"


def test_non_finite_gradient_is_a_divergence_too(corpus, tmp_path, monkeypatch):
    real = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def exploding(params, max_norm):
        calls["n"] += 1
        norm = real(params, max_norm)
        return norm * float("inf") if calls["n"] == 2 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", exploding)
    m = train_run(text_config(corpus, tokens=8 * 32 * 6), tmp_path)
    assert m["status"] == "diverged" and "gradient norm is inf at step 1" in m["reason"]
    assert m["steps"] == 1
