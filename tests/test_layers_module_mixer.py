"""Any module as a mixer: a factory from a module path, its state-size hook, decoding through its
own step, hybrids with it, and one-line errors."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import decode_all

from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.layers import LM, LMConfig

EMA = {"module": "examples.mixers:EMAMixer", "options": {"decay": 0.8, "width": 6}}


def _lm(mixer=EMA, layers=(), n_layers=2):
    torch.manual_seed(0)
    return LM(LMConfig(vocab_size=30, d_model=16, n_layers=n_layers, mixer=mixer, layers=list(layers))).double()


def test_a_module_mixer_decodes_step_by_step_like_its_forward():
    lm = _lm()
    assert lm.layout_labels() == ["module", "module"]
    assert lm.mixers[0].inner.decay == 0.8 and lm.state_elements() == 2 * 6
    tokens = torch.randint(0, 30, (2, 7))
    torch.testing.assert_close(decode_all(lm, tokens)[0], lm(tokens), rtol=1e-9, atol=1e-10)


def test_a_hybrid_of_objective_and_module_layers():
    obj = {"kind": "objective", "objective": "longhorn", "heads": 2, "state_size": 4}
    lm = _lm(obj, [{"at": [1], "mixer": EMA}], n_layers=3)
    assert lm.layout_labels() == ["objective", "module", "objective"] and lm.recurrent_layers == [0, 2]
    assert lm.state_elements() == 2 * (2 * 16 * 4) + 6               # two objective layers (H d m) + the EMA's width
    tokens = torch.randint(0, 30, (2, 6))
    torch.testing.assert_close(decode_all(lm, tokens)[0], lm(tokens), rtol=1e-9, atol=1e-10)


def test_fla_style_layers_take_hidden_size_and_return_tuples():
    lm = _lm({"module": "example_mixer:fla_like", "d_model_arg": "hidden_size", "options": {"expand": 2},
              "state_elements": 64})
    assert lm(torch.randint(0, 30, (2, 5))).shape == (2, 5, 30)
    assert lm.state_elements() == 2 * 64                               # the config's count, the layer has no hook
    with pytest.raises(SsmcraftError, match="has no init_cache"):
        lm.init_cache(1)
    assert _lm({"module": "example_mixer:fla_like", "d_model_arg": "hidden_size"}).state_elements() is None


def test_a_module_mixer_trains_and_is_not_exported(tmp_path):
    from ssmcraft.export import export
    from ssmcraft.train import train_run

    metrics = train_run({"name": "module", "task": {"name": "mqar", "vocab": 32, "seq_len": 16, "num_kv_pairs": 2},
                         "model": {"d_model": 16, "n_layers": 1, "mixer": EMA},
                         "train": {"batch_size": 8, "tokens": 8 * 16 * 4, "eval_every": 0, "eval_batches": 1,
                                   "eval_batch_size": 4}}, tmp_path / "run")
    assert metrics["status"] == "ok" and math.isfinite(metrics["val_loss"])
    assert metrics["layout"] == ["module"] and metrics["state_elements"] == 6
    assert metrics["mixer"]["module"] == "examples.mixers:EMAMixer"
    with pytest.raises(SsmcraftError, match="module mixer, whose code an export cannot carry"):
        export(tmp_path / "run", tmp_path / "exp")
    assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize("mixer, key, problem", [
    ({"module": "examples.no_such_pkg_xyz:f"}, "model.mixer.module", "cannot import module 'examples.no_such_pkg_xyz'"),
    ({"module": "example_mixer:missing"}, "model.mixer.module", "has no 'missing'"),
    ({"module": "example_mixer:NOT_CALLABLE"}, "model.mixer.module", "not callable"),
    ({"module": "os.system('x'):f"}, "model.mixer.module", "not a module path"),
    ({"module": "examples.mixers:EMAMixer", "options": {"colour": 1}}, "model.mixer.options", "failed"),
    ({"module": "examples.mixers:EMAMixer", "state_elements": -1}, "model.mixer.state_elements", "non-negative"),
    ({"module": "examples.mixers:EMAMixer", "option": {}}, "model.mixer.option", "unknown key"),
])
def test_bad_module_mixers_are_one_error_naming_the_key(mixer, key, problem, tmp_path):
    from ssmcraft.train.loop import build_model
    from ssmcraft.train.config import resolve

    with pytest.raises(SpecError) as e:
        cfg = resolve({"task": {"name": "mqar"}, "model": {"d_model": 16, "n_layers": 1, "mixer": mixer}})
        cfg["model"]["vocab_size"] = 64
        build_model(cfg)
    assert e.value.key == key and problem in e.value.problem


def test_a_module_returning_the_wrong_shape_is_refused():
    with pytest.raises(SsmcraftError, match=r"returned \[1, 3, 17\]"):
        _lm({"module": "example_mixer:wrong_shape"})(torch.zeros(1, 3, dtype=torch.long))


def test_fla_layers_when_installed():
    fla_layers = pytest.importorskip("fla.layers")
    if not torch.cuda.is_available():
        pytest.skip("FLA's kernels need a GPU")
    lm = LM(LMConfig(vocab_size=30, d_model=64, n_layers=1,
                     mixer={"module": "fla.layers:GatedLinearAttention", "d_model_arg": "hidden_size",
                            "options": {"num_heads": 1}})).cuda()
    assert isinstance(lm.mixers[0].inner, fla_layers.GatedLinearAttention)
    assert lm(torch.randint(0, 30, (2, 64), device="cuda")).shape == (2, 64, 30)
