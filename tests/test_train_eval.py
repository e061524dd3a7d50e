"""Long-context evaluation: files written, explosion detection, passkey grid, mitigations."""
import json
import math

import pytest
import torch

import ssmcraft
from ssmcraft.cli import main
from ssmcraft.errors import SsmcraftError
from ssmcraft.layers import Mitigation, ObjectiveMixer, ObjectiveMixerConfig
from ssmcraft.train import train_run
from ssmcraft.train.eval_run import EvalOptions, eval_run
from ssmcraft.train.state_stats import detect_explosion, state_statistics


def _config(corpus, mixer, tokens=8 * 32 * 12):
    return {"name": "evaltest", "seed": 0,
            "task": {"name": "text", "corpus": corpus, "seq_len": 32, "val_fraction": 0.2, "block_size": 1024},
            "model": {"d_model": 16, "n_layers": 2, "mlp_ratio": 2, "mixer": mixer},
            "train": {"batch_size": 8, "tokens": tokens, "lr": 1e-2, "eval_every": 0, "eval_batches": 1,
                      "eval_batch_size": 4}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "t.txt").write_text("The grass is green. The sky is blue. 12345 is a number. " * 400)
    return str(folder)


def _run(tmp_path_factory, corpus, mixer, tokens=8 * 32 * 12):
    out = tmp_path_factory.mktemp("run")
    assert train_run(_config(corpus, mixer, tokens), out)["status"] == "ok"
    return out


@pytest.fixture(scope="module")
def longhorn_run(tmp_path_factory, corpus):
    return _run(tmp_path_factory, corpus, {"kind": "objective", "objective": "longhorn", "state_size": 4})


@pytest.fixture(scope="module")
def retnet_run(tmp_path_factory, corpus):
    return _run(tmp_path_factory, corpus, {"kind": "objective", "objective": "retnet", "state_size": 4,
                                           "heads": 2}, tokens=8 * 32)


def test_eval_writes_its_files(longhorn_run):
    options = EvalOptions(extrapolate=2, batches=1, batch_size=2, state_batch_size=2, passkey=True,
                          passkey_lengths=[260, 300], passkey_depths=[0.0, 1.0], passkey_trials=2)
    summary = eval_run(longhorn_run, options)
    out = longhorn_run / "eval"
    for name in ("eval.json", "loss_by_position.json", "loss_by_position.png", "state_stats.json",
                 "state_stats.png", "passkey.json", "passkey.png"):
        assert (out / name).is_file(), name
    assert json.loads((out / "eval.json").read_text())["train_len"] == 32
    assert summary["loss_by_position"]["seq_len"] == 64
    assert set(summary["loss_by_position"]["curves"]["plain"]["segments"]) == {"1x", "2x"}
    assert math.isfinite(summary["extrapolation_loss_2x"]) and math.isfinite(summary["loss_within_train_len"])
    assert set(summary["metrics_by_length"]) == {"32", "64"}
    assert isinstance(summary["state"]["plain"]["exploded"], bool)
    states = json.loads((out / "state_stats.json").read_text())["plain"]
    assert len(states["stats"]["norm"]) == 2 and len(states["stats"]["norm"][0]) == 1     # [layer][head]
    assert len(states["times"]) == len(states["stats"]["var"][1][0])
    grid = json.loads((out / "passkey.json").read_text())["plain"]
    assert len(grid["accuracy"]) == 2 and len(grid["accuracy"][0]) == 2
    assert 0.0 <= summary["passkey"]["plain"] <= 1.0


def _trace(stable: bool, T=64, L=16):
    """[B=2, T, H=2, d=3, m=4] states: constant scale, or growing 10x past position L."""
    g = torch.Generator().manual_seed(0)
    S = torch.randn(2, T, 2, 3, 4, generator=g)
    S = S / S.flatten(3).norm(dim=-1)[..., None, None]           # unit norm at every step
    if not stable:
        grow = torch.ones(T)
        grow[L:] = torch.linspace(1, 10, T - L)
        S = S * grow[None, :, None, None, None]
    return S


def _verdict(states, L=16, factor=3.0):
    stats = state_statistics(states)
    series = {name: [v.transpose(0, 1).tolist()] for name, v in stats.items()}     # one layer
    return detect_explosion(list(range(1, states.shape[1] + 1)), series, L, factor)


def test_explosion_fires_on_an_exploding_state_and_not_on_a_stable_one():
    assert not _verdict(_trace(stable=True))["exploded"]
    v = _verdict(_trace(stable=False))
    assert v["exploded"]
    norm_flags = [f for f in v["flags"] if f["stat"] == "norm"]
    assert len(norm_flags) == 2 and all(f["ratio"] > 3 and f["first_position"] > 16 for f in norm_flags)
    broken = _trace(stable=True)
    broken[:, 40, 0] = float("inf")
    assert _verdict(broken)["exploded"]


def test_a_signed_mean_near_zero_does_not_flag_alone():
    """Stable norm and variance, but the signed mean goes from ~0 within L to 10x that beyond:
    the mean's ratio is recorded, not flagged (cancellation is not growth)."""
    T, L = 64, 16
    S = _trace(stable=True, T=T, L=L)
    S = S - S.flatten(3).mean(-1)[..., None, None]                 # zero mean at every step
    shift = torch.zeros(T)
    shift[:L], shift[L:] = 1e-3, 1e-2
    S = S + shift[None, :, None, None, None]
    v = _verdict(S, L=L)
    assert not v["exploded"] and not v["flags"]
    assert v["ratios"]["mean"][0][0] > 5 and v["ratios"]["norm"][0][0] < 1.5


def test_explosion_on_real_objectives_constant_input():
    """Linear attention's state sums every write: it grows ~t and explodes at 4x; Longhorn's
    implicit update converges to a fixed point and stays in range."""
    h = torch.randn(1, 1, 16).expand(2, 128, 16)                  # the same token over and over
    for name, explodes in (("linear_attention", True), ("longhorn", False)):
        torch.manual_seed(0)
        mixer = ObjectiveMixer(ObjectiveMixerConfig(objective=name, state_size=4), 16, ssmcraft.compile(name))
        with torch.no_grad():
            states = mixer.trace_states(h, every=4)
        assert states.shape == (2, 32, 1, 32, 4)
        verdict = _verdict(states, L=8)
        assert verdict["exploded"] is explodes, (name, verdict["ratios"])


def test_cli_eval_and_refusals(longhorn_run, capsys):
    assert main(["eval", str(longhorn_run), "--extrapolate", "2", "--batches", "1", "--batch-size", "2",
                 "--out", str(longhorn_run / "e2"), "--quiet"]) == 0
    assert "extrapolation_loss_2x=" in capsys.readouterr().out
    assert main(["eval", str(longhorn_run), "--mitigate", "window=8", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and "sliding window" in err
    assert main(["eval", str(longhorn_run), "--mitigate", "retention=0.5", "--quiet"]) == 2
    assert "retention" in capsys.readouterr().err
    assert main(["eval", str(longhorn_run), "--mitigate", "speed=2", "--quiet"]) == 2
    assert "expected retention=R,insertion=I or window=W" in capsys.readouterr().err


@pytest.mark.parametrize("option, message", [
    ({"batches": 0}, "--batches must be an integer >= 1, got 0"),
    ({"batch_size": 0}, "--batch-size must be"),
    ({"state_points": 0}, "--state-points must be"),
    ({"passkey_trials": 0}, "--passkey-trials must be"),
    ({"passkey_depths": [0.0, 2.0]}, "--passkey-depths must lie in [0, 1], got 2"),
    ({"device": "tpu"}, "device 'tpu'"),
    ({"extrapolate": 1000}, "--extrapolate 1000: the text's validation split has"),
])
def test_eval_options_it_cannot_run_are_one_error(longhorn_run, tmp_path, option, message):
    with pytest.raises(SsmcraftError) as e:
        eval_run(longhorn_run, EvalOptions(**option), tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_eval_refuses_a_corpus_that_is_not_the_one_trained_on(longhorn_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(longhorn_run, run, ignore=shutil.ignore_patterns("e2", "eval"))
    config = json.loads((run / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "t.txt").write_text("Another text altogether, of another length. " * 500)
    config["task"]["corpus"] = str(other)          # as a relative path read from another folder would
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(SsmcraftError, match="reads as sha256 .* but the run trained on sha256"):
        eval_run(run, EvalOptions(extrapolate=2, batches=1, batch_size=2), tmp_path / "e")


@pytest.mark.parametrize("spec", ["retention=0.5,insertion=0.9", "window=8"])
def test_mitigations_run_where_the_structure_allows(retnet_run, tmp_path, spec):
    options = EvalOptions(extrapolate=2, batches=1, batch_size=2, state_batch_size=2,
                          mitigation=Mitigation.parse(spec))
    summary = eval_run(retnet_run, options, tmp_path)
    label = Mitigation.parse(spec).label()
    curves = summary["loss_by_position"]["curves"]
    assert set(curves) == {"plain", label}
    assert curves["plain"]["mean_loss"] != curves[label]["mean_loss"]
    traced = {"plain"} if "window" in spec else {"plain", label}          # a window has no single state
    assert set(summary["state"]) == traced


def test_passkey_needs_a_byte_level_model(tmp_path):
    cfg = {"name": "mq", "task": {"name": "mqar", "vocab": 32, "seq_len": 16, "num_kv_pairs": 2},
           "model": {"d_model": 16, "n_layers": 1, "mixer": {"kind": "attention", "heads": 2}},
           "train": {"batch_size": 4, "tokens": 64, "eval_every": 0, "eval_batches": 1, "eval_batch_size": 4}}
    train_run(cfg, tmp_path)
    with pytest.raises(SsmcraftError, match="byte-level model"):
        eval_run(tmp_path, EvalOptions(passkey=True))
    summary = eval_run(tmp_path, EvalOptions(extrapolate=2, batches=1, batch_size=2))      # attention: no states
    assert "skipped" in summary["state"] and summary["metrics_by_length"]["32"]["chance_accuracy"] == 0.5
